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

**Block masks.** A call with a block mask (any ``mask_mod``, ``nki_attn.create_block_mask``) has no band; its
per-tile classes replace the band's tests (``BlockRows``, ``block_key_tile``, the section below). They are
trace-time data, like the band: NKI's control flow is fixed when the kernel is traced, and skipping a tile
means emitting no instruction for it, which only a trace-time decision can do. The element masks of PARTIAL
tiles are runtime data (a bitmap store in HBM), as the packing bounds are.
"""

from ..backend import nl
from .steps import BLOCK_FULL, BLOCK_PARTIAL, BLOCK_SKIP, CHUNK_BYTES, K_TILE, PMAX, block_partial_count

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
    ``SKIP``, ``FULL`` or ``PARTIAL`` (packing makes every visible tile PARTIAL). ``runs``: None, or for a block
    mask's tile with SKIP chunks inside ``[k0, k1)`` the key ranges ``[[r0, r1], ...]`` of its maximal runs of
    non-SKIP chunks, in key order (``block_key_tile``; the forward visits only those)."""

    def __init__(self, k0, k1, needs_lo, needs_hi, kind, runs=None):
        self.k0 = k0
        self.k1 = k1
        self.needs_lo = needs_lo
        self.needs_hi = needs_hi
        self.kind = kind
        self.runs = runs


