"""Block masks: any ``mask_mod(b, h, q_idx, kv_idx) -> bool`` turned once into per-tile classes and bitmaps.

``create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, BLOCK_SIZE=None)`` has the meaning of
``torch.nn.attention.flex_attention.create_block_mask``: ``mask_mod`` says whether query ``q_idx`` of head ``h``
of batch element ``b`` sees key ``kv_idx``; ``B`` / ``H`` None mean the mask is the same for every batch
element / head (it is evaluated at ``b = 0`` / ``h = 0`` and broadcast). The result, a ``BlockMask``, holds per
(batch, head, 128-query tile, 128-key chunk) the class

- SKIP: no pair visible, the kernels issue no instruction for it;
- FULL: every pair visible, the kernels compute it without any mask instruction;
- PARTIAL: some pairs visible, the kernels apply its bitmap (128 x 128 bits, 2 KiB),

in the kernels' tile sizes (128 x 128: ``BLOCK_SIZE`` must be None or 128). The bitmaps of PARTIAL tiles are
kept packed (``bits``: uint8 ``[n_partial, 128, 16]``, bit ``c % 8`` of byte ``c // 8`` of row r is key
``c`` of query ``r`` of the tile). Build it once and pass it to every call, forward and backward: the kernels'
operands are derived from it once and cached on the object (``kernel_operands``).

``mask_mod`` is evaluated vectorised on the host, with broadcastable index tensors (b ``[nb, 1, 1, 1]``, h
``[1, nh, 1, 1]``, q_idx ``[1, 1, n_q, 1]``, kv_idx ``[1, 1, 1, n_kv]``, int64), in chunks of query rows, so
memory stays ``O(chunk x KV_LEN)``, not ``O(Q_LEN x KV_LEN)``. Any mask_mod written with torch operations on
its arguments (comparisons, arithmetic, indexing a tensor with them) works; it must return a bool tensor
broadcastable to that shape. Rows and keys past Q_LEN / KV_LEN (padding to the tile) are hidden.
"""
import inspect
import math

import torch

from .kernels import band as _band

__all__ = ["BlockMask", "create_block_mask", "SKIP", "PARTIAL", "FULL", "BLOCK"]

BLOCK = 128  # the kernels' tile: query rows per query tile, keys per key chunk
SKIP = _band.BLOCK_SKIP
PARTIAL = _band.BLOCK_PARTIAL
FULL = _band.BLOCK_FULL
_CHUNK_ELEMS = 1 << 23  # booleans evaluated at once (8 MiB): the memory bound of create_block_mask
_BIT_WEIGHTS = (1 << torch.arange(8, dtype=torch.int32))


def _fail(name, value, rule, exc=ValueError):
    raise exc(f"create_block_mask: {name}={value}: {rule}")


def _check_size(name, x, allow_none):
    if x is None and allow_none:
        return 1
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        _fail(name, repr(x), "must be an int >= 1" + (" or None (broadcast)" if allow_none else ""), TypeError
              if not isinstance(x, int) or isinstance(x, bool) else ValueError)
    return x


def _check_mask_mod(mask_mod):
    if not callable(mask_mod):
        _fail("mask_mod", type(mask_mod).__name__, "must be callable as mask_mod(b, h, q_idx, kv_idx)", TypeError)
    try:
        sig = inspect.signature(mask_mod)
    except (TypeError, ValueError):
        return  # builtins without a signature: the call below decides
    try:
        sig.bind(0, 0, 0, 0)
    except TypeError:
        _fail("mask_mod", f"{getattr(mask_mod, '__name__', 'mask_mod')}{sig}",
              "must take exactly 4 positional arguments (b, h, q_idx, kv_idx)", TypeError)


