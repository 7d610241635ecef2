"""The band planner: which (query tile, key tile) pairs a call's mask leaves visible, decided at trace time.

Pure functions of Python ints, in NKI's kernel subset: both kernels call them while tracing, and host code can
call them too (they import ``nl`` only for the ``NKIObject`` base the kernel subset requires of classes, and
``steps.PMAX``, the 128-key chunk). Positions are absolute token indices: a query tile covers rows ``[q0, q1)``,
a key tile columns ``[k0, k1)``.

**The band.** Causal masking, the NKI Library's sliding window and FlashAttention's two-sided ``window_size`` all
keep a diagonal band of every query row, bottom-right aligned (``off = seqlen_k - seqlen_q``, so the last query
lines up with the last key)::

    key j visible to query i   iff   i + lo_rel <= j <= i + hi_rel

``attention_band`` computes ``(lo_rel, hi_rel)`` once per call: ``lo_rel = off - left`` (a sliding window W has
``left = W - 1``), ``hi_rel = off`` with causal or ``off + right`` with a right bound (the tighter one when both
apply). An unbounded side is the finite value no position of the problem can reach (``lo_rel = -seqlen_q``,
``hi_rel = seqlen_k``): the band stays two ints and every test below is a plain integer comparison, exact for
every position inside ``[0, seqlen_q) x [0, seqlen_k)``. The band is never empty (``lo_rel <= hi_rel``), so the
keys a run of queries sees form one interval.

**Classification.** ``classify_keys`` trims one key tile to the 128-key chunks a query tile sees and says which
sides of the band still cut the trimmed tile: a tile is SKIP (no visible pair: never computed), FULL (every pair
visible: no element mask) or PARTIAL (an element mask is needed). Sequence-packing bounds are runtime data: they
never skip a tile, and a kernel treats every tile of a packed call as PARTIAL. ``band_plan`` applies it to a whole
problem (the host's view; the kernels classify the tiles of their own loops with ``classify_keys``).
"""

from ..backend import nl
from .steps import PMAX

SKIP = "skip"
FULL = "full"
PARTIAL = "partial"


def attention_band(use_causal_mask, sliding_window, window_size, seqlen_q, seqlen_k):
    """The band ``(lo_rel, hi_rel)`` of a call: key j visible to query i iff ``i + lo_rel <= j <= i + hi_rel``.

    Args: ``use_causal_mask`` (``j <= i + off``); ``sliding_window`` None/0 or W >= 1 (``j >= i + off - W + 1``);
    ``window_size`` None or ``(left, right)`` ints, -1 = unbounded (``i + off - left <= j <= i + off + right``);
    ``seqlen_q``, ``seqlen_k`` the lengths (``off = seqlen_k - seqlen_q``). The arguments are assumed valid
    (``validation.attention_problem``). Unbounded sides come back as ``-seqlen_q`` / ``seqlen_k``.
    """
    off = seqlen_k - seqlen_q
    lo_rel = -seqlen_q  # i + lo_rel <= 0 <= j for every query i < seqlen_q: no lower bound
    hi_rel = seqlen_k   # i + hi_rel >= seqlen_k > j for every query i >= 0: no upper bound
    if use_causal_mask:
        hi_rel = min(hi_rel, off)
    if sliding_window is not None:
        if sliding_window > 0:
            lo_rel = max(lo_rel, off - sliding_window + 1)
    if window_size is not None:
        left = window_size[0]
        right = window_size[1]
        if left >= 0:
            lo_rel = max(lo_rel, off - left)
        if right >= 0:
            hi_rel = min(hi_rel, off + right)
    return lo_rel, hi_rel


def band_is_full(lo_rel, hi_rel, seqlen_q, seqlen_k):
    """True when the band masks nothing in ``[0, seqlen_q) x [0, seqlen_k)`` (no element mask, no skipping)."""
    return lo_rel <= 1 - seqlen_q and hi_rel >= seqlen_k - 1


def band_tile_visible(q0, q1, k0, k1, lo_rel, hi_rel):
    """True when some (query, key) pair of the tiles [q0, q1) x [k0, k1) lies in the band: compute the tile.

    The queries of the tile see the keys ``q0 + lo_rel .. q1 - 1 + hi_rel`` (one interval, as the band is never
    narrower than one key), so the tile is visible iff that interval meets [k0, k1)."""
    if lo_rel > hi_rel:
        return False
    return k0 <= q1 - 1 + hi_rel and k1 - 1 >= q0 + lo_rel


