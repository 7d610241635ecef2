"""Dropout tile step: the keep mask of attention dropout regenerated tile by tile from a seed.

    seed_sb = load_dropout_seed(dropout_seed)                       # once per kernel call
    keys = dropout_row_keys(seed_sb, b, h, q0, rows)                # once per 128 query rows (and key block)
    scale = dropout_scale_keys(keys, dropout_p, k0, rows, cols)     # per score tile
    scale = dropout_scale_tile(seed_sb, dropout_p, b, h, q0, k0, rows, cols)   # the two in one call

``scale`` is a new float32 SBUF tile ``[rows, cols]`` with ``scale[r, c] = M[b, h, q0 + r, k0 + c] / (1 - p)``
(0 where the element is dropped); kernels multiply their probability tile by it. ``M`` is a pure function of
``(dropout_seed, b, h, i, j)`` (``h`` the query head): the same element gets the same decision whatever the
tiling, in the forward and the backward, and ``golden.dropout.keep_mask`` reproduces it bit for bit. The hash is
specified in ``golden/dropout.py`` and docs/semantics.md, section "Dropout"; in short, with ``lo``/``hi`` the 16-bit
halves of a 32-bit word::

    row words   K1, K2 from (seed, b, h, i, j >> 16)               [rows, 1] tiles, 4 mixing rounds
    element     m = j & 0xFFFF
                p1 = lo(m ^ K1) * (hi(K1) | 1);  u1 = p1 ^ (p1 >> 16)
                v = lo(lo(u1 ^ K2) * ((m ^ hi(K2)) | 1));  keep  iff  v < T = round((1 - p) * 65536)

Only integer instructions whose result the NKI docs define exactly are used: bit-vector ``tensor_scalar`` /
``tensor_tensor`` on VectorE (raw bits), int32/uint32 ``tensor_tensor`` multiplies on GpSimdE ("native integer
arithmetic", exact: every product here is below 2**32), ``iota`` (int32 arithmetic) and float32 arithmetic on
integers below 2**24 (exact). Immediates stay below 2**24, so they are the same number whether an instruction
encodes them as int32 or float32. Cost per [128 x 512] tile (modeled): scripts/bench.py dropout-cost.

Kernel code: NKI's compile-time subset (the simulator's frontend check enforces it).
"""
from ..backend import nisa, nki, nl
from .steps import PMAX

M16 = 0xFFFF
KEY_BLOCK = 1 << 16  # key columns sharing one set of row words (the element hash sees j & 0xFFFF)
MAX_COLS = 512  # widest tile one call produces (one PSUM bank of fp32 scores)
THRESHOLD_ONE = 65536
# Whitening constants of the seed stage (31-bit: iota builds them exactly from an int32 offset).
SEED_C0 = 0x6A09E667
SEED_C1 = 0x3C6EF372
SEED_C2 = 0x510E527F
SEED_C3 = 0x1F83D9AB
# Row-stage immediates (below 2**24: exact as int32 or float32).
ROW_A4 = 0x165667
ROW_A5 = 0xD3A2E5
ROW_A6 = 0x85EBCB
ROW_A7 = 0x5BD1E9
MAX_INDEX_IMM = 1 << 20  # b, h and the key block index enter as immediates xor a 24-bit constant


def keep_threshold(dropout_p):
    """``T = round((1 - p) * 65536)`` (trace-time): elements whose 16-bit hash value is below ``T`` are kept."""
    return int((1.0 - dropout_p) * THRESHOLD_ONE + 0.5)


