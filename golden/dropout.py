"""The dropout keep mask: a counter-based hash of (seed, b, h, i, j), bit-identical to the kernels' tile step.

Independent of the kernels (imports nothing from ``nki_attn``): this module restates the hash that
``nki_attn/kernels/dropout.py`` computes with NKI integer instructions, in torch int64 arithmetic, so the golden
regenerates any kernel's mask from the same seed. docs/semantics.md, section "Dropout", is the specification.

Seed. ``dropout_seed`` is an int32 or uint32 tensor of shape ``[2]``: ``(seed, offset)``, both used as 32-bit
patterns (an int32 ``-1`` is ``0xFFFFFFFF``); shape ``[1]`` is ``(seed,)`` with offset 0. ``make_seed(seed, offset)`` builds one. Stepping ``offset`` gives a
new independent mask per training step with a fixed ``seed`` (FlashAttention's Philox (seed, offset) pair).

Hash. Every value is a 32-bit unsigned integer; ``lo(x) = x & 0xFFFF``, ``hi(x) = x >> 16`` (logical), ``^`` xor.
The only nonlinear step is a 16 x 16 -> 32-bit product (exact: it is below 2**32, so no overflow rule matters)::

    g(y)        = p ^ (p << 16)   with  p = lo(y) * (hi(y) + 1)   (mod 2**32)
    seed words  Z0 = g(g(s0 ^ C0) ^ s1 ^ C1);  Z1 = g(g(s1 ^ C2) ^ s0 ^ C3)
    row words   x1 = g(i ^ Z0 ^ h ^ A4);  x2 = g(x1 ^ i ^ Z1 ^ b ^ A5);  K1 = g(x2 ^ i ^ Z0 ^ jb ^ A6)
                K2 = g(K1 ^ i ^ Z1 ^ A7)
    element     m  = j & 0xFFFF,  jb = j >> 16
                p1 = lo(m ^ K1) * (hi(K1) | 1);  u1 = p1 ^ (p1 >> 16)
                v  = lo(lo(u1 ^ K2) * ((m ^ hi(K2)) | 1))
    keep        v < T,  T = keep_threshold(p) = round((1 - p) * 65536)

(``b`` batch, ``h`` query head, ``i`` query row, ``j`` key column, all absolute.) The row words depend on the row
only, so a kernel computes them once per 128 rows; per element the hash costs two products. ``v`` is uniform on
``[0, 65536)`` (the low half of a product by an odd number is a bijection of the other factor). The keep
probability is ``T / 65536``, within ``2**-17`` of ``1 - p``; the kept values are scaled by ``1 / (1 - p)`` (as
FlashAttention does, which thresholds 8-bit values).

Limits (checked): ``b``, ``h`` < 2**20 (they enter as instruction immediates, kept below 2**24), ``i`` < 2**31,
``j`` < 2**31.
"""
import numbers

import torch

# Seed whitening constants (31-bit; the kernel builds them with iota) and row-stage immediates (below 2**24, so
# an instruction immediate holds them exactly whether it is encoded as int32 or float32).
C0, C1, C2, C3 = 0x6A09E667, 0x3C6EF372, 0x510E527F, 0x1F83D9AB
A4, A5, A6, A7 = 0x165667, 0xD3A2E5, 0x85EBCB, 0x5BD1E9
M16 = 0xFFFF
KEY_BLOCK = 1 << 16  # key columns per row-key block (m = j & 0xFFFF repeats after 2**16 columns)
MAX_INDEX_IMM = 1 << 20  # b, h bound (immediates)
MAX_POS = 1 << 31  # i, j bound (int32 iota)
THRESHOLD_ONE = 1 << 16  # T for p = 0


def make_seed(seed: int, offset: int = 0) -> torch.Tensor:
    """The ``dropout_seed`` tensor: int32 ``[2]`` = ``(seed, offset)``, each an int in ``[-2**31, 2**32)`` taken
    modulo 2**32 (so any 32-bit pattern can be given signed or unsigned)."""
    for name, val in (("seed", seed), ("offset", offset)):
        if isinstance(val, bool) or not isinstance(val, numbers.Integral):
            raise ValueError(f"make_seed: {name} = {val!r} must be an int")
        if not -(1 << 31) <= int(val) < (1 << 32):
            raise ValueError(f"make_seed: {name} = {val} must be in [-2**31, 2**32)")
    words = [int(seed) & 0xFFFFFFFF, int(offset) & 0xFFFFFFFF]
    signed = [w - (1 << 32) if w >= (1 << 31) else w for w in words]
    return torch.tensor(signed, dtype=torch.int32)


def seed_words(dropout_seed) -> tuple:
    """``(s0, s1)``: the two words of ``dropout_seed`` (int32/uint32 tensor ``[2]``; a ``[1]`` tensor is the seed
    with offset 0) as Python ints in ``[0, 2**32)``."""
    if not isinstance(dropout_seed, torch.Tensor):
        raise ValueError(f"dropout_seed: got {type(dropout_seed).__name__}; must be an int32 or uint32 tensor of "
                         f"shape [2] (seed, offset), e.g. golden.dropout.make_seed(1234)")
    if dropout_seed.dtype not in (torch.int32, torch.uint32):
        raise ValueError(f"dropout_seed.dtype = {dropout_seed.dtype}; must be torch.int32 or torch.uint32")
    if tuple(dropout_seed.shape) not in ((1,), (2,)):
        raise ValueError(f"dropout_seed.shape = {tuple(dropout_seed.shape)}; must be (2,) (seed, offset) or (1,) "
                         f"(seed; offset 0)")
    vals = dropout_seed.detach().cpu().to(torch.int64).tolist() + [0]
    return tuple(int(v) & 0xFFFFFFFF for v in vals[:2])