def band_needs_lo_mask(q0, q1, k0, k1, lo_rel):
    """True when some pair of the tiles violates the band's lower side ``j >= i + lo_rel`` (its worst pair is the
    last query with the first key): the tile needs the lower element mask."""
    return k0 < q1 - 1 + lo_rel


def band_needs_hi_mask(q0, q1, k0, k1, hi_rel):
    """True when some pair of the tiles violates the band's upper side ``j <= i + hi_rel`` (its worst pair is the
    first query with the last key): the tile needs the upper element mask."""
    return k1 - 1 > q0 + hi_rel


def band_tile_fully_visible(q0, q1, k0, k1, lo_rel, hi_rel):
    """True when every pair of the tiles lies in the band: no element mask is needed."""
    if band_needs_lo_mask(q0, q1, k0, k1, lo_rel):
        return False
    return not band_needs_hi_mask(q0, q1, k0, k1, hi_rel)


def band_key_range(q0, q1, lo_rel, hi_rel, seqlen_k):
    """The keys ``[k_start, k_end)`` that some query of [q0, q1) sees, clipped to ``[0, seqlen_k)``; empty
    (``k_end <= k_start``) when none."""
    k_start = max(0, q0 + lo_rel)
    k_end = min(seqlen_k, q1 + hi_rel)
    if lo_rel > hi_rel:
        k_end = k_start
    return k_start, k_end


def band_query_range(k0, k1, lo_rel, hi_rel, seqlen_q):
    """The queries ``[q_start, q_end)`` that see some key of [k0, k1), clipped to ``[0, seqlen_q)``; empty
    (``q_end <= q_start``) when none."""
    q_start = max(0, k0 - hi_rel)
    q_end = min(seqlen_q, k1 - lo_rel)
    if lo_rel > hi_rel:
        q_end = q_start
    return q_start, q_end


class KeyTile(nl.NKIObject):
    """One classified (query tile, key tile) pair: the visible keys ``[k0, k1)`` (whole 128-key chunks; ``k0 ==
    k1`` when none), ``needs_lo`` / ``needs_hi``: that side of the band cuts the trimmed tile, and ``kind``:
    ``SKIP``, ``FULL`` or ``PARTIAL`` (packing makes every visible tile PARTIAL)."""

    def __init__(self, k0, k1, needs_lo, needs_hi, kind):
        self.k0 = k0
        self.k1 = k1
        self.needs_lo = needs_lo
        self.needs_hi = needs_hi
        self.kind = kind


def classify_keys(q0, q1, t0, t1, lo_rel, hi_rel, packing=False):
    """Classify the key tile ``[t0, t1)`` (whole 128-key chunks) for the query tile ``[q0, q1)`` under the band
    ``(lo_rel, hi_rel)``: a ``KeyTile`` trimmed to the run of chunks some query sees (the band leaves one
    contiguous run), with the band sides that still cut it."""
    k0 = t0
    k1 = t0
    for c0 in range(t0, t1, PMAX):
        if band_tile_visible(q0, q1, c0, c0 + PMAX, lo_rel, hi_rel):
            if k1 == k0:
                k0 = c0
            k1 = c0 + PMAX
    if k1 == k0:
        return KeyTile(k0, k0, False, False, SKIP)
    needs_lo = band_needs_lo_mask(q0, q1, k0, k1, lo_rel)
    needs_hi = band_needs_hi_mask(q0, q1, k0, k1, hi_rel)
    kind = FULL
    if packing or needs_lo or needs_hi:
        kind = PARTIAL
    return KeyTile(k0, k1, needs_lo, needs_hi, kind)


def band_plan(seqlen_q, seqlen_k, lo_rel, hi_rel, packing=False, q_tile=128, k_tile=512):
    """Host view of a whole problem: ``plan[i][j]`` is the ``KeyTile`` of query tile i (rows ``[i q_tile,
    (i + 1) q_tile)``) and key tile j (keys ``[j k_tile, min((j + 1) k_tile, seqlen_k))``). Lengths are multiples
    of 128 and ``k_tile`` a multiple of 128."""
    plan = []
    for q0 in range(0, seqlen_q, q_tile):
        row = []
        for t0 in range(0, seqlen_k, k_tile):
            row.append(classify_keys(q0, min(q0 + q_tile, seqlen_q), t0, min(t0 + k_tile, seqlen_k), lo_rel,
                                     hi_rel, packing))
        plan.append(row)
    return plan