def _evaluate(mask_mod, nb, nh, q0, q1, kv_len):
    """mask_mod on batch 0..nb-1, heads 0..nh-1, queries q0..q1-1, keys 0..kv_len-1: bool ``[nb, nh, q1 - q0,
    kv_len]`` (checked)."""
    b = torch.arange(nb).view(nb, 1, 1, 1)
    h = torch.arange(nh).view(1, nh, 1, 1)
    q = torch.arange(q0, q1).view(1, 1, q1 - q0, 1)
    kv = torch.arange(kv_len).view(1, 1, 1, kv_len)
    try:
        m = mask_mod(b, h, q, kv)
    except Exception as e:  # any failure of user code becomes one clear error naming it
        raise ValueError(f"create_block_mask: mask_mod raised {type(e).__name__}: {e} (it is called with "
                         f"broadcastable int64 index tensors b [{nb},1,1,1], h [1,{nh},1,1], q_idx "
                         f"[1,1,{q1 - q0},1], kv_idx [1,1,1,{kv_len}])") from e
    if not isinstance(m, torch.Tensor):
        _fail("mask_mod", f"a function returning {type(m).__name__}", "must return a bool tensor", TypeError)
    if m.dtype != torch.bool:
        _fail("mask_mod", f"a function returning a {m.dtype} tensor", "must return a bool tensor (e.g. "
              "q_idx >= kv_idx), not numbers", TypeError)
    try:
        return m.expand(nb, nh, q1 - q0, kv_len)
    except RuntimeError:
        _fail("mask_mod", f"a function returning shape {tuple(m.shape)}",
              f"the result must broadcast to [{nb}, {nh}, {q1 - q0}, {kv_len}] (b, h, q_idx, kv_idx)")


