"""Flash-attention forward (training): ``o`` and the log-sum-exp ``lse`` the backward kernel consumes.

    attention_fwd(q_ref, k_ref, v_ref, sinks_ref=None, bound_min=None, bound_max=None, use_causal_mask=False,
                  mixed_precision=True, softmax_scale=None, sliding_window=None, softcap=0.0, alibi_slopes=None,
                  window_size=None, dropout_p=0.0, dropout_seed=None, kb_tiles=None, block_members_max=None,
                  slab_tiles=None, attn_bias=None, block_mask=None, block_bits=None, p_dma_period=None,
                  pv_lag=None, logit_scale=None, vt_scratch=None) -> (o, lse)

Layouts (head_dim on the partition axis): q ``[bs, nheads, d_qk, seqlen_q]``, k ``[bs, nheads_kv, d_qk,
seqlen_k]``, v ``[bs, nheads_kv, d_v, seqlen_k]``, o ``[bs, nheads, d_v, seqlen_q]``, lse float32 ``[bs, nheads,
128, seqlen_q // 128]`` with ``lse[b, h, p, t]`` the log-sum-exp of query row ``t * 128 + p`` (``+inf`` for a row that sees no key and has no
sink; its ``o`` is 0). Semantics follow ``golden/attention_fwd_torch.py``; docs/kernel-fwd.md explains the design.
Kernel code stays in NKI's compile-time subset (checked by the simulator's frontend check): invalid arguments fail
an ``assert`` on ``fwd_problem``'s message; ``nki_attn.kernel_api.attention_fwd`` raises it as ``ValueError``.

Algorithm (FlashAttention-2, Q outer). The work is sharded over ``bs * nheads_kv`` (LNC2: ``nl.program_id``).
For one (batch, kv head) the query tiles are processed in *slabs* (as many 128-row tiles as the SBUF budget
holds for every query head of the GQA group): Q is loaded, O and the LSE are stored, once per (head, slab).
A slab's *members* (query head, query tile) are processed in *blocks* of up to ``block_members_max``; a block
streams the keys in *key blocks* of ``kb_tiles`` key tiles of 512 keys, loading K and V and transposing V once
for all its members (the words are both kernels', docs/kernel-fwd.md "Vocabulary"). Per key block, with ``c``
the factor the exponent applies (the softmax scale, in float32: ``steps`` "The scale convention")::

    phase 1, per member and key tile:  S = Q^T K (TensorE, fp32 PSUM);  S -> SBUF, masked, tile row max
    phase 2, all members at once:      m' = max(m, tile maxima);  alpha = exp(c (m - m'));  bias = -c m'
    phase 3, per member and key tile:  P = exp(c S + bias), row sums (ONE activation);  P^T;  O_psum += P V
             per member:               O = O * alpha + O_psum  (PV accumulated over the key block in PSUM)
    phase 4, all members at once:      l = l * alpha + row sums

and per block at the end ``o = O / l``, ``lse = c m + log(l)``; rows whose max is still the mask value (no visible
key, no sink) are forced to ``o = 0``, ``lse = +inf`` by selects on a keep flag. The statistics of all members of a
block live in the columns of ``[128, members]`` tiles, so each statistics instruction serves the whole block.

Variants (soft-capping, ALiBi, bands, dropout) are steps of the protocol shared with the backward
(``nki_attn.kernels.steps``), chosen once per launch (``_select_steps``; docs/kernel-fwd.md "Variants"); the
default launch runs none of them. Which (query tile, key tile) pairs are computed, and which are masked, is the
band planner's decision (``nki_attn.kernels.band``), also shared.
"""
import math

from ..backend import nisa, nki, nl
from .band import PARTIAL, BlockRows, block_mask_problem, classify_keys
from .dropout import (dropout_row_keys, dropout_row_keys_members, dropout_values, keep_threshold,
                      load_dropout_seed)
from .score_mods import MOD_KEYWORDS, SCORE_MODS_BY_RANK
from .steps import (FP32_MAX, FP32_MIN, K_TILE, PMAX, Hbm, Item, Steps, Tile, block_bitsel, block_mask_scores,
                    head_dim_tiles, itemsize, load_packing_bounds, mask_step, per_member, run_steps, spmd_items)
from .validation import attention_problem, attention_shape, sbuf_bytes_per_partition

# Defaults of the tuning keywords of ``attention_fwd`` (``kb_tiles``, ``block_members_max``, ``slab_tiles``):
KB_TILES = 4  # key tiles per key block: the online-softmax statistics are updated once per 2048 keys
BLOCK_MEMBERS_MAX = 8  # members per block: they share one K/V load and one set of statistics ops
# every P_DMA_PERIOD-th member's full P tiles of a key block are transposed by DMA when both head dims are <= 128
# (P^T is then a third of TensorE's work per tile), every P_DMA_PERIOD_WIDE-th with a larger one (0: never; at a
# fifth of TensorE's work, every 2nd member batched is faster under the default model but 2.1x / 3.5x the bound
# at d 256 with the DMA-transpose efficiency at 0.25 / the DMA floor at 850 ns); docs/kernel-fwd.md, "Third round"
P_DMA_PERIOD = 4
P_DMA_PERIOD_WIDE = 0
P_DMA_MIN_TILES = 2  # ... a member with at least this many full tiles (or its key block's count, if smaller)
# consecutive such members of a unit share ONE dma_transpose of up to this many full tiles (or a key block's): a
# transpose pays its fixed costs (per hardware-DGE instruction and queue piece) once per batch
P_DMA_BATCH_TILES = 4
PV_LAG = 16  # P^T tiles waiting for their PV matmul: TensorE never waits for the P^T eviction or DMA
EXP_LEAD = 7  # exponents emitted ahead of their P^T: ScalarE never waits behind TensorE's finishing work
# ... or this many where EXP_LEAD's P tiles would cost a key-block tile (trn1's SBUF at d 128: a key block of one
# tile instead of two, Qwen3 4K's forward 395 -> 427 us modeled by cost model v2)
EXP_LEAD_MIN = 5
# the next unit's scores are all emitted by SCORE_NUM / SCORE_DEN of this unit's phase-3 steps: its phase 2 (the
# exponent bias) then has the rest of the segment to reach ScalarE before the next unit's exponents
SCORE_NUM = 1
SCORE_DEN = 16
# of the P tiles transposed by TensorE, every PT_VECTOR_PERIOD-th is evicted (PSUM -> SBUF) by VectorE, the others
# by ScalarE (1: all by VectorE, the rule with soft-capping, whose tanh keeps ScalarE busy), except in a segment
# with no scores to evict (the pipeline's drain), where VectorE takes them all; docs/kernel-fwd.md, "Engine balance"
PT_VECTOR_PERIOD = 2
FIRST_O_SCALAR = True  # a member's O = PV at its first key block by a ScalarE copy (deferred like those evictions)
# head dims > 128: each step emits its exponents before the next unit's scores. A d 256 key block holds one key
# tile, so a unit has as few jobs as members and the SCORE_NUM / SCORE_DEN rule puts all the next unit's scores
# first; with soft-capping their tanh then stood on ScalarE before the exponents the P transposes wait for
EXPS_FIRST_WIDE = True
# d_v > 128 where the work item's V^T does not fit the SBUF (``vt_cache`` off): a key chunk's V^T is transposed
# by TensorE once per work item and parked in a private HBM scratch; a later unit loads it from there (a plain
# copy, 512 contiguous bytes per key at d_v 256) instead of V (``_plan_vt``)
VT_SCRATCH_WIDE = True
VT_GROUP = 32  # 128-key chunks per row group of that scratch (a multiple of a key block's 16)
PT_SCALAR_LAG = 3  # a ScalarE eviction is emitted this many phase-3 steps after its transposes
FIN_DELAY_MIN = 2  # ... where the SBUF has no room for the finishing blocks' O accumulators FIN_DELAY keeps
FIN_DELAY = 12  # phase-3 steps between a block's last PV and its finishing (and between its members' O^T)
# A row's running max stays at FP32_MIN while every score it saw was masked; any real score is many orders of
# magnitude larger, so "max below -1e38" means "the row saw no key".
EMPTY_MAX = -1.0e38
L_FLOOR = 0.5  # a row that saw a key has l >= 1 (its max contributes exp(0)); keeps log/reciprocal in range
POS_INF = float("inf")  # lse of a row that sees no key (module level: plain Python, not traced)
# V^T of a work item's keys is kept for the whole work item (computed once per 128-key chunk, not once per block
# that sees it) where the SBUF holds it without a smaller key block (``_FwdConfig.vt_cache``)
VT_CACHE = True
# ... in a ring of 128-key chunks (chunk c in slot c mod ring) as long as the widest run of chunks still read when
# a unit writes its V^T (``_vt_ring_need``), so a window or a narrow band keeps V^T in SBUF at any length
# the launch's last slab stores the blocks before its last one early when the last block's score elements are at
# least this many times the O elements that store moves (it is then out before the pipeline's end)
EARLY_STORE_RATIO = 2
# the pipeline's last block takes its statistics before its last PVs only in a launch of more units than this: in a
# shorter one nothing else is in flight to hide them (one causal head of 512 tokens, one unit: 9.98 -> 11.91 us with
# them early; two heads of 1024, two units: 35.57 -> 38.70 us; cost model v2)
STATS_EARLY_MIN_UNITS = 2
# ... and, where the last block has more than one unit and both head dims are <= 128, only if the last unit's PV
# matmuls move at least this many columns (one matmul per visible 128-key chunk, d_v columns each: 48 chunks at
# d_v 128, three quarters of a full unit's 64): the statistics then have that much PV work to hide behind; a
# lighter last unit (the causal diagonal of a block of one head, a window, d_v 64) finishes sooner with them after
# its PVs (docs/kernel-fwd.md, "Sixth round"; a last block of one unit, a narrow window with a wide group, keeps
# the step: its time is the same either way, and the step keeps its worst case over the sensitivity set; so do
# head dims > 128, whose one-tile key blocks make every unit light and whose model shapes are faster with it)
STATS_EARLY_PV_COLUMNS = 6144
SBUF_MARGIN = 24576  # bytes per partition left free when sizing a slab (allocation order, small tiles)