def _mix(y, rows, n=1):
    """``g(y) = p ^ (p << 16)`` (32-bit), ``p = lo(y) * (hi(y) + 1)``, on a uint32 ``[rows, n]`` tile: a new tile.
    ``hi + 1`` keeps every bit of ``y`` and never multiplies by 0; the product is below 2**32 (exact on GpSimdE);
    the shift puts the well-mixed low half of the product into the high half, so a small input does not stay
    small."""
    a = nl.ndarray((rows, n), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=a, data=y, op0=nl.bitwise_and, operand0=M16)
    hb = nl.ndarray((rows, n), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=hb, data=y, op0=nl.right_shift, operand0=16)
    # float32 arithmetic on a value below 2**16: exact
    nisa.tensor_scalar(dst=hb, data=hb, op0=nl.add, operand0=1.0)
    p = nl.ndarray((rows, n), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=p, data1=a, data2=hb, op=nl.multiply, engine=nisa.engine.gpsimd)
    t = nl.ndarray((rows, n), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=t, data=p, op0=nl.left_shift, operand0=16)
    out = nl.ndarray((rows, n), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=out, data1=p, data2=t, op=nl.bitwise_xor, engine=nisa.engine.vector)
    return out


def _const_col(value, rows):
    col = nl.ndarray((rows, 1), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.iota(dst=col, pattern=[[0, 1]], offset=value, channel_multiplier=0)
    return col


def load_dropout_seed(dropout_seed):
    """Seed state for the dropout steps.

    Args:
        dropout_seed: int32 or uint32 HBM tensor ``[2]`` = ``(seed, offset)``, or ``[1]`` = ``(seed,)`` with
            offset 0 (runtime data; the words are used as 32-bit patterns).
    Returns:
        uint32 SBUF tile ``[128, 2]``: the mixed seed words ``(Z0, Z1)``, the same in every partition
        (``Z0 = g(g(s0 ^ C0) ^ s1 ^ C1)``, ``Z1 = g(g(s1 ^ C2) ^ s0 ^ C3)``). Call once per kernel call.
    """
    n = dropout_seed.shape[0]
    assert len(dropout_seed.shape) == 1 and (n == 1 or n == 2), \
        "dropout_seed must have shape (2,) (seed, offset) or (1,) (seed)"
    raw = nl.ndarray((PMAX, n), dtype=dropout_seed.dtype, buffer=nl.sbuf)
    # every partition reads the same words (stride-0 partition walk of the HBM tensor)
    nisa.dma_copy(dst=raw, src=dropout_seed.ap([[0, PMAX], [1, n]]))
    words = nl.ndarray((PMAX, 2), dtype=nl.uint32, buffer=nl.sbuf)
    if n == 1:
        nisa.memset(dst=words[:, 1:2], value=0)
    # bit-vector op: raw bits, so an int32 seed becomes the same 32-bit pattern in uint32
    nisa.tensor_scalar(dst=words[:, 0:n], data=raw, op0=nl.bitwise_or, operand0=0)
    s0 = words[:, 0:1]
    s1 = words[:, 1:2]
    y = nl.ndarray((PMAX, 1), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=y, data=s0, op0=nl.bitwise_xor, operand0=_const_col(SEED_C0, PMAX))
    w = _mix(y, PMAX)
    y2 = nl.ndarray((PMAX, 1), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=y2, data=w, op0=nl.bitwise_xor, operand0=s1, op1=nl.bitwise_xor,
                       operand1=_const_col(SEED_C1, PMAX))
    z0 = _mix(y2, PMAX)
    y3 = nl.ndarray((PMAX, 1), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=y3, data=s1, op0=nl.bitwise_xor, operand0=_const_col(SEED_C2, PMAX))
    w2 = _mix(y3, PMAX)
    y4 = nl.ndarray((PMAX, 1), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=y4, data=w2, op0=nl.bitwise_xor, operand0=s0, op1=nl.bitwise_xor,
                       operand1=_const_col(SEED_C3, PMAX))
    z1 = _mix(y4, PMAX)
    seed_sb = nl.ndarray((PMAX, 2), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=seed_sb[:, 0:1], src=z0)
    nisa.tensor_copy(dst=seed_sb[:, 1:2], src=z1)
    return seed_sb


def dropout_row_keys(seed_sb, b, h, q0, rows, key_block=0):
    """Row words of query rows ``q0 .. q0 + rows - 1`` of (batch ``b``, query head ``h``) for the key columns
    ``j`` with ``j >> 16 == key_block``.

    Args:
        seed_sb: ``load_dropout_seed``'s tile.
        b, h, q0, rows, key_block: trace-time ints; ``rows <= 128``, ``b, h < 2**20``.
    Returns:
        uint32 SBUF tile ``[rows, 4]``: ``(K1, hi(K1) | 1, K2, hi(K2))`` per row, with
        ``x1 = g(i ^ Z0 ^ h ^ A4)``, ``x2 = g(x1 ^ i ^ Z1 ^ b ^ A5)``, ``K1 = g(x2 ^ i ^ Z0 ^ key_block ^ A6)``,
        ``K2 = g(K1 ^ i ^ Z1 ^ A7)``. Four rounds: with three, some seeds leave a measurable bias (5 sigma at
        8M elements) in the decisions.
    """
    assert 1 <= rows <= PMAX, "dropout_row_keys: rows must be in [1, 128]"
    assert 0 <= b < MAX_INDEX_IMM and 0 <= h < MAX_INDEX_IMM, "dropout: batch and head indices must be < 2**20"
    assert 0 <= key_block < MAX_INDEX_IMM, "dropout: key block index out of range"
    assert 0 <= q0 and q0 + rows <= (1 << 31), "dropout: query rows must lie in [0, 2**31)"
    ii = nl.ndarray((rows, 1), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.iota(dst=ii, pattern=[[0, 1]], offset=q0, channel_multiplier=1)
    y = nl.ndarray((rows, 1), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=y, data=ii, op0=nl.bitwise_xor, operand0=seed_sb[0:rows, 0:1], op1=nl.bitwise_xor,
                       operand1=h ^ ROW_A4)
    keys = _row_rounds(seed_sb, y, ii, b, key_block, rows, 1)
    return keys[:, 0, :]


def dropout_row_keys_members(seed_sb, b, ii, hh, n, key_block=0):
    """``dropout_row_keys`` for ``n`` (query row base, query head) units at once, on 128 rows.

    Args:
        seed_sb: ``load_dropout_seed``'s tile.
        b, key_block: trace-time ints, as in ``dropout_row_keys``.
        ii: uint32 SBUF tile ``[128, n]``: column u holds the absolute query row of each partition for unit u.
        hh: uint32 SBUF tile ``[128, n]``: column u holds unit u's query head (below 2**20).
        n: the number of units.
    Returns:
        uint32 SBUF tile ``[128, n, 4]``; ``keys[:, u, :]`` equals ``dropout_row_keys`` of unit u (same
        instructions on ``[128, n]`` tiles: their fixed cost is paid once, not n times).
    """
    y = nl.ndarray((PMAX, n), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=y, data1=ii, data2=hh, op=nl.bitwise_xor, engine=nisa.engine.vector)
    nisa.tensor_scalar(dst=y, data=y, op0=nl.bitwise_xor, operand0=seed_sb[:, 0:1], op1=nl.bitwise_xor,
                       operand1=ROW_A4)
    return _row_rounds(seed_sb, y, ii, b, key_block, PMAX, n)


def _row_rounds(seed_sb, y, ii, b, key_block, rows, n):
    """Rounds of the row words from ``y = i ^ Z0 ^ h ^ A4`` (uint32 ``[rows, n]``; ``ii`` the query rows):
    ``x1 = g(y)``, ``x2 = g(x1 ^ i ^ Z1 ^ b ^ A5)``, ``K1 = g(x2 ^ i ^ Z0 ^ key_block ^ A6)``,
    ``K2 = g(K1 ^ i ^ Z1 ^ A7)``; returns uint32 ``[rows, n, 4]`` = ``(K1, hi(K1) | 1, K2, hi(K2))``."""
    z0 = seed_sb[0:rows, 0:1]
    z1 = seed_sb[0:rows, 1:2]
    x1 = _mix(y, rows, n)
    y2 = nl.ndarray((rows, n), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=y2, data1=x1, data2=ii, op=nl.bitwise_xor, engine=nisa.engine.vector)
    nisa.tensor_scalar(dst=y2, data=y2, op0=nl.bitwise_xor, operand0=z1, op1=nl.bitwise_xor, operand1=b ^ ROW_A5)
    x2 = _mix(y2, rows, n)
    y3 = nl.ndarray((rows, n), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=y3, data1=x2, data2=ii, op=nl.bitwise_xor, engine=nisa.engine.vector)
    nisa.tensor_scalar(dst=y3, data=y3, op0=nl.bitwise_xor, operand0=z0, op1=nl.bitwise_xor,
                       operand1=key_block ^ ROW_A6)
    k1 = _mix(y3, rows, n)
    y4 = nl.ndarray((rows, n), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=y4, data1=k1, data2=ii, op=nl.bitwise_xor, engine=nisa.engine.vector)
    nisa.tensor_scalar(dst=y4, data=y4, op0=nl.bitwise_xor, operand0=z1, op1=nl.bitwise_xor, operand1=ROW_A7)
    k2 = _mix(y4, rows, n)
    keys = nl.ndarray((rows, n, 4), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=keys[:, :, 0], src=k1)
    nisa.tensor_scalar(dst=keys[:, :, 1], data=k1, op0=nl.right_shift, operand0=16, op1=nl.bitwise_or, operand1=1)
    nisa.tensor_copy(dst=keys[:, :, 2], src=k2)
    nisa.tensor_scalar(dst=keys[:, :, 3], data=k2, op0=nl.right_shift, operand0=16)
    return keys


def dropout_values(keys, k0, rows, cols):
    """The 16-bit hash values ``v`` of key columns ``k0 .. k0 + cols - 1`` (all in one key block, see
    ``dropout_row_keys``) for the rows of ``keys``: a new uint32 SBUF tile ``[rows, cols]``, ``cols <= 512``."""
    assert 1 <= cols <= MAX_COLS, "dropout: cols must be in [1, 512]"
    assert 0 <= k0 and (k0 >> 16) == ((k0 + cols - 1) >> 16), \
        "dropout_values: the columns must lie in one block of 65536 keys (dropout_scale_tile splits them)"
    k1 = keys[0:rows, 0:1]
    r1 = keys[0:rows, 1:2]
    k2 = keys[0:rows, 2:3]
    r3 = keys[0:rows, 3:4]
    # three [rows, cols] uint32 tiles updated in place (6 KiB per partition at 512 columns, 8 KiB with the result)
    m = nl.ndarray((rows, cols), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.iota(dst=m, pattern=[[1, cols]], offset=k0 & M16, channel_multiplier=0)
    x = nl.ndarray((rows, cols), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=x, data=m, op0=nl.bitwise_xor, operand0=k1, op1=nl.bitwise_and, operand1=M16)
    # p1 = a1 * (hi(K1) | 1) < 2**32: exact on GpSimdE
    nisa.tensor_tensor(dst=x, data1=x, data2=r1.broadcast(1, cols), op=nl.multiply, engine=nisa.engine.gpsimd)
    t = nl.ndarray((rows, cols), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=t, data=x, op0=nl.right_shift, operand0=16)
    nisa.tensor_tensor(dst=t, data1=x, data2=t, op=nl.bitwise_xor, engine=nisa.engine.vector)  # u1
    nisa.tensor_scalar(dst=x, data=t, op0=nl.bitwise_xor, operand0=k2, op1=nl.bitwise_and, operand1=M16)  # a2
    nisa.tensor_scalar(dst=m, data=m, op0=nl.bitwise_xor, operand0=r3, op1=nl.bitwise_or, operand1=1)  # b2
    nisa.tensor_tensor(dst=x, data1=x, data2=m, op=nl.multiply, engine=nisa.engine.gpsimd)  # p2
    nisa.tensor_scalar(dst=t, data=x, op0=nl.bitwise_and, operand0=M16)  # v
    return t


def dropout_scale_keys(keys, dropout_p, k0, rows, cols):
    """``M / (1 - p)`` for key columns ``k0 .. k0 + cols - 1`` (one key block) of the rows of ``keys``: a new
    float32 SBUF tile ``[rows, cols]`` (``cols <= 512``); ``dropout_p`` a trace-time float in ``[0, 1)``."""
    assert 0.0 <= dropout_p < 1.0, "dropout_p must be in [0, 1)"
    v = dropout_values(keys, k0, rows, cols)
    scale = nl.ndarray((rows, cols), dtype=nl.float32, buffer=nl.sbuf)
    # v < 2**16 is exact in float32: (v < T) is 1.0 or 0.0, times 1 / (1 - p)
    nisa.tensor_scalar(dst=scale, data=v, op0=nl.less, operand0=float(keep_threshold(dropout_p)),
                       op1=nl.multiply, operand1=1.0 / (1.0 - dropout_p))
    return scale


def dropout_scale_tile(seed_sb, dropout_p, b, h, q0, k0, rows, cols):
    """``M[b, h, q0 + r, k0 + c] / (1 - dropout_p)`` as a new float32 SBUF tile ``[rows, cols]``.

    Args:
        seed_sb: ``load_dropout_seed``'s tile.
        dropout_p: trace-time float in ``[0, 1)``.
        b: batch index; h: QUERY head index; q0: first query row; k0: first key column (trace-time ints).
        rows: <= 128 query rows (partitions); cols: <= 512 key columns.
    Row words are recomputed on every call; a kernel that visits many key tiles per query tile can call
    ``dropout_row_keys`` once and ``dropout_scale_keys`` per tile instead (same result).
    """
    assert 1 <= cols <= MAX_COLS, "dropout_scale_tile: cols must be in [1, 512]"
    kb0 = k0 >> 16
    kb1 = (k0 + cols - 1) >> 16
    if kb0 == kb1:
        keys = dropout_row_keys(seed_sb, b, h, q0, rows, kb0)
        return dropout_scale_keys(keys, dropout_p, k0, rows, cols)
    # the tile straddles a 65536-key boundary: two pieces with their own row words
    split = kb1 * KEY_BLOCK - k0
    out = nl.ndarray((rows, cols), dtype=nl.float32, buffer=nl.sbuf)
    keys0 = dropout_row_keys(seed_sb, b, h, q0, rows, kb0)
    left = dropout_scale_keys(keys0, dropout_p, k0, rows, split)
    nisa.tensor_copy(dst=out[:, 0:split], src=left)
    keys1 = dropout_row_keys(seed_sb, b, h, q0, rows, kb1)
    right = dropout_scale_keys(keys1, dropout_p, k0 + split, rows, cols - split)
    nisa.tensor_copy(dst=out[:, split:cols], src=right)
    return out


@nki.jit
def dropout_mask_kernel(dropout_seed, dropout_p, bs, nheads, seqlen_q, seqlen_k, q_tile=128, k_tile=512, k_start=0):
    """Debug kernel: the dropout multiplier of a whole problem, written through ``dropout_scale_tile``.

    Args:
        dropout_seed: int32/uint32 HBM ``[2]`` (or ``[1]``).
        dropout_p: float in ``[0, 1)``; bs, nheads, seqlen_q, seqlen_k: problem sizes (ints).
        q_tile (<= 128), k_tile (<= 512): the tile decomposition to use (any sizes; the result does not depend on
            them); k_start: absolute key column of output column 0 (to reach key blocks beyond 65536 cheaply).
    Returns:
        float32 ``[bs, nheads, seqlen_q, seqlen_k]`` in shared HBM: ``M / (1 - p)`` for key columns
        ``k_start + c``.
    """
    out = nl.ndarray((bs, nheads, seqlen_q, seqlen_k), dtype=nl.float32, buffer=nl.shared_hbm)
    seed_sb = load_dropout_seed(dropout_seed)
    for b in range(bs):
        for h in range(nheads):
            for q0 in range(0, seqlen_q, q_tile):
                rows = min(q_tile, seqlen_q - q0)
                for c0 in range(0, seqlen_k, k_tile):
                    cols = min(k_tile, seqlen_k - c0)
                    t = dropout_scale_tile(seed_sb, dropout_p, b, h, q0, k_start + c0, rows, cols)
                    nisa.dma_copy(dst=out[b, h, q0:q0 + rows, c0:c0 + cols], src=t)
    return out
