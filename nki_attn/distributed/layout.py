"""Where each rank's tokens sit in the global sequence, and what one (query rank, key rank) pair must compute.

Pure host-side geometry: no communication and no kernel here, so every rule is testable in one process.

A rank's tokens are a :class:`Shard`: runs ("chunks") of consecutive global positions, listed in the order the
rank stores them, with positions increasing along the local axis. Two layouts are provided:

- **ring** (contiguous): rank r holds positions ``[off_r, off_r + len_r)``, ``off_r = len_0 + ... + len_{r-1}``;
  lengths may differ between ranks (``torch.tensor_split`` of the sequence, or any split).
- **zigzag**: the sequence is cut into ``2R`` chunks (``torch.tensor_split`` sizes: the first ``S mod 2R`` chunks
  one token longer); rank r holds chunks ``r`` and ``2R - 1 - r``, in that order. Under a causal mask every rank
  then has the same work (the early chunk sees little, the late chunk sees a lot).

Masks are FlashAttention's on the full sequence (``seqlen_q == seqlen_k``, so top-left = bottom-right): query at
position i sees key j iff ``i - left <= j <= i + right`` (a side of -1 is unbounded; causal is right = 0).
Because a shard's positions increase along its local axis, the keys of any shard that one query sees form one
contiguous run of local indices, so a block pair's mask is exactly a per-query key interval ``[lo, hi)``: the
kernels' ``bound_min`` / ``bound_max``. ``lo`` counts the local keys before the window and ``hi`` the local keys
up to its end, which add up chunk by chunk; each chunk's count is ``spec.window_intervals`` (the helper the
single-process API builds its bounds with).
"""
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..ops import kernel_bounds, padded_length
from ..spec import PMAX, window_intervals

__all__ = ["Shard", "ring_layout", "zigzag_layout", "zigzag_chunk_lengths", "key_intervals", "BlockPlan",
           "plan_block", "Schedule", "plan_schedule", "work_balance", "partial_counts"]


# ----------------------------------------------------------------------------------------------------- shards
@dataclass(frozen=True)
class Shard:
    """The tokens one rank holds: ``chunks = ((global_start, length), ...)`` in local order, positions
    increasing and non-overlapping (the interval argument above needs local order = position order)."""
    chunks: tuple

    def __post_init__(self):
        end = -1
        for start, n in self.chunks:
            if n < 0 or start < end:
                raise ValueError(f"Shard.chunks={self.chunks}: chunks must have lengths >= 0 and increasing, "
                                 f"non-overlapping positions")
            end = start + n

    @property
    def length(self):
        return sum(n for _, n in self.chunks)

    def positions(self):
        """int64 ``[length]``: the global position of each local token."""
        parts = [torch.arange(s, s + n, dtype=torch.int64) for s, n in self.chunks]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def ring_layout(lengths: Sequence[int]):
    """Contiguous shards: rank r holds the ``lengths[r]`` tokens after those of ranks ``0 .. r-1``."""
    out, off = [], 0
    for n in lengths:
        out.append(Shard(((off, int(n)),)))
        off += int(n)
    return tuple(out)