def classify_keys(q0, q1, t0, t1, lo_rel, hi_rel, packing=False, blocks=None):
    """Classify the key tile ``[t0, t1)`` (whole 128-key chunks) for the query tile ``[q0, q1)`` under the band
    ``(lo_rel, hi_rel)``: a ``KeyTile`` trimmed to the run of chunks some query sees (the band leaves one
    contiguous run), with the band sides that still cut it. With a block mask (``blocks``, a ``BlockRows``; the
    band is then the whole problem) its classes decide instead (``block_key_tile``)."""
    if blocks is not None:
        return block_key_tile(blocks.rows[q0 // PMAX], t0, t1)
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


def band_plan(seqlen_q, seqlen_k, lo_rel, hi_rel, packing=False, q_tile=128, k_tile=512, blocks=None):
    """Host view of a whole problem: ``plan[i][j]`` is the ``KeyTile`` of query tile i (rows ``[i q_tile,
    (i + 1) q_tile)``) and key tile j (keys ``[j k_tile, min((j + 1) k_tile, seqlen_k))``). Lengths are multiples
    of 128 and ``k_tile`` a multiple of 128; ``blocks``: a ``BlockRows`` (block mask) instead of the band
    (``q_tile`` 128 then)."""
    plan = []
    for q0 in range(0, seqlen_q, q_tile):
        row = []
        for t0 in range(0, seqlen_k, k_tile):
            row.append(classify_keys(q0, min(q0 + q_tile, seqlen_q), t0, min(t0 + k_tile, seqlen_k), lo_rel,
                                     hi_rel, packing, blocks))
        plan.append(row)
    return plan


# ----------------------------------------------------------------------------------------------- block masks
# A block mask (``nki_attn.create_block_mask``) reaches the kernels as per-tile classes fixed at trace time plus
# a bitmap store in HBM read at run time. The classes are one row per 128-query tile, one entry per 128-key
# chunk, already reduced over the (batch, head) pairs of the call ("union" classes: SKIP when every pair skips
# the chunk, FULL when every pair sees all of it, PARTIAL otherwise). A kernel key tile (512 keys from a
# multiple of 512) is trimmed to the run of its non-SKIP chunks; it is FULL when every chunk of the run is FULL,
# else PARTIAL. Inside a PARTIAL key tile the mask steps treat each chunk by its own class
# (``steps.block_segments``): FULL chunks are evicted unmasked, SKIP chunks filled with the mask value, and only
# the PARTIAL chunks read bits. So only those have *slots* in the store, consecutive within a tile (one DMA per
# run of adjacent PARTIAL chunks): the store is uint8 ``[128, pairs * n_slots * 16]``, slot s of pair (b, h) at
# columns ``((b * n_h + h) * n_slots + s) * 16`` (16 bytes = 128 keys of one query row, bit ``c % 8`` of byte
# ``c // 8`` for key column c, set = visible). The constants and the slot arithmetic live in ``steps`` (the mask
# steps use them; band imports steps, not the reverse).
def block_key_tile(row, t0, t1):
    """Classify the key tile ``[t0, t1)`` (whole 128-key chunks) of one query tile from its row of chunk
    classes ``row`` (``BLOCK_*`` ints): a ``KeyTile`` trimmed to the run of non-SKIP chunks, FULL when every
    chunk of the run is FULL, else PARTIAL (the bitmap masks it); with SKIP chunks left inside, ``runs`` lists
    the maximal runs of non-SKIP chunks (``block_runs``)."""
    first = -1
    last = -1
    for c in range(t0 // PMAX, t1 // PMAX):
        if row[c] != BLOCK_SKIP:
            if first < 0:
                first = c
            last = c
    if first < 0:
        return KeyTile(t0, t0, False, False, SKIP)
    kind = FULL
    for c in range(first, last + 1):
        if row[c] != BLOCK_FULL:
            kind = PARTIAL
    runs = block_runs(row, first * PMAX, (last + 1) * PMAX)
    if len(runs) < 2:
        runs = None
    return KeyTile(first * PMAX, (last + 1) * PMAX, False, False, kind, runs)


def block_runs(row, k0, k1):
    """The maximal runs of non-SKIP chunks of the keys ``[k0, k1)`` (whole 128-key chunks) of one query tile's
    row of chunk classes, as key ranges ``[[r0, r1], ...]`` in key order."""
    runs = []
    for c in range(k0 // PMAX, k1 // PMAX):
        if row[c] != BLOCK_SKIP:
            if len(runs) > 0 and runs[len(runs) - 1][1] == c * PMAX:
                runs[len(runs) - 1][1] = (c + 1) * PMAX
            else:
                runs.append([c * PMAX, (c + 1) * PMAX])
    return runs


class BlockRows(nl.NKIObject):
    """The trace-time half of a block mask in a kernel: ``n_b`` / ``n_h`` the batch and query-head extents of
    the mask (1: broadcast), ``rows[t][c]`` the union class of query tile t and key chunk c, ``n_kc`` the key
    chunks, ``slot0[t][kt]`` the first store slot of key tile kt of query tile t (-1 unless some chunk of its
    run is PARTIAL: one slot per PARTIAL chunk, in key order), ``n_slots`` the slots per (batch, head) pair.
    ``bits`` (the HBM store) and ``bitsel`` (the on-chip bit-select constant) are set by the kernel at launch."""

    def __init__(self, n_b, n_h, rows, n_kc):
        self.n_b = n_b
        self.n_h = n_h
        self.rows = rows
        self.n_kc = n_kc
        table = []
        n = 0
        for t in range(len(rows)):
            r = []
            for t0 in range(0, n_kc * PMAX, K_TILE):
                kt = block_key_tile(rows[t], t0, min(t0 + K_TILE, n_kc * PMAX))
                n_part = 0
                if kt.kind == PARTIAL:
                    n_part = block_partial_count(rows[t], kt.k0 // PMAX, kt.k1 // PMAX)
                if n_part > 0:
                    r.append(n)
                    n += n_part
                else:
                    r.append(-1)
            table.append(r)
        self.slot0 = table
        self.n_slots = n
        self.bits = None
        self.bitsel = None


def block_slot(bl, b, hq, t, k0, c=None):
    """Store slot (global, all pairs) of the PARTIAL key tile starting at key ``k0`` of query tile ``t`` for
    batch ``b`` and query head ``hq``: its first PARTIAL chunk's, or with ``c`` (a PARTIAL chunk index of the
    tile's run) that chunk's."""
    bb = 0
    if bl.n_b > 1:
        bb = b
    hh = 0
    if bl.n_h > 1:
        hh = hq
    s = bl.slot0[t][k0 // K_TILE]
    if c is not None:
        s = s + block_partial_count(bl.rows[t], k0 // PMAX, c)
    return (bb * bl.n_h + hh) * bl.n_slots + s


def block_mask_problem(block_mask, block_bits, seqlen_q, seqlen_k, bs, nheads, masked):
    """None when the kernels accept ``block_mask`` (None, or a trace-time ``(n_b, n_h, rows)``, rows a tuple of
    ``seqlen_q // 128`` tuples of ``seqlen_k // 128`` ``BLOCK_*`` ints) with ``block_bits`` (uint8 ``[128,
    n_b * n_h * n_slots * 16]`` HBM, or None when no key tile is PARTIAL); ``masked``: the call also has a
    causal / window / packing mask (not combinable: fold it into the block mask). Else the problem."""
    if block_mask is None:
        if block_bits is not None:
            return "block_bits is given without block_mask"
        return None
    if masked:
        return ("block_mask cannot be combined with use_causal_mask, sliding_window, window_size or packing "
                "bounds: fold that mask into the block mask")
    if not isinstance(block_mask, tuple) or len(block_mask) != 3:
        return "block_mask must be a tuple (n_b, n_h, rows)"
    n_b = block_mask[0]
    n_h = block_mask[1]
    rows = block_mask[2]
    if n_b != 1 and n_b != bs:
        return f"block_mask batch extent {n_b} must be 1 or bs={bs}"
    if n_h != 1 and n_h != nheads:
        return f"block_mask head extent {n_h} must be 1 or nheads={nheads}"
    if len(rows) != seqlen_q // PMAX:
        return f"block_mask has {len(rows)} query-tile rows, expected seqlen_q // 128 = {seqlen_q // PMAX}"
    for r in rows:
        if len(r) != seqlen_k // PMAX:
            return f"a block_mask row has {len(r)} key chunks, expected seqlen_k // 128 = {seqlen_k // PMAX}"
    bl = BlockRows(n_b, n_h, rows, seqlen_k // PMAX)
    if bl.n_slots == 0:
        return None
    if block_bits is None:
        return "block_mask has PARTIAL key tiles but block_bits is None"
    want = n_b * n_h * bl.n_slots * CHUNK_BYTES
    if tuple(block_bits.shape) != (PMAX, want):
        return f"block_bits.shape={tuple(block_bits.shape)} must be ({PMAX}, {want})"
    if str(block_bits.dtype) != str(nl.uint8):
        return f"block_bits.dtype={block_bits.dtype} must be uint8"
    return None