def pack_bits(blocks):
    """bool ``[..., 128, 128]`` -> uint8 ``[..., 128, 16]``: bit ``c % 8`` of byte ``c // 8`` is column c."""
    x = blocks.reshape(*blocks.shape[:-1], BLOCK // 8, 8).to(torch.int32)
    return (x * _BIT_WEIGHTS).sum(-1).to(torch.uint8)


def unpack_bits(bits):
    """uint8 ``[..., 128, 16]`` -> bool ``[..., 128, 128]`` (inverse of ``pack_bits``)."""
    x = bits.to(torch.int32).unsqueeze(-1)
    return ((x & _BIT_WEIGHTS) != 0).reshape(*bits.shape[:-1], BLOCK)


class BlockMask:
    """The blocks of a mask (module docstring); built by ``create_block_mask``, immutable.

    Attributes:
        shape: ``(B, H, Q_LEN, KV_LEN)``, B / H 1 when broadcast.
        seq_lengths: ``(Q_LEN, KV_LEN)``; BLOCK_SIZE: ``(128, 128)``.
        classes: uint8 ``[B, H, ceil(Q_LEN / 128), ceil(KV_LEN / 128)]``: ``SKIP`` 0, ``PARTIAL`` 1, ``FULL`` 2.
        partial_index: int64 like ``classes``: the PARTIAL block's row in ``bits``, -1 elsewhere.
        bits: uint8 ``[n_partial, 128, 16]``: the packed bitmaps of the PARTIAL blocks.
        mask_mod: the function it was built from.
    """

    BLOCK_SIZE = (BLOCK, BLOCK)

    def __init__(self, classes, partial_index, bits, q_len, kv_len, mask_mod=None):
        self.classes = classes
        self.partial_index = partial_index
        self.bits = bits
        self.seq_lengths = (q_len, kv_len)
        self.mask_mod = mask_mod
        self.shape = (int(classes.shape[0]), int(classes.shape[1]), q_len, kv_len)
        self._operands = None
        self._union = None
        self.kernel_operands()  # now, in eager code: a call traced by torch.compile only reads the cache

    # ------------------------------------------------------------------------------------------------ views
    def counts(self):
        """``{"skip": n, "partial": n, "full": n}`` over every (b, h, query tile, key chunk)."""
        c = self.classes
        return {"skip": int((c == SKIP).sum()), "partial": int((c == PARTIAL).sum()), "full": int((c == FULL).sum())}

    def density(self):
        """Fraction of the blocks the kernels compute (FULL + PARTIAL) over all blocks."""
        n = self.counts()
        return (n["full"] + n["partial"]) / max(1, self.classes.numel())

    def sparsity(self):
        """Percentage of blocks skipped (FlexAttention's ``BlockMask.sparsity``)."""
        return 100.0 * (1.0 - self.density())

    def to_dense(self):
        """The element mask: bool ``[B, H, Q_LEN, KV_LEN]`` (True = visible), rebuilt from the blocks."""
        nb, nh, nq, nk = self.classes.shape
        blocks = (self.classes == FULL)[..., None, None].expand(nb, nh, nq, nk, BLOCK, BLOCK).clone()
        part = self.partial_index >= 0
        if bool(part.any()):
            blocks[part] = unpack_bits(self.bits[self.partial_index[part]])
        dense = blocks.permute(0, 1, 2, 4, 3, 5).reshape(nb, nh, nq * BLOCK, nk * BLOCK)
        return dense[:, :, :self.seq_lengths[0], :self.seq_lengths[1]].contiguous()

    # ------------------------------------------------------------------------------------------------ kernels
    def kernel_operands(self):
        """What the kernels take (``band`` "Block masks"), built once and cached: ``(block_mask, store)`` with
        ``block_mask = (B, H, rows)`` (``rows[t][c]``: the class of query tile t and key chunk c over every
        (b, h), the trace-time plan) and ``store`` uint8 ``[128, B * H * n_slots * 16]`` (the bits of every
        chunk whose class over every (b, h) is PARTIAL, in key order within each key tile's run, per (b, h): all
        ones where that (b, h) sees the whole chunk, zeros where it sees none), or None when no chunk needs
        bits."""
        if self._operands is not None:
            return self._operands
        c = self.classes
        nb, nh, nq, nk = c.shape
        all_skip = (c == SKIP).all(0).all(0)
        all_full = (c == FULL).all(0).all(0)
        union = torch.full((nq, nk), PARTIAL, dtype=torch.uint8)
        union[all_skip] = SKIP
        union[all_full] = FULL
        rows = tuple(tuple(r) for r in union.tolist())
        plan = _band.BlockRows(nb, nh, rows, nk)
        store = None
        if plan.n_slots:
            qt, ch = [], []
            for t in range(nq):
                for kt in range(len(plan.slot0[t])):
                    if plan.slot0[t][kt] >= 0:
                        tile = _band.block_key_tile(rows[t], kt * 512, min((kt + 1) * 512, nk * BLOCK))
                        for cc in range(tile.k0 // BLOCK, tile.k1 // BLOCK):
                            if rows[t][cc] == PARTIAL:  # the run's FULL and SKIP chunks need no bits
                                qt.append(t)
                                ch.append(cc)
            qt = torch.tensor(qt)
            ch = torch.tensor(ch)
            cls = c[:, :, qt, ch]  # [nb, nh, n_slots]
            pidx = self.partial_index[:, :, qt, ch]
            slots = torch.zeros(nb, nh, len(qt), BLOCK, BLOCK // 8, dtype=torch.uint8)
            slots[cls == FULL] = 255
            sel = cls == PARTIAL
            if bool(sel.any()):
                slots[sel] = self.bits[pidx[sel]]
            store = slots.permute(3, 0, 1, 2, 4).reshape(BLOCK, -1).contiguous()
        self._union = union
        self._operands = ((nb, nh, rows), store)
        return self._operands

    def union_rows(self):
        """The trace-time classes as a tensor: uint8 ``[ceil(Q_LEN / 128), ceil(KV_LEN / 128)]``, the class of
        each (query tile, key chunk) over every (b, h) (``kernel_operands``' rows)."""
        self.kernel_operands()
        return self._union

    # ------------------------------------------------------------------------------------------------ printing
    def to_string(self, grid_size=(24, 24), limit=4):
        """A picture of the blocks of the first ``limit`` (b, h) pairs, one character pair per block: ``██``
        FULL, ``░░`` PARTIAL, blank SKIP. Grids larger than ``grid_size`` are shown at a coarser step (a cell
        is FULL / SKIP when all its blocks are, else PARTIAL)."""
        nb, nh, nq, nk = self.classes.shape
        sq = max(1, math.ceil(nq / grid_size[0]))
        sk = max(1, math.ceil(nk / grid_size[1]))
        n = self.counts()
        lines = [f"BlockMask(shape={self.shape}, block={BLOCK}x{BLOCK}, sparsity={self.sparsity():.2f}%, "
                 f"full={n['full']}, partial={n['partial']}, skip={n['skip']}"
                 + (f", 1 cell = {sq}x{sk} blocks" if sq > 1 or sk > 1 else "") + ")"]
        shown = 0
        for b in range(nb):
            for h in range(nh):
                if shown == limit:
                    lines.append(f"... {nb * nh - limit} more (b, h) pairs")
                    return "\n".join(lines)
                lines.append(f"({'*' if nb == 1 else b}, {'*' if nh == 1 else h})")
                c = self.classes[b, h]
                for i in range(0, nq, sq):
                    row = []
                    for j in range(0, nk, sk):
                        cell = c[i:i + sq, j:j + sk]
                        if bool((cell == FULL).all()):
                            row.append("██")
                        elif bool((cell == SKIP).all()):
                            row.append("  ")
                        else:
                            row.append("░░")
                    lines.append("".join(row))
                shown += 1
        return "\n".join(lines)

    def __repr__(self):
        return self.to_string()


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, BLOCK_SIZE=None):
    """The ``BlockMask`` of ``mask_mod`` (module docstring) for ``B`` batch elements (None: broadcast), ``H``
    query heads (None: broadcast) and ``Q_LEN`` x ``KV_LEN`` positions; ``BLOCK_SIZE`` None, 128 or
    ``(128, 128)`` (the kernels' tile). Raises TypeError / ValueError naming the argument for a bad size, a
    mask_mod that is not callable with 4 arguments, raises, or returns anything but a broadcastable bool
    tensor."""
    _check_mask_mod(mask_mod)
    nb = _check_size("B", B, True)
    nh = _check_size("H", H, True)
    q_len = _check_size("Q_LEN", Q_LEN, False)
    kv_len = _check_size("KV_LEN", KV_LEN, False)
    if BLOCK_SIZE is not None:
        bs = BLOCK_SIZE if isinstance(BLOCK_SIZE, tuple) else (BLOCK_SIZE, BLOCK_SIZE)
        if len(bs) != 2 or any(isinstance(x, bool) or not isinstance(x, int) for x in bs) \
                or tuple(bs) != (BLOCK, BLOCK):
            _fail("BLOCK_SIZE", repr(BLOCK_SIZE), f"must be None, {BLOCK} or ({BLOCK}, {BLOCK}): the kernels' "
                  f"tiles are {BLOCK} queries x {BLOCK} keys")
    nq, nk = -(-q_len // BLOCK), -(-kv_len // BLOCK)
    kv_pad = nk * BLOCK
    rows_per = max(BLOCK, (_CHUNK_ELEMS // max(1, nb * nh * kv_pad)) // BLOCK * BLOCK)
    classes = torch.empty(nb, nh, nq, nk, dtype=torch.uint8)
    bits = []
    pindex = torch.full((nb, nh, nq, nk), -1, dtype=torch.int64)
    n_part = 0
    for r0 in range(0, nq * BLOCK, rows_per):
        r1 = min(r0 + rows_per, nq * BLOCK)
        m = torch.zeros(nb, nh, r1 - r0, kv_pad, dtype=torch.bool)
        real = min(r1, q_len) - r0
        if real > 0:
            m[:, :, :real, :kv_len] = _evaluate(mask_mod, nb, nh, r0, r0 + real, kv_len)
        t0, t1 = r0 // BLOCK, r1 // BLOCK
        blk = m.view(nb, nh, t1 - t0, BLOCK, nk, BLOCK).permute(0, 1, 2, 4, 3, 5)
        cnt = blk.sum(dim=(4, 5), dtype=torch.int32)
        cls = torch.full(cnt.shape, PARTIAL, dtype=torch.uint8)
        cls[cnt == 0] = SKIP
        cls[cnt == BLOCK * BLOCK] = FULL
        classes[:, :, t0:t1] = cls
        part = cls == PARTIAL
        k = int(part.sum())
        if k:
            bits.append(pack_bits(blk[part]))
            idx = torch.full(cls.shape, -1, dtype=torch.int64)
            idx[part] = torch.arange(n_part, n_part + k)
            pindex[:, :, t0:t1] = idx
            n_part += k
    bits = torch.cat(bits) if bits else torch.zeros(0, BLOCK, BLOCK // 8, dtype=torch.uint8)
    return BlockMask(classes, pindex, bits, q_len, kv_len, mask_mod)