def zigzag_chunk_lengths(total: int, world_size: int):
    """Lengths of the ``2 * world_size`` chunks of a ``total``-token sequence (``torch.tensor_split`` sizes)."""
    n = 2 * world_size
    return [total // n + (1 if c < total % n else 0) for c in range(n)]


def zigzag_layout(total: int, world_size: int):
    """Zigzag shards: rank r holds chunks r and ``2R - 1 - r`` of the ``2R``-way split, in that order."""
    sizes = zigzag_chunk_lengths(total, world_size)
    starts = [sum(sizes[:c]) for c in range(len(sizes))]
    return tuple(Shard(((starts[r], sizes[r]), (starts[2 * world_size - 1 - r], sizes[2 * world_size - 1 - r])))
                 for r in range(world_size))


# ----------------------------------------------------------------------------------------------------- masks
def key_intervals(q_shard: Shard, k_shard: Shard, left: int, right: int):
    """Local key interval ``[lo, hi)`` (int64 ``[q_shard.length]`` each) that each local query of ``q_shard``
    sees in ``k_shard`` under the window ``(left, right)``; ``lo == hi`` when it sees none."""
    lo_rows, hi_rows = [], []
    for q0, nq in q_shard.chunks:
        lo = torch.zeros(nq, dtype=torch.int64)
        hi = torch.zeros(nq, dtype=torch.int64)
        for k0, nk in k_shard.chunks:
            # per chunk: #keys before the window start, #keys up to the window end (left, right >= 0 or -1
            # keep hi >= lo, so window_intervals' clamp of hi to lo never fires and the counts add up)
            clo, chi = window_intervals(nq, nk, left, right, shift=q0 - k0)
            lo += clo
            hi += chi
        lo_rows.append(lo)
        hi_rows.append(hi)
    lo = torch.cat(lo_rows) if lo_rows else torch.zeros(0, dtype=torch.int64)
    hi = torch.cat(hi_rows) if hi_rows else torch.zeros(0, dtype=torch.int64)
    return lo, torch.maximum(hi, lo)


def _down(n):
    return n // PMAX * PMAX


def _up(n):
    return -(-n // PMAX) * PMAX


@dataclass(frozen=True)
class BlockPlan:
    """One kernel call of a block pair, cropped to the 128-aligned box of rows and keys that see anything.

    ``rows = (r0, r1)``: query rows of the local (padded) q; ``keys = (k0, k1)``: keys of the (padded) K/V
    buffer of the key rank. The mask inside the box is one of: nothing (``causal`` False and no bounds: every
    row sees every key), the kernels' native causal mask (+ ``window`` W), or per-query bounds (float32
    ``[r1 - r0]``, rows past the real queries see no key). ``visible`` counts visible (query, key) pairs;
    ``tiles`` the 128 x 128 score tiles the kernel computes (native causal skips tiles, bounds never do).
    """
    rows: tuple
    keys: tuple
    causal: bool
    window: Optional[int]
    bound_min: Optional[torch.Tensor]
    bound_max: Optional[torch.Tensor]
    visible: int
    tiles: int

    @property
    def kind(self):
        return "bounds" if self.bound_min is not None else ("causal" if self.causal else "full")


def _causal_tiles(n, window):
    """128 x 128 tiles of an n x n causal (window W) block holding a visible pair: the tiles the kernels run."""
    t = n // PMAX
    return sum(1 for a in range(t) for b in range(a + 1)
               if not window or (b + 1) * PMAX - 1 >= a * PMAX - window + 1)


def _plan(lo, hi, nq, q_pad, k_pad, left):
    """Crop and classify one kernel call from per-query intervals (int64 ``[nq]``, local key indices); None when
    no row sees a key."""
    seen = hi > lo
    if nq == 0 or not bool(seen.any()):
        return None
    rows = torch.nonzero(seen).flatten()
    r0, r1 = _down(int(rows[0])), min(_up(int(rows[-1]) + 1), q_pad)
    k0, k1 = _down(int(lo[seen].min())), min(_up(int(hi[seen].max())), k_pad)
    real = slice(r0, min(r1, nq))
    clo = torch.where(seen[real], lo[real] - k0, 0)
    chi = torch.where(seen[real], hi[real] - k0, 0)
    sq, sk = r1 - r0, k1 - k0
    visible = int((hi - lo).sum())
    t = torch.arange(clo.shape[0], dtype=torch.int64)
    if bool((clo == 0).all() and (chi == sk).all()):
        return BlockPlan((r0, r1), (k0, k1), False, None, None, None, visible, (sq // PMAX) * (sk // PMAX))
    if sq == sk and bool((chi == t + 1).all()):
        window = left + 1 if left >= 0 else None
        want_lo = (t - left).clamp(min=0) if left >= 0 else torch.zeros_like(t)
        if bool((clo == want_lo).all()):
            return BlockPlan((r0, r1), (k0, k1), True, window, None, None, visible, _causal_tiles(sq, window))
    bmin, bmax = kernel_bounds(clo, chi, sq)
    return BlockPlan((r0, r1), (k0, k1), False, None, bmin, bmax, visible, (sq // PMAX) * (sk // PMAX))


def plan_block(q_shard: Shard, k_shard: Shard, left: int, right: int, q_pad: Optional[int] = None,
               k_pad: Optional[int] = None):
    """The kernel calls (a tuple of :class:`BlockPlan`, empty when every pair is masked: the block is skipped)
    for the queries of ``q_shard`` against the keys of ``k_shard``. ``q_pad`` / ``k_pad``: padded lengths of
    the local q and of the K/V buffer (multiples of 128; default the shards' lengths rounded up).

    One call covers the pair when its mask is "all visible" or native causal; when it needs bounds and the
    shards have several chunks (zigzag with a window), one call per chunk pair is used instead if that computes
    fewer tiles (each chunk pair is a plain window: native causal or a small crop)."""
    nq, nk = q_shard.length, k_shard.length
    q_pad = padded_length(nq) if q_pad is None else q_pad
    k_pad = padded_length(nk) if k_pad is None else k_pad
    if nq == 0 or nk == 0:
        return ()
    lo, hi = key_intervals(q_shard, k_shard, left, right)
    whole = _plan(lo, hi, nq, q_pad, k_pad, left)
    if whole is None:
        return ()
    if whole.kind != "bounds" or len(q_shard.chunks) * len(k_shard.chunks) == 1:
        return (whole,)
    parts, q_off = [], 0
    for qc in q_shard.chunks:
        k_off = 0
        for kc in k_shard.chunks:
            clo, chi = key_intervals(Shard((qc,)), Shard((kc,)), left, right)
            lo = torch.zeros(nq, dtype=torch.int64)
            hi = torch.zeros(nq, dtype=torch.int64)
            lo[q_off:q_off + qc[1]] = clo + k_off
            hi[q_off:q_off + qc[1]] = chi + k_off
            p = _plan(lo, hi, nq, q_pad, k_pad, left)
            if p is not None:
                parts.append(p)
            k_off += kc[1]
        q_off += qc[1]
    return tuple(parts) if sum(p.tiles for p in parts) < whole.tiles else (whole,)


# ----------------------------------------------------------------------------------------------------- schedule
@dataclass(frozen=True)
class Schedule:
    """How far K/V travel: ``forward`` hops to rank r+1 (rank r then holds the K/V of r-1, r-2, ...) and
    ``backward`` hops to rank r-1 (r+1, r+2, ...), both directions at once. ``blocks[r][s]`` holds rank r's
    kernel calls against rank s's keys (empty: skipped). The classic ring is ``forward = R - 1, backward = 0``."""
    world_size: int
    forward: int
    backward: int
    blocks: tuple
    q_pad: tuple
    kv_pad: int

    @property
    def steps(self):
        return max(self.forward, self.backward) + 1

    def sources(self, rank, step):
        """(direction, source rank) pairs whose K/V rank ``rank`` holds at ``step``: step 0 is its own."""
        if step == 0:
            return [(0, rank)]
        out = []
        if step <= self.forward:
            out.append((1, (rank - step) % self.world_size))
        if step <= self.backward:
            out.append((-1, (rank + step) % self.world_size))
        return out


def plan_schedule(shards: Sequence[Shard], left: int, right: int) -> Schedule:
    """Block plans of every (query rank, key rank) pair and the shortest travel that reaches every needed pair.

    A key rank at ring offset t (``s = r - t mod R``) is needed when some query rank's block against it is not
    empty. The classic ring sends K/V forward ``max t`` hops; when windows leave a gap of unneeded offsets
    (e.g. a window shorter than a shard needs only the neighbours) sending forward up to the gap and backward
    past it moves less data; ties keep the classic ring.
    """
    R = len(shards)
    kv_pad = max(padded_length(s.length) for s in shards)
    q_pad = tuple(padded_length(s.length) for s in shards)
    blocks = tuple(tuple(plan_block(shards[r], shards[s], left, right, q_pad[r], kv_pad) for s in range(R))
                   for r in range(R))
    needed = sorted({(r - s) % R for r in range(R) for s in range(R) if s != r and blocks[r][s]})
    best = (max(needed, default=0), 0)
    for split in range(R):
        fwd = max((t for t in needed if t <= split), default=0)
        bwd = max((R - t for t in needed if t > split), default=0)
        if (fwd + bwd, bwd > 0, max(fwd, bwd)) < (best[0] + best[1], best[1] > 0, max(best)):
            best = (fwd, bwd)
    return Schedule(R, best[0], best[1], blocks, q_pad, kv_pad)


# ----------------------------------------------------------------------------------------------------- balance
def work_balance(shards: Sequence[Shard], left: int = -1, right: int = -1):
    """Per-rank work of one attention call: a list of dicts with ``visible`` (query, key) pairs (the exact
    attention work), ``tiles`` (128 x 128 score tiles the kernels compute under the block plans: crops and
    causal skips included, bounds never skip) and ``blocks`` (kernel calls), plus ``imbalance`` = max / mean of
    ``tiles`` in every row (1.0 is perfect balance: the slowest rank sets the step time)."""
    sched = plan_schedule(shards, left, right)
    rows = []
    for r in range(len(shards)):
        plans = [p for pair in sched.blocks[r] for p in pair]
        rows.append({"rank": r, "tokens": shards[r].length, "visible": sum(p.visible for p in plans),
                     "tiles": sum(p.tiles for p in plans), "blocks": len(plans)})
    mean = sum(x["tiles"] for x in rows) / len(rows)
    imb = max(x["tiles"] for x in rows) / mean if mean else 1.0
    for x in rows:
        x["imbalance"] = imb
    return rows


def partial_counts(shards: Sequence[Shard], left: int = -1, right: int = -1):
    """-> (n_row, n_key): the most kernel calls (partial results) that meet in one query row and in one key under
    the ring's schedule for ``shards`` and the band (``left``, ``right``; -1 unbounded). The ring's accuracy rule
    (docs/distributed.md) scales its merge term by these counts."""
    sched = plan_schedule(shards, left, right)
    world_size = len(shards)
    n_row = n_key = 1
    for r in range(world_size):
        rows = torch.zeros(sched.q_pad[r], dtype=torch.int64)
        for pair in sched.blocks[r]:
            for p in pair:
                rows[p.rows[0]:p.rows[1]] += 1
        n_row = max(n_row, int(rows.max()))
    for s in range(world_size):
        keys = torch.zeros(sched.kv_pad, dtype=torch.int64)
        for r in range(world_size):
            for p in sched.blocks[r][s]:
                keys[p.keys[0]:p.keys[1]] += 1
        n_key = max(n_key, int(keys.max()))
    return n_row, n_key