# ----------------------------------------------------------------------------------------------------- trace-time plan
class _FwdConfig(nl.NKIObject):
    """Trace-time facts of one launch: shapes, tilings, dtypes, the masking method and the blocking.

    qk_tiles / v_tiles: ``[(start, size)]`` partition tiles of the Q/K head dim (the QK contraction) and of the
    V/O head dim (V^T and O columns); d_qk / d_v: the head dims. exp_scale: the
    float32 factor the exponent applies to the stored scores (softmax_scale; the cap with soft-capping, ``steps``
    "The scale convention"); cap_scale: the tanh's float32 input factor (soft-capping: softmax_scale / cap).
    off, lo_rel, hi_rel: the band (``band.attention_band``), band_lo / band_hi: that side masks something. alibi
    / alibi_mm: ALiBi given / taken by ``_alibi_matmul``; dropout_p, o_factor = 1 / (1 - p). mask: "bounds"
    (range_select on per-query-tile key bounds, trn2+), "predicate" (trn1 packing: key index compared with the
    bounds, select_reduce) or "affine" (trn1 causal / window: affine_select). group: query heads per kv head;
    block_members_max: members per block at most; members: members per block (whole query tiles of the group
    when the group fits); kb_tiles: key tiles per key block; slab_tiles: query tiles per slab; p_dma_transpose:
    full P tiles may be transposed by DMA (``_transpose_p``), every ``p_dma_period``-th member's; pt_vector_period:
    of the P tiles transposed by TensorE every n-th is evicted by VectorE, the others by ScalarE, ``pt_scalar_lag``
    steps later (``_evict_pt``); finish_on_vector: the block finishing's O normalisation and O^T evictions run on
    VectorE; score_num / score_den: the share of a segment by which the next unit's scores are all out;
    vt_cache: V^T is kept per work item (``_WorkItem.vt``, ``_transpose_v_into``) instead of per unit; vt_ring:
    the chunks that store holds (``_vt_ring``: seqlen_k / 128 unless the band is narrower), chunk c in slot
    c mod vt_ring.

    ``shp`` is the call's ``validation.AttentionShape`` (its softcap, alibi, window_size and dropout_p give the
    variants); ``kb_tiles``, ``block_members_max``, ``slab_tiles``: the kernel's tuning keywords (None: default).
    """

    def __init__(self, shp, io_dtype, acc_dtype, range_select_ok, d_v=None, kb_tiles=None, block_members_max=None,
                 slab_tiles=None, p_dma_period=None, pv_lag=None, vt_scratch=None):
        if d_v is None:
            d_v = shp.d_v
        self.shp = shp
        self.d_qk = shp.d_head
        self.qk_tiles = head_dim_tiles(shp.d_head)
        self.v_tiles = head_dim_tiles(d_v)
        self.d_v = d_v
        self.group = shp.group
        # the scale convention (``steps``): the stored scores are the unscaled float32 S = Q^T K; softmax_scale
        # reaches them only as a float32 factor of the exponent (or of the tanh with soft-capping)
        # soft-capping c > 0: the stored scores are t = tanh(scale * S / c) (``score_mods.softcap_scores``) and the
        # exponent applies c, so exp(c t + bias) is still the ONE exponent of the softmax
        self.softcap = shp.softcap
        self.cap_scale = shp.scale / shp.softcap if shp.softcap > 0 else 1.0
        # the block finishing (O * 1/l, the O^T evictions) runs on VectorE: on ScalarE it waited for VectorE's
        # 1/l and TensorE's O^T between the exponents (semaphores on the critical path); back on ScalarE when a
        # VectorE-heavy variant (exact ALiBi, dropout) comes
        self.finish_on_vector = not shp.alibi and shp.dropout_p == 0.0
        self.exp_scale = shp.softcap if shp.softcap > 0 else shp.scale
        self.dropout_p = shp.dropout_p
        self.o_factor = 1.0 / (1.0 - shp.dropout_p)  # dropout's 1 / (1 - p), applied with 1 / l
        self.io_dtype = io_dtype
        self.acc_dtype = acc_dtype
        self.kb_tiles = KB_TILES if kb_tiles is None else kb_tiles  # the default is sized below
        self.vt_cache = False  # decided below, once the key block is sized
        self.vt_ring = shp.seqlen_k // PMAX
        self.block_members_max = BLOCK_MEMBERS_MAX if block_members_max is None else block_members_max
        self.n_qt = shp.seqlen_q // PMAX
        self.n_kt = (shp.seqlen_k + K_TILE - 1) // K_TILE
        # the band: key j visible to query i iff i + lo_rel <= j <= i + hi_rel, bottom-right aligned
        # (off = seqlen_k - seqlen_q); band_lo / band_hi: that side cuts some pair of the problem
        self.off = shp.off
        self.lo_rel = shp.lo_rel
        self.hi_rel = shp.hi_rel
        self.band_lo = self.lo_rel > 1 - shp.seqlen_q
        self.band_hi = self.hi_rel < shp.seqlen_k - 1
        self.packing = shp.packing
        self.masked = shp.packing or self.band_lo or self.band_hi
        self.block_mask = None  # a block mask's band.BlockRows (set by _setup_config)
        # ALiBi by TensorE (``_alibi_matmul``) when every visible key is left of the diagonal (causal), the inputs
        # are bfloat16, no soft-cap (the bias follows the tanh) and no sinks (they would need the row shift);
        # otherwise the exact VectorE step (``_alibi_scores``)
        # (positions up to 65536: 256 floor(j / 256) stays an exact bfloat16 integer)
        # (and no logit scale: the matmul adds the bias in PSUM, before the logit scale's step would scale it)
        self.alibi_mm = (shp.alibi and self.hi_rel <= self.off and shp.num_sinks == 0 and shp.softcap == 0.0
                         and not shp.logit_scale and str(io_dtype) == str(nl.bfloat16) and shp.seqlen_k <= 65536)
        if range_select_ok:
            self.mask = "bounds"
        elif shp.packing:
            self.mask = "predicate"
        else:
            self.mask = "affine"
        g = shp.group
        if g <= self.block_members_max:
            self.members = (self.block_members_max // g) * g  # whole query tiles: every head of the group
        else:
            self.members = self.block_members_max  # a block holds some heads of one query tile
        # dma_transpose: trn2+ (the range_select generations), 2-byte dtypes only
        self.p_dma_transpose = range_select_ok and itemsize(io_dtype) == 2
        self.p_dma_period = p_dma_period
        if p_dma_period is None:
            self.p_dma_period = P_DMA_PERIOD_WIDE
            if shp.d_head <= PMAX and d_v <= PMAX:
                self.p_dma_period = P_DMA_PERIOD
        self.pv_lag = PV_LAG if pv_lag is None else pv_lag
        self.fin_delay = FIN_DELAY
        self.exp_lead = EXP_LEAD
        self.score_num = SCORE_NUM
        self.score_den = SCORE_DEN
        if itemsize(io_dtype) == 4:
            # float32: the next unit's float32 scores all at once ran past trn1's SBUF at d 256 (the working set
            # does not count them); 2/3 of the segment, as before, is within it
            self.score_num = 2
            self.score_den = 3
        self.pt_vector_period = PT_VECTOR_PERIOD
        if shp.softcap > 0:
            self.pt_vector_period = 1  # the tanh keeps ScalarE as busy as TensorE already
        self.pt_scalar_lag = PT_SCALAR_LAG
        # head dims > 128 (``wide``): exponents first in each step, phase 2 before the unit's V^T, the first
        # slab's Q in two parts (its first block's query tiles first)
        self.wide = shp.d_head > PMAX or d_v > PMAX
        self.exps_first = EXPS_FIRST_WIDE and self.wide
        self.vt_scratch_on = VT_SCRATCH_WIDE if vt_scratch is None else vt_scratch
        self.vt_scratch = False  # decided below, after vt_cache
        self.first_o_scalar = FIRST_O_SCALAR and self.pt_vector_period > 1
        if kb_tiles is None:
            # the deeper exponent lead only where it costs no key-block size (each exponent in flight holds a P tile)
            self.fin_delay = FIN_DELAY_MIN
            self.exp_lead = EXP_LEAD_MIN
            kb_short = _kb_tiles(self, itemsize(io_dtype), itemsize(acc_dtype))
            self.exp_lead = EXP_LEAD
            if _kb_tiles(self, itemsize(io_dtype), itemsize(acc_dtype)) < kb_short:
                self.exp_lead = EXP_LEAD_MIN
            self.fin_delay = FIN_DELAY
            self.kb_tiles = _kb_tiles(self, itemsize(io_dtype), itemsize(acc_dtype))
            if self.fin_delay > FIN_DELAY_MIN:
                # the long finishing only where it costs no key-block size and fits (tight SBUF: float32, d 256)
                kb_long = self.kb_tiles
                fits = _kb_fits(self, kb_long, itemsize(io_dtype), itemsize(acc_dtype))
                self.fin_delay = FIN_DELAY_MIN
                self.kb_tiles = _kb_tiles(self, itemsize(io_dtype), itemsize(acc_dtype))
                if fits and self.kb_tiles <= kb_long:
                    self.fin_delay = FIN_DELAY
        # V^T once per work item: only where a second block reads the same keys and the work item's V^T store
        # (two items live at an item boundary; a ring of the band's chunks, ``_vt_ring``) fits beside the key
        # block already chosen
        if VT_CACHE and self.n_qt * self.group > self.members:
            self.vt_cache = True
            self.vt_ring = _vt_ring(self, [(0, self.n_qt)])  # one slab: the launch's are sized after the ring
            if not _kb_fits(self, self.kb_tiles, itemsize(io_dtype), itemsize(acc_dtype)):
                self.vt_cache = False
        # where the SBUF cannot keep the work item's V^T and d_v > 128: the HBM scratch (``_plan_vt``)
        self.vt_scratch = self.vt_scratch_on and d_v > PMAX and not self.vt_cache
        if slab_tiles is None:
            self.slab_tiles = _slab_tiles(self, itemsize(io_dtype), itemsize(acc_dtype))
        else:
            self.slab_tiles = min(slab_tiles, self.n_qt)
        if self.vt_cache:
            # the launch's slabs may cut blocks short, so the ring may need a little more: sized again with them
            # (where that leaves too little SBUF, no store; the plan is checked once more, ``attention_fwd``)
            ring = _vt_ring(self, _slabs(self))
            if ring > self.vt_ring:
                self.vt_ring = ring
                if not _kb_fits(self, self.kb_tiles, itemsize(io_dtype), itemsize(acc_dtype)):
                    self.vt_cache = False
                if slab_tiles is None:
                    self.slab_tiles = _slab_tiles(self, itemsize(io_dtype), itemsize(acc_dtype))


def _working_set(cfg, kb_tiles, e, acc_e):
    """SBUF bytes per partition the pipeline holds besides the slabs' staging, with ``kb_tiles`` key tiles per
    key block: two units' scores (one scored while one is exponentiated), three units' K and V (loaded two units ahead),
    two units' V^T, the O accumulators of two blocks, the P and P^T tiles in flight, statistics, key bounds."""
    shp = cfg.shp
    kk = kb_tiles * K_TILE
    n_qk = len(cfg.qk_tiles)
    n_v = len(cfg.v_tiles)
    u = cfg.members
    fixed = 2 * u * kk * 4  # scores of every member of two units (float32): the next one's, this one's
    fixed += 3 * (n_qk + n_v) * kk * e  # K and V of three units
    if cfg.vt_cache:
        fixed += 2 * cfg.vt_ring * cfg.d_v * e  # V^T stores of two work items (rings of the band's chunks)
    else:
        fixed += 2 * (kk // PMAX) * cfg.d_v * e  # V^T of two units
    # O accumulators of three blocks (one accumulating, two finishing), and of the blocks a finishing longer than
    # FIN_DELAY_MIN steps keeps (it lasts about 2 fin_delay + u steps, a block at least u of them)
    n_acc = 3 + (2 * (cfg.fin_delay - FIN_DELAY_MIN) + u - 1) // u
    fixed += n_acc * u * cfg.d_v * acc_e
    fixed += (cfg.exp_lead + cfg.pv_lag + 2) * K_TILE * e + u * cfg.d_v * e  # P, P^T in flight, normalised O
    # P of the members transposed by DMA (one batch being written, one waiting for its DMA; _p_dma_batches)
    fixed += 2 * max(kb_tiles, P_DMA_BATCH_TILES) * K_TILE * e
    fixed += 3 * 4 * u * (kb_tiles + 1) * 4 + 2 * 12 * u * 4  # statistics
    fixed += 2 * cfg.n_qt * 4  # key bounds per query tile
    if cfg.mask == "predicate":
        fixed += 2 * kk * 4 + K_TILE  # key index of two units, visibility predicate
    fixed += 3 * cfg.group * max(shp.num_sinks, 1) * 4  # sink statistics
    return fixed


def _vt_ring(cfg, slabs):
    """Chunks of a work item's V^T store, used as a ring (chunk c in slot c mod ring): what the key-block plan of
    one work item in ``slabs`` needs (``_vt_ring_need``), at most every 128-key chunk of the keys (``seqlen_k /
    128``: the whole keys, where the band is not narrower)."""
    n_all = cfg.shp.seqlen_k // PMAX
    if cfg.packing:
        return n_all
    return min(n_all, _vt_ring_need(cfg, _plan_units(cfg, 0, 1, slabs)))


def _slabs(cfg):
    """``[(t0, t1)]`` query-tile ranges of the slabs (``cfg.slab_tiles`` each, the last one shorter)."""
    out = []
    for t0 in range(0, cfg.n_qt, cfg.slab_tiles):
        out.append((t0, min(t0 + cfg.slab_tiles, cfg.n_qt)))
    return out


def _per_tile(cfg, e):
    """SBUF bytes per partition of one query tile of a slab: Q, O staging and LSE of every head of the group."""
    return cfg.group * (len(cfg.qk_tiles) * PMAX * e + len(cfg.v_tiles) * PMAX * e + 4)


def _kb_tiles(cfg, e, acc_e):
    """The default key-block size: ``KB_TILES``, halved until the working set leaves room for three slabs (the
    finishing one, the current one and the next one, which opens two units ahead) of two blocks' query tiles
    each."""
    kb = KB_TILES
    while kb > 1 and not _kb_fits(cfg, kb, e, acc_e):
        kb = kb // 2
    return kb


def _kb_fits(cfg, kb, e, acc_e):
    """True when the working set with ``kb`` key tiles per key block leaves room for three slabs of two blocks'
    query tiles."""
    tiles = min(cfg.n_qt, 2 * max(1, cfg.members // cfg.group))
    return _working_set(cfg, kb, e, acc_e) + 3 * tiles * _per_tile(cfg, e) + SBUF_MARGIN <= \
        sbuf_bytes_per_partition()


def _slab_tiles(cfg, e, acc_e):
    """Query tiles per slab: the most whose Q, O and LSE staging (every head of the group) fits the SBUF three
    times (the pipeline opens the next slab two units ahead, while the last one may still be finishing) next to
    the working set, slabs of balanced length."""
    room = sbuf_bytes_per_partition() - _working_set(cfg, cfg.kb_tiles, e, acc_e) - SBUF_MARGIN
    fit = max(1, room // (3 * _per_tile(cfg, e)))
    n_sec = (cfg.n_qt + fit - 1) // fit
    return (cfg.n_qt + n_sec - 1) // n_sec


def _key_blocks(cfg, tiles):
    """Visibility plan of a block whose members sit at query tiles ``tiles``: one ``_KeyBlock`` per key block some
    member sees (``band.classify_keys`` for every (member, key tile))."""
    shp = cfg.shp
    plan = []
    ch = K_TILE // PMAX
    for kt0 in range(0, cfg.n_kt, cfg.kb_tiles):
        kt_n = min(cfg.kb_tiles, cfg.n_kt - kt0)
        vis = []
        c_lo = cfg.kb_tiles * ch
        c_hi = 0
        gaps = kt_n < cfg.kb_tiles
        for u in range(len(tiles)):
            row = []
            for i in range(kt_n):
                k0 = (kt0 + i) * K_TILE
                q0 = tiles[u] * PMAX
                kt = classify_keys(q0, q0 + PMAX, k0, min(k0 + K_TILE, shp.seqlen_k), cfg.lo_rel, cfg.hi_rel,
                                   cfg.packing, cfg.block_mask)
                row.append(kt)
                if kt.k1 > kt.k0:
                    c_lo = min(c_lo, i * ch + (kt.k0 - k0) // PMAX)
                    c_hi = max(c_hi, i * ch + (kt.k1 - k0) // PMAX)
                else:
                    gaps = True
            vis.append(row)
        if c_hi > c_lo:
            plan.append(_KeyBlock(kt0, kt_n, vis, c_lo, c_hi, gaps))
    return plan


class _KeyBlock(nl.NKIObject):
    """One key block of a block's plan: key tiles ``[kt0, kt0 + kt_n)``; ``vis[u][i]`` the ``band.KeyTile`` of
    member u and key tile ``kt0 + i``; ``[c_lo, c_hi)`` the union of the visible 128-key chunks, counted from the
    key block's first key (what is loaded); ``gaps``: some (member, key tile) slot of the key block is not
    computed (its statistics slot must be preset)."""

    def __init__(self, kt0, kt_n, vis, c_lo, c_hi, gaps):
        self.kt0 = kt0
        self.kt_n = kt_n
        self.vis = vis
        self.c_lo = c_lo
        self.c_hi = c_hi
        self.gaps = gaps


# ----------------------------------------------------------------------------------------------------- mask steps
# Forward mask steps (``steps`` protocol): S (PSUM, or the SBUF output of a score step) -> masked float32 scores
# in SBUF, with the row max into ``tile.row_max`` in the same instruction where the engine allows it.
def _evict_max(cfg, tile, item, s):
    """A key tile no mask touches: copy to SBUF and take its row max in one VectorE instruction."""
    dst = nl.ndarray((PMAX, tile.kw), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar_reduce(dst=dst, data=s, op0=nl.multiply, operand0=1.0, reduce_op=nl.maximum,
                              reduce_res=tile.row_max)
    return dst


def _mask_bounds(cfg, tile, item, s):
    """trn2+: keep key j iff ``bmin[q] <= j < bmax[q]`` (the bounds carry causal, window and packing): one
    range_select copies PSUM -> SBUF, fills the rest with FP32_MIN and yields the row max."""
    bmin, bmax = item.bounds
    t = tile.t
    dst = nl.ndarray((PMAX, tile.kw), dtype=nl.float32, buffer=nl.sbuf)
    nisa.range_select(dst=dst, on_true_tile=s, comp_op0=nl.greater_equal, comp_op1=nl.less,
                      bound0=bmin[:, t:t + 1], bound1=bmax[:, t:t + 1], reduce_cmd=nisa.reduce_cmd.reset_reduce,
                      reduce_res=tile.row_max, reduce_op=nl.maximum, range_start=tile.k0, on_false_value=FP32_MIN)
    return dst


def _mask_predicate(cfg, tile, item, s):
    """trn1 packing (no range_select): keep = (j >= bmin) * (j < bmax) from ``tile.key_idx`` (the key index of
    each column of the tile), then one select that also takes the row max. Bit-identical to ``_mask_bounds``."""
    bmin, bmax = item.bounds
    t = tile.t
    idx = tile.key_idx
    dst = nl.ndarray((PMAX, tile.kw), dtype=nl.float32, buffer=nl.sbuf)
    keep = nl.ndarray((PMAX, tile.kw), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=keep, data=idx, op0=nl.greater_equal, operand0=bmin[:, t:t + 1])
    nisa.scalar_tensor_tensor(dst=keep, data=idx, op0=nl.less, operand0=bmax[:, t:t + 1], op1=nl.multiply,
                              operand1=keep)
    nisa.select_reduce(dst=dst, predicate=keep, on_true=s, on_false=FP32_MIN, reduce_res=tile.row_max,
                       reduce_cmd=nisa.reduce_cmd.reset_reduce, reduce_op=nl.maximum)
    return dst


def _mask_affine(cfg, tile, item, s):
    """trn1 band (causal, windows): copy to SBUF (affine_select is GpSimd, SBUF only), mask by the band's affine
    conditions where a side cuts the tile, then the row max."""
    q0 = tile.q0
    ks = tile.k0
    width = tile.kw
    dst = nl.ndarray((PMAX, width), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=dst, src=s)
    if tile.needs_hi:
        # keep key ks + j for query q0 + c when (q0 + hi_rel - ks) + c - j >= 0
        nisa.affine_select(dst=dst, pattern=[[-1, width]], channel_multiplier=1, on_true_tile=dst,
                           on_false_value=FP32_MIN, cmp_op=nl.greater_equal, offset=q0 + cfg.hi_rel - ks)
    if tile.needs_lo:
        # keep when key >= query + lo_rel:  (ks - q0 - lo_rel) + j - c >= 0
        nisa.affine_select(dst=dst, pattern=[[1, width]], channel_multiplier=-1, on_true_tile=dst,
                           on_false_value=FP32_MIN, cmp_op=nl.greater_equal, offset=ks - q0 - cfg.lo_rel)
    nisa.tensor_reduce(dst=tile.row_max, op=nl.maximum, data=dst, axis=1)
    return dst


# ----------------------------------------------------------------------------------------------------- variant steps
def _dropout_slab(cfg, b, kvh, t0, n_tiles, item):
    """Slab step of dropout: the hash's row words (``dropout.dropout_row_keys_members``, keys below 65536) of
    every member of the slab at once, as uint32 ``[128, members, 4]`` (member j: query tile ``t0 + j // group``,
    head ``j % group``): one set of instructions per slab instead of per member (they are [128, 1] each, so
    their fixed cost would dominate)."""
    g = cfg.group
    n = n_tiles * g
    ii = nl.ndarray((PMAX, n), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.iota(dst=ii, pattern=[[PMAX, n_tiles], [0, g]], offset=t0 * PMAX, channel_multiplier=1)  # query row
    hh = nl.ndarray((PMAX, n), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.iota(dst=hh, pattern=[[0, n_tiles], [1, g]], offset=kvh * g, channel_multiplier=0)  # query head
    return dropout_row_keys_members(item.seed, b, ii, hh, n, 0)


def _dropout_probs(cfg, tile, item, p):
    """Probability step, dropout: ``P * M`` with the keep mask ``M`` of the tile regenerated from the seed
    (``dropout.dropout_values``: the element hash; then the keep flag ``v < T`` and ``P * keep``). The row sum
    was taken before (the LSE is pre-dropout); the factor ``1 / (1 - p)`` is applied once per row at the end
    (``_finish_block``, ``cfg.o_factor``). ``tile.rows``: the member's row words (``_dropout_slab``). A key tile
    never straddles a 65536-key block of the hash; tiles beyond the first block recompute their row words."""
    ks = tile.k0
    w = tile.kw
    keys = tile.rows
    kblk = ks >> 16
    if kblk != 0:
        keys = dropout_row_keys(item.seed, tile.b, tile.hq, tile.q0, PMAX, kblk)
    v = dropout_values(keys, ks, PMAX, w)
    # keep flag on VectorE (one input), the product on GpSimdE (the hash leaves VectorE the busier engine)
    keep = nl.ndarray((PMAX, w), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=keep, data=v, op0=nl.less, operand0=float(keep_threshold(cfg.dropout_p)))
    nisa.tensor_tensor(dst=p, data1=p, data2=keep, op=nl.multiply, engine=nisa.engine.gpsimd)
    return p


def _select_steps(cfg):
    """The launch's steps (``steps`` protocol): the score modifications' steps from their ``score_mods`` rows
    (the score steps in rank order: the logit scale, soft-capping, ALiBi, the additive bias; every other slot in
    table order), the masking steps by generation and mask kind, the probability steps (dropout). The default
    launch has no score or probability step."""
    partial = _mask_affine
    if cfg.mask == "bounds":
        partial = _mask_bounds
    elif cfg.mask == "predicate":
        partial = _mask_predicate
    if cfg.block_mask is not None:
        partial = block_mask_scores
    score = []
    for m in SCORE_MODS_BY_RANK:
        if m.is_on(cfg.shp.mods):
            score.extend(m.fwd(cfg, cfg.shp.mods).score)
    key_block = []
    lse = []
    launch = []
    item_start = []
    for m in cfg.shp.active:
        ms = m.fwd(cfg, cfg.shp.mods)
        key_block.extend(ms.key_block)
        lse.extend(ms.lse)
        launch.extend(ms.launch)
        item_start.extend(ms.item_start)
    prob = []
    rows = None
    if cfg.dropout_p > 0:
        prob.append(_dropout_probs)
        rows = _dropout_slab
    return Steps(score, _evict_max, partial, [], prob, key_block=key_block, lse=lse, rows=rows, launch=launch,
                 item_start=item_start)


def _load_bounds(cfg, bound_min, bound_max):
    """Key bounds of every query row as SBUF ``[128, n_qt]`` float32 columns (column t = query tile t): key j is
    visible to query q iff ``bmin[q] <= j < bmax[q]``. Packing bounds come from HBM; the band's sides
    (causal, windows: ``bmax <= q + hi_rel + 1``, ``bmin >= q + lo_rel``) are folded in."""
    shp = cfg.shp
    n_qt = cfg.n_qt
    if shp.packing:
        bmin, bmax = load_packing_bounds(bound_min, bound_max, n_qt)
    else:
        bmin = nl.ndarray((PMAX, n_qt), dtype=nl.float32, buffer=nl.sbuf)
        bmax = nl.ndarray((PMAX, n_qt), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=bmin, value=0.0, engine=nisa.engine.gpsimd)
        nisa.memset(dst=bmax, value=float(shp.seqlen_k), engine=nisa.engine.gpsimd)
    if cfg.band_hi:
        qpos1 = nl.ndarray((PMAX, n_qt), dtype=nl.float32, buffer=nl.sbuf)
        nisa.iota(dst=qpos1, pattern=[[PMAX, n_qt]], offset=cfg.hi_rel + 1, channel_multiplier=1)  # q + hi_rel + 1
        nisa.tensor_tensor(dst=bmax, data1=bmax, data2=qpos1, op=nl.minimum)
    if cfg.band_lo:
        qlo = nl.ndarray((PMAX, n_qt), dtype=nl.float32, buffer=nl.sbuf)
        nisa.iota(dst=qlo, pattern=[[PMAX, n_qt]], offset=cfg.lo_rel, channel_multiplier=1)  # q + lo_rel
        nisa.tensor_tensor(dst=bmin, data1=bmin, data2=qlo, op=nl.maximum)
    return bmin, bmax


def _sink_stats(cfg, sinks_ref, b, kvh):
    """Starting statistics of the kv head's query heads from their sinks: ``m0`` ``[128, group]`` the sinks' max
    in stored-score members (max / exp_scale, at least FP32_MIN) and ``l0`` the sum of exp(sink - max). All sinks
    -inf (no sink) give exactly the no-sink start: FP32_MIN and 0."""
    shp = cfg.shp
    g = cfg.group
    ns = shp.num_sinks
    # the sink logits of the group's heads, broadcast to every partition (stride-0 HBM read); NOT scaled
    sink = nl.ndarray((PMAX, g, ns), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=sink, src=sinks_ref.ap(pattern=[[0, PMAX], [1, g * ns]],
                                             offset=(b * shp.nheads + kvh * g) * ns))
    neg_max = nl.ndarray((PMAX, g), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=neg_max, op=nl.maximum, data=sink, axis=2, negate=True)
    # m0 from the UNCAPPED negated max: all sinks -inf give +inf * (-1/c) = -inf, clamped to FP32_MIN, the
    # no-sink start that finishing reads as "no key". From the capped FP32_MAX it would be -FP32_MAX / c, which
    # for c > 3.4 (a soft-cap, or a power-of-two scale applied in the exponent) is above EMPTY_MAX: an empty row
    # would be finished as a real one, with lse = log(L_FLOOR) - FP32_MAX instead of +inf.
    m0 = nl.ndarray((PMAX, g), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=m0, data=neg_max, op0=nl.multiply, operand0=-1.0 / cfg.exp_scale, op1=nl.maximum,
                       operand1=FP32_MIN)
    # all sinks -inf: cap the negated max so exp(sink + neg_max) is exp(-inf) = 0, not exp(-inf + inf) = NaN
    nisa.tensor_scalar(dst=neg_max, data=neg_max, op0=nl.minimum, operand0=FP32_MAX)
    l0 = nl.ndarray((PMAX, g), dtype=nl.float32, buffer=nl.sbuf)
    sink_p = nl.ndarray((PMAX, g, ns), dtype=nl.float32, buffer=nl.sbuf)
    for h in range(g):
        nisa.activation(dst=sink_p[:, h, :], op=nl.exp, data=sink[:, h, :], bias=neg_max[:, h:h + 1], scale=1.0,
                        reduce_op=nl.add, reduce_res=l0[:, h:h + 1], reduce_cmd=nisa.reduce_cmd.reset_reduce)
    return m0, l0


def _blocks(cfg, n_tiles):
    """``[(j0, j1)]`` member ranges of a slab of ``n_tiles`` query tiles: whole query tiles (every head of the
    group) per block when the group fits a block, else at most ``block_members_max`` heads of one query tile."""
    g = cfg.group
    bmax = cfg.block_members_max
    out = []
    if g <= bmax:
        for j0 in range(0, n_tiles * g, cfg.members):
            out.append((j0, min(j0 + cfg.members, n_tiles * g)))
    else:
        for r in range(n_tiles):
            for h0 in range(0, g, bmax):
                out.append((r * g + h0, r * g + min(h0 + bmax, g)))
    return out


class _WorkItem(nl.NKIObject):
    """One (batch ``b``, kv head ``kvh``) work item of the pipeline; ``item``: its ``steps.Item`` (runtime
    tiles), made when its first slab opens (``_open_item``). With ``cfg.vt_cache``: ``vt`` the V^T store of its
    keys ``[128 keys, cfg.vt_ring, d_v]`` (allocated at its first load; chunk c in slot c mod vt_ring),
    ``vt_done[r]``: the chunk whose V^T slot r holds or is claimed for by a unit already (trace time; -1: none),
    ``vt_users``: its units whose PVs are not all out (the store is dropped after the last)."""

    def __init__(self, b, kvh):
        self.b = b
        self.kvh = kvh
        self.item = None
        self.vt = None
        self.vt_done = None
        self.vt_users = 0
        self.vt_hbm = None


class _Slab(nl.NKIObject):
    """One slab of a work item: query tiles ``[t0, t0 + n)``; once opened (``_open_slab``) ``q[h][qi]`` the Q of
    head h of the group per Q/K partition tile, ``o[vi]`` / ``lse`` the O^T and LSE staging in member order
    (column block j = member j), ``state`` the per-row state of the row steps (``[128, members, k]``, or None).
    ``blocks_left``: blocks not finished yet (the slab is stored after its last)."""

    def __init__(self, work, t0, n, n_blocks):
        self.work = work
        self.t0 = t0
        self.n = n
        self.q = None
        self.q_rest = None
        self.q_first = 0
        self.stored = 0
        self.lse_done = 0
        self.early_store = False
        self.o = None
        self.lse = None
        self.state = None
        self.opened = False
        self.blocks_left = n_blocks


class _Block(nl.NKIObject):
    """The work of one block: members ``[j0, j1)`` of its slab (member j: query tile ``t0 + j // group``, head
    ``j % group``), their ``heads`` and query ``tiles``, ``plan`` (``_key_blocks``). Once started
    (``_start_block``; the O accumulator ``o_acc`` ``[128, members, d_v]`` at its first exponents): ``started[u]`` (member u's O holds
    a key block's PV already), and the online-softmax statistics as the key blocks leave them: ``pm`` (running
    max in column ``kb_tiles``), ``l_sum``, ``bias`` (the last exponent bias, None before the first). From its
    finishing statistics (``_finish_stats``): ``recip`` (1 / l per member column), and for the pipeline's last
    block, whose statistics go out before its last PVs, ``o_ns[u]`` (member u's O / l once its last O update is
    out, else None)."""

    def __init__(self, slab, j0, j1, heads, tiles, plan):
        self.slab = slab
        self.j0 = j0
        self.j1 = j1
        self.heads = heads
        self.tiles = tiles
        self.plan = plan
        self.o_acc = None
        self.started = None
        self.pm = None
        self.l_sum = None
        self.bias = None
        self.lse_parts = None
        self.recip = None
        self.o_ns = None
        self.o_first = None


class _Unit(nl.NKIObject):
    """One (block, key block) of the pipeline (``kb`` None: a block no key reaches). ``jobs``: its visible
    (member, key tile) pairs ``[u, i]`` in phase order; the rest is filled as the pipeline emits it: K, V^T,
    the scores ``s[u][i]`` and tiles ``tl[u][i]`` (phase 1), the exponent bias and alpha (phase 2), the row sums
    ``rs`` and PV accumulators ``o_ps[u]`` (phase 3)."""

    def __init__(self, blk, kb, first, last):
        self.blk = blk
        self.kb = kb
        self.first = first
        self.last = last
        self.jobs = []
        if kb is not None:
            for u in range(len(blk.heads)):
                for i in range(kb.kt_n):
                    if kb.vis[u][i].k1 > kb.vis[u][i].k0:
                        self.jobs.append([u, i])
        self.k_tiles = None
        self.v_tiles = None
        self.vt = None
        self.vt_base = 0
        self.vt_new = None
        self.vt_load = False
        self.vt_store = False
        self.vt_prev = None
        self.idx = None
        self.s = None
        self.tl = None
        self.diff = None
        self.alpha = None
        self.bias = None
        self.rs = None
        self.o_ps = None
        self.pv_left = None
        self.pv_total = 0
        self.n_full = None
        self.last_full = None
        self.pbuf = None
        self.p_owner = None
        self.p = None
        self.slot = None
        self.summed = False


class _Pipe(nl.NKIObject):
    """Emission state of the software pipeline (``_attend_all``): ``pv`` the P^T tiles waiting for their PV
    matmul (``[unit, u, i, pt]``, emitted ``cfg.pv_lag`` exponents later; ``pv_at`` the next one), ``later`` the
    deferred finishing work ``[due step, kind, block, member, o_n list]``, ``step`` the phase-3 steps emitted,
    ``dma_members`` the members that could have their P transposed by DMA so far (every ``p_dma_period``-th does),
    ``vector_idle``: this segment scores nothing, so every P^T eviction goes to VectorE."""

    def __init__(self):
        self.pv = []
        self.pv_at = 0
        self.later = []
        self.step = 0
        self.dma_members = 0
        self.pt_evictions = 0
        self.evict = []
        self.live_slabs = 0
        self.vector_idle = False


# ----------------------------------------------------------------------------------------------------- key block phases
def _transpose_v(cfg, v_tiles, n_ch):
    """V^T ``[128 keys, n_ch, d_v]`` from the loaded V tiles (TensorE transposes, as many chunks per PSUM bank
    as fit, one eviction per bank)."""
    e = itemsize(cfg.io_dtype)
    vt = nl.ndarray((PMAX, n_ch, cfg.d_v), dtype=cfg.io_dtype, buffer=nl.sbuf)
    per = max(1, 2048 // (cfg.d_v * e))
    for c0 in range(0, n_ch, per):
        g = min(per, n_ch - c0)
        vt_ps = nl.ndarray((PMAX, g, cfg.d_v), dtype=cfg.io_dtype, buffer=nl.psum)
        for c in range(g):
            k0 = (c0 + c) * PMAX
            for vi in range(len(cfg.v_tiles)):
                v0, vsz = cfg.v_tiles[vi]
                nisa.nc_transpose(dst=vt_ps[:, c, v0:v0 + vsz], data=v_tiles[vi][:, k0:k0 + PMAX])
        nisa.tensor_copy(dst=vt[:, c0:c0 + g, :], src=vt_ps)
    return vt


def _transpose_v_into(cfg, v_tiles, chunks, store):
    """V^T of the 128-key ``chunks`` (ascending work-item chunk indices; ``v_tiles`` hold V from the first to
    the last of them) into the work item's V^T ``store`` ``[128 keys, cfg.vt_ring, d_v]`` (chunk c in slot
    c mod vt_ring): TensorE transposes, runs of consecutive chunks sharing a PSUM bank (a run ends where the
    ring wraps), one eviction per bank."""
    e = itemsize(cfg.io_dtype)
    per = max(1, 2048 // (cfg.d_v * e))
    ring = cfg.vt_ring
    first = chunks[0]
    n = len(chunks)
    j = 0
    while j < n:
        g = 1
        while j + g < n and g < per and chunks[j + g] == chunks[j] + g and (chunks[j] + g) % ring != 0:
            g = g + 1
        vt_ps = nl.ndarray((PMAX, g, cfg.d_v), dtype=cfg.io_dtype, buffer=nl.psum)
        for c in range(g):
            k0 = (chunks[j] + c - first) * PMAX
            for vi in range(len(cfg.v_tiles)):
                v0, vsz = cfg.v_tiles[vi]
                nisa.nc_transpose(dst=vt_ps[:, c, v0:v0 + vsz], data=v_tiles[vi][:, k0:k0 + PMAX])
        r = chunks[j] % ring
        nisa.tensor_copy(dst=store[:, r:r + g, :], src=vt_ps)
        j = j + g


def _score_tile(cfg, steps, unit, u, i):
    """Phase 1 of one (member u, key tile i) of ``unit``: S = Q^T K (TensorE, fp32 PSUM), the score steps and the
    mask step of the tile's kind into float32 SBUF ``unit.s[u][i]``, its row max into ``blk.pm[:, u, i]``."""
    blk = unit.blk
    kb = unit.kb
    slab = blk.slab
    item = slab.work.item
    h = blk.heads[u]
    qcol = (blk.tiles[u] - slab.t0) * PMAX
    rows = None
    if slab.state is not None:
        rows = slab.state[:, blk.j0 + u, :]
    kt = kb.vis[u][i]
    if kt.runs is not None:
        _score_runs(cfg, steps, unit, u, i, rows)
        return
    w = kt.k1 - kt.k0
    col = kt.k0 - kb.kt0 * K_TILE - kb.c_lo * PMAX  # first visible key in the loaded K
    key_idx = None
    if unit.idx is not None:
        key_idx = unit.idx[:, col:col + w]
    tile = Tile(item.b, item.kvh * cfg.group + h, h, blk.tiles[u], kt.k0, w, kt.needs_lo, kt.needs_hi, kt.kind,
                rows, blk.pm[:, u, i], key_idx)
    s_ps = nl.ndarray((PMAX, w), dtype=nl.float32, buffer=nl.psum)
    for qi in range(len(cfg.qk_tiles)):
        nisa.nc_matmul(dst=s_ps, stationary=slab.q[h][qi][:, qcol:qcol + PMAX], moving=unit.k_tiles[qi][:, col:col + w])
    src = run_steps(cfg, steps.score, tile, item, s_ps)
    unit.s[u][i] = mask_step(steps, tile)(cfg, tile, item, src)
    tile.saved = {}  # what the score steps left (soft-capping's tanh) is the backward's; the tile lives to its PV
    unit.tl[u][i] = tile


def _score_runs(cfg, steps, unit, u, i, rows):
    """Phase 1 of a block-mask key tile with SKIP chunks between its visible ones (``KeyTile.runs``): only the runs
    of non-SKIP chunks are computed. Their scores sit back to back in one PSUM tile (one QK matmul per run, N =
    the run's width), each run goes through the score steps as its own ``Tile`` (their positions are the run's
    keys), and ONE mask step (``block_mask_scores``, which reads the split from ``tile.runs``) masks them all and
    takes the tile's row max. The job's tile is then ``[128, visible columns]`` for the exponent, the P^T and
    the PV (``_tile_chunks`` maps its chunks back to keys); the online-softmax state is the same as unsplit, as
    the skipped columns would only have held FP32_MIN."""
    blk = unit.blk
    kb = unit.kb
    slab = blk.slab
    item = slab.work.item
    h = blk.heads[u]
    hq = item.kvh * cfg.group + h
    qcol = (blk.tiles[u] - slab.t0) * PMAX
    kt = kb.vis[u][i]
    w = 0
    for r in kt.runs:
        w = w + r[1] - r[0]
    tile = Tile(item.b, hq, h, blk.tiles[u], kt.k0, w, False, False, PARTIAL, rows, blk.pm[:, u, i], None)
    s_ps = nl.ndarray((PMAX, w), dtype=nl.float32, buffer=nl.psum)
    runs = []
    srcs = []
    a = 0
    for r in kt.runs:
        rw = r[1] - r[0]
        col = r[0] - kb.kt0 * K_TILE - kb.c_lo * PMAX  # the run's first key in the loaded K
        for qi in range(len(cfg.qk_tiles)):
            nisa.nc_matmul(dst=s_ps[:, a:a + rw], stationary=slab.q[h][qi][:, qcol:qcol + PMAX],
                           moving=unit.k_tiles[qi][:, col:col + rw])
        rt = Tile(item.b, hq, h, blk.tiles[u], r[0], rw, False, False, PARTIAL, rows, None, None)
        runs.append(rt)
        srcs.append(run_steps(cfg, steps.score, rt, item, s_ps[:, a:a + rw]))
        a = a + rw
    tile.runs = runs
    if len(steps.score) > 0:
        tile.srcs = srcs
    unit.s[u][i] = mask_step(steps, tile)(cfg, tile, item, s_ps)
    tile.saved = {}
    for rt in runs:
        rt.saved = {}
    tile.srcs = None
    unit.tl[u][i] = tile


def _tile_chunks(tile):
    """The key chunks of a job's tile, column chunk by column chunk, counted from ``tile.k0``: all of them, or the
    runs' chunks of a split tile (``_score_runs``)."""
    out = []
    if tile.runs is None:
        for c in range(tile.kw // PMAX):
            out.append(c)
    else:
        for rt in tile.runs:
            for c in range(rt.kw // PMAX):
                out.append((rt.k0 - tile.k0) // PMAX + c)
    return out


def _prob_steps(cfg, steps, tile, item, p):
    """The P-mask and probability steps of a job's P: on the whole tile, or run by run for a split tile (their
    positions are the runs' keys; the steps write the run's columns of ``p`` in place, as dropout does)."""
    if tile.runs is None:
        p = run_steps(cfg, steps.p_mask, tile, item, p)
        return run_steps(cfg, steps.prob, tile, item, p)
    a = 0
    for rt in tile.runs:
        q = run_steps(cfg, steps.p_mask, rt, item, p[:, a:a + rt.kw])
        run_steps(cfg, steps.prob, rt, item, q)
        a = a + rt.kw
    return p


def _update_max(cfg, pm, pm_next):
    """Phase 2 (online-softmax max, all members at once): ``m' = max(m, tile maxima)`` into ``pm_next[:, :, KB]``
    (``pm[:, :, KB]`` holds m), the exponent bias ``-c m'`` (c = exp_scale) capped at FP32_MAX (with c > 1 a row
    that saw only masked scores would give -inf + inf in the exponent), and ``m - m'`` for alpha (``_alpha``). The
    bias first: the exponents wait for it, alpha only for the O rescale."""
    kb = cfg.kb_tiles
    n = pm.shape[1]
    nisa.tensor_reduce(dst=pm_next[:, :, kb], op=nl.maximum, data=pm, axis=2)
    bias = nl.ndarray((PMAX, n), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=bias, data=pm_next[:, :, kb], op0=nl.multiply, operand0=-cfg.exp_scale,
                       op1=nl.minimum, operand1=FP32_MAX)
    diff = nl.ndarray((PMAX, n), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=diff, data1=pm[:, :, kb], data2=pm_next[:, :, kb], op=nl.subtract)
    return diff, bias


def _alpha(cfg, diff):
    """alpha = exp(c (m - m')) of every member (ScalarE), the factor O and l are rescaled by."""
    alpha = nl.ndarray((PMAX, diff.shape[1]), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=alpha, op=nl.exp, data=diff, scale=cfg.exp_scale)
    return alpha


def _rescale_o(o_acc, u, alpha, o_ps, first):
    """Online-softmax update of member ``u``'s O with a key block's PV (float32 PSUM): ``O = O * alpha + PV``, or
    ``O = PV`` at the member's first key block (O is not initialised; sinks add to l only)."""
    if first:
        nisa.tensor_copy(dst=o_acc[:, u, :], src=o_ps)
    else:
        nisa.scalar_tensor_tensor(dst=o_acc[:, u, :], data=o_acc[:, u, :], op0=nl.multiply,
                                  operand0=alpha[:, u:u + 1], op1=nl.add, operand1=o_ps)


def _transpose_p(cfg, p_sb, n_ch, dma_turn, on_scalar=False):
    """P^T ``[128 keys, n_ch, 128 queries]`` (SBUF) for the PV matmul. TensorE transposes (PSUM) and one eviction
    (VectorE; with ``on_scalar`` none: it returns ``[P^T, its PSUM tile]`` for the caller's deferred ScalarE copy,
    ``_evict_pt``) by default; on trn2+ with 16-bit P, a full key tile
    whose ``dma_turn`` it is goes by one SBUF -> SBUF dma_transpose instead (bit-exact too; docs/kernel-fwd.md,
    "Engine balance", says which share)."""
    pt_sb = nl.ndarray((PMAX, n_ch, PMAX), dtype=cfg.io_dtype, buffer=nl.sbuf)
    if cfg.p_dma_transpose and dma_turn and n_ch == K_TILE // PMAX:
        nisa.dma_transpose(dst=pt_sb, src=p_sb.ap(pattern=[[n_ch * PMAX, PMAX], [PMAX, n_ch], [1, PMAX]], offset=0))
    else:
        pt_ps = nl.ndarray((PMAX, n_ch, PMAX), dtype=cfg.io_dtype, buffer=nl.psum)
        for c in range(n_ch):
            nisa.nc_transpose(dst=pt_ps[:, c, :], data=p_sb[:, c * PMAX:(c + 1) * PMAX])
        if on_scalar:
            return [pt_sb, pt_ps]
        nisa.tensor_copy(dst=pt_sb, src=pt_ps)
    return pt_sb


def _exp_tile(cfg, steps, unit, j):
    """Phase 3, first part, of job ``j`` (member u, key tile i) of ``unit``: ``P = exp(c S + bias)`` with its row
    sum into ``rs[:, u, i]`` in ONE activation, then the probability steps; P waits in ``unit.p[j]`` for its
    transpose (``_pt_tile``), so ScalarE runs ahead of TensorE."""
    u = unit.jobs[j][0]
    i = unit.jobs[j][1]
    tile = unit.tl[u][i]
    item = unit.blk.slab.work.item
    k = unit.slot[j]
    if k >= 0:
        o = unit.p_owner[u]
        if unit.pbuf[o] is None:
            unit.pbuf[o] = nl.ndarray((PMAX, unit.n_full[o] * K_TILE), dtype=cfg.io_dtype, buffer=nl.sbuf)
        p_sb = unit.pbuf[o][:, k * K_TILE:(k + 1) * K_TILE]
    else:
        p_sb = nl.ndarray((PMAX, tile.kw), dtype=cfg.io_dtype, buffer=nl.sbuf)
    nisa.activation(dst=p_sb, op=nl.exp, data=unit.s[u][i], bias=unit.bias[:, u:u + 1], scale=cfg.exp_scale,
                    reduce_op=nl.add, reduce_res=unit.rs[:, u, i], reduce_cmd=nisa.reduce_cmd.reset_reduce)
    unit.s[u][i] = None
    unit.p[j] = _prob_steps(cfg, steps, tile, item, p_sb)


def _pt_tile(cfg, pipe, unit, j):
    """Phase 3, second part, of job ``j``: P^T by TensorE (``_transpose_p``), or, for a member whose full tiles
    go by DMA, nothing until the last full tile of its batch (``_p_dma_batches``), then ONE dma_transpose of the
    batch's tiles (SBUF -> SBUF, bit-exact). Each P^T waits in ``pipe.pv`` for its PV."""
    u = unit.jobs[j][0]
    i = unit.jobs[j][1]
    n_ch = unit.tl[u][i].kw // PMAX
    if unit.slot[j] < 0:
        pipe.pt_evictions = pipe.pt_evictions + 1
        on_scalar = pipe.pt_evictions % cfg.pt_vector_period != 0 and not pipe.vector_idle
        pt_sb = _transpose_p(cfg, unit.p[j], n_ch, False, on_scalar)
        unit.p[j] = None
        if on_scalar:
            # its ScalarE eviction waits PT_SCALAR_LAG steps in ``pipe.evict``: emitted at once, ScalarE would
            # stall on the transpose (two semaphores) with only its EXP_LEAD exponents in between
            ev = [pipe.step + cfg.pt_scalar_lag, pt_sb[0], pt_sb[1], False]
            pipe.evict.append(ev)
            pipe.pv.append([unit, u, i, pt_sb[0], ev])
        else:
            pipe.pv.append([unit, u, i, pt_sb, None])
    elif unit.last_full[u] == j:
        o = unit.p_owner[u]
        nc = unit.n_full[o] * n_ch
        pt_all = nl.ndarray((PMAX, nc, PMAX), dtype=cfg.io_dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=pt_all, src=unit.pbuf[o].ap(pattern=[[nc * PMAX, PMAX], [PMAX, nc], [1, PMAX]],
                                                            offset=0))
        unit.pbuf[o] = None
        for jj in range(len(unit.jobs)):
            k = unit.slot[jj]
            w = unit.jobs[jj][0]
            if unit.p_owner[w] == o and k >= 0:
                unit.p[jj] = None
                pipe.pv.append([unit, w, unit.jobs[jj][1], pt_all[:, k * n_ch:(k + 1) * n_ch, :], None])


def _evict_pt(cfg, pipe, flush):
    """The ScalarE P^T evictions (PSUM -> SBUF, ``activation(copy)``) that are due (all when ``flush``)."""
    todo = pipe.evict
    pipe.evict = []
    for k in range(len(todo)):
        if flush or todo[k][0] <= pipe.step:
            nisa.activation(dst=todo[k][1], op=nl.copy, data=todo[k][2])
            todo[k][1] = None
            todo[k][2] = None  # the PSUM bank is free again
            todo[k][3] = True
        else:
            pipe.evict.append(todo[k])


def _pv_tile(cfg, pipe):
    """Phase 3, second half, of the oldest waiting tile: PV accumulated over the member's key block in one PSUM
    tile; after the member's last tile of the key block the O update, after the unit's last tile the block's
    finishing is scheduled (``_later``)."""
    entry = pipe.pv[pipe.pv_at]
    if entry[4] is not None and not entry[4][3]:
        _evict_pt(cfg, pipe, True)  # its P^T eviction first (only a short pipeline gets here before it is due)
    pipe.pv[pipe.pv_at] = None
    pipe.pv_at = pipe.pv_at + 1
    unit = entry[0]
    u = entry[1]
    i = entry[2]
    pt_sb = entry[3]
    kb = unit.kb
    blk = unit.blk
    vt = unit.vt
    ch = K_TILE // PMAX
    tile = unit.tl[u][i]
    n_ch = tile.kw // PMAX
    lo = (tile.k0 - (kb.kt0 + i) * K_TILE) // PMAX
    if unit.o_ps[u] is None:
        unit.o_ps[u] = nl.ndarray((PMAX, cfg.d_v), dtype=nl.float32, buffer=nl.psum)
    o_ps = unit.o_ps[u]
    chunks = _tile_chunks(tile)
    for c in range(n_ch):
        r = i * ch + lo + chunks[c] - unit.vt_base
        if cfg.vt_cache:
            r = r % cfg.vt_ring  # the work item's store: chunk c in slot c mod vt_ring
        nisa.nc_matmul(dst=o_ps, stationary=pt_sb[:, c, :], moving=vt[:, r, :])
    unit.pv_left[u] = unit.pv_left[u] - 1
    unit.pv_total = unit.pv_total - 1
    if unit.pv_left[u] == 0:
        if not blk.started[u] and cfg.first_o_scalar:
            # the member's first key block: O = PV by a ScalarE copy, deferred like the P^T evictions
            ev = [pipe.step + cfg.pt_scalar_lag, blk.o_acc[:, u, :], o_ps, False]
            pipe.evict.append(ev)
            if blk.o_first is None:
                blk.o_first = []
                for k in range(len(blk.heads)):
                    blk.o_first.append(None)
            blk.o_first[u] = ev
        else:
            if blk.o_first is not None and blk.o_first[u] is not None and not blk.o_first[u][3]:
                _evict_pt(cfg, pipe, True)  # the member's first O copy still waits (short key blocks)
            _rescale_o(blk.o_acc, u, unit.alpha, o_ps, not blk.started[u])
            if blk.o_ns is not None and unit.last:
                # the drain's last block (statistics already out): O / l right after the member's last update
                blk.o_ns[u] = _normalise(cfg, blk, u)
        if not blk.started[u]:
            blk.started[u] = True
        unit.o_ps[u] = None
    if unit.pv_total == 0:
        unit.vt = None
        if cfg.vt_cache:
            work = blk.slab.work
            work.vt_users = work.vt_users - 1
            if work.vt_users == 0:
                work.vt = None
        _release_unit(unit)
        if unit.last:
            pipe.later.append([pipe.step + cfg.fin_delay, "stats", blk, 0, None])


def _release_unit(unit):
    """Drop a unit's tiles once its PVs and its phase 4 are out (the plan keeps every unit to the end)."""
    if unit.pv_total == 0 and unit.summed:
        unit.alpha = None
        unit.diff = None
        unit.bias = None
        unit.tl = None
        unit.s = None
        unit.o_ps = None
        unit.p = None


def _update_sum(cfg, l_sum, alpha, rs):
    """Phase 4 (online-softmax sum, all members at once): ``l' = l * alpha + sum of the row sums``."""
    kb = cfg.kb_tiles
    nisa.tensor_tensor(dst=rs[:, :, kb], data1=l_sum, data2=alpha, op=nl.multiply)
    l_new = nl.ndarray((PMAX, rs.shape[1]), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=l_new, op=nl.add, data=rs, axis=2)
    return l_new


# ----------------------------------------------------------------------------------------------------- opening work
def _open_item(cfg, hbm, sinks_ref, launch, steps, work):
    """The work item's runtime tiles (``steps.Item``): sink statistics, then the steps' ``item_start`` hooks (the
    score modifications' per-head operands: ALiBi's coefficients, the logit scale's column); ``launch``: the
    launch-wide ``Item`` (seed, bounds, ALiBi's position table)."""
    b = work.b
    kvh = work.kvh
    sink_stats = None
    if cfg.shp.num_sinks > 0:
        sink_stats = _sink_stats(cfg, sinks_ref, b, kvh)
    work.item = Item(b, kvh, seed=launch.seed, bounds=launch.bounds, pos_tab=launch.pos_tab, sinks=sink_stats)
    if cfg.vt_scratch:
        n_grp = ((cfg.shp.seqlen_k + PMAX - 1) // PMAX + VT_GROUP - 1) // VT_GROUP
        work.vt_hbm = nl.ndarray((n_grp * PMAX, VT_GROUP * cfg.d_v), dtype=cfg.io_dtype, buffer=nl.private_hbm)
    for f in steps.item_start:
        f(cfg, hbm, work.item)


def _open_slab(cfg, hbm, steps, slab, n_first):
    """Q of the slab's query tiles (every head of the group, loaded once, unscaled), the O^T and LSE staging,
    the row steps' state. Q comes in two parts: the first ``n_first`` query tiles (the first block's) now, the
    rest (``slab.q_rest``) after the first unit's K (``_load_unit``), so the first scores wait only for what
    they read."""
    g = cfg.group
    n = slab.n
    t0 = slab.t0
    t1 = t0 + n
    tm = t0 + n_first
    b = slab.work.b
    kvh = slab.work.kvh
    q_slab = []
    rest = []
    for h in range(g):
        row = []
        for qi in range(len(cfg.qk_tiles)):
            d0, dsz = cfg.qk_tiles[qi]
            qt = nl.ndarray((dsz, n * PMAX), dtype=cfg.io_dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=qt[:, 0:n_first * PMAX], src=hbm.q[b, kvh * g + h, d0:d0 + dsz, t0 * PMAX:tm * PMAX])
            if tm < t1:
                rest.append([qt, h, qi])
            row.append(qt)
        q_slab.append(row)
    slab.q_rest = rest
    slab.q_first = n_first
    # O^T and LSE staging in member order (column block j = member j), stored per head by strided reads
    o_slab = []
    for vi in range(len(cfg.v_tiles)):
        v0, vsz = cfg.v_tiles[vi]
        o_stage = nl.ndarray((vsz, n * g * PMAX), dtype=cfg.io_dtype, buffer=nl.sbuf)
        o_slab.append(o_stage)
    slab.q = q_slab
    slab.o = o_slab
    slab.lse = nl.ndarray((PMAX, n * g), dtype=nl.float32, buffer=nl.sbuf)
    if steps.rows is not None:
        slab.state = steps.rows(cfg, b, kvh, t0, n, slab.work.item)
    slab.opened = True


def _start_block(cfg, blk):
    """The block's statistics (running max, sum: from the sinks, or empty)."""
    j0 = blk.j0
    n = blk.j1 - j0
    item = blk.slab.work.item
    plan = blk.plan
    started = []
    for u in range(n):
        started.append(False)
    # pm[:, u, i]: row max of key tile i of the current key block; pm[:, u, KB]: the running max m
    pm = nl.ndarray((PMAX, n, cfg.kb_tiles + 1), dtype=nl.float32, buffer=nl.sbuf)
    l_sum = nl.ndarray((PMAX, n), dtype=nl.float32, buffer=nl.sbuf)
    if item.sinks is None:
        nisa.memset(dst=pm, value=FP32_MIN, engine=nisa.engine.gpsimd)
        nisa.memset(dst=l_sum, value=0.0, engine=nisa.engine.gpsimd)
    else:
        if len(plan) == 0 or plan[0].gaps:
            nisa.memset(dst=pm, value=FP32_MIN, engine=nisa.engine.gpsimd)
        m0, l0 = item.sinks
        nisa.tensor_copy(dst=pm[:, :, cfg.kb_tiles], src=per_member(cfg, m0, j0, n))
        nisa.tensor_copy(dst=l_sum, src=per_member(cfg, l0, j0, n))
    blk.started = started
    blk.pm = pm
    blk.l_sum = l_sum


def _load_unit(cfg, hbm, sinks_ref, launch, steps, unit, first):
    """Open what ``unit`` needs (its work item, slab and block when it is their first) and load its K and V
    (the union of the members' visible chunks) one pipeline segment before its scores."""
    blk = unit.blk
    slab = blk.slab
    work = slab.work
    if work.item is None:
        _open_item(cfg, hbm, sinks_ref, launch, steps, work)
    opening = not slab.opened
    k_tiles = None
    if opening and cfg.wide and unit.kb is not None:
        k_tiles = _load_k(cfg, hbm, unit, first)  # before the slab's Q: the first score reads one head's Q
    if opening:
        n_first = slab.n
        if first and (cfg.group == 1 or cfg.wide):
            n_first = blk.tiles[len(blk.tiles) - 1] - slab.t0 + 1
        _open_slab(cfg, hbm, steps, slab, n_first)
    if unit.first:
        _start_block(cfg, blk)
    kb = unit.kb
    if kb is None:
        if opening:
            _load_q_rest(cfg, hbm, slab)
        return
    b = work.b
    kvh = work.kvh
    key0 = kb.kt0 * K_TILE + kb.c_lo * PMAX
    width = (kb.c_hi - kb.c_lo) * PMAX
    if k_tiles is None:
        k_tiles = _load_k(cfg, hbm, unit, first)
    ch = K_TILE // PMAX
    if cfg.vt_cache:
        # only the chunks whose slot of the store does not hold them (claimed by an earlier unit of the work item
        # and not overwritten since): V loaded from the first to the last of them. A ring evicts the chunk a slot
        # held, which is transposed again if a later unit needs it (``_plan_vt_ring``: never one still read)
        if work.vt is None:
            work.vt = nl.ndarray((PMAX, cfg.vt_ring, cfg.d_v), dtype=cfg.io_dtype, buffer=nl.sbuf)
            done = []
            for r in range(cfg.vt_ring):
                done.append(-1)
            work.vt_done = done
        new = _claim_chunks(work.vt_done, kb.kt0 * ch + kb.c_lo, kb.kt0 * ch + kb.c_hi)
        unit.vt_new = new
        unit.vt_base = -kb.kt0 * ch
        if len(new) > 0:
            key0 = new[0] * PMAX
            width = (new[len(new) - 1] + 1 - new[0]) * PMAX
        else:
            width = 0
    if unit.vt_load:
        n_ch = kb.c_hi - kb.c_lo
        vt = nl.ndarray((PMAX, n_ch, cfg.d_v), dtype=cfg.io_dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=vt, src=_vt_scratch(cfg, work, key0, n_ch))
        unit.vt = vt
        unit.vt_base = kb.c_lo
    if unit.vt_load or unit.vt_prev is not None:
        width = 0
    v_tiles = []
    if width > 0:
        for vi in range(len(cfg.v_tiles)):
            v0, vsz = cfg.v_tiles[vi]
            v_sb = nl.ndarray((vsz, width), dtype=cfg.io_dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=v_sb, src=hbm.v[b, kvh, v0:v0 + vsz, key0:key0 + width])
            v_tiles.append(v_sb)
    unit.k_tiles = k_tiles
    unit.v_tiles = v_tiles
    if opening:
        _load_q_rest(cfg, hbm, slab)


def _claim_chunks(done, c0, c1):
    """The chunks of ``[c0, c1)`` whose V^T a unit must transpose: those whose ring slot (``done``, one entry per
    slot: the chunk it holds or is claimed for, -1 none; chunk c in slot c mod len(done)) holds another chunk.
    Claims them (trace time, in unit order, which is the order of the transposes)."""
    new = []
    for c in range(c0, c1):
        r = c % len(done)
        if done[r] != c:
            new.append(c)
            done[r] = c
    return new


def _load_k(cfg, hbm, unit, first):
    """K of ``unit`` (the union of its members' visible chunks), one DMA per Q/K partition tile; the
    pipeline's ``first`` unit: its first key tile's K in a load of its own (the first scores wait for less)."""
    kb = unit.kb
    work = unit.blk.slab.work
    key0 = kb.kt0 * K_TILE + kb.c_lo * PMAX
    width = (kb.c_hi - kb.c_lo) * PMAX
    k_tiles = []
    cut = 0
    if first:
        cut = min(width, K_TILE - (key0 % K_TILE))
    for qi in range(len(cfg.qk_tiles)):
        d0, dsz = cfg.qk_tiles[qi]
        kt_sb = nl.ndarray((dsz, width), dtype=cfg.io_dtype, buffer=nl.sbuf)
        if cut > 0:
            nisa.dma_copy(dst=kt_sb[:, 0:cut], src=hbm.k[work.b, work.kvh, d0:d0 + dsz, key0:key0 + cut])
        if cut < width:
            nisa.dma_copy(dst=kt_sb[:, cut:width],
                          src=hbm.k[work.b, work.kvh, d0:d0 + dsz, key0 + cut:key0 + width])
        k_tiles.append(kt_sb)
    return k_tiles


def _load_q_rest(cfg, hbm, slab):
    """The rest of a slab's Q (``_open_slab``), once its first unit's K is on its way."""
    g = cfg.group
    m = slab.q_first
    for r in slab.q_rest:
        qt, h, qi = r
        d0, dsz = cfg.qk_tiles[qi]
        nisa.dma_copy(dst=qt[:, m * PMAX:slab.n * PMAX],
                      src=hbm.q[slab.work.b, slab.work.kvh * g + h, d0:d0 + dsz,
                                (slab.t0 + m) * PMAX:(slab.t0 + slab.n) * PMAX])
    slab.q_rest = None


def _begin_scores(cfg, steps, unit):
    """Before a unit's first score: the key-index tile (trn1 packing) and the key-block steps."""
    kb = unit.kb
    n = len(unit.blk.heads)
    s = []
    tl = []
    for u in range(n):
        row = []
        for i in range(kb.kt_n):
            row.append(None)
        s.append(row)
        tl.append(list(row))
    unit.s = s
    unit.tl = tl
    if cfg.mask == "predicate":
        key0 = kb.kt0 * K_TILE + kb.c_lo * PMAX
        width = (kb.c_hi - kb.c_lo) * PMAX
        unit.idx = nl.ndarray((PMAX, width), dtype=nl.float32, buffer=nl.sbuf)
        nisa.iota(dst=unit.idx, pattern=[[1, width]], offset=key0, channel_multiplier=0)  # key index per column
    for f in steps.key_block:
        f(cfg, kb.kt0, unit.blk.slab.work.item)


def _end_scores_vt(cfg, unit):
    """The unit's V^T: into the work item's SBUF V^T (``vt_cache``), or from its V (TensorE), stored to the
    work item's HBM scratch when it holds new chunks (``vt_scratch``); a unit that loaded its V^T, or takes the
    previous unit's, has it already."""
    kb = unit.kb
    blk = unit.blk
    if cfg.vt_cache:
        work = blk.slab.work
        if len(unit.vt_new) > 0:
            _transpose_v_into(cfg, unit.v_tiles, unit.vt_new, work.vt)
        unit.vt = work.vt
    elif unit.vt_prev is not None:
        unit.vt = unit.vt_prev.vt
        unit.vt_base = kb.c_lo
        unit.vt_prev = None
    elif not unit.vt_load:
        unit.vt = _transpose_v(cfg, unit.v_tiles, kb.c_hi - kb.c_lo)
        unit.vt_base = kb.c_lo
        if unit.vt_store:
            key0 = kb.kt0 * K_TILE + kb.c_lo * PMAX
            nisa.dma_copy(dst=_vt_scratch(cfg, blk.slab.work, key0, kb.c_hi - kb.c_lo), src=unit.vt)
    unit.v_tiles = None


def _end_scores(cfg, unit, gaps_next):
    """After a unit's last score: V^T, and phase 2 into the statistics tile of the block's next key block
    (``gaps_next``: it has slots no key tile will write)."""
    kb = unit.kb
    blk = unit.blk
    unit.k_tiles = None
    if not cfg.wide:
        _end_scores_vt(cfg, unit)
    unit.idx = None
    n = len(blk.heads)
    pm_next = nl.ndarray((PMAX, n, cfg.kb_tiles + 1), dtype=nl.float32, buffer=nl.sbuf)
    if gaps_next:
        nisa.memset(dst=pm_next, value=FP32_MIN, engine=nisa.engine.gpsimd)  # slots no key tile will write
    diff, bias = _update_max(cfg, blk.pm, pm_next)
    if cfg.wide:
        # after phase 2: its V^T eviction (a d_v > 128 bank holds two chunks) would delay the exponent bias
        _end_scores_vt(cfg, unit)
    unit.diff = diff
    unit.bias = bias
    blk.pm = pm_next
    blk.bias = bias


def _begin_exps(cfg, steps, pipe, unit, drain):
    """Before a unit's first exponent: the row-sum tile, the PV accumulators and counters, and which
    members' full P tiles go by dma_transpose (every ``p_dma_period``-th member with at least
    ``P_DMA_MIN_TILES`` full tiles, or the key block's count, on trn2+ with 16-bit P and no probability step):
    their exponents write the ``[128, n * 512]`` P buffer of their batch (``pbuf[p_owner[u]]``, job j in column
    block ``slot[j]``). ``drain``: the pipeline's last unit, whose transposes TensorE has time for (nothing is
    scored beside them) and a DMA transpose's latency would end up on the critical path: none by DMA."""
    kb = unit.kb
    n = len(unit.blk.heads)
    full = K_TILE // PMAX
    if unit.first:
        unit.blk.o_acc = nl.ndarray((PMAX, n, cfg.d_v), dtype=cfg.acc_dtype, buffer=nl.sbuf)
    unit.rs = nl.ndarray((PMAX, n, cfg.kb_tiles + 1), dtype=nl.float32, buffer=nl.sbuf)
    if kb.gaps:
        nisa.memset(dst=unit.rs, value=0.0, engine=nisa.engine.gpsimd)
    o_ps = []
    pv_left = []
    n_full = []
    last_full = []
    pbuf = []
    for u in range(n):
        o_ps.append(None)
        pv_left.append(0)
        n_full.append(0)
        last_full.append(-1)
        pbuf.append(None)
    p = []
    slot = []
    for j in range(len(unit.jobs)):
        u = unit.jobs[j][0]
        i = unit.jobs[j][1]
        pv_left[u] = pv_left[u] + 1
        p.append(None)
        slot.append(-1)
        if unit.tl[u][i].kw // PMAX == full:
            slot[j] = n_full[u]
            n_full[u] = n_full[u] + 1
            last_full[u] = j
    batch = cfg.p_dma_transpose and cfg.p_dma_period > 0 and len(steps.prob) == 0 and len(steps.p_mask) == 0
    batch = batch and not drain
    for u in range(n):
        dma = False
        if batch and n_full[u] >= min(P_DMA_MIN_TILES, cfg.kb_tiles):
            pipe.dma_members = pipe.dma_members + 1
            dma = pipe.dma_members % cfg.p_dma_period == 0
        if not dma:
            last_full[u] = -1
    for j in range(len(unit.jobs)):
        if last_full[unit.jobs[j][0]] < 0:
            slot[j] = -1
    unit.p_owner = _p_dma_batches(unit.jobs, n_full, last_full, slot, max(cfg.kb_tiles, P_DMA_BATCH_TILES))
    unit.o_ps = o_ps
    unit.pv_left = pv_left
    unit.pv_total = len(unit.jobs)
    unit.n_full = n_full
    unit.last_full = last_full
    unit.pbuf = pbuf
    unit.p = p
    unit.slot = slot


def _p_dma_batches(jobs, n_full, last_full, slot, most):
    """Group the DMA-transposed members of a unit (``last_full[u] >= 0``) into batches of consecutive ones
    holding at most ``most`` full tiles together, so one dma_transpose carries several members' tiles (its fixed
    costs, per hardware-DGE instruction and queue piece, are paid once per batch). Rewrites in place: ``slot[j]``
    becomes the tile's column block in its batch's buffer, ``n_full[lead]`` the batch's tile count,
    ``last_full`` keeps only the batch's last job (the one whose ``_pt_tile`` emits the transpose; -1 for the
    others). Returns ``owner[u]``: the batch leader whose ``pbuf`` holds member u's tiles (-1: TensorE)."""
    n = len(n_full)
    owner = []
    for u in range(n):
        owner.append(-1)
    lead = -1
    for u in range(n):
        if last_full[u] >= 0:
            if lead >= 0 and n_full[lead] + n_full[u] <= most:
                for j in range(len(jobs)):
                    if jobs[j][0] == u and slot[j] >= 0:
                        slot[j] = slot[j] + n_full[lead]
                n_full[lead] = n_full[lead] + n_full[u]
                for w in range(n):
                    if owner[w] == lead:
                        last_full[w] = -1  # the batch is transposed after u's last full tile now
            else:
                lead = u
            owner[u] = lead
    return owner


# ----------------------------------------------------------------------------------------------------- finishing
def _finish_stats(cfg, steps, blk, normalise):
    """Finishing of a block, all members at once: ``1 / l``, the keep flags and ``log(l)`` (``_finish_lse``
    writes ``lse = c m + log(l)`` = log(l) - bias a few steps later), rows that saw no key (and have no sink) get 0
    and +inf; then per member ``O * (1/l)`` into o's dtype (VectorE, or ScalarE with ``cfg.finish_on_vector``
    off). Returns the normalised ``o_n`` per member (``_finish_member`` transposes them)."""
    slab = blk.slab
    item = slab.work.item
    j0 = blk.j0
    o_acc = blk.o_acc
    pm = blk.pm
    l_sum = blk.l_sum
    n = pm.shape[1]
    if o_acc is None:
        o_acc = nl.ndarray((PMAX, n, cfg.d_v), dtype=cfg.acc_dtype, buffer=nl.sbuf)
        blk.o_acc = o_acc
    for u in range(n):
        if not blk.started[u]:
            # no visible key for this member's rows: O = 0 (o = 0; with sinks lse = their logsumexp)
            nisa.memset(dst=o_acc[:, u, :], value=0.0, engine=nisa.engine.gpsimd)
    bias = blk.bias
    if bias is None:
        bias = nl.ndarray((PMAX, n), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=bias, data=pm[:, :, cfg.kb_tiles], op0=nl.multiply, operand0=-cfg.exp_scale,
                           op1=nl.minimum, operand1=FP32_MAX)
    keep = nl.ndarray((PMAX, n), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=keep, data=pm[:, :, cfg.kb_tiles], op0=nl.greater, operand0=EMPTY_MAX)
    l_safe = nl.ndarray((PMAX, n), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=l_safe, data=l_sum, op0=nl.maximum, operand0=L_FLOOR)
    recip = nl.ndarray((PMAX, n), dtype=nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(dst=recip, data=l_safe)
    nisa.select_reduce(dst=recip, predicate=keep, on_true=recip, on_false=0.0)  # 0 for empty rows
    if cfg.o_factor != 1.0:
        nisa.tensor_scalar(dst=recip, data=recip, op0=nl.multiply, operand0=cfg.o_factor)
    blk.recip = recip
    o_ns = []
    for u in range(n):
        o_ns.append(None)
        if normalise:
            o_ns[u] = _normalise(cfg, blk, u)
    log_l = nl.ndarray((PMAX, n), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=log_l, op=nl.log, data=l_safe)
    blk.lse_parts = [log_l, bias, keep]
    return o_ns


def _normalise(cfg, blk, u):
    """Member ``u``'s O / l in o's dtype ``[128, d_v]`` (``blk.recip`` from ``_finish_stats``)."""
    o_n = nl.ndarray((PMAX, cfg.d_v), dtype=cfg.io_dtype, buffer=nl.sbuf)
    if cfg.finish_on_vector:
        nisa.tensor_scalar(dst=o_n, data=blk.o_acc[:, u, :], op0=nl.multiply, operand0=blk.recip[:, u:u + 1])
    else:
        nisa.activation(dst=o_n, op=nl.copy, data=blk.o_acc[:, u, :], scale=blk.recip[:, u:u + 1])
    return o_n


def _finish_lse(cfg, steps, blk):
    """The block's LSE, ``log(l) - bias`` (+inf for rows that saw no key) into the slab's LSE staging: emitted
    a few steps after ``_finish_stats``, so VectorE does not wait for ScalarE's ``log`` (two semaphores)."""
    slab = blk.slab
    n = len(blk.heads)
    log_l = blk.lse_parts[0]
    bias = blk.lse_parts[1]
    keep = blk.lse_parts[2]
    blk.lse_parts = None
    lse_real = nl.ndarray((PMAX, n), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=lse_real, data1=log_l, data2=bias, op=nl.subtract)
    for f in steps.lse:
        f(cfg, slab.t0, blk.j0, lse_real, slab.work.item)
    nisa.select_reduce(dst=slab.lse[:, blk.j0:blk.j0 + n], predicate=keep, on_true=lse_real, on_false=POS_INF)


def _finish_member(cfg, blk, u, o_n, drain=False):
    """O^T of member ``u`` per V/O partition tile (TensorE) into the slab's O staging (``drain``: the pipeline
    has ended, ScalarE is idle: every 2nd member's eviction there)."""
    slab = blk.slab
    j0 = blk.j0
    col = (j0 + u) * PMAX
    for vi in range(len(cfg.v_tiles)):
        v0, vsz = cfg.v_tiles[vi]
        ot_ps = nl.ndarray((vsz, PMAX), dtype=cfg.io_dtype, buffer=nl.psum)
        nisa.nc_transpose(dst=ot_ps, data=o_n[:, v0:v0 + vsz])
        if cfg.finish_on_vector and not (drain and u % 2 == 1):
            nisa.tensor_copy(dst=slab.o[vi][:, col:col + PMAX], src=ot_ps)
        else:
            nisa.activation(dst=slab.o[vi][:, col:col + PMAX], op=nl.copy, data=ot_ps)


def _lse_dma(cfg, hbm, slab, h, a, z):
    """The LSE of head ``h`` of the group for the slab's query tiles ``[t0 + a, t0 + z)``: ONE DMA from the slab's
    LSE staging ``[128, n * group]`` (member order: column ``t * group + h``, read with stride ``group``) to
    ``lse[b, kvh * group + h, :, t0 + a:t0 + z]`` (the ``[128, n_tiles]`` layout ``attention_bwd`` loads)."""
    g = cfg.group
    nisa.dma_copy(dst=hbm.lse[slab.work.b, slab.work.kvh * g + h, :, slab.t0 + a:slab.t0 + z],
                  src=slab.lse.ap(pattern=[[slab.n * g, PMAX], [g, z - a]], offset=a * g + h))


def _store_lse(cfg, hbm, slab):
    """Head dims > 128, the launch's last slab at its last block's LSE: the LSE not stored yet goes out now,
    one DMA per head (every block before has its LSE), so the pipeline's end waits for O's stores only."""
    for h in range(cfg.group):
        _lse_dma(cfg, hbm, slab, h, slab.lse_done, slab.n)
    slab.lse_done = slab.n


def _store_slab(cfg, hbm, slab, a, z):
    """O and the LSE of the slab's query tiles ``[t0 + a, t0 + z)``, one DMA per (head, d tile) and one per head,
    from the staging."""
    g = cfg.group
    n = slab.n
    t0 = slab.t0
    m = z - a
    b = slab.work.b
    kvh = slab.work.kvh
    for h in range(g):
        hq = kvh * g + h
        for vi in range(len(cfg.v_tiles)):
            v0, vsz = cfg.v_tiles[vi]
            nisa.dma_copy(dst=hbm.o[b, hq, v0:v0 + vsz, (t0 + a) * PMAX:(t0 + z) * PMAX],
                          src=slab.o[vi].ap(pattern=[[n * g * PMAX, vsz], [g * PMAX, m], [1, PMAX]],
                                            offset=(a * g + h) * PMAX))
        if z > slab.lse_done:
            _lse_dma(cfg, hbm, slab, h, max(a, slab.lse_done), z)
    slab.stored = z
    if z > slab.lse_done:
        slab.lse_done = z
    if z < n:
        return
    slab.q = None
    slab.o = None
    slab.lse = None
    slab.state = None


def _run_later(cfg, hbm, steps, pipe, flush):
    """Run the deferred finishing work that is due (all of it when ``flush``): a block's statistics and
    normalisation (``stats``), then one member's O^T per phase-3 step (``member``), then the slab's stores."""
    if len(pipe.evict) > 0:
        _evict_pt(cfg, pipe, flush)
    again = True
    while again:
        again = False
        todo = pipe.later
        pipe.later = []
        for k in range(len(todo)):
            job = todo[k]
            if flush or job[0] <= pipe.step:
                blk = job[2]
                if job[1] == "stats":
                    if len(pipe.evict) > 0:
                        _evict_pt(cfg, pipe, True)  # a first O copy may still wait (FIN_DELAY_MIN < its lag)
                    o_ns = blk.o_ns
                    if o_ns is None:
                        o_ns = _finish_stats(cfg, steps, blk, True)
                    pipe.later.append([pipe.step + cfg.fin_delay, "lse", blk, 0, None])
                    for u in range(len(o_ns)):
                        pipe.later.append([pipe.step + cfg.fin_delay + u, "member", blk, u, o_ns])
                    again = flush
                elif job[1] == "lse":
                    _finish_lse(cfg, steps, blk)
                    if cfg.wide and blk.slab.early_store and blk.slab.blocks_left == 1:
                        _store_lse(cfg, hbm, blk.slab)
                else:
                    u = job[3]
                    if job[4][u] is None:
                        job[4][u] = _normalise(cfg, blk, u)  # the drain's last block: not normalised yet
                    _finish_member(cfg, blk, u, job[4][u], flush and cfg.wide)
                    job[4][u] = None
                    if u == len(job[4]) - 1:
                        blk.o_acc = None
                        blk.recip = None
                        blk.o_ns = None
                        blk.pm = None
                        blk.l_sum = None
                        blk.bias = None
                        slab = blk.slab
                        slab.blocks_left = slab.blocks_left - 1
                        if slab.blocks_left == 0:
                            _store_slab(cfg, hbm, slab, slab.stored, slab.n)
                            pipe.live_slabs = pipe.live_slabs - 1
                        elif slab.blocks_left == 1 and slab.early_store:
                            # the launch's last slab: what is finished goes out now, so only the last block's
                            # query tiles are stored after the pipeline's end
                            done = blk.j1 // cfg.group
                            if done > slab.stored:
                                _store_slab(cfg, hbm, slab, slab.stored, done)
            else:
                pipe.later.append(job)


# ----------------------------------------------------------------------------------------------------- the pipeline
def _plan_units(cfg, start, stop, slabs):
    """Every unit of this core's work items, in emission order: work item, slab, block, key block."""
    shp = cfg.shp
    g = cfg.group
    units = []
    for w in range(start, stop):
        work = _WorkItem(w // shp.nheads_kv, w % shp.nheads_kv)
        for si in range(len(slabs)):
            t0, t1 = slabs[si]
            blocks = _blocks(cfg, t1 - t0)
            slab = _Slab(work, t0, t1 - t0, len(blocks))
            for bi in range(len(blocks)):
                j0, j1 = blocks[bi]
                heads = []
                tiles = []
                for j in range(j0, j1):
                    heads.append(j % g)
                    tiles.append(slab.t0 + j // g)
                # (a bottom-right band can leave whole query tiles without a visible key: seqlen_q > seqlen_k with
                # causal, windows that end before the first key or start after the last; such members are
                # finished as empty rows)
                plan = _key_blocks(cfg, tiles)
                blk = _Block(slab, j0, j1, heads, tiles, plan)
                if len(plan) == 0:
                    units.append(_Unit(blk, None, True, True))
                for k in range(len(plan)):
                    units.append(_Unit(blk, plan[k], k == 0, k == len(plan) - 1))
                    work.vt_users = work.vt_users + 1
    if cfg.vt_scratch:
        _plan_vt(cfg, units)
    return units


def _vt_ring_need(cfg, units):
    """The fewest chunks a work item's V^T ring may hold so that no unit of ``units`` overwrites a chunk still
    read. Unit n writes its V^T in segment n, while unit n - 1 is in phase 3 and the PVs of older units may still
    wait (``cfg.pv_lag`` at most, all from units up to n - 2): every unit m of the work item with at most
    ``pv_lag`` jobs after it up to unit n - 2 is read then. Two chunks share a slot only when they are a
    multiple of the ring apart, so the ring must span the chunks of those units and unit n."""
    ch = K_TILE // PMAX
    lo = []
    hi = []
    jobs = []
    item = []
    for m in range(len(units)):
        unit = units[m]
        work = unit.blk.slab.work
        item.append(work.b * cfg.shp.nheads_kv + work.kvh)
        jobs.append(len(unit.jobs))
        lo.append(-1)
        hi.append(-1)
        if unit.kb is not None:
            lo[m] = unit.kb.kt0 * ch + unit.kb.c_lo
            hi[m] = unit.kb.kt0 * ch + unit.kb.c_hi
    need = 0
    for n in range(len(units)):
        if lo[n] >= 0:
            c0 = lo[n]
            c1 = hi[n]
            m = n - 1
            after = 0
            while m >= 0 and item[m] == item[n] and after <= cfg.pv_lag:
                if lo[m] >= 0:
                    c0 = min(c0, lo[m])
                    c1 = max(c1, hi[m])
                if m < n - 1:
                    after = after + jobs[m]
                m = m - 1
            need = max(need, c1 - c0)
    return need


def _plan_vt(cfg, units):
    """Which units load V^T from the work item's HBM scratch (``vt_load``) and which write theirs there
    (``vt_store``). Unit m's K/V load is emitted in segment m - 2, before that segment's V^T (of unit m - 1), so
    unit m may load a chunk only if the unit that stored it is m - 3 or earlier; otherwise it transposes V itself
    and stores its V^T if it holds a chunk not stored yet, or, when the unit before it (the same work item)
    holds the same chunks, takes that unit's V^T tile (``vt_prev``: made in the segment before this unit's
    phase 2, and alive until that unit's last PV, which comes after)."""
    n_ch = (cfg.shp.seqlen_k + PMAX - 1) // PMAX
    item = -1
    stored = []
    prev = None
    for m in range(len(units)):
        unit = units[m]
        work = unit.blk.slab.work
        if work.b * cfg.shp.nheads_kv + work.kvh != item:
            item = work.b * cfg.shp.nheads_kv + work.kvh
            stored = []
            for c in range(n_ch):
                stored.append(-1)
        kb = unit.kb
        if kb is None:
            prev = None
            continue
        c0 = kb.kt0 * (K_TILE // PMAX) + kb.c_lo
        c1 = kb.kt0 * (K_TILE // PMAX) + kb.c_hi
        ready = True
        new = False
        for c in range(c0, c1):
            if stored[c] < 0:
                new = True
            if stored[c] < 0 or stored[c] > m - 3:
                ready = False
        same = prev is not None and prev.kb is not None and prev.blk.slab.work.b == work.b and \
            prev.blk.slab.work.kvh == work.kvh and prev.kb.kt0 == kb.kt0 and prev.kb.c_lo == kb.c_lo and \
            prev.kb.c_hi == kb.c_hi
        if ready:
            unit.vt_load = True
        elif same:
            unit.vt_prev = prev
        elif new:
            unit.vt_store = True
            for c in range(c0, c1):
                stored[c] = m
        prev = unit


def _vt_scratch(cfg, work, key0, n_ch):
    """The work item's V^T scratch for keys ``[key0, key0 + n_ch * 128)`` as ``[128 keys, n_ch, d_v]`` (the
    SBUF layout of ``_transpose_v``). The scratch is ``[groups * 128, VT_GROUP * d_v]``: chunk c's key p at row
    ``(c // VT_GROUP) * 128 + p``, columns ``(c % VT_GROUP) * d_v`` on, so every stride fits the ISA's int16
    field; a key block (at most 16 chunks, aligned) never straddles a group."""
    d = cfg.d_v
    c0 = key0 // PMAX
    grp = c0 // VT_GROUP
    off = grp * PMAX * VT_GROUP * d + (c0 - grp * VT_GROUP) * d
    return work.vt_hbm.ap(pattern=[[VT_GROUP * d, PMAX], [d, n_ch], [1, d]], offset=off)


def _plan_early_store(cfg, last):
    """Whether the launch's last slab (that of ``last``, the last block) stores the query tiles its earlier blocks
    finish before the last block's finishing: only where the last block's score elements are at least
    ``EARLY_STORE_RATIO`` times the O elements that store moves, so it is out before the pipeline's end (a store
    still in flight at the end only adds its fixed costs to the final one)."""
    done = last.j0 // cfg.group
    if done == 0:
        return
    elems = 0
    for kb in last.plan:
        for u in range(len(kb.vis)):
            for i in range(kb.kt_n):
                elems = elems + kb.vis[u][i].k1 - kb.vis[u][i].k0
    if elems >= EARLY_STORE_RATIO * done * cfg.group * cfg.d_v:
        last.slab.early_store = True


def _stats_early(cfg, n_units, last):
    """Whether the pipeline's ``last`` unit (of ``n_units``) takes its block's statistics before its last PVs:
    in a launch of more than ``STATS_EARLY_MIN_UNITS`` units, where it is its block's only unit, a head dim is
    > 128 (``cfg.wide``) or its PV matmuls move at least ``STATS_EARLY_PV_COLUMNS`` columns (visible 128-key
    chunks x d_v)."""
    if n_units <= STATS_EARLY_MIN_UNITS:
        return False
    if last.first or cfg.wide:
        return True
    chunks = 0
    for j in range(len(last.jobs)):
        kt = last.kb.vis[last.jobs[j][0]][last.jobs[j][1]]
        chunks = chunks + (kt.k1 - kt.k0 + PMAX - 1) // PMAX
    return chunks * cfg.d_v >= STATS_EARLY_PV_COLUMNS


def _make_room(cfg, hbm, steps, pipe):
    """Before a slab opens: while three slabs are live (finishing, current, next: what ``_slab_tiles`` sizes
    for), emit the waiting PVs and the deferred finishing, oldest first, until one is stored. Only short slabs
    (a few units each) get here."""
    while pipe.live_slabs >= 3 and (pipe.pv_at < len(pipe.pv) or len(pipe.later) > 0):
        if pipe.pv_at < len(pipe.pv):
            _pv_tile(cfg, pipe)
            pipe.step = pipe.step + 1
            _run_later(cfg, hbm, steps, pipe, False)
        else:
            _run_later(cfg, hbm, steps, pipe, True)


def _attend_all(cfg, hbm, sinks_ref, launch, steps, units):
    """The software pipeline over ``units``: while unit n is in phase 3 (exponents, P^T, PV), unit n + 1 is
    scored (phase 1, its phase 2 as soon as its last score is out) and unit n + 2's K and V are loaded, so each
    engine's instruction stream always holds independent work (engines run their streams in order). PV runs
    ``cfg.pv_lag`` tiles behind its P^T, a block's finishing ``cfg.fin_delay`` steps behind its last PV
    (docs/kernel-fwd.md, "Loop nest")."""
    pipe = _Pipe()
    n_units = len(units)
    if n_units > 0:
        _plan_early_store(cfg, units[n_units - 1].blk)
    for n in range(min(2, n_units)):
        if not units[n].blk.slab.opened:
            pipe.live_slabs = pipe.live_slabs + 1
        _load_unit(cfg, hbm, sinks_ref, launch, steps, units[n], n == 0)
    for n in range(n_units + 1):
        cur = None
        if n < n_units:
            cur = units[n]
        prev = None
        if n > 0:
            prev = units[n - 1]
        if n + 2 < n_units:
            if not units[n + 2].blk.slab.opened:
                _make_room(cfg, hbm, steps, pipe)
                pipe.live_slabs = pipe.live_slabs + 1
            _load_unit(cfg, hbm, sinks_ref, launch, steps, units[n + 2], False)
        n1 = 0
        if cur is not None and cur.kb is not None:
            n1 = len(cur.jobs)
            _begin_scores(cfg, steps, cur)
        n3 = 0
        if prev is not None and prev.kb is not None:
            n3 = len(prev.jobs)
            _begin_exps(cfg, steps, pipe, prev, cur is None)
        if prev is not None and prev.kb is None:
            pipe.later.append([pipe.step, "stats", prev.blk, 0, None])
        done1 = 0
        done3 = 0
        # no scores to evict in this segment (the drain): VectorE is free for every P^T eviction
        pipe.vector_idle = n1 == 0
        gaps_next = False
        if cur is not None and cur.kb is not None and not cur.last:
            gaps_next = units[n + 1].kb.gaps
        if n3 == 0 and n1 > 0:
            for j in range(n1):
                _score_tile(cfg, steps, cur, cur.jobs[j][0], cur.jobs[j][1])
            _end_scores(cfg, cur, gaps_next)
            done1 = n1
        for t in range(n3):
            # the scores of the next unit run ahead of this unit's exponents, done by 2/3 of them: its phase 2
            # then has the last third of the segment to reach the exponent bias
            if cfg.exps_first:
                while done3 < min(n3, t + 1 + cfg.exp_lead):
                    _exp_tile(cfg, steps, prev, done3)
                    done3 = done3 + 1
            want = min(n1, ((t + 1) * n1 * cfg.score_den + cfg.score_num * n3 - 1) // (cfg.score_num * n3))
            while done1 < want:
                _score_tile(cfg, steps, cur, cur.jobs[done1][0], cur.jobs[done1][1])
                done1 = done1 + 1
                if done1 == n1:
                    _end_scores(cfg, cur, gaps_next)
            while done3 < min(n3, t + 1 + cfg.exp_lead):
                _exp_tile(cfg, steps, prev, done3)
                done3 = done3 + 1
            if t == 0:
                # alpha after the first exponents: it waits for phase 2's last result (m - m'), they only for
                # the bias; the O rescale and phase 4 need it much later
                prev.alpha = _alpha(cfg, prev.diff)
            _pt_tile(cfg, pipe, prev, t)
            if len(pipe.evict) > 0:
                _evict_pt(cfg, pipe, False)
            if len(pipe.pv) - pipe.pv_at > cfg.pv_lag:
                _pv_tile(cfg, pipe)
            pipe.step = pipe.step + 1
            _run_later(cfg, hbm, steps, pipe, False)
        if n3 > 0:
            prev.blk.l_sum = _update_sum(cfg, prev.blk.l_sum, prev.alpha, prev.rs)
            prev.rs = None
            prev.summed = True
            _release_unit(prev)
            if cur is None and prev.last and cfg.finish_on_vector and _stats_early(cfg, n_units, prev):
                # the pipeline's last block: its statistics need no O, so they go out before its last PVs and
                # each member's O / l follows its last O update (the finishing waits for less at the end);
                # not where the last PVs are too few to hide them, which then wait behind the statistics
                prev.blk.o_ns = _finish_stats(cfg, steps, prev.blk, False)
    while pipe.pv_at < len(pipe.pv):
        _pv_tile(cfg, pipe)
        pipe.step = pipe.step + 1
        _run_later(cfg, hbm, steps, pipe, False)
    _run_later(cfg, hbm, steps, pipe, True)


def _positive_int_problem(name, value):
    """The problem with a tuning keyword that must be None or an int >= 1 (None when it is fine)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"{name}={value!r} must be None (the default) or an int >= 1"
    return None


def _nonnegative_int_problem(name, value):
    """The problem with a tuning keyword that must be None or an int >= 0 (None when it is fine)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return f"{name}={value!r} must be None (the default) or an int >= 0"
    return None


def fwd_problem(q_ref, k_ref, v_ref, sinks_ref=None, bound_min=None, bound_max=None, use_causal_mask=False,
                mixed_precision=True, softmax_scale=None, sliding_window=None, window_size=None, dropout_p=0.0,
                dropout_seed=None, kb_tiles=None, block_members_max=None, slab_tiles=None, block_mask=None,
                block_bits=None, p_dma_period=None, pv_lag=None, vt_scratch=None, **mods):
    """``None`` when ``attention_fwd`` accepts these arguments, else the first problem as a message (host side:
    ``nki_attn.kernel_api.attention_fwd`` raises it as ``ValueError`` before launching). The score modifications'
    keywords (``softcap``, ``alibi_slopes``, ``attn_bias``, ``logit_scale``: ``score_mods.MOD_KEYWORDS``) come
    as ``mods``; TypeError for a keyword neither the kernel nor the table has."""
    for key in mods:
        if key not in MOD_KEYWORDS or key == "bias_grad":
            raise TypeError(f"fwd_problem() got an unexpected keyword argument {key!r}")
    return _fwd_problem(q_ref, k_ref, v_ref, sinks_ref, bound_min, bound_max, use_causal_mask, mixed_precision,
                        softmax_scale, sliding_window, window_size, dropout_p, dropout_seed, kb_tiles,
                        block_members_max, slab_tiles, block_mask, block_bits, p_dma_period, pv_lag, vt_scratch,
                        mods)


def _fwd_problem(q_ref, k_ref, v_ref, sinks_ref, bound_min, bound_max, use_causal_mask, mixed_precision,
                 softmax_scale, sliding_window, window_size, dropout_p, dropout_seed, kb_tiles, block_members_max,
                 slab_tiles, block_mask, block_bits, p_dma_period, pv_lag, vt_scratch, mods):
    """``fwd_problem`` in kernel code (the kernel asserts on it): ``mods`` the score modifications' arguments by
    kernel keyword."""
    problem = attention_problem(q_ref, k_ref, v_ref, sinks=sinks_ref, bound_min=bound_min, bound_max=bound_max,
                                use_causal_mask=use_causal_mask, softmax_scale=softmax_scale,
                                sliding_window=sliding_window, window_size=window_size, dropout_p=dropout_p,
                                dropout_seed=dropout_seed, mods=mods, kernel="attention_fwd")
    if problem is None and not isinstance(mixed_precision, bool):
        problem = f"mixed_precision={mixed_precision!r} must be True or False"
    if problem is None:
        problem = _positive_int_problem("kb_tiles", kb_tiles)
    if problem is None:
        problem = _positive_int_problem("block_members_max", block_members_max)
    if problem is None:
        problem = _positive_int_problem("slab_tiles", slab_tiles)
    if problem is None:
        masked = use_causal_mask or sliding_window is not None or window_size is not None or bound_min is not None
        problem = block_mask_problem(block_mask, block_bits, q_ref.shape[3], k_ref.shape[3], q_ref.shape[0],
                                     q_ref.shape[1], masked)
    if problem is None:
        problem = _nonnegative_int_problem("p_dma_period", p_dma_period)
    if problem is None:
        problem = _nonnegative_int_problem("pv_lag", pv_lag)
    if problem is None and vt_scratch is not None and not isinstance(vt_scratch, bool):
        problem = f"vt_scratch={vt_scratch!r} must be None, True or False"
    return problem


def _setup_config(q_ref, k_ref, v_ref, sinks_ref, bound_min, use_causal_mask, mixed_precision, softmax_scale,
                  sliding_window, window_size, dropout_p, kb_tiles, block_members_max, slab_tiles, block_mask=None,
                  p_dma_period=None, pv_lag=None, mods=None, vt_scratch=None):
    """The launch's ``_FwdConfig``, built once from the kernel's (valid) arguments; ``block_mask`` its
    ``band.BlockRows`` (or None); ``mods`` the score modifications' arguments by kernel keyword."""
    shp = attention_shape(q_ref, k_ref, sinks=sinks_ref, bound_min=bound_min, use_causal_mask=use_causal_mask,
                          softmax_scale=softmax_scale, sliding_window=sliding_window, v=v_ref,
                          window_size=window_size, dropout_p=dropout_p, mods=mods)
    range_select_ok = nisa.get_nc_version() >= nisa.nc_version.gen3  # range_select exists on trn2+
    acc_dtype = nl.float32 if mixed_precision else q_ref.dtype
    cfg = _FwdConfig(shp, q_ref.dtype, acc_dtype, range_select_ok, v_ref.shape[2], kb_tiles, block_members_max,
                     slab_tiles, p_dma_period, pv_lag, vt_scratch)
    if block_mask is not None:
        cfg.block_mask = BlockRows(block_mask[0], block_mask[1], block_mask[2], shp.seqlen_k // PMAX)
    return cfg


@nki.jit
def attention_fwd(q_ref, k_ref, v_ref, sinks_ref=None, bound_min=None, bound_max=None, use_causal_mask=False,
                  mixed_precision=True, softmax_scale=None, sliding_window=None, softcap=0.0, alibi_slopes=None,
                  window_size=None, dropout_p=0.0, dropout_seed=None, kb_tiles=None, block_members_max=None,
                  slab_tiles=None, attn_bias=None, block_mask=None, block_bits=None, p_dma_period=None,
                  pv_lag=None, logit_scale=None, vt_scratch=None):
    """Flash-attention forward; returns ``(o, lse)`` in shared HBM.

    Args:
        q_ref: ``[bs, nheads, d_qk, seqlen_q]`` float32 / bfloat16 / float16 (d_qk 1..256).
        k_ref: ``[bs, nheads_kv, d_qk, seqlen_k]``, v_ref: ``[bs, nheads_kv, d_v, seqlen_k]`` (d_v 1..256), q's
            dtype; query head h reads kv head
            ``h // (nheads // nheads_kv)``.
        sinks_ref: optional ``[bs, nheads]`` or ``[bs, nheads, num_sinks]`` logits (not scaled) that join the
            softmax denominator and produce no output.
        bound_min, bound_max: optional float32 ``[seqlen_q]`` packing bounds: key j is visible to query i iff
            ``bound_min[i] <= j < bound_max[i]``.
        use_causal_mask: mask key j > query i + seqlen_k - seqlen_q (bottom-right aligned).
        mixed_precision: True keeps the O accumulator in float32; False keeps it in the input dtype. The
            softmax statistics (max, sum, LSE) are float32 either way; P is the input dtype for the PV matmul.
        softmax_scale: multiplies q.k; default ``1 / sqrt(d_head)``.
        sliding_window: W >= 1 (causal only): query i sees keys ``i + off - W + 1 .. i + off``.
        softcap: c > 0 caps the scaled logits to ``c tanh(S / c)`` (0 = off).
        alibi_slopes: optional float32 ``[bs, nheads]``: adds ``-slope |i + off - j|`` after the cap.
        window_size: None or ``(left, right)`` (-1 = unbounded): keys ``i + off - left .. i + off + right``,
            causal or not; not with sliding_window.
        dropout_p: drop probability in [0, 1) (trace-time); dropout_seed: int32/uint32 ``[2]`` HBM
            ``(seed, offset)``, given iff dropout_p > 0; the keep mask is ``golden.dropout.keep_mask``'s, the LSE
            stays pre-dropout.
        kb_tiles, block_members_max, slab_tiles: tuning (trace-time ints >= 1, None = the default): key tiles
            per key block (``KB_TILES``), members per block at most (``BLOCK_MEMBERS_MAX``), query tiles per slab
            (default: the most the SBUF holds, balanced). The modeled time changes, the result only by float32
            summation order (docs/kernel-fwd.md, "Tuning keywords").
        p_dma_period, pv_lag: tuning (trace-time ints >= 0, None = the default): every p_dma_period-th member's
            full P tiles of a key block are transposed by one dma_transpose (trn2+, 16-bit; default 4 when both
            head dims are <= 128, else 0 = never); PV matmuls run pv_lag jobs behind their P^T (``PV_LAG``). The
            result does not change.
        vt_scratch: tuning (None = ``VT_SCRATCH_WIDE``, on): with d_v > 128 where the work item's V^T does not fit
            the SBUF, each 128-key chunk's V^T is transposed once per work item into a private HBM scratch and
            later key blocks load it from there (``_plan_vt``); False: every key block transposes its V on
            TensorE. The result does not change.
        attn_bias: optional float32 / bfloat16 / float16 ``[bb, hb, sqb, skb]``, each dim 1 (broadcast) or the
            call's ``[bs, nheads, seqlen_q, seqlen_k]``: added to the scaled (and capped) scores, after ALiBi
            (``score_mods.bias_scores``; rows are query positions, columns keys, in the kernel's padded lengths).
        block_mask, block_bits: a block mask (docs/masks.md): trace-time ``(n_b, n_h, rows)`` (n_b 1 or bs, n_h
            1 or nheads; ``rows[t][c]`` the class ``band.BLOCK_*`` of query tile t and 128-key chunk c over all
            (batch, head) pairs) and the uint8 HBM bitmap store of its PARTIAL key tiles (``band`` "Block
            masks"); not with causal, windows or packing bounds.
        logit_scale: optional float32 ``[bs, nheads]``, the per-head logit scale: the logits are
            ``softmax_scale * logit_scale[b, h] * q.k`` before soft-capping and ALiBi.

    Returns:
        o: ``[bs, nheads, d_v, seqlen_q]`` in q's dtype; lse: float32 ``[bs, nheads, 128, seqlen_q // 128]``.
    """
    # the score modifications' arguments, by kernel keyword: everything else about them is read from their
    # ``score_mods.SCORE_MODS`` rows (a new modification adds its keyword above and its entry here)
    mods = {"softcap": softcap, "alibi_slopes": alibi_slopes, "attn_bias": attn_bias, "logit_scale": logit_scale}
    problem = _fwd_problem(q_ref, k_ref, v_ref, sinks_ref, bound_min, bound_max, use_causal_mask, mixed_precision,
                           softmax_scale, sliding_window, window_size, dropout_p, dropout_seed, kb_tiles,
                           block_members_max, slab_tiles, block_mask, block_bits, p_dma_period, pv_lag, vt_scratch,
                           mods)
    assert problem is None, problem
    cfg = _setup_config(q_ref, k_ref, v_ref, sinks_ref, bound_min, use_causal_mask, mixed_precision, softmax_scale,
                        sliding_window, window_size, dropout_p, kb_tiles, block_members_max, slab_tiles, block_mask,
                        p_dma_period, pv_lag, mods, vt_scratch)
    if cfg.block_mask is not None and cfg.block_mask.n_slots > 0:
        cfg.block_mask.bits = block_bits
        cfg.block_mask.bitsel = block_bitsel()
    shp = cfg.shp
    steps = _select_steps(cfg)

    o_ref = nl.ndarray((shp.bs, shp.nheads, cfg.d_v, shp.seqlen_q), dtype=q_ref.dtype, buffer=nl.shared_hbm)
    lse_ref = nl.ndarray((shp.bs, shp.nheads, PMAX, cfg.n_qt), dtype=nl.float32, buffer=nl.shared_hbm)
    hbm = Hbm(q_ref, k_ref, v_ref, o=o_ref, lse=lse_ref, mods=mods)
    start, stop = spmd_items(shp.bs * shp.nheads_kv)

    seed_sb = None
    if cfg.dropout_p > 0:
        seed_sb = load_dropout_seed(dropout_seed)
    launch = Item(0, 0, seed=seed_sb)
    for f in steps.launch:
        f(cfg, hbm, launch)
    if cfg.masked and cfg.mask != "affine":
        launch.bounds = _load_bounds(cfg, bound_min, bound_max)
    units = _plan_units(cfg, start, stop, _slabs(cfg))
    if cfg.vt_cache and _vt_ring_need(cfg, units) > cfg.vt_ring:
        cfg.vt_cache = False  # a unit would overwrite a chunk still read: V^T per unit (it fits where the ring does)
    _attend_all(cfg, hbm, sinks_ref, launch, steps, units)
    return o_ref, lse_ref