def keep_threshold(dropout_p: float) -> int:
    """``T = round((1 - p) * 65536)``: an element is kept when its 16-bit hash value is below ``T``."""
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p = {p}; must be in [0, 1)")
    return int((1.0 - p) * THRESHOLD_ONE + 0.5)


def _g(y: torch.Tensor) -> torch.Tensor:
    p = (y & M16) * ((y >> 16) + 1)
    return p ^ ((p << 16) & 0xFFFFFFFF)


def _t(x) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.int64)


def seed_state(dropout_seed) -> tuple:
    """``(Z0, Z1)``: the mixed seed words (Python ints), what ``load_dropout_seed`` leaves in SBUF."""
    s0, s1 = (_t(w) for w in seed_words(dropout_seed))
    z0 = _g(_g(s0 ^ C0) ^ s1 ^ C1)
    z1 = _g(_g(s1 ^ C2) ^ s0 ^ C3)
    return int(z0), int(z1)


def row_keys(z0: int, z1: int, b: int, h: int, i: torch.Tensor, jb: int) -> tuple:
    """``(K1, K2)`` int64 tensors shaped like ``i``: the row words of rows ``i`` of (batch ``b``, query head
    ``h``) for key block ``jb = j >> 16``."""
    x1 = _g(i ^ z0 ^ (h ^ A4))
    x2 = _g(x1 ^ i ^ z1 ^ (b ^ A5))
    k1 = _g(x2 ^ i ^ z0 ^ (jb ^ A6))
    k2 = _g(k1 ^ i ^ z1 ^ A7)
    return k1, k2


def element_values(k1: torch.Tensor, k2: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """16-bit hash values ``v`` (int64) of key columns ``j`` for row words ``k1``, ``k2`` (broadcasting)."""
    m = j & M16
    p1 = ((m ^ k1) & M16) * ((k1 >> 16) | 1)
    u1 = p1 ^ (p1 >> 16)
    return (((u1 ^ k2) & M16) * ((m ^ (k2 >> 16)) | 1)) & M16


def _check_dims(bs, nheads, seqlen_q, seqlen_k):
    for name, val, hi in (("bs", bs, MAX_INDEX_IMM), ("nheads", nheads, MAX_INDEX_IMM),
                          ("seqlen_q", seqlen_q, MAX_POS), ("seqlen_k", seqlen_k, MAX_POS)):
        if isinstance(val, bool) or not isinstance(val, numbers.Integral) or not 1 <= int(val) <= hi:
            raise ValueError(f"keep_mask: {name} = {val!r} must be an int in [1, {hi}]")


def hash_values(dropout_seed, bs: int, nheads: int, seqlen_q: int, seqlen_k: int,
                q_range=None, k_range=None) -> torch.Tensor:
    """int64 ``[bs, nheads, nq, nk]`` 16-bit hash values ``v`` of rows ``q_range`` (default all) and columns
    ``k_range`` (default all): the numbers the kernel compares with the threshold."""
    _check_dims(bs, nheads, seqlen_q, seqlen_k)
    z0, z1 = seed_state(dropout_seed)
    qi = torch.arange(seqlen_q, dtype=torch.int64) if q_range is None else _t(list(q_range))
    kj = torch.arange(seqlen_k, dtype=torch.int64) if k_range is None else _t(list(k_range))
    for name, idx, n in (("q_range", qi, seqlen_q), ("k_range", kj, seqlen_k)):
        if idx.numel() and not (0 <= int(idx.min()) and int(idx.max()) < n):
            raise ValueError(f"hash_values: {name} must lie in [0, {n})")
    out = torch.empty((bs, nheads, qi.numel(), kj.numel()), dtype=torch.int64)
    i = qi[:, None]
    jbs = kj >> 16
    for b in range(bs):
        for h in range(nheads):
            for jb in torch.unique(jbs).tolist():
                sel = jbs == jb
                k1, k2 = row_keys(z0, z1, b, h, i, jb)
                out[b, h][:, sel] = element_values(k1, k2, kj[sel][None, :])
    return out


def keep_mask(dropout_seed, dropout_p: float, bs: int, nheads: int, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """Bool keep mask ``[bs, nheads, seqlen_q, seqlen_k]`` (True = kept), ``M[b, h, i, j]`` a pure function of
    ``(dropout_seed, b, h, i, j)`` (``h`` the query head), bit-identical to the kernels' ``dropout_scale_tile``.

    Args:
        dropout_seed: int32/uint32 tensor ``[2]`` ``(seed, offset)`` (``make_seed``).
        dropout_p: drop probability in ``[0, 1)``; ``p = 0`` keeps everything.
        bs, nheads, seqlen_q, seqlen_k: the problem's sizes.
    """
    t = keep_threshold(dropout_p)
    return hash_values(dropout_seed, bs, nheads, seqlen_q, seqlen_k) < t
