"""Trace-time decisions about which (query tile, key tile) pairs a mask leaves visible.

Positions are absolute token indices: a query tile covers rows [q0, q1), a key tile columns [k0, k1).

**The band.** Causal masking, the NKI Library's sliding window and FlashAttention's two-sided ``window_size`` all
keep a diagonal band of every query row, bottom-right aligned (``off = seqlen_k - seqlen_q``, so the last query
lines up with the last key)::

    key j visible to query i   iff   i + lo_rel <= j <= i + hi_rel

``attention_band`` computes ``(lo_rel, hi_rel)`` once per call, at trace time: ``lo_rel = off - left`` (a sliding
window W has ``left = W - 1``), ``hi_rel = off`` with causal or ``off + right`` with a right bound (the tighter one
when both apply). An unbounded side is the finite value that no position of the problem can reach
(``lo_rel = -seqlen_q``, ``hi_rel = seqlen_k``): the band stays two ints, the tile tests stay plain integer
comparisons, and they are exact for every position inside ``[0, seqlen_q) x [0, seqlen_k)``. The band is never
empty (``lo_rel <= hi_rel``), so the keys a run of queries sees form one interval; ``band_key_range`` and
``band_query_range`` give it, which lets a kernel loop over the visible tiles only (linear cost for a bounded
window) instead of testing every tile. Sequence-packing bounds are runtime data, so they never skip a tile.

``tile_visible`` / ``tile_fully_visible`` with ``(causal, window)`` are the older equal-length interface (top-left,
``window`` 0 = none); they are the band functions with the band of those two flags.
"""


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
    (``k_end <= k_start``) when none. A forward kernel loops over the key tiles of this range only."""
    k_start = max(0, q0 + lo_rel)
    k_end = min(seqlen_k, q1 + hi_rel)
    if lo_rel > hi_rel:
        k_end = k_start
    return k_start, k_end


def band_query_range(k0, k1, lo_rel, hi_rel, seqlen_q):
    """The queries ``[q_start, q_end)`` that see some key of [k0, k1), clipped to ``[0, seqlen_q)``; empty
    (``q_end <= q_start``) when none. A backward kernel that walks key tiles loops over these query tiles only."""
    q_start = max(0, k0 - hi_rel)
    q_end = min(seqlen_q, k1 - lo_rel)
    if lo_rel > hi_rel:
        q_end = q_start
    return q_start, q_end


def _legacy_band(q0, q1, k0, k1, causal, window):
    """The band of the older ``(causal, window)`` flags (equal lengths, top-left; window 0 = none), with each
    unbounded side set just out of reach of the tiles [q0, q1) x [k0, k1) (and the band kept non-empty)."""
    hi_rel = max(k1 - q0, 1)
    if causal:
        hi_rel = 0
    lo_rel = min(k0 - q1, hi_rel)
    if window:
        lo_rel = 1 - window
    return lo_rel, hi_rel


def tile_visible(q0, q1, k0, k1, causal, window):
    """True when at least one (query, key) pair of the two tiles is visible: the tile must be computed.

    Equal-length interface: ``causal`` keeps ``j <= i``, ``window`` W > 0 keeps ``j >= i - W + 1`` (0 = none)."""
    lo_rel, hi_rel = _legacy_band(q0, q1, k0, k1, causal, window)
    return band_tile_visible(q0, q1, k0, k1, lo_rel, hi_rel)


def tile_fully_visible(q0, q1, k0, k1, causal, window):
    """True when every pair of the two tiles is visible: no element mask is needed (equal-length interface, as
    ``tile_visible``)."""
    lo_rel, hi_rel = _legacy_band(q0, q1, k0, k1, causal, window)
    return band_tile_fully_visible(q0, q1, k0, k1, lo_rel, hi_rel)


def head_dim_tiles(d):
    """Partition tiles of a head dimension ``d`` (1..256): ``[(first row, rows), ...]``, full tiles of 128 rows
    and one remainder tile (199 -> ``[(0, 128), (128, 71)]``). Q/K (``d_qk``) and V/O (``d_v``) get one list
    each."""
    tiles = []
    for start in range(0, d, 128):
        tiles.append((start, min(128, d - start)))
    return tiles
