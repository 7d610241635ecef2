"""Flash-attention backward pass (training) for Trainium, in NKI.

``attention_bwd(q_ref, k_ref, v_ref, o_ref, dy_ref, lse_ref, sinks_ref=None, bound_min=None, bound_max=None,
use_causal_mask=False, mixed_precision=False, softmax_scale=None, sliding_window=None, softcap=0.0,
alibi_slopes=None, window_size=None, dropout_p=0.0, dropout_seed=None, k_section_len=None, group_max=None,
block_members_max=None, p_cast_on_gpsimd=None, ds_dma_transpose=None, attn_bias=None, bias_grad=False,
block_mask=None, block_bits=None, logit_scale=None, ds_dma_every=None, pipe_lead=None, pipe_lag_b=None,
pipe_lag_d=None, d_from_o=False, qk_transposed=None, stream_keys=None)`` returns ``(dq, dk, dv)``, then
``dsinks`` with sinks, then ``dlogit_scale`` (float32 ``[bs, nheads]``) with a logit scale: the layouts and semantics of
``golden.attention_bwd_torch.attention_bwd_torch_ref`` (see docs/semantics.md). docs/kernel-bwd.md explains the
design; each step below is named there after the function that implements it. Kernel code stays in NKI's
compile-time subset (checked by the simulator's frontend check): invalid arguments fail an ``assert`` on
``bwd_problem``'s message; ``nki_attn.kernel_api.attention_bwd`` raises it as ``ValueError`` before launching.

Layouts (head_dim on the partition axis in HBM): q, dq ``[bs, nheads, d_qk, seqlen_q]``; o, dy ``[bs, nheads,
d_v, seqlen_q]``; k, dk ``[bs, nheads_kv, d_qk, seqlen_k]``; v, dv ``[bs, nheads_kv, d_v, seqlen_k]`` (d_qk, d_v
in 1..256, tiled as 128 + remainder partition rows); alibi_slopes float32 ``[bs, nheads]``; dropout_seed int32 /
uint32 ``[2]`` (``nki_attn.kernels.dropout``); lse float32 ``[bs, nheads, 128, seqlen_q // 128]``
(``lse[b, h, p, t]`` is the log-sum-exp of query row ``t * 128 + p``, ``+inf`` for a row that sees no key); dsinks float32 shaped like
sinks.

The FlashAttention-2 recipe, per (batch, kv head) work item. A *member* is one (query head, 128-row query tile)
of the kv head; members are loaded in *blocks* (one DMA per tensor) and computed in *groups* of up to 4 whose
dV, dK and dQ partial sums stay in PSUM:

    load -LSE of every member (one DMA)                                         _load_neg_lse
    for each K/V section (<= K_SECTION_MAX keys so SBUF holds it, or k_section_len)  KV-outer
        load K, V (+ K^T for dQ); zero the fp32 dK, dV section accumulators     _load_kv_section
        for each block of members with a visible key in the section (trace-time plan, BwdConfig.blocks)
            load dO, Q (and O) of the block; previous dQ partial sums           _load_block
            member's first section: D = rowsum(O * dO)                          _rowsum_o_dy
            for each group of the block: Q^T, dO^T of its members              _transpose_members
                for each visible 512-key tile of the group
                    for each member that sees it                                _visit
                        S = Q^T K; P = exp(scale*S - LSE) (ONE activation); mask  _recompute_p
                        dP = dO V^T;  dS = (dP - D) * P           (ONE fused op)  _softmax_bwd
                        dV += P^T dO;  dK += Q^T dS          (group's PSUM)       _dv_dk
                        dQ += dS K                      (member's PSUM columns)   _dq
                    add dV, scale * dK into the section accumulators            _evict_dv_dk
                dQ = scale * PSUM (+ previous partial)                          _evict_dq
            store the block's dQ (one DMA)
        write dK, dV of the section
    with sinks: dsinks = -sum_rows exp(sink - LSE) * D, all heads at once       _dsinks

The loops above are the plan (``BwdConfig``: sections, blocks, groups, key tiles, visits, flattened into
``streams``). ``_pipeline`` emits them as ONE software pipeline over every (work item, section): a visit's
dV/dK matmuls and dS transposes come ``pipe_lag_b`` visits, its dQ matmuls ``pipe_lag_d`` visits after its S,
dP and dS, and the loads ``pipe_lead`` visits before, so every engine (which runs its own instructions in
program order) always has independent work queued.
"""

from ..backend import nisa, nki, nl
from .band import BlockRows, block_key_tile, block_mask_problem, classify_keys
from .dropout import dropout_row_keys, dropout_scale_keys, dropout_scale_tile, load_dropout_seed
from .score_mods import MOD_KEYWORDS, SCORE_MODS_BY_RANK
from .steps import (BLOCK_SKIP, FP32_MIN, K_TILE, PMAX, Hbm, Item, Steps, Tile, block_bitsel, block_mask_probs,
                    itemsize, load_packing_bounds, mask_step, no_step, run_steps, spmd_items)
from .validation import attention_problem, attention_shape, sbuf_bytes_per_partition

# Key tiles (steps.K_TILE, 512 keys): S, dP, dV, dK of one (query tile, key tile) pair are each one 2 KiB PSUM
# bank (512 fp32), and 512 is the matmul's moving free-size limit on trn1/trn2.
#
# The constants below are the defaults of the kernel's tuning keywords (``attention_bwd``'s docstring).
# Longest K/V section. The section length is the largest multiple of K_TILE whose section buffers fit
# SECTION_BUDGET_BYTES per partition, capped by K_SECTION_MAX; the kernel argument k_section_len (a multiple of
# 128) overrides it per call (tests use it to force several sections at small seqlen). All are constants:
# a kernel must be a pure function of its arguments (NKI caches compiled kernels by argument).
K_SECTION_MAX = 8192
SECTION_BUDGET_BYTES = 112 * 1024
# Members per group: the group's dQ stays in ONE PSUM bank across the key tiles of a section, members x
# Q/K head-dim tiles x 128 fp32 <= 512 (so 4 for d_head <= 128, 2 for d_head 256). dV and dK of a key tile add
# into the SBUF accumulators once per group instead of once per member.
GROUP_MAX = 4
# Members per block (one DMA per tensor per block) and the block buffers' SBUF budget per partition.
BLOCK_MEMBERS_MAX = 8
BLOCK_BUDGET_BYTES = 16 * 1024
# Engine choices from trn2 on (``BwdConfig``): the P cast on GpSimdE, and dS transposed by DMA where
# ``_use_dma_transpose`` finds it pays. Both are the design; False gives the alternative (the cast on ScalarE,
# every dS transpose on TensorE) for measurement.
P_CAST_ON_GPSIMD = True
DS_DMA_TRANSPOSE = False
# The software pipeline of a section's visits (``_pipeline``): a block's loads are issued PIPE_LEAD visits before
# its first visit computes; a visit's dV / dK matmuls and dS transposes PIPE_LAG_B visits after its S / dP / dS,
# and its dQ matmuls PIPE_LAG_D visits after.
PIPE_LEAD = 4
# With dS transposes by DMA allowed, every DS_DMA_EVERY-th whole 512-key tile takes the DMA path (1: all).
DS_DMA_EVERY = 1
PIPE_LAG_B = 2
PIPE_LAG_D = 4
# TensorE's shortest matmul, in moving columns (cost model v2: MM_INIT_LATENCY, 64 cycles; docs/performance.md):
# a matmul streaming fewer columns takes as long as one streaming this many (``transposed_qk_grads``).
MM_MIN_COLUMNS = 64
# With the streamed keys (``streamed_keys``), a group's dQ leaves PSUM in two parts: the ScalarE copy at its last
# visit's stage D, and (for a transposed tile, ``transposed_qk_grads``) the TensorE transposes back to the HBM
# layout, with its block's store, DQ_T_LAG visits later, so TensorE does not wait for that copy (``_pipeline``).
DQ_T_LAG = 2
# With the same rule, a block's O * dO product (for D) is formed D_PRODUCT_LAG visits after its loads instead of
# at its first stage A, so the ones-vector matmuls that sum it do not wait for VectorE there (``_pipeline``).
D_PRODUCT_LAG = 2
# With the same rule, the keys whose dK and dV are final after a key tile's eviction are stored (``_store_keys``;
# a transposed dK tile transposed back first) KEY_STORE_LAG visits after it, so TensorE does not wait for the
# eviction.
KEY_STORE_LAG = 2
# The transposed dQ / dK (``transposed_qk_grads``) only where a 128-query tile's band spans more keys than this.
QK_T_MIN_TILE_KEYS = 2 * PMAX


# ----------------------------------------------------------------------------------------------- planning
def section_bytes_per_key(d_head, d_tiles, itemsize, v_tiles=None):
    """SBUF bytes per partition that one key of a K/V section costs: K (``d_tiles`` Q/K head-dim tiles) and V
    (``v_tiles``, default ``d_tiles``) in the input dtype, K^T (128 keys per partition row, d_head = d_qk wide)
    and the fp32 dK, dV accumulators."""
    if v_tiles is None:
        v_tiles = d_tiles
    return (d_tiles + v_tiles) * itemsize + d_head * itemsize / PMAX + (d_tiles + v_tiles) * 4


def two_sections_live(section_len, seqlen_k, items):
    """True when the software pipeline (``_pipeline``) holds two K/V sections' buffers at once: there is a next
    section to load while one drains, because the keys need several sections (``section_len < seqlen_k``) or
    the launch has several work items (``items``: batch x kv heads)."""
    return section_len < seqlen_k or items > 1


def default_section_len(d_head, d_tiles, itemsize, seqlen_k, cap=K_SECTION_MAX, v_tiles=None, items=1):
    """Keys per K/V section: the largest multiple of K_TILE within SECTION_BUDGET_BYTES, at most ``cap``
    (default K_SECTION_MAX) and seqlen_k, rounded down to a multiple of 128. When the keys need more than one
    section, or the launch has more than one work item (``items``: batch x kv heads), the software pipeline
    (``_pipeline``) loads the next section (of this item or the next) while the last one drains, so two
    sections' buffers are live at once: each then gets half the budget."""
    per_key = section_bytes_per_key(d_head, d_tiles, itemsize, v_tiles)
    fit = int(SECTION_BUDGET_BYTES // per_key) // K_TILE * K_TILE
    if two_sections_live(min(cap, fit), seqlen_k, items):
        fit = int(SECTION_BUDGET_BYTES // 2 // per_key) // K_TILE * K_TILE
    n = min(min(cap, fit), seqlen_k) // PMAX * PMAX  # (NKI's min takes two values)
    return max(n, PMAX)


def group_size(d_tiles, group_max=None):
    """Members per group: their dQ columns (d_tiles x 128 fp32 each) share one 2 KiB PSUM bank; ``group_max``
    (default GROUP_MAX) members per group for a head dim of one partition tile."""
    if group_max is None:
        group_max = GROUP_MAX
    return max(1, group_max // d_tiles)


def block_member_bytes(d_tiles, itemsize, dq_fp32, v_tiles=None):
    """SBUF bytes per partition one member costs in its block: Q (``d_tiles`` Q/K head-dim tiles), dO, O
    (``v_tiles``, default ``d_tiles``; input dtype), the fp32 O*dO product (first section) or previous dQ
    partial (later sections, at most fp32), and the dQ staging tile (fp32 when it goes to the fp32 HBM scratch,
    else the input dtype)."""
    if v_tiles is None:
        v_tiles = d_tiles
    stage = 4 if dq_fp32 else itemsize
    return PMAX * (d_tiles * (itemsize + stage) + v_tiles * 2 * itemsize + max(d_tiles, v_tiles) * 4)


def block_members(d_tiles, itemsize, dq_fp32, v_tiles=None, group_max=None, block_members_max=None):
    """Members per block: within BLOCK_BUDGET_BYTES and ``block_members_max`` (default BLOCK_MEMBERS_MAX), a
    multiple of the group size when it holds at least one group."""
    if block_members_max is None:
        block_members_max = BLOCK_MEMBERS_MAX
    n = BLOCK_BUDGET_BYTES // block_member_bytes(d_tiles, itemsize, dq_fp32, v_tiles)
    n = max(1, min(block_members_max, n))
    g = group_size(d_tiles, group_max)
    if n >= g:
        n = n // g * g
    return n


def sbuf_usage(d_head, d_tiles, itemsize, section_len, group, seqlen_q, mixed_precision=False, packing=False,
               num_sinks=0, trn1_packing=False, dq_fp32=False, d_v=None, v_tiles=None, dropout=False,
               group_max=None, block_members_max=None, mod_bytes=(0, 0), pipe=(PIPE_LEAD, PIPE_LAG_B, PIPE_LAG_D),
               live_sections=1, dq_transposed=False):
    """SBUF bytes per partition of the kernel's live tensors, by category. ``pipe``: ``(pipe_lead, pipe_lag_b,
    pipe_lag_d)`` of the software pipeline; ``live_sections``: K/V sections whose buffers are live at once (2
    when the pipeline runs more than one section, of one work item or several: the next one loads while the
    last one drains). ``total`` counts the blocks the pipeline holds at once (3 with a
    lead: loading, in stage A, in stage D), two groups, two visits' stage-A tiles and the visit buffers in flight
    between stages A, B and D (``in_flight``). ``mod_bytes``: ``(persistent, per_key)``, the bytes the score
    modifications' steps add per work item and per key of a visit (``_mod_bytes``: their ``bwd_sbuf``).
    ``d_head``/``d_tiles``: d_qk and its partition tiles; ``d_v``/``v_tiles`` default to them.
    ``dq_transposed`` (``transposed_qk_grads``): the groups' dQ copies waiting ``DQ_T_LAG`` visits for their
    transposes (``_evict_dq_transposed``) and the dK staging tiles of the key stores (``_store_keys``) are counted
    in ``in_flight``, and the section's dK accumulator in its transposed layout. The streamed keys
    (``streamed_keys``) add nothing here: their O * dO product is formed in the loading block, whose product slot
    ``block_member_bytes`` counts, and a block whose store waits ``DQ_T_LAG`` visits holds only its staging tiles,
    no larger than the product / previous-dQ slot (first section) or the O slot (later sections: no O loaded)
    that the stage-A and stage-D blocks count but do not use. Used by the trace-time budget check and
    docs/kernel-bwd.md."""
    e = itemsize
    nq = seqlen_q // PMAX
    pe = 4 if mixed_precision else e
    if d_v is None:
        d_v = d_head
    if v_tiles is None:
        v_tiles = d_tiles
    section = int(section_len * section_bytes_per_key(d_head, d_tiles, itemsize, v_tiles))
    # with the transposed path, the partial Q/K tile (the last; MLA's 64 rows) is the transposed one
    rn_t = d_head - PMAX * (d_tiles - 1)
    if dq_transposed and rn_t < PMAX:
        # its dK accumulator is [128 keys, rn_t] per 128-key chunk: rn_t * 4 / 128 bytes per key instead of 4
        section -= int(section_len * (4 - rn_t * 4 / PMAX))
    # -LSE and D of every member; the ones column (D); the identity of the dQ reload (several sections)
    persistent = 2 * group * nq * 4 + 4 + PMAX * 4
    if packing:
        persistent += 3 * nq * 4                           # bound_min, bound_max (+ query index for clamping)
    if num_sinks:
        # sink logits and sums; exp(sink - LSE) and its product with D for every member, at the end
        persistent += 2 * group * num_sinks * 4 + 2 * group * num_sinks * nq * 4
    persistent += mod_bytes[0]                             # the score modifications' per-head operands
    g = group_size(d_tiles, group_max)
    per_block = (block_members(d_tiles, e, dq_fp32, v_tiles, group_max, block_members_max)
                 * block_member_bytes(d_tiles, e, dq_fp32, v_tiles))
    per_group = g * (d_head + d_v) * e                     # Q^T and dO^T of the members (128 partitions)
    # the visit buffers of the software pipeline (``_pipeline``): P and the steps' tiles live in stage A only;
    # the P cast and dS until stage B, pipe_lag_b visits later; dS^T until stage D, pipe_lag_d visits later
    lead, lag_b, lag_d = pipe
    p_cast = K_TILE * e if pe != e else 0
    stage_a = (K_TILE * pe                                 # P
               + (K_TILE * 4 if packing else 0)            # masked S (fp32)
               + (K_TILE * 5 if trn1_packing else 0)       # key index (fp32) and visibility (uint8)
               + (K_TILE * (8 + e) if dropout else 0)      # keep-scale tile, dP * scale (fp32), dropped P
               + K_TILE * mod_bytes[1])                    # the score modifications' tiles
    per_visit = stage_a + p_cast + 2 * K_TILE * e
    in_flight = 2 * stage_a + (lag_b + 1) * (p_cast + K_TILE * e) + (max(lag_b, lag_d) - lag_b + 1) * K_TILE * e
    if dq_transposed and rn_t < PMAX:
        # at most one group per visit waits between its dQ copy and its transposes, each g x rn_t (<= fp32); the
        # transposed dK of at most one key tile per visit waits in a staging tile for its store, K_TILE keys
        in_flight += (DQ_T_LAG + 1) * g * rn_t * 4 + (KEY_STORE_LAG + 1) * K_TILE * e
    # blocks: the one in stage D, the one in stage A and, with a lead, the one whose loads are in flight
    n_blocks = 3 if lead > 0 else 2
    total = live_sections * section + persistent + n_blocks * per_block + 2 * per_group + in_flight
    return {"section": section, "persistent": persistent, "per_block": per_block, "per_group": per_group,
            "per_visit": per_visit, "in_flight": in_flight, "n_blocks": n_blocks, "total": total,
            "d_tile": min(d_head, PMAX)}


def transposed_qk_grads(d_qk, d_v, qk_rows, tile_keys=None):
    """True when dQ and dK of the partial Q/K head-dim tile (``rn`` < 128 rows, ``BwdConfig.qk_t``) are
    accumulated transposed, dQ as ``[128 queries, rn]`` per member (``_dq``), dK as ``[128 keys, rn]`` per 128-key
    chunk (``_dv_dk``): when it streams fewer TensorE columns, whatever ``d_v`` (kept in the signature: the rule
    was once d_qk != d_v only). Per 128-key chunk the untransposed dQ and dK each stream 128 columns (dS^T, dS
    moving) per Q/K head-dim tile; a transposed tile streams its ``rn`` columns (K^T, Q^T moving), at least
    ``MM_MIN_COLUMNS``: 192 instead of 256 for MLA's 192 = 128 + 64, 64 instead of 128 for d 64, 96 for d 96,
    none saved for d_qk = 128 or 256 (a full tile streams 128 either way, so it is never transposed). It costs one
    TensorE transpose per member when dQ leaves PSUM (``_finish_dq_transposed``) and one per 128 keys when dK does
    (``_store_keys``), and needs the streamed keys (``streamed_keys``); ``qk_transposed`` forces the choice.
    ``tile_keys``: the keys a 128-query tile's band spans at most (None: unbounded); at most
    ``QK_T_MIN_TILE_KEYS`` (two 128-key chunks: a sliding window of 128 or less) a member's dQ transposes and
    copies are paid for by too few saved columns and the rule keeps the untransposed products (cost model v2,
    GPT-OSS-like d 64, 8 / 1 heads, 2048 tokens, window 128, one sink: 159.5 us untransposed, 162.2 transposed;
    window 256: 182.4 / 178.0)."""
    if tile_keys is not None and tile_keys <= QK_T_MIN_TILE_KEYS:
        return False
    cols = 0
    for rt in qk_rows:
        cols += max(rt[1], MM_MIN_COLUMNS)
    return cols < len(qk_rows) * PMAX


def streamed_keys(d_qk, d_v, qk_rows):
    """True when the backward streams its keys (``BwdConfig.stream``, ``_pipeline``): K and V loaded by 512-key
    tile at the first visit that needs them and K^T formed at its first use (not the whole section up front), each
    key's dK and dV stored ``KEY_STORE_LAG`` visits after its last eviction (not at the section's end), a block's
    O * dO formed ``D_PRODUCT_LAG`` visits after its loads, a group's dQ leaving PSUM at its last visit and its
    block stored ``DQ_T_LAG`` visits later. None of it depends on the matmul orientation or adds SBUF, so it is
    taken for every shape; ``stream_keys`` forces the choice (the transposed dQ / dK need it)."""
    return True


def _qk_transposed(a, isz, sec, qk_transposed, mixed_precision, group_max, block_members_max, pipe_lead,
                   pipe_lag_b, pipe_lag_d, stream=True):
    """The launch's choice of the transposed dQ / dK of the partial Q/K tile (``BwdConfig.qk_t``): the
    ``qk_transposed`` keyword when given, else the rule ``transposed_qk_grads`` when the keys are streamed
    (``stream``) and the SBUF budget check passes with the buffers it adds (``sbuf_usage``'s ``dq_transposed``),
    so that the rule never refuses a launch the untransposed path takes (float32 MLA on trn1 falls back to it)."""
    if qk_transposed is not None:
        return qk_transposed
    if not stream or not transposed_qk_grads(a.d_qk, a.d_v, a.qk_tiles, _tile_keys(a)):
        return False
    use = _sbuf_use(a, isz, sec, mixed_precision, group_max, block_members_max, pipe_lead, pipe_lag_b, pipe_lag_d,
                    True)
    return use["total"] <= sbuf_bytes_per_partition()


def _tile_keys(a):
    """The keys one 128-query tile's band spans at most (``a.lo_rel``, ``a.hi_rel``), at most seqlen_k."""
    return min(a.hi_rel - a.lo_rel + PMAX, a.seqlen_k)


def _stream_keys(a, stream_keys, qk_transposed):
    """The launch's choice of the streamed keys (``BwdConfig.stream``): the ``stream_keys`` keyword when given,
    else on with ``qk_transposed=True`` (the transposed dQ / dK need it), else the rule ``streamed_keys``."""
    if stream_keys is not None:
        return stream_keys
    if qk_transposed:
        return True
    return streamed_keys(a.d_qk, a.d_v, a.qk_tiles)


def _sbuf_use(a, isz, sec, mixed_precision, group_max, block_members_max, pipe_lead, pipe_lag_b, pipe_lag_d,
              transposed):
    """``sbuf_usage`` of a launch (``a`` its ``AttentionShape``, ``isz`` the input dtype's bytes, ``sec`` its
    section length; ``transposed``: with the transposed dQ / dK's buffers)."""
    dq_fp32 = mixed_precision and isz != 4 and sec < a.seqlen_k
    return sbuf_usage(a.d_qk, len(a.qk_tiles), isz, sec, a.group, a.seqlen_q, mixed_precision, a.packing,
                      a.num_sinks, _is_trn1() and a.packing, dq_fp32, a.d_v, len(a.v_tiles), a.dropout, group_max,
                      block_members_max, _mod_bytes(a), _pipe_of(pipe_lead, pipe_lag_b, pipe_lag_d),
                      _live_sections(a, sec), transposed)


def psum_banks(d_tiles, v_tiles=None, dq_transposed=False):
    """PSUM banks that can be live at once: a visit's S, dP, dS^T with its group's dV (one per V head-dim tile)
    and dK (one per Q/K head-dim tile) and dQ: d_tiles + v_tiles + 4 (6 for head dims <= 128, 8 for 256). The
    transposes at group, block and section start (Q^T, dO^T, K^T, the D sums) are never live together with dV/dK,
    which are allocated per key tile inside the group. ``dq_transposed`` (``transposed_qk_grads``): one bank more
    for the transposes of the dQ eviction and the key stores (an upper bound: the simulator's program-order peak
    stays 5 banks at MLA's 192 / 128, as without them)."""
    if v_tiles is None:
        v_tiles = d_tiles
    if dq_transposed:
        # the transposes of a group's dQ on its way out of PSUM, or of a key store, while later visits run
        return d_tiles + v_tiles + 5
    return d_tiles + v_tiles + 4


def _visible_tiles(c, q0, k_lo, k_len):
    """Trace-time list of the key tiles of one section that query tile [q0, q0+128) needs, each a
    ``band.KeyTile`` trimmed to its visible 128-key chunks (skipped tiles left out). The band ``(c.lo_rel,
    c.hi_rel)`` decides both, so a bounded window costs O(window) per query tile."""
    out = []
    for t0 in range(k_lo, k_lo + k_len, K_TILE):
        t1 = min(t0 + K_TILE, k_lo + k_len)
        if c.block_mask is not None:
            for kt in _block_runs(c.block_mask.rows[q0 // PMAX], t0, t1):
                out.append(kt)
        else:
            kt = classify_keys(q0, q0 + PMAX, t0, t1, c.lo_rel, c.hi_rel, c.packing, c.block_mask)
            if kt.k1 > kt.k0:
                out.append(kt)
    return out


def _block_runs(row, t0, t1):
    """A block mask's key tile ``[t0, t1)`` of one query tile (``row``: its chunk classes) as one ``KeyTile``
    per run of non-SKIP chunks: the chunks between two runs are hidden from every row of the tile, so no
    visit computes them (a 512-key tile trimmed only at its ends computes 0.59 of the chunks of a random
    half-dense row instead of 0.5). Each run is FULL when all its chunks are, else PARTIAL."""
    seen = []
    for c in range(t1 // PMAX):
        seen.append(row[c] != BLOCK_SKIP)
    out = []
    for run in _runs(seen, t0 // PMAX, t1 // PMAX):
        out.append(block_key_tile(row, run[0] * PMAX, run[1] * PMAX))
    return out


def _narrow_visit_lags(rows):
    """``(pipe_lag_b, pipe_lag_d)`` for a block mask's launch whose visits are at most half a key tile wide on
    average (``rows``: the mask's chunk classes; a visit is one run of non-SKIP chunks of a key tile,
    ``_block_runs``), else None (the defaults). A narrow visit gives the other engines less TensorE work to
    hide their part of it behind, so stages B and D come twice as many visits later (the modeled schedule, cost
    model v2: a random half-dense mask of 128 x 128 blocks, 1.6 chunks per visit, at 4096 tokens 243.1 -> 205.2
    us). Wider visits keep the defaults, which are better for them: the document and key-tile-aligned masks
    (whole key tiles) and the causal document mask (3.4 chunks per visit: 484.0 -> 498.7 us at 16384 tokens
    with the deeper lags, though 77.4 -> 66.9 us at 4096). The kernel takes them only when the SBUF budget
    check passes with them (``attention_bwd``)."""
    runs = 0
    chunks = 0
    for r in rows:
        for t0 in range(0, len(r) * PMAX, K_TILE):
            for run in _block_runs(r, t0, min(t0 + K_TILE, len(r) * PMAX)):
                runs = runs + 1
                chunks = chunks + (run.k1 - run.k0) // PMAX
    if runs == 0 or 2 * chunks > runs * (K_TILE // PMAX):
        return None
    return 2 * PIPE_LAG_B, 2 * PIPE_LAG_D


class BwdVisit(nl.NKIObject):
    """One member's visit of one key tile of its group (trace-time plan).

    m: the member's index in the group; k0, kw: the visible keys [k0, k0+kw) (128-aligned); kt: its
    ``band.KeyTile`` (kind, and which band sides cut it); off: k0 - u0, the visit's first column in the group's
    dV/dK PSUM tiles of this key tile; segs: ``[(a, b, acc)]`` column ranges [a, b) of those PSUM tiles (relative to u0)
    the dV/dK matmuls write, ``acc`` False where no earlier member of the group wrote (a matmul must overwrite
    first, then accumulate); dq_first: the member's first visit in the group (its first dQ matmul overwrites);
    dsT_dma: dS is transposed by one DMA transpose instead of TensorE."""

    def __init__(self, m, kt, off, segs, dq_first, dsT_dma):
        self.m = m
        self.k0 = kt.k0
        self.kw = kt.k1 - kt.k0
        self.kt = kt
        self.off = off
        self.segs = segs
        self.dq_first = dq_first
        self.dsT_dma = dsT_dma


class BwdKeyTile(nl.NKIObject):
    """The keys [u0, u0+uw) a group visits in one 512-key tile (the span of its members' visible keys), the
    visits, in member order, and ``wrote``: per 128-key chunk of the span, whether any visit's dV/dK matmul
    writes it. With a block mask (or packing) the members' runs can leave a chunk of the span that no matmul
    writes; its PSUM columns hold stale data and must not be evicted (``_evict_dv_dk``)."""

    def __init__(self, u0, uw, visits, wrote):
        self.u0 = u0
        self.uw = uw
        self.visits = visits
        self.wrote = wrote


class BwdGroup(nl.NKIObject):
    """Up to ``group_size`` members computed together: members ``[(g, i, col)]`` (query head g of the kv head,
    query tile i, first column of the member in the block tiles) and the key tiles they visit."""

    def __init__(self, members, ktiles):
        self.members = members
        self.ktiles = ktiles


class BwdBlock(nl.NKIObject):
    """Members loaded and stored together: query heads [h0, h0+nh) of the kv head x query tiles [i0, i0+nt),
    block column ``(h*nt + t)*128`` for head h0+h, tile i0+t (head-major, as one DMA reads them). first: the
    section is every member's first (D is computed here; no earlier dQ partial); last: the section is every
    member's last (dQ goes to out_dq)."""

    def __init__(self, h0, nh, i0, nt, first, last, groups):
        self.h0 = h0
        self.nh = nh
        self.i0 = i0
        self.nt = nt
        self.first = first
        self.last = last
        self.groups = groups


def _runs(flags, a, b, value=True):
    """Maximal runs ``[(j, e)]`` of consecutive indices in ``[a, b)`` whose ``flags`` entry equals ``value``."""
    runs = []
    j = a
    while j < b:
        e = j
        while e < b and flags[e] == value:
            e += 1
        if e > j:
            runs.append((j, e))
            j = e
        else:
            j += 1
    return runs


def _segments(covered, a, b):
    """Split the 128-key chunks [a, b) into runs that earlier visits did (acc True) or did not (False) write,
    and mark them written. ``covered``: list of bools per chunk of the key tile's union."""
    segs = []
    j = a
    while j < b:
        acc = covered[j]
        e = j
        while e < b and covered[e] == acc:
            e += 1
        segs.append((j * PMAX, e * PMAX, acc))
        j = e
    for k in range(a, b):
        covered[k] = True
    return segs


def _group_plan(c, s, members):
    """The key tiles and visits of one group (members ``[(g, i, col)]``) in section s."""
    k_lo, k_len = c.sections[s]
    n_kt = (k_len + K_TILE - 1) // K_TILE
    ktiles = []
    started = []
    for mi in range(len(members)):
        started.append(False)
    for kt in range(n_kt):
        t0 = k_lo + kt * K_TILE
        t1 = min(t0 + K_TILE, k_lo + k_len)
        u0, u1 = -1, -1
        for mem in members:
            for tile in c.tiles[s][mem[1]]:
                if t0 <= tile.k0 and tile.k0 < t1:
                    if u0 < 0 or tile.k0 < u0:
                        u0 = tile.k0
                    if tile.k1 > u1:
                        u1 = tile.k1
        if u0 < 0:
            continue
        covered = []
        for j in range((u1 - u0) // PMAX):
            covered.append(False)
        visits = []
        for mi in range(len(members)):
            for tile in c.tiles[s][members[mi][1]]:
                if t0 <= tile.k0 and tile.k0 < t1:
                    off = tile.k0 - u0
                    kw = tile.k1 - tile.k0
                    segs = _segments(covered, off // PMAX, (off + kw) // PMAX)
                    dma = False
                    if c.dsT_dma and kw == K_TILE:
                        # every ds_dma_every-th whole tile of the launch goes to DMA (a mix by tile)
                        c.whole_visits += 1
                        dma = c.whole_visits % c.ds_dma_every == 0
                    visits.append(BwdVisit(mi, tile, off, segs, not started[mi], dma))
                    started[mi] = True
        ktiles.append(BwdKeyTile(u0, u1 - u0, visits, covered))
    return BwdGroup(members, ktiles)


def _section_runs(c, s):
    """Maximal runs [i_a, i_b) of consecutive query tiles with a visible key in section s and the same
    (first, last) flags: ``[(i_a, i_b, first, last)]``."""
    runs = []
    i = 0
    while i < c.nq:
        if not c.tiles[s][i]:
            i += 1
            continue
        first = c.first_sec[i] == s
        last = c.last_sec[i] == s
        j = i + 1
        while j < c.nq and c.tiles[s][j] and (c.first_sec[j] == s) == first and (c.last_sec[j] == s) == last:
            j += 1
        runs.append((i, j, first, last))
        i = j
    return runs


def _section_blocks(c, s):
    """The blocks of section s: every member (query head, query tile) with a visible key in the section once,
    in runs of query tiles; within a block the members are grouped tile-major (GQA: the query heads of one
    query tile first, which see the same keys)."""
    blocks = []
    nh_max = min(c.group, c.block_members)
    for run in _section_runs(c, s):
        i_a, i_b, first, last = run
        for h0 in range(0, c.group, nh_max):
            nh = min(nh_max, c.group - h0)
            nt_max = max(1, c.block_members // nh)
            for i0 in range(i_a, i_b, nt_max):
                nt = min(nt_max, i_b - i0)
                order = []
                for t in range(nt):
                    for h in range(nh):
                        order.append((h0 + h, i0 + t, (h * nt + t) * PMAX))
                groups = []
                for g0 in range(0, len(order), c.group_size):
                    groups.append(_group_plan(c, s, order[g0:min(g0 + c.group_size, len(order))]))
                blocks.append(BwdBlock(h0, nh, i0, nt, first, last, groups))
    return blocks


class BwdStep(nl.NKIObject):
    """One visit of a section's flat plan (``BwdConfig.streams``), in program order: block ``bi`` of the section,
    its group ``gi`` (``gf``: the group's index in the whole section), key tile ``ki`` of the group, visit ``vi``
    of the key tile; the flags mark the first / last visit of its block, group and key tile."""

    def __init__(self, bi, gi, gf, ki, vi, blk_first, blk_last, grp_first, grp_last, kt_first, kt_last):
        self.bi = bi
        self.gi = gi
        self.gf = gf
        self.ki = ki
        self.vi = vi
        self.blk_first = blk_first
        self.blk_last = blk_last
        self.grp_first = grp_first
        self.grp_last = grp_last
        self.kt_first = kt_first
        self.kt_last = kt_last


def _section_stream(blocks):
    """The flat visit plan of one section's ``blocks``: ``([BwdStep], number of groups)``."""
    out = []
    gf = 0
    for bi in range(len(blocks)):
        groups = blocks[bi].groups
        for gi in range(len(groups)):
            ktiles = groups[gi].ktiles
            for ki in range(len(ktiles)):
                nv = len(ktiles[ki].visits)
                for vi in range(nv):
                    last_kt = ki == len(ktiles) - 1 and vi == nv - 1
                    out.append(BwdStep(bi, gi, gf, ki, vi, gi == 0 and ki == 0 and vi == 0,
                                       gi == len(groups) - 1 and last_kt, ki == 0 and vi == 0, last_kt, vi == 0,
                                       vi == nv - 1))
            gf += 1
    return out, gf


def _key_stores(c, s):
    """Per visit of section ``s``'s stream, the runs ``[(x, y)]`` of 128-key chunks (section-relative) whose dK
    and dV that visit's eviction (``_evict_dv_dk``, at a key tile's last visit) completes: the last eviction that
    writes them. Chunks no eviction writes are in no run (``_section_end`` zeroes and stores them)."""
    k_lo, k_len = c.sections[s]
    n_ch = k_len // PMAX
    last = []
    for j in range(n_ch):
        last.append(-1)
    stream = c.streams[s]
    for jj in range(len(stream)):
        st = stream[jj]
        if st.kt_last:
            kt = c.blocks[s][st.bi].groups[st.gi].ktiles[st.ki]
            ch0 = (kt.u0 - k_lo) // PMAX
            for j in range(len(kt.wrote)):
                if kt.wrote[j]:
                    last[ch0 + j] = jj
    out = []
    for jj in range(len(stream)):
        done = []
        for j in range(n_ch):
            done.append(last[j] == jj)
        out.append(_runs(done, 0, n_ch))
    return out


class BwdConfig(nl.NKIObject):
    """Trace-time plan of one attention_bwd call (shapes, dtypes, engines, sections, blocks, groups, visits).

    ``a``: the call's ``validation.AttentionShape``; ``group_max``, ``block_members_max``, ``p_cast_on_gpsimd``,
    ``ds_dma_transpose``, ``pipe_lead``, ``pipe_lag_b``, ``pipe_lag_d``, ``qk_transposed``: the kernel's tuning
    keywords (None: the module defaults, or the rule); ``block_mask``: a ``band.BlockRows`` or None."""

    def __init__(self, a, dtype, mixed, section_len, trn1, group_max=None, block_members_max=None,
                 p_cast_on_gpsimd=None, ds_dma_transpose=None, block_mask=None, ds_dma_every=None, pipe_lead=None,
                 pipe_lag_b=None, pipe_lag_d=None, d_from_o=False, qk_transposed=None, stream_keys=None):
        # (NKI binds one target per attribute assignment: no tuple unpacking into attributes)
        self.bs = a.bs
        self.nheads = a.nheads
        self.nheads_kv = a.nheads_kv
        self.group = a.group
        self.d_head = a.d_head
        # Q/K head dim (S, dK, dQ, K^T) and V/O head dim (dP, dV, D, dO^T) are tiled separately, each into
        # partition tiles of 128 rows + remainder (``steps.head_dim_tiles``: 199 -> 128 + 71).
        self.d_qk = a.d_qk
        self.d_v = a.d_v
        self.qk_rows = a.qk_tiles
        self.v_rows = a.v_tiles
        self.d_tiles = len(a.qk_tiles)
        self.v_tiles = len(a.v_tiles)
        self.seqlen_q = a.seqlen_q
        self.seqlen_k = a.seqlen_k
        self.nq = a.seqlen_q // PMAX
        self.scale = a.scale
        # the scale convention (``steps``): softmax_scale is a float32 factor of the exp (or of the tanh), of the
        # dK eviction and of the dQ eviction; Q and the scores are never scaled in the input dtype
        self.dk_scale = a.scale
        self.causal = a.causal
        self.window = a.window
        # the band of causal / sliding window / window_size: key j visible to query i iff
        # i + lo_rel <= j <= i + hi_rel (bottom-right aligned: off = seqlen_k - seqlen_q)
        self.off = a.off
        self.lo_rel = a.lo_rel
        self.hi_rel = a.hi_rel
        self.lo_bounded = a.lo_rel > -a.seqlen_q
        self.hi_bounded = a.hi_rel < a.seqlen_k
        self.banded = a.banded
        self.softcap = a.softcap
        self.dropout_p = a.dropout_p
        self.dropout = a.dropout
        # the score modifications (``score_mods``): their arguments by kernel keyword, the rows applied
        self.mods = a.mods
        self.active = a.active
        # the dS step's output: the dS operand in the matmul dtype, or float32 when a score modification has a
        # ds_post step, which scales it and rounds it once (the logit scale's dS * scale[h])
        self.ds_dtype = dtype
        for m in a.active:
            if len(m.bwd(self, a.mods).ds_post) > 0:
                self.ds_dtype = nl.float32
        # the scale of the exp's input after the score steps: soft-capping hands over tanh(scale S / c) with
        # scale c, so ALiBi divides its bias by it (``_bias_alibi``)
        self.cap_scale = a.scale / a.softcap if a.softcap > 0.0 else 1.0
        self.exp_scale = a.softcap if a.softcap > 0.0 else a.scale
        self.packing = a.packing
        self.num_sinks = a.num_sinks
        self.sinks_3d = a.sinks_3d
        self.mm_dtype = dtype
        self.itemsize = itemsize(dtype)
        self.mixed = mixed
        # P is kept in fp32 with mixed precision (cast for the dV matmul), else in the input dtype.
        self.p_dtype = nl.float32 if mixed else dtype
        self.p_cast = mixed and str(dtype) != str(nl.float32)
        self.trn1 = trn1
        # Engines. trn1 has no ScalarE tensor_copy (activation copy instead), no DMA transpose, and its VectorE
        # and GpSimdE cannot use SBUF at the same time: the P cast goes to ScalarE there, to GpSimdE (idle
        # otherwise) from trn2 on. dS is transposed by DMA (trn2+, 2-byte types, whole 512-key tiles) when
        # TensorE would otherwise be the busiest engine (``_use_dma_transpose``).
        if p_cast_on_gpsimd is None:
            p_cast_on_gpsimd = P_CAST_ON_GPSIMD
        if ds_dma_transpose is None:
            ds_dma_transpose = DS_DMA_TRANSPOSE
        self.cast_on_gpsimd = p_cast_on_gpsimd and not trn1
        self.ds_dma_transpose = ds_dma_transpose
        self.section_len = section_len
        self.sections = []
        for lo in range(0, a.seqlen_k, section_len):
            self.sections.append((lo, min(section_len, a.seqlen_k - lo)))
        self.n_sections = len(self.sections)
        # a block mask's ``band.BlockRows`` (or None): its classes replace the band's in the plan below
        self.block_mask = block_mask
        # tiles[s][i]: visible key tiles of section s for query tile i; first_sec[i] / last_sec[i]: the first and
        # last section with one (-1: none)
        self.tiles = []
        for sec in self.sections:
            lo, n = sec
            row = []
            for i in range(self.nq):
                row.append(_visible_tiles(self, i * PMAX, lo, n))
            self.tiles.append(row)
        self.first_sec = []
        self.last_sec = []
        self.no_key_tiles = []
        for i in range(self.nq):
            first, last = -1, -1
            for s in range(self.n_sections):
                if self.tiles[s][i]:
                    if first < 0:
                        first = s
                    last = s
            self.first_sec.append(first)
            self.last_sec.append(last)
            if first < 0:
                self.no_key_tiles.append(i)
        # dQ partial sums between sections: fp32 scratch in HBM with mixed precision, else out_dq itself.
        self.dq_scratch = mixed and str(dtype) != str(nl.float32) and self.n_sections > 1
        self.dq_park_dtype = nl.float32 if self.dq_scratch else dtype
        self.group_size = group_size(self.d_tiles, group_max)
        # the streamed keys (``streamed_keys``): K, V loaded by key tile, dK and dV stored by key as they complete
        # (``key_stores``), D's product ahead of its block, dQ out of PSUM in two parts
        self.stream = _stream_keys(a, stream_keys, qk_transposed)
        # the transposed dQ / dK of the partial Q/K tile (``transposed_qk_grads``) where it streams fewer TensorE
        # columns, with the streamed keys
        self.qk_trans = self.stream and _qk_transposed(a, self.itemsize, section_len, qk_transposed, mixed,
                                                       group_max, block_members_max, pipe_lead, pipe_lag_b,
                                                       pipe_lag_d, self.stream)
        # per Q/K head-dim tile: transposed or not. A full 128-row tile streams 128 columns either way, so only a
        # partial tile (MLA's 64 rows, d 64, d 96) is transposed; the full one keeps the untransposed products and
        # needs no transposes on its way out
        self.qk_t = []
        for rt in a.qk_tiles:
            self.qk_t.append(self.qk_trans and rt[1] < PMAX)
        self.block_members = block_members(self.d_tiles, self.itemsize, self.dq_scratch, self.v_tiles, group_max,
                                           block_members_max)
        if ds_dma_every is None:
            ds_dma_every = DS_DMA_EVERY
        self.ds_dma_every = ds_dma_every
        self.d_from_o = d_from_o
        self.dsT_dma = _use_dma_transpose(self, trn1)
        self.whole_visits = 0
        self.blocks = []
        self.streams = []
        self.stream_groups = []
        self.key_stores = []
        for s in range(self.n_sections):
            self.blocks.append(_section_blocks(self, s))
            stream, n_groups = _section_stream(self.blocks[s])
            self.streams.append(stream)
            self.stream_groups.append(n_groups)
            if self.stream:
                self.key_stores.append(_key_stores(self, s))
        # the software pipeline of ``_pipeline`` (stage B never after stage D)
        pipe = _pipe_of(pipe_lead, pipe_lag_b, pipe_lag_d)
        self.pipe_lead = pipe[0]
        self.pipe_lag_b = pipe[1]
        self.pipe_lag_d = pipe[2]


def _use_dma_transpose(c, trn1):
    """Transpose dS by DMA (one ``dma_transpose`` per whole 512-key tile) instead of 4 TensorE transposes and a
    ScalarE copy. DMA transposes exist from trn2 on, for 2-byte types only; a DMA pays a fixed ~0.85 us per
    transfer, worth it only for whole tiles and only when TensorE, not the DMA queues, is the busier: counted at
    trace time from the plan (TensorE cycles of the matmuls and transposes of a whole tile against the DMA time
    of its transpose)."""
    if trn1 or c.itemsize != 2 or not c.ds_dma_transpose:
        return False
    full = 0
    chunks = 0
    for s in range(c.n_sections):
        for i in range(c.nq):
            for tile in c.tiles[s][i]:
                chunks += (tile.k1 - tile.k0) // PMAX
                if tile.k1 - tile.k0 == K_TILE:
                    full += 1
    # Per 128-key chunk and head-dim tile TensorE streams 5 matmuls x 128 columns (S, dP, dV, dK, dQ) at 2.4 GHz:
    # its time without the dS transposes. A whole-tile DMA transpose occupies the queues ~850 ns. Move the
    # transposes to DMA when TensorE's time without them still exceeds the DMA time they add.
    tensor_ns = chunks * (3 * c.d_tiles + 2 * c.v_tiles) * PMAX / 2.4
    dma_ns = full * 850.0
    return full > 0 and tensor_ns > dma_ns


def _pipe_of(pipe_lead, pipe_lag_b, pipe_lag_d):
    """``(lead, lag_b, lag_d)`` of the software pipeline from the keywords (None: the module defaults)."""
    if pipe_lead is None:
        pipe_lead = PIPE_LEAD
    if pipe_lag_b is None:
        pipe_lag_b = PIPE_LAG_B
    if pipe_lag_d is None:
        pipe_lag_d = PIPE_LAG_D
    return pipe_lead, pipe_lag_b, max(pipe_lag_b, pipe_lag_d)


def _section_len(a, itemsize, k_section_len):
    if k_section_len is None:
        return default_section_len(a.d_qk, len(a.qk_tiles), itemsize, a.seqlen_k, K_SECTION_MAX, len(a.v_tiles),
                                   a.bs * a.nheads_kv)
    return min(k_section_len, a.seqlen_k)


def _live_sections(a, section_len):
    """K/V sections whose buffers the software pipeline holds at once: 2 when there is a next section to load
    while one drains (several sections, or several work items), else 1."""
    if two_sections_live(section_len, a.seqlen_k, a.bs * a.nheads_kv):
        return 2
    return 1


def _is_trn1():
    return not nisa.get_nc_version() >= nisa.nc_version.gen3  # no range_select before trn2


def _knob_problem(name, value, allowed):
    """The problem with a tuning keyword: None (the default) or a value of the ``allowed`` kind ("int": an int
    >= 1, "count": an int >= 0, or "bool"); None when it is fine."""
    if value is None:
        return None
    if allowed == "bool":
        if not isinstance(value, bool):
            return f"{name}={value!r} must be None (the default), True or False"
        return None
    if allowed == "count":
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return f"{name}={value!r} must be None (the default) or an int >= 0"
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"{name}={value!r} must be None (the default) or an int >= 1"
    return None


def bwd_problem(q_ref, k_ref, v_ref, o_ref, dy_ref, lse_ref, sinks_ref=None, bound_min=None, bound_max=None,
                use_causal_mask=False, mixed_precision=False, softmax_scale=None, sliding_window=None,
                window_size=None, dropout_p=0.0, dropout_seed=None, k_section_len=None, group_max=None,
                block_members_max=None, p_cast_on_gpsimd=None, ds_dma_transpose=None, block_mask=None,
                block_bits=None, ds_dma_every=None, pipe_lead=None, pipe_lag_b=None, pipe_lag_d=None,
                d_from_o=False, qk_transposed=None, stream_keys=None, **mods):
    """``None`` when ``attention_bwd`` accepts these arguments on the current target, else the first problem as
    a message (argument, value, rule); host side: ``nki_attn.kernel_api.attention_bwd`` raises it as
    ``ValueError`` before launching. The score modifications' keywords (``softcap``, ``alibi_slopes``,
    ``attn_bias``, ``bias_grad``, ``logit_scale``: ``score_mods.MOD_KEYWORDS``) come as ``mods``; TypeError for a
    keyword neither the kernel nor the table has."""
    for key in mods:
        if key not in MOD_KEYWORDS:
            raise TypeError(f"bwd_problem() got an unexpected keyword argument {key!r}")
    return _bwd_problem(q_ref, k_ref, v_ref, o_ref, dy_ref, lse_ref, sinks_ref, bound_min, bound_max,
                        use_causal_mask, mixed_precision, softmax_scale, sliding_window, window_size, dropout_p,
                        dropout_seed, k_section_len, group_max, block_members_max, p_cast_on_gpsimd,
                        ds_dma_transpose, block_mask, block_bits, ds_dma_every, pipe_lead, pipe_lag_b, pipe_lag_d,
                        d_from_o, mods, qk_transposed, stream_keys)


def _bwd_problem(q_ref, k_ref, v_ref, o_ref, dy_ref, lse_ref, sinks_ref, bound_min, bound_max, use_causal_mask,
                 mixed_precision, softmax_scale, sliding_window, window_size, dropout_p, dropout_seed,
                 k_section_len, group_max, block_members_max, p_cast_on_gpsimd, ds_dma_transpose, block_mask,
                 block_bits, ds_dma_every, pipe_lead, pipe_lag_b, pipe_lag_d, d_from_o, mods, qk_transposed=None,
                 stream_keys=None):
    """``bwd_problem`` in kernel code (the kernel asserts on it): ``mods`` the score modifications' arguments by
    kernel keyword."""
    if lse_ref is None or o_ref is None or dy_ref is None:
        return "o_ref, dy_ref and lse_ref are required by attention_bwd (got None)"
    problem = attention_problem(q_ref, k_ref, v_ref, o=o_ref, dy=dy_ref, lse=lse_ref, sinks=sinks_ref,
                                bound_min=bound_min, bound_max=bound_max, use_causal_mask=use_causal_mask,
                                softmax_scale=softmax_scale, sliding_window=sliding_window, window_size=window_size,
                                dropout_p=dropout_p, dropout_seed=dropout_seed, mods=mods, kernel="attention_bwd")
    if problem is not None:
        return problem
    if not isinstance(mixed_precision, bool):
        return f"mixed_precision={mixed_precision!r} must be a bool"
    if not isinstance(d_from_o, bool):
        return f"d_from_o={d_from_o!r} must be a bool"
    if k_section_len is not None:
        if isinstance(k_section_len, bool) or not isinstance(k_section_len, int) or k_section_len < PMAX \
                or k_section_len % PMAX != 0:
            return f"k_section_len={k_section_len!r} must be a positive multiple of {PMAX}"
    knobs = (("group_max", group_max, "int"), ("block_members_max", block_members_max, "int"),
             ("p_cast_on_gpsimd", p_cast_on_gpsimd, "bool"), ("ds_dma_transpose", ds_dma_transpose, "bool"),
             ("ds_dma_every", ds_dma_every, "int"), ("pipe_lead", pipe_lead, "count"),
             ("pipe_lag_b", pipe_lag_b, "count"),
             ("pipe_lag_d", pipe_lag_d, "count"), ("qk_transposed", qk_transposed, "bool"),
             ("stream_keys", stream_keys, "bool"))
    for knob in knobs:
        name, value, allowed = knob
        problem = _knob_problem(name, value, allowed)
        if problem is not None:
            return problem
    masked = use_causal_mask or sliding_window is not None or window_size is not None or bound_min is not None
    problem = block_mask_problem(block_mask, block_bits, q_ref.shape[3], k_ref.shape[3], q_ref.shape[0],
                                 q_ref.shape[1], masked)
    if problem is not None:
        return problem
    if block_mask is not None and k_section_len is not None and k_section_len % K_TILE != 0:
        # the block mask's store is laid out by 512-key tiles from key 0: sections must end on them
        return f"k_section_len={k_section_len} must be a multiple of {K_TILE} with a block_mask"
    a = _shape_of(q_ref, k_ref, v_ref, sinks_ref, bound_min, use_causal_mask, softmax_scale, sliding_window,
                  window_size, dropout_p, mods)
    isz = itemsize(q_ref.dtype)
    sec = _section_len(a, isz, k_section_len)
    stream = _stream_keys(a, stream_keys, qk_transposed)
    if qk_transposed and not stream:
        return "qk_transposed=True needs the streamed keys: it cannot be combined with stream_keys=False"
    t = stream and _qk_transposed(a, isz, sec, qk_transposed, mixed_precision, group_max, block_members_max,
                                  pipe_lead, pipe_lag_b, pipe_lag_d, stream)
    use = _sbuf_use(a, isz, sec, mixed_precision, group_max, block_members_max, pipe_lead, pipe_lag_b, pipe_lag_d,
                    t)
    cap = sbuf_bytes_per_partition()
    if use["total"] > cap:
        return (f"attention_bwd needs {use['total']} SBUF bytes per partition (section {use['section']}, per-row "
                f"statistics {use['persistent']} for nheads/nheads_kv={a.group} x seqlen_q={a.seqlen_q}), more "
                f"than the {cap} available: shorten seqlen_q or the query-head group per kv head")
    return None


def _mod_bytes(a):
    """``(persistent, per_key)``: the SBUF bytes per partition the applied score modifications' backward steps
    add per work item and per key of a visit (the sum of their ``score_mods`` rows' ``bwd_sbuf``)."""
    persistent = 0
    per_key = 0
    for m in a.active:
        extra = m.bwd_sbuf(a, a.mods)
        persistent = persistent + extra[0]
        per_key = per_key + extra[1]
    return persistent, per_key


def _shape_of(q_ref, k_ref, v_ref, sinks_ref, bound_min, use_causal_mask, softmax_scale, sliding_window,
              window_size, dropout_p, mods=None):
    return attention_shape(q_ref, k_ref, sinks=sinks_ref, bound_min=bound_min, use_causal_mask=use_causal_mask,
                           softmax_scale=softmax_scale, sliding_window=sliding_window, v=v_ref,
                           window_size=window_size, dropout_p=dropout_p, mods=mods)


def _configure(q_ref, k_ref, sinks_ref, bound_min, use_causal_mask, mixed_precision, softmax_scale,
               sliding_window, k_section_len, v_ref=None, window_size=None, dropout_p=0.0, group_max=None,
               block_members_max=None, p_cast_on_gpsimd=None, ds_dma_transpose=None, block_mask=None,
               ds_dma_every=None, pipe_lead=None, pipe_lag_b=None, pipe_lag_d=None, d_from_o=False, mods=None,
               qk_transposed=None, stream_keys=None):
    """The launch's ``BwdConfig``, built once from arguments ``bwd_problem`` accepted (``v_ref`` None: d_v =
    d_qk; ``block_mask`` the kernel's trace-time ``(n_b, n_h, rows)`` or None; ``mods`` the score
    modifications' arguments by kernel keyword)."""
    a = _shape_of(q_ref, k_ref, v_ref, sinks_ref, bound_min, use_causal_mask, softmax_scale, sliding_window,
                  window_size, dropout_p, mods)
    sec = _section_len(a, itemsize(q_ref.dtype), k_section_len)
    rows = None
    if block_mask is not None:
        rows = BlockRows(block_mask[0], block_mask[1], block_mask[2], a.seqlen_k // PMAX)
    return BwdConfig(a, q_ref.dtype, mixed_precision, sec, _is_trn1(), group_max, block_members_max,
                     p_cast_on_gpsimd, ds_dma_transpose, rows, ds_dma_every, pipe_lead, pipe_lag_b, pipe_lag_d,
                     d_from_o, qk_transposed, stream_keys)


# ----------------------------------------------------------------------------------------------- engines
def _copy_on_scalar(c, dst, src, scale):
    """ScalarE copy (PSUM or SBUF -> SBUF) times ``scale``, cast on write: ``tensor_copy`` where ScalarE has it
    and no scale is needed (trn2+; faster for 16-bit types on trn3), else ``activation(copy, scale=)``."""
    if c.trn1 or scale != 1.0:
        nisa.activation(dst=dst, op=nl.copy, data=src, scale=scale)
    else:
        nisa.tensor_copy(dst=dst, src=src, engine=nisa.engine.scalar)


def _cast_p(c, p):
    """P in the matmul dtype for the dV matmul (mixed precision keeps the fp32 P for dS): GpSimdE (SBUF to
    SBUF, otherwise idle) from trn2 on; ScalarE on trn1, where GpSimdE would hold VectorE's SBUF port."""
    if str(p.dtype) == str(c.mm_dtype):
        return p
    p_mm = nl.ndarray(p.shape, dtype=c.mm_dtype, buffer=nl.sbuf)
    if c.cast_on_gpsimd:
        nisa.tensor_copy(dst=p_mm, src=p, engine=nisa.engine.gpsimd)
    else:
        nisa.activation(dst=p_mm, op=nl.copy, data=p)
    return p_mm


# ----------------------------------------------------------------------------------------------- loads
def _hbm_block(ref, b, h0, nh, r0, rn, c0, ncols):
    """View ``[rn, nh, ncols]`` of rows r0..r0+rn (head dim) of heads h0..h0+nh-1 and columns c0..c0+ncols-1 of
    a ``[bs, nheads, d, seqlen]`` HBM tensor: the head-major layout of a block tile, so ONE DMA moves the block
    (a permuted view: the head stride d*seqlen does not fit an access pattern's int16 stride field)."""
    if nh == 1:
        return ref[b, h0, r0:r0 + rn, c0:c0 + ncols]
    return ref[b, h0:h0 + nh, r0:r0 + rn, c0:c0 + ncols].permute((1, 0, 2))


def _load_block(c, ref, b, blk, h_abs0, rows):
    """One SBUF tile ``[rn, nh*nt*128]`` per head-dim tile ``rows`` of the block's members of ``ref`` (q, o or
    dy): one DMA per tile, head-major columns."""
    ncols = blk.nt * PMAX
    tiles = []
    for rt in rows:
        r0, rn = rt
        t = nl.ndarray((rn, blk.nh * ncols), dtype=c.mm_dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=_hbm_block(ref, b, h_abs0, blk.nh, r0, rn, blk.i0 * PMAX, ncols))
        tiles.append(t)
    return tiles


def _load_kv_section(c, k_ref, v_ref, b, hk, k_lo, k_len):
    """K ([rn, k_len] per Q/K head-dim tile), V (per V head-dim tile) and K^T ([128, n_chunks * rn] per Q/K
    head-dim tile: chunk j of 128 keys at columns j*rn) for the dQ matmul, which contracts over keys."""
    ks, vs, kts = [], [], []
    n_ch = k_len // PMAX
    for rt in c.qk_rows:
        r0, rn = rt
        kt = nl.ndarray((rn, k_len), dtype=c.mm_dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=kt, src=k_ref[b, hk, r0:r0 + rn, k_lo:k_lo + k_len])
        per = max(1, K_TILE // rn)  # chunks per PSUM transpose tile (<= 512 elements: one bank)
        ktr = nl.ndarray((PMAX, n_ch * rn), dtype=c.mm_dtype, buffer=nl.sbuf)
        for g0 in range(0, n_ch, per):
            gn = min(per, n_ch - g0)
            ps = nl.ndarray((PMAX, gn * rn), dtype=c.mm_dtype, buffer=nl.psum)
            for j in range(gn):
                ch = g0 + j
                nisa.nc_transpose(dst=ps[:, j * rn:(j + 1) * rn], data=kt[:, ch * PMAX:(ch + 1) * PMAX])
            nisa.tensor_copy(dst=ktr[:, g0 * rn:(g0 + gn) * rn], src=ps)
        ks.append(kt)
        kts.append(ktr)
    for rt in c.v_rows:
        r0, rn = rt
        vt = nl.ndarray((rn, k_len), dtype=c.mm_dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=vt, src=v_ref[b, hk, r0:r0 + rn, k_lo:k_lo + k_len])
        vs.append(vt)
    return ks, vs, kts


def _load_neg_lse(c, lse_ref, b, hk):
    """-LSE of every member of the kv head, [128, group, nq] fp32 (``[p, g, t]``: row t*128+p of query head g):
    the exp bias of the P recompute. One DMA and one negation per work item."""
    neg_lse = nl.ndarray((PMAX, c.group, c.nq), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=neg_lse, src=lse_ref[b, hk * c.group:(hk + 1) * c.group, :, :].permute((1, 0, 2)))
    nisa.tensor_scalar(dst=neg_lse, data=neg_lse, op0=nl.multiply, operand0=-1.0)
    return neg_lse


def _load_bounds(c, bound_min, bound_max):
    """Packing bounds as [128, nq] fp32 columns (query row t*128+p at [p, t]), loaded once per launch. Causal
    and the sliding window are folded in here (bound_max = min(bound_max, q+1), bound_min = max(bound_min,
    q-W+1)) so one range test per score masks all three rules."""
    bmin, bmax = load_packing_bounds(bound_min, bound_max, c.nq)
    if c.hi_bounded or c.lo_bounded:
        qidx = nl.ndarray((PMAX, c.nq), dtype=nl.float32, buffer=nl.sbuf)
        nisa.iota(dst=qidx, pattern=[[PMAX, c.nq]], offset=0, channel_multiplier=1)
        if c.hi_bounded:
            nisa.scalar_tensor_tensor(dst=bmax, data=qidx, op0=nl.add, operand0=float(c.hi_rel + 1),
                                      op1=nl.minimum, operand1=bmax)
        if c.lo_bounded:
            nisa.scalar_tensor_tensor(dst=bmin, data=qidx, op0=nl.add, operand0=float(c.lo_rel), op1=nl.maximum,
                                      operand1=bmin)
    return bmin, bmax


# ----------------------------------------------------------------------------------------------- steps
def _o_dy_products(c, blk, o_b, dy_b):
    """O * dO of the block's members in fp32, one VectorE ``tensor_tensor`` per V head-dim tile (``_rowsum_o_dy``'s
    first half)."""
    n = blk.nh * blk.nt
    prods = []
    for dt in range(len(c.v_rows)):
        rn = c.v_rows[dt][1]
        prod = nl.ndarray((rn, n * PMAX), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=prod, data1=o_b[dt], data2=dy_b[dt], op=nl.multiply)
        prods.append(prod)
    return prods


def _rowsum_o_dy(c, blk, o_b, dy_b, ones, dsum, prods=None):
    """Step 1: D = rowsum(O * dO) of the block's members into ``dsum[:, g, i]`` (fp32). Equals
    sum_j P_ij dP_ij (O = P V), so the softmax Jacobian needs no key-axis reduction. O and dO are multiplied in
    their HBM layout (head dim on the partitions: no transpose), one fp32 ``tensor_tensor`` per head-dim tile for
    the whole block; a ones-vector matmul per member sums the head dim over the partitions into one PSUM column.
    Run in each member's first section only; D stays in SBUF for the later sections. ``o_b``, ``dy_b``: the
    block's O and dO tiles (``_block_load``); ``prods``: their products when ``_o_dy_products`` formed them
    earlier (the streamed keys' pipeline), else None."""
    n = blk.nh * blk.nt
    d_ps = nl.ndarray((PMAX, n), dtype=nl.float32, buffer=nl.psum)
    if prods is None:
        prods = _o_dy_products(c, blk, o_b, dy_b)
    for j in range(n):
        for dt in range(len(c.v_rows)):
            rn = c.v_rows[dt][1]
            nisa.nc_matmul(dst=d_ps[:, j:j + 1], stationary=prods[dt][:, j * PMAX:(j + 1) * PMAX],
                           moving=ones[0:rn, :], is_moving_onezero=True, accumulate=dt > 0)
    # block column j = h*nt + t -> dsum[:, h0+h, i0+t]
    nisa.tensor_copy(dst=dsum[:, blk.h0:blk.h0 + blk.nh, blk.i0:blk.i0 + blk.nt], src=d_ps)


def _transpose_members(c, grp, q_b, dy_b):
    """Q^T and dO^T of the group's members (query rows on the partitions: the stationary operands of the dV and
    dK matmuls, which contract the query rows). TensorE transposes, several members per PSUM bank, one copy per
    bank. Returns ``[(qT, dyT)]`` views ``[128, d_qk]``, ``[128, d_v]`` per member."""
    width = c.d_qk + c.d_v
    per = max(1, 2048 // (width * c.itemsize))  # members per 2 KiB PSUM bank
    out = []
    n = len(grp.members)
    for m0 in range(0, n, per):
        mn = min(per, n - m0)
        ps = nl.ndarray((PMAX, mn * width), dtype=c.mm_dtype, buffer=nl.psum)
        for j in range(mn):
            col = grp.members[m0 + j][2]
            base = j * width
            for dt in range(len(c.qk_rows)):
                r0, rn = c.qk_rows[dt]
                nisa.nc_transpose(dst=ps[:, base + r0:base + r0 + rn], data=q_b[dt][:, col:col + PMAX])
            for dt in range(len(c.v_rows)):
                r0, rn = c.v_rows[dt]
                nisa.nc_transpose(dst=ps[:, base + c.d_qk + r0:base + c.d_qk + r0 + rn],
                                  data=dy_b[dt][:, col:col + PMAX])
        sb = nl.ndarray((PMAX, mn * width), dtype=c.mm_dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=sb, src=ps)
        for j in range(mn):
            base = j * width
            out.append((sb[:, base:base + c.d_qk], sb[:, base + c.d_qk:base + width]))
    return out


# ----------------------------------------------------------------------------------------------- steps
# The backward's steps (``steps`` protocol, one signature ``step(c, tile, item, x) -> x``), chosen once per launch
# by ``_select_steps``. Per visit, in this order:
#   score         S (PSUM) -> the exp's input      the score modifications (``score_mods``: the logit scale,
#                                                  soft-capping, ALiBi, the additive bias)
#   mask_partial  -> the exp's input               packing bounds (``_scores_packed``; causal, window folded in)
#   P = exp(exp_scale * x - LSE)                    (ONE activation, always)
#   p_mask        P -> P                           the band's element masks (causal, windows: ``_p_band``)
#   grad          P -> the P operand of dS         soft-capping: P * (1 - tanh^2)
#   prob          P -> the P operand of dV         dropout (its keep multiplier saved for dS)
#   ds            dP -> dS = (dP [* keep] - D) * P operand
#   ds_post       dS -> the dS operand of dK, dQ   the logit scale: its gradient's partial sums, dS * scale[h]
def _p_band(c, tile, item, p):
    """The band masks on P (GpSimdE ``affine_select``, zero outside), only on the columns a mask can touch: the
    upper side (causal, window_size right: keep key k0+j <= query q0+p + hi_rel) from the first column some row
    loses, the lower side (sliding window, window_size left: keep k0+j >= q0+p + lo_rel) up to the last column
    some row loses. Masking P instead of S lets exp read S from PSUM (no copy): the exp of a masked score may
    overflow, the select replaces it."""
    q0 = tile.q0
    k0 = tile.k0
    kw = tile.kw
    if tile.needs_hi:
        a = max(0, q0 + c.hi_rel - k0)
        nisa.affine_select(dst=p[:, a:kw], pattern=[[-1, kw - a]], channel_multiplier=1,
                           on_true_tile=p[:, a:kw], on_false_value=0.0, cmp_op=nl.greater_equal,
                           offset=q0 + c.hi_rel - k0 - a)
    if tile.needs_lo:
        e = min(kw, q0 + PMAX - 1 + c.lo_rel - k0)
        e = (e + PMAX - 1) // PMAX * PMAX
        nisa.affine_select(dst=p[:, 0:e], pattern=[[1, e]], channel_multiplier=-1, on_true_tile=p[:, 0:e],
                           on_false_value=0.0, cmp_op=nl.greater_equal, offset=k0 - q0 - c.lo_rel)
    return p


def _scores_packed(c, tile, item, s):
    """Packing (trn2+): ONE Vector ``range_select`` copies S from PSUM keeping bound_min <= key < bound_max (causal
    and window are folded into the bounds), -3.4e38 elsewhere, so exp gives exactly 0."""
    bmin, bmax = item.bounds
    i = tile.t
    s_sb = nl.ndarray((PMAX, tile.kw), dtype=nl.float32, buffer=nl.sbuf)
    nisa.range_select(dst=s_sb, on_true_tile=s, comp_op0=nl.greater_equal, comp_op1=nl.less,
                      bound0=bmin[:, i:i + 1], bound1=bmax[:, i:i + 1], range_start=tile.k0,
                      on_false_value=FP32_MIN)
    return s_sb


def _scores_packed_trn1(c, tile, item, s):
    """Packing on trn1 (no range_select): key index (iota), two compares into a 0/1 mask, predicated fill."""
    bmin, bmax = item.bounds
    i = tile.t
    kw = tile.kw
    s_sb = nl.ndarray((PMAX, kw), dtype=nl.float32, buffer=nl.sbuf)
    kidx = nl.ndarray((PMAX, kw), dtype=nl.float32, buffer=nl.sbuf)
    nisa.iota(dst=kidx, pattern=[[1, kw]], offset=tile.k0, channel_multiplier=0)
    vis = nl.ndarray((PMAX, kw), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=vis, data=kidx, op0=nl.greater_equal, operand0=bmin[:, i:i + 1])
    nisa.scalar_tensor_tensor(dst=vis, data=kidx, op0=nl.less, operand0=bmax[:, i:i + 1], op1=nl.multiply,
                              operand1=vis)
    nisa.tensor_copy(dst=s_sb, src=s)
    nisa.tensor_copy_predicated(dst=s_sb, src=FP32_MIN, predicate=vis, reverse_pred=True)
    return s_sb


def _drop_keep(c, tile, item, p):
    """Dropout: the keep multiplier M / (1 - p) of this [128 x kw] tile, regenerated from the seed exactly as the
    forward made it (``dropout.dropout_scale_keys`` from the member's row words, ``tile.rows``, computed once per
    group; ``dropout_scale_tile`` when there are none), then P_drop = P * multiplier (GpSimdE, rounded to the
    matmul dtype) for dV = P_drop^T dO. The multiplier is saved for the dS step (``tile.saved["keep"]``)."""
    keys = tile.rows
    if keys is None:
        ms = dropout_scale_tile(item.seed, c.dropout_p, tile.b, tile.hq, tile.q0, tile.k0, PMAX, tile.kw)
    else:
        ms = dropout_scale_keys(keys, c.dropout_p, tile.k0, PMAX, tile.kw)
    pd = nl.ndarray((PMAX, tile.kw), dtype=c.mm_dtype, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=pd, data1=p, data2=ms, op=nl.multiply, engine=nisa.engine.gpsimd)
    tile.saved["keep"] = ms
    return pd


def _ds_dropout(c, tile, item, dp):
    """Dropout: dS = (dP * M / (1 - p) - D) * P (D = rowsum(dO * O) of the dropped O): the multiplier on dP
    first (VectorE, from PSUM), then the fused op of ``_ds_plain``."""
    dpm = nl.ndarray((PMAX, tile.kw), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=dpm, data1=dp, data2=tile.saved["keep"], op=nl.multiply)
    ds = nl.ndarray((PMAX, tile.kw), dtype=c.ds_dtype, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=ds, data=dpm, op0=nl.subtract, operand0=tile.d_col, op1=nl.multiply,
                              operand1=tile.saved["p_ds"])
    return ds


def _ds_plain(c, tile, item, dp):
    """dS = (dP - D) * P as ONE VectorE scalar_tensor_tensor reading dP from PSUM, fp32 inside, rounded once to
    the matmul dtype (P: the grad steps' output, ``tile.saved["p_ds"]``)."""
    ds = nl.ndarray((PMAX, tile.kw), dtype=c.ds_dtype, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=ds, data=dp, op0=nl.subtract, operand0=tile.d_col, op1=nl.multiply,
                              operand1=tile.saved["p_ds"])
    return ds


def _select_steps(c):
    """The steps of this launch (see above), chosen once from the config: the score modifications' from their
    ``score_mods`` rows (the score steps in rank order, every other slot in table order; a row's ``ds`` replaces
    the dS step), the masks by kind and generation, dropout's."""
    score = []
    for m in SCORE_MODS_BY_RANK:
        if m.is_on(c.mods):
            score.extend(m.bwd(c, c.mods).score)
    partial = no_step
    p_mask = []
    if c.packing:
        partial = _scores_packed
        if c.trn1:
            partial = _scores_packed_trn1
    elif c.banded:
        p_mask.append(_p_band)
    if c.block_mask is not None:
        p_mask.append(block_mask_probs)
    prob = []
    ds = _ds_plain
    if c.dropout:
        prob.append(_drop_keep)
        ds = _ds_dropout
    grad = []
    ds_post = []
    item_open = []
    item_start = []
    item_end = []
    for m in c.active:
        ms = m.bwd(c, c.mods)
        grad.extend(ms.grad)
        if ms.ds is not None:
            ds = ms.ds
        ds_post.extend(ms.ds_post)
        item_open.extend(ms.item_open)
        item_start.extend(ms.item_start)
        item_end.extend(ms.item_end)
    return Steps(score, no_step, partial, p_mask, prob, grad=grad, ds=ds, ds_post=ds_post, item_open=item_open,
                 item_start=item_start, item_end=item_end)


def _recompute_p(c, item, steps, tile, q_m, ks, kk, nlse_col):
    """Step 2: S = Q^T K (contracting head_dim on the partitions, unscaled), then P = exp(scale S - LSE) as ONE
    activation with the float32 softmax_scale as its ``scale`` and -LSE as its bias, reading S
    from PSUM when no step edits it: no max subtraction, no division (LSE = max + log(sum)). The variants and the
    element masks are the steps."""
    s_ps = nl.ndarray((PMAX, tile.kw), dtype=nl.float32, buffer=nl.psum)
    for dt in range(len(c.qk_rows)):
        nisa.nc_matmul(dst=s_ps, stationary=q_m[dt], moving=ks[dt][:, kk:kk + tile.kw], accumulate=dt > 0)
    src = run_steps(c, steps.score, tile, item, s_ps)
    src = mask_step(steps, tile)(c, tile, item, src)
    p = nl.ndarray((PMAX, tile.kw), dtype=c.p_dtype, buffer=nl.sbuf)
    nisa.activation(dst=p, op=nl.exp, data=src, bias=nlse_col, scale=c.exp_scale)
    return run_steps(c, steps.p_mask, tile, item, p)


def _softmax_bwd(c, item, steps, tile, dy_m, vs, kk):
    """Steps 3.2 + 4: dP = dO V^T in PSUM, then dS = (dP - D) * P by the dS step (ONE fused op without
    dropout); D summed from this visit instead when it sees the whole row (``tile.saved["p_row"]``,
    ``_row_dsum``)."""
    dp_ps = nl.ndarray((PMAX, tile.kw), dtype=nl.float32, buffer=nl.psum)
    for dt in range(len(c.v_rows)):
        nisa.nc_matmul(dst=dp_ps, stationary=dy_m[dt], moving=vs[dt][:, kk:kk + tile.kw], accumulate=dt > 0)
    if tile.saved["p_row"] is not None:
        tile.d_col = _row_dsum(tile, dp_ps, tile.saved["p_row"])
    return run_steps(c, steps.ds_post, tile, item, steps.ds(c, tile, item, dp_ps))


def _whole_row(c, i):
    """True when every key query tile ``i`` sees lies in ONE 128-key chunk of one visit (with a causal mask: the
    first 128 rows; without one: seqlen_k 128), so that visit has all of the row's P and dP. Rows with more keys
    keep D = rowsum(O * dO): the error D's rounding puts into a row's dq falls as 1 / (its keys) while the dq
    falls as 1 / sqrt(its keys), so the first chunk's rows carry nearly all of it, at a tenth of the VectorE
    time the first 512 rows would take. Not with dropout, whose D is summed over the dropped P, nor with
    ``d_from_o`` (o and lse from a larger problem than this call's keys: the visit does not hold the row)."""
    s = c.first_sec[i]
    if c.dropout or c.d_from_o or c.last_sec[i] != s or len(c.tiles[s][i]) != 1:
        return False
    return c.tiles[s][i][0].k1 - c.tiles[s][i][0].k0 == PMAX


def _row_dsum(tile, dp, p):
    """D = sum_j P_ij dP_ij ``[128, 1]`` fp32 over the visit's keys, all of the row's (``_whole_row``): the P
    ``[128, kw]`` (fp32 with mixed precision) and the fp32 dP (PSUM) the visit's dS is made of, two VectorE
    instructions. It equals rowsum(O * dO) in exact arithmetic, but
    the O the forward wrote is rounded to the input dtype, and a row with few keys has a small dS next to that
    rounding: with a causal mask, D from the bf16 O adds up to a tenth to dq's and dk's error, nearly all of it
    from the first rows (docs/validation.md "Where the backward's error comes from")."""
    prod = nl.ndarray((PMAX, tile.kw), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=prod, data1=dp, data2=p, op=nl.multiply)
    d = nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=d, op=nl.add, data=prod, axis=1)
    return d


def _dv_dk(c, v, dyT, qT, p_mm, ds, dv_ps, dk_ps):
    """Steps 3.1 + 5.2: dV += P^T dO and dK += Q^T dS (contracting the 128 query rows) into the group's PSUM
    tiles of this key tile: the group's members (query tiles, or the query heads of a kv head) accumulate there,
    each matmul overwriting the columns no earlier member wrote (``v.segs``). dK gets softmax_scale when it leaves
    PSUM (``_evict_dv_dk``)."""
    for seg in v.segs:
        a, e, acc = seg
        cols = slice(a - v.off, e - v.off)
        for dt in range(len(c.v_rows)):
            r0, rn = c.v_rows[dt]
            nisa.nc_matmul(dst=dv_ps[dt][:, a:e], stationary=dyT[:, r0:r0 + rn], moving=p_mm[:, cols],
                           accumulate=acc)
        if c.stream:
            for dt in range(len(c.qk_rows)):
                r0, rn = c.qk_rows[dt]
                if not c.qk_t[dt]:
                    nisa.nc_matmul(dst=dk_ps[dt][:, a:e], stationary=qT[:, r0:r0 + rn], moving=ds[:, cols],
                                   accumulate=acc)
                    continue
                # transposed (``transposed_qk_grads``): dK^T [128 keys, rn] += dS^T Q^T per 128-key chunk, the
                # chunk of dS the stationary operand, Q^T's rn columns the moving one
                for ch in range(a // PMAX, e // PMAX):
                    d0 = ch * PMAX - v.off
                    nisa.nc_matmul(dst=dk_ps[dt][:, ch * rn:(ch + 1) * rn], stationary=ds[:, d0:d0 + PMAX],
                                   moving=qT[:, r0:r0 + rn], accumulate=acc)
            continue
        for dt in range(len(c.qk_rows)):
            r0, rn = c.qk_rows[dt]
            nisa.nc_matmul(dst=dk_ps[dt][:, a:e], stationary=qT[:, r0:r0 + rn], moving=ds[:, cols],
                           accumulate=acc)


def _transpose_ds(c, v, ds):
    """dS^T ``[128 keys, 1, chunks, 128 queries]``: chunk ch at ``[:, 0, ch, :]``. Whole 512-key tiles on trn2+
    (``v.dsT_dma``): ONE DMA transpose, SBUF to SBUF. Otherwise TensorE transposes of the 128-key chunks into one
    PSUM tile and one ScalarE copy (VectorE is the busier engine)."""
    n_ch = v.kw // PMAX
    dsT = nl.ndarray((PMAX, 1, n_ch, PMAX), dtype=c.mm_dtype, buffer=nl.sbuf)
    if v.dsT_dma:
        nisa.dma_transpose(dst=dsT, src=ds.reshape((PMAX, 1, n_ch, PMAX)), axes=(3, 1, 2, 0))
        return dsT
    ps = nl.ndarray((PMAX, v.kw), dtype=c.mm_dtype, buffer=nl.psum)
    for ch in range(n_ch):
        nisa.nc_transpose(dst=ps[:, ch * PMAX:(ch + 1) * PMAX], data=ds[:, ch * PMAX:(ch + 1) * PMAX])
    _copy_on_scalar(c, dsT, ps, 1.0)
    return dsT


def _dq_cols(c, dt):
    """Columns one member's Q/K head-dim tile ``dt`` takes in the group's dQ PSUM tile: 128 queries, or its ``rn``
    rows when it is transposed (``c.qk_t``)."""
    if c.qk_t[dt]:
        return c.qk_rows[dt][1]
    return PMAX


def _dq_width(c):
    """Columns of a group's fp32 dQ PSUM tile (one bank): ``group_size`` members x ``_dq_cols`` per Q/K head-dim
    tile."""
    w = 0
    for dt in range(len(c.qk_rows)):
        w += c.group_size * _dq_cols(c, dt)
    return w


def _dq_col(c, dt, m):
    """First column of member ``m``'s Q/K head-dim tile ``dt`` in the group's dQ PSUM tile: tile-major, the
    group's members side by side (``[rn, 128 queries]`` each, or ``[128 queries, rn]`` transposed). For
    untransposed tiles only this is ``(dt * group_size + m) * 128``."""
    col = 0
    for t in range(dt):
        col += c.group_size * _dq_cols(c, t)
    return col + m * _dq_cols(c, dt)


def _dq(c, v, dsT, kts, kk, dq_ps, dq_fresh):
    """Step 5.1: dQ += dS K, contracting keys on the partitions (dS^T, ``_transpose_ds``, against the section's
    K^T), into the member's columns of the group's dQ PSUM tile, accumulated over all the key tiles of the
    section (onto the earlier sections' partial sum, which ``_reload_dq`` put there, unless ``dq_fresh``)."""
    n_ch = v.kw // PMAX
    ch0 = kk // PMAX
    if c.stream:
        for dt in range(len(c.qk_rows)):
            rn = c.qk_rows[dt][1]
            col = _dq_col(c, dt, v.m)
            for ch in range(n_ch):
                acc = not (dq_fresh and v.dq_first and ch == 0)
                ktc = kts[dt][:, (ch0 + ch) * rn:(ch0 + ch + 1) * rn]
                if c.qk_t[dt]:
                    # transposed (``transposed_qk_grads``): dQ^T [128 queries, rn] += dS K^T, dS^T the stationary
                    # operand, the tile's K^T the moving one (rn columns streamed instead of 128)
                    nisa.nc_matmul(dst=dq_ps[:, col:col + rn], stationary=dsT[:, 0, ch, :], moving=ktc,
                                   accumulate=acc)
                else:
                    nisa.nc_matmul(dst=dq_ps[0:rn, col:col + PMAX], stationary=ktc, moving=dsT[:, 0, ch, :],
                                   accumulate=acc)
        return
    for dt in range(len(c.qk_rows)):
        rn = c.qk_rows[dt][1]
        col = (dt * c.group_size + v.m) * PMAX
        for ch in range(n_ch):
            nisa.nc_matmul(dst=dq_ps[0:rn, col:col + PMAX], stationary=kts[dt][:, (ch0 + ch) * rn:(ch0 + ch + 1) * rn],
                           moving=dsT[:, 0, ch, :], accumulate=not (dq_fresh and v.dq_first and ch == 0))


def _visit_a(c, item, steps, sec, grp, mem, v):
    """Stage A of one member's visit of one key tile (the seed's steps 2-4 on a [128 queries x <= 512 keys]
    tile): S, P and its masks, the P cast, dP and dS. Returns ``(p_mm, ds)``, the operands of stage B."""
    g, i, col = grp.members[v.m]
    tile = Tile(item.b, item.kvh * c.group + g, g, i, v.k0, v.kw, v.kt.needs_lo, v.kt.needs_hi, v.kt.kind,
                rows=mem.rows, d_col=item.dsum[:, g, i:i + 1])
    kk = v.k0 - sec.k_lo
    p = _recompute_p(c, item, steps, tile, mem.q, sec.ks, kk, item.neg_lse[:, g, i:i + 1])
    tile.saved["p"] = p  # P as the exponent and the masks left it, for a step after the grad steps rewrite it
    tile.saved["p_row"] = p if _whole_row(c, i) else None
    tile.saved["p_ds"] = run_steps(c, steps.grad, tile, item, p)
    p_mm = _cast_p(c, run_steps(c, steps.prob, tile, item, p))
    ds = _softmax_bwd(c, item, steps, tile, mem.dy, sec.vs, kk)
    return p_mm, ds


def _evict_dv_dk(c, kt, sec, dv_ps, dk_ps):
    """Add the group's dV and softmax_scale times its dK of one key tile into the section's fp32 SBUF
    accumulators: one VectorE instruction per head-dim tile and group, not per member (the PSUM adds of the
    group's matmuls are free; the scale rides on the dK add, in float32). Columns no earlier eviction of the
    section wrote (``sec.written``, trace time) are overwritten instead (a copy, or the scale alone): the
    accumulators are never zeroed, and the result is bit-identical to adding into zeros."""
    a0 = kt.u0 - sec.k_lo
    runs = []
    # only the chunks some matmul of the group wrote: a chunk between two members' runs stays unwritten in the
    # section (zeroed at its end unless another key tile's group writes it)
    for wr in _runs(kt.wrote, 0, len(kt.wrote)):
        for run in _segments(sec.written, a0 // PMAX + wr[0], a0 // PMAX + wr[1]):
            runs.append(run)
    for run in runs:
        x, y, acc = run
        src = slice(x - a0, y - a0)
        for dt in range(len(c.v_rows)):
            dst = sec.dv_acc[dt][:, x:y]
            if acc:
                nisa.tensor_tensor(dst=dst, data1=dst, data2=dv_ps[dt][:, src], op=nl.add)
            else:
                nisa.tensor_copy(dst=dst, src=dv_ps[dt][:, src])
        for dt in range(len(c.qk_rows)):
            if c.qk_t[dt]:
                # transposed: chunk j's rn columns at j * rn, in PSUM and in the accumulator
                rn = c.qk_rows[dt][1]
                dst = sec.dk_acc[dt][:, x // PMAX * rn:y // PMAX * rn]
                dk_src = dk_ps[dt][:, (x - a0) // PMAX * rn:(y - a0) // PMAX * rn]
            else:
                dst = sec.dk_acc[dt][:, x:y]
                dk_src = dk_ps[dt][:, src]
            if acc and c.dk_scale == 1.0:
                nisa.tensor_tensor(dst=dst, data1=dst, data2=dk_src, op=nl.add)
            elif acc:
                nisa.scalar_tensor_tensor(dst=dst, data=dk_src, op0=nl.multiply, operand0=c.dk_scale,
                                          op1=nl.add, operand1=dst)
            elif c.dk_scale == 1.0:
                nisa.tensor_copy(dst=dst, src=dk_src)
            else:
                nisa.tensor_scalar(dst=dst, data=dk_src, op0=nl.multiply, operand0=c.dk_scale)


def _reload_dq(c, grp, dq_ps, dq_prev, ident):
    """Later sections: put each member's earlier partial sum (unscaled, fp32 scratch or out_dq) back into its dQ
    PSUM columns with ONE matmul against the identity, so this section's matmuls accumulate onto it in the same
    order as without sections (the result does not depend on where the sections end, when they end on 512-key
    tiles) and the scale is applied once, at the end."""
    for mi in range(len(grp.members)):
        col = grp.members[mi][2]
        for dt in range(len(c.qk_rows)):
            rn = c.qk_rows[dt][1]
            if c.qk_t[dt]:
                # transposed: the partial sum [rn, 128 queries] is the stationary operand, the identity the
                # moving one, so the product is its transpose [128 queries, rn] (exact, as above)
                pc = _dq_col(c, dt, mi)
                nisa.nc_matmul(dst=dq_ps[:, pc:pc + rn], stationary=dq_prev[dt][:, col:col + PMAX],
                               moving=ident[0:rn, 0:rn], accumulate=False)
                continue
            pc = _dq_col(c, dt, mi)
            nisa.nc_matmul(dst=dq_ps[0:rn, pc:pc + PMAX], stationary=ident[0:rn, 0:rn],
                           moving=dq_prev[dt][:, col:col + PMAX], accumulate=False)


def _evict_dq(c, grp, blk, dq_ps, dq_stage):
    """dQ of each member out of PSUM into the block's staging tile, ONE ScalarE instruction per member and
    head-dim tile: times softmax_scale, rounded to the output dtype, in the member's last section; unscaled (to
    the fp32 scratch, or out_dq) before it."""
    scale = 1.0
    if blk.last:
        scale = c.scale
    for mi in range(len(grp.members)):
        col = grp.members[mi][2]
        for dt in range(len(c.qk_rows)):
            rn = c.qk_rows[dt][1]
            pc = (dt * c.group_size + mi) * PMAX
            _copy_on_scalar(c, dq_stage[dt][:, col:col + PMAX], dq_ps[0:rn, pc:pc + PMAX], scale)


def _dq_t_base(c):
    """First column of the transposed Q/K tiles in the group's dQ PSUM tile (they come last: only the partial
    tile, the last, is transposed); the SBUF copy of ``_evict_dq_transposed`` holds the columns from there on."""
    for dt in range(len(c.qk_rows)):
        if c.qk_t[dt]:
            return _dq_col(c, dt, 0)
    return _dq_width(c)


def _consecutive(grp):
    """True when the group's members sit in consecutive 128-column slots of their block's tiles."""
    ok = True
    for mi in range(len(grp.members)):
        if grp.members[mi][2] != grp.members[0][2] + mi * PMAX:
            ok = False
    return ok


def _evict_dq_transposed(c, grp, dq_ps, dq_stage, scale):
    """``_evict_dq`` with the streamed keys (``c.stream``), first part: per transposed Q/K head-dim tile ONE ScalarE
    copy of the group's ``[128 queries, rn]`` columns out of PSUM, times ``scale``, rounded to the staging dtype
    (the one rounding); an untransposed tile goes straight into the staging tile as in ``_evict_dq`` (one copy
    for the group when its members are consecutive). Returns the SBUF copy for ``_finish_dq_transposed``."""
    n = len(grp.members)
    base = _dq_t_base(c)
    sb = None
    if base < _dq_width(c):
        sb = nl.ndarray((PMAX, _dq_width(c) - base), dtype=dq_stage[0].dtype, buffer=nl.sbuf)
    for dt in range(len(c.qk_rows)):
        rn = c.qk_rows[dt][1]
        a = _dq_col(c, dt, 0)
        if c.qk_t[dt]:
            _copy_on_scalar(c, sb[:, a - base:a - base + n * rn], dq_ps[:, a:a + n * rn], scale)
        elif _consecutive(grp):
            col = grp.members[0][2]
            _copy_on_scalar(c, dq_stage[dt][:, col:col + n * PMAX], dq_ps[0:rn, a:a + n * PMAX], scale)
        else:
            for mi in range(n):
                col = grp.members[mi][2]
                pc = _dq_col(c, dt, mi)
                _copy_on_scalar(c, dq_stage[dt][:, col:col + PMAX], dq_ps[0:rn, pc:pc + PMAX], scale)
    return sb


def _finish_dq_transposed(c, grp, sb, dq_stage):
    """``_evict_dq``'s second part for the transposed dQ, ``DQ_T_LAG`` visits after the first: one TensorE
    transpose per member and transposed Q/K head-dim tile of the copy ``sb`` back to ``[rn, 128 queries]``
    (exact) into one PSUM tile, and one ScalarE copy per tile (per member when the members' block columns are not
    consecutive) into the block's staging tile."""
    if sb is None:
        return
    n = len(grp.members)
    tp = nl.ndarray((PMAX, len(c.qk_rows) * n * PMAX), dtype=sb.dtype, buffer=nl.psum)
    for dt in range(len(c.qk_rows)):
        rn = c.qk_rows[dt][1]
        if not c.qk_t[dt]:
            continue
        for mi in range(n):
            a = _dq_col(c, dt, mi) - _dq_t_base(c)
            t0 = (dt * n + mi) * PMAX
            nisa.nc_transpose(dst=tp[0:rn, t0:t0 + PMAX], data=sb[:, a:a + rn])
    consecutive = _consecutive(grp)
    for dt in range(len(c.qk_rows)):
        rn = c.qk_rows[dt][1]
        if not c.qk_t[dt]:
            continue
        if consecutive:
            col = grp.members[0][2]
            t0 = dt * n * PMAX
            _copy_on_scalar(c, dq_stage[dt][:, col:col + n * PMAX], tp[0:rn, t0:t0 + n * PMAX], 1.0)
        else:
            for mi in range(n):
                col = grp.members[mi][2]
                t0 = (dt * n + mi) * PMAX
                _copy_on_scalar(c, dq_stage[dt][:, col:col + PMAX], tp[0:rn, t0:t0 + PMAX], 1.0)


class _MemberData(nl.NKIObject):
    """One member's views for its visits: ``q`` / ``dy`` its Q and dO tiles (head dim on the partitions), ``qT`` /
    ``dyT`` their transposes (``_transpose_members``), ``rows`` its dropout row words (or None)."""

    def __init__(self, q, dy, qT, dyT, rows):
        self.q = q
        self.dy = dy
        self.qT = qT
        self.dyT = dyT
        self.rows = rows


class _SectionBufs(nl.NKIObject):
    """The buffers of one K/V section ``s`` (keys ``[k_lo, k_lo + k_len)``): ``ks`` / ``vs`` / ``kts`` K, V and
    K^T per head-dim tile (``_load_kv_section``), ``dk_acc`` / ``dv_acc`` the fp32 accumulators; ``written``: per
    128-key chunk, whether an eviction has written its accumulator columns yet (the first one overwrites, so the
    accumulators need no zeroing); ``loaded`` / ``kT_done``: per 512-key tile, whether its K, V and its K^T are
    there yet (the streamed keys' loads by key tile)."""

    def __init__(self, s, k_lo, k_len, ks, vs, kts, dk_acc, dv_acc):
        self.s = s
        self.k_lo = k_lo
        self.k_len = k_len
        self.ks = ks
        self.vs = vs
        self.kts = kts
        self.dk_acc = dk_acc
        self.dv_acc = dv_acc
        self.written = []
        for j in range(k_len // PMAX):
            self.written.append(False)
        # per 512-key tile, with the streamed keys (``_section_start``): K, V loaded; K^T formed
        self.loaded = []
        self.kT_done = []
        for t in range((k_len + K_TILE - 1) // K_TILE):
            self.loaded.append(False)
            self.kT_done.append(False)


class _BlockBufs(nl.NKIObject):
    """The buffers of one block: ``q`` / ``dy`` its Q and dO tiles, ``dq_stage`` the dQ staging, ``dq_prev`` the
    earlier sections' dQ partial sums (None in the members' first section), ``o`` its O tiles (the members' first
    section only, for D; else None)."""

    def __init__(self, q, dy, dq_stage, dq_prev, o=None):
        self.q = q
        self.dy = dy
        self.dq_stage = dq_stage
        self.dq_prev = dq_prev
        self.o = o
        # O * dO, formed before stage A by the streamed keys' pipeline (``_o_dy_products``), else None
        self.prods = None


def _block_load(c, hbm, item, blk):
    """Pipeline stage L of a block (its first visit, ``c.pipe_lead`` visits before stage A reaches it): the DMAs of
    dO, Q (and O in the members' first section, for D), the earlier sections' dQ partial sums, and the dQ
    staging tiles. Returns the block's ``_BlockBufs``."""
    b = item.b
    h_abs0 = item.kvh * c.group + blk.h0
    ncols = blk.nt * PMAX
    dy_b = _load_block(c, hbm.dy, b, blk, h_abs0, c.v_rows)
    q_b = _load_block(c, hbm.q, b, blk, h_abs0, c.qk_rows)
    o_b = None
    if blk.first:
        o_b = _load_block(c, hbm.o, b, blk, h_abs0, c.v_rows)
    to_scratch = c.dq_scratch and not blk.last
    dq_stage = []
    for rt in c.qk_rows:
        if to_scratch:
            dq_stage.append(nl.ndarray((rt[1], blk.nh * ncols), dtype=nl.float32, buffer=nl.sbuf))
        else:
            dq_stage.append(nl.ndarray((rt[1], blk.nh * ncols), dtype=c.mm_dtype, buffer=nl.sbuf))
    return _BlockBufs(q_b, dy_b, dq_stage, None, o_b)


def _load_dq_prev(c, hbm, item, blk):
    """The block's dQ partial sums from its members' earlier sections (unscaled): fp32 scratch (mixed precision)
    or out_dq itself, one DMA per head-dim tile."""
    b = item.b
    h_abs0 = item.kvh * c.group + blk.h0
    ncols = blk.nt * PMAX
    dq_prev = []
    for rt in c.qk_rows:
        r0, rn = rt
        if c.dq_scratch:
            t = nl.ndarray((rn, blk.nh * ncols), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=_hbm_block(hbm.dq_scratch, 0, blk.h0, blk.nh, r0, rn, blk.i0 * PMAX, ncols))
        else:
            t = nl.ndarray((rn, blk.nh * ncols), dtype=c.mm_dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=_hbm_block(hbm.dq, b, h_abs0, blk.nh, r0, rn, blk.i0 * PMAX, ncols))
        dq_prev.append(t)
    return dq_prev


def _parked(c, parked, blk, s):
    """True when the store of every member of ``blk`` (a block of section ``s``) from the member's previous
    section with a visible key has been emitted (``parked``: per member ``g * nq + i`` of the work item, the
    section of its last emitted dQ partial store, kept by ``_pipeline``)."""
    for i in range(blk.i0, blk.i0 + blk.nt):
        prev = -1
        for t in range(s):
            if c.tiles[t][i]:
                prev = t
        for h in range(blk.h0, blk.h0 + blk.nh):
            if parked[h * c.nq + i] != prev:
                return False
    return True


def _set_parked(c, parked, blk, s):
    for h in range(blk.h0, blk.h0 + blk.nh):
        for i in range(blk.i0, blk.i0 + blk.nt):
            parked[h * c.nq + i] = s


def _block_store(c, hbm, item, blk, bb):
    """After the block's last dQ eviction: one dQ store per head-dim tile (to out_dq in the members' last
    section, else unscaled to the fp32 scratch or out_dq)."""
    b = item.b
    h_abs0 = item.kvh * c.group + blk.h0
    ncols = blk.nt * PMAX
    to_scratch = c.dq_scratch and not blk.last
    for dt in range(len(c.qk_rows)):
        r0, rn = c.qk_rows[dt]
        if to_scratch:
            dst = _hbm_block(hbm.dq_scratch, 0, blk.h0, blk.nh, r0, rn, blk.i0 * PMAX, ncols)
        else:
            dst = _hbm_block(hbm.dq, b, h_abs0, blk.nh, r0, rn, blk.i0 * PMAX, ncols)
        nisa.dma_copy(dst=dst, src=bb.dq_stage[dt])


def _group_start(c, item, grp, bb):
    """Stage A of a group's first visit: Q^T, dO^T of its members (``_transpose_members``) and each member's
    views (``_MemberData``)."""
    tr = _transpose_members(c, grp, bb.q, bb.dy)
    mems = []
    for mi in range(len(grp.members)):
        g, i, col = grp.members[mi]
        # dropout row words of the member, once per group (keys below 65536; else per visit, _drop_keep)
        rows = None
        if c.dropout and c.seqlen_k <= 65536:
            rows = dropout_row_keys(item.seed, item.b, item.kvh * c.group + g, i * PMAX, PMAX, 0)
        q_m = []
        for t in bb.q:
            q_m.append(t[:, col:col + PMAX])
        dy_m = []
        for t in bb.dy:
            dy_m.append(t[:, col:col + PMAX])
        qT, dyT = tr[mi]
        mems.append(_MemberData(q_m, dy_m, qT, dyT, rows))
    return mems


def _key_tile_psum(c, kt):
    """The group's dV / dK PSUM tiles of one key tile (one bank per head-dim tile each)."""
    dv_ps = []
    for rt in c.v_rows:
        dv_ps.append(nl.ndarray((rt[1], kt.uw), dtype=nl.float32, buffer=nl.psum))
    dk_ps = []
    for rt in c.qk_rows:
        if c.qk_t[len(dk_ps)]:
            # transposed: [128 keys, rn] per 128-key chunk of the key tile, side by side
            dk_ps.append(nl.ndarray((PMAX, kt.uw // PMAX * rt[1]), dtype=nl.float32, buffer=nl.psum))
        else:
            dk_ps.append(nl.ndarray((rt[1], kt.uw), dtype=nl.float32, buffer=nl.psum))
    return dv_ps, dk_ps


def _dsinks(c, sinks_ref, out_dsinks, b, hk, neg_lse, dsum):
    """dsinks[b, h, n] = sum over query rows of dS_sink = -exp(sink_n - LSE) * D (a sink gets no dP: it has no
    value), for all the kv head's query heads at once: per (head, sink) ONE exp activation over every query row
    (exp(-LSE + sink): -LSE is the data, the sink logit the per-partition bias); then one multiply by D, one
    row sum with negation, one partition sum and one DMA for all of them."""
    ns, g_n = c.num_sinks, c.group
    width = g_n * ns
    sink_sb = nl.ndarray((PMAX, width), dtype=nl.float32, buffer=nl.sbuf)
    # the group's sink logits, broadcast to every partition (stride-0 partition pattern)
    nisa.dma_copy(dst=sink_sb, src=sinks_ref.ap(pattern=[[0, PMAX], [1, width]],
                                                offset=(b * c.nheads + hk * g_n) * ns))
    p_sink = nl.ndarray((PMAX, width, c.nq), dtype=nl.float32, buffer=nl.sbuf)
    for g in range(g_n):
        for n in range(ns):
            col = g * ns + n
            nisa.activation(dst=p_sink[:, col, :], op=nl.exp, data=neg_lse[:, g, :], bias=sink_sb[:, col:col + 1],
                            scale=1.0)
    prod = nl.ndarray((PMAX, width, c.nq), dtype=nl.float32, buffer=nl.sbuf)
    # D of head g for every sink n of it: a stride-0 view over the sinks
    d_bc = dsum.ap(pattern=[[g_n * c.nq, PMAX], [c.nq, g_n], [0, ns], [1, c.nq]], offset=0)
    nisa.tensor_tensor(dst=prod, data1=p_sink, data2=d_bc, op=nl.multiply)
    acc = nl.ndarray((PMAX, width), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=acc, op=nl.add, data=prod, axis=2, negate=True)
    red = nl.ndarray((1, width), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_partition_reduce(dst=red, op=nl.add, data=acc)
    if c.sinks_3d:
        nisa.dma_copy(dst=out_dsinks[b, hk * g_n:(hk + 1) * g_n, :], src=red)
    else:
        nisa.dma_copy(dst=out_dsinks[b, hk * g_n:(hk + 1) * g_n], src=red)


# ----------------------------------------------------------------------------------------------- driver
def _identity(c):
    """[128, 128] identity in the dtype of the parked dQ partial sums (fp32 scratch, or the input dtype of
    out_dq): the stationary operand of ``_reload_dq``. One memset and one GpSimdE affine_select (keep p == j)."""
    ident = nl.ndarray((PMAX, PMAX), dtype=c.dq_park_dtype, buffer=nl.sbuf)
    nisa.memset(dst=ident, value=1.0)
    nisa.affine_select(dst=ident, pattern=[[-1, PMAX]], channel_multiplier=1, on_true_tile=ident,
                       on_false_value=0.0, cmp_op=nl.equal, offset=0)
    return ident


def _section_start(c, hbm, item, s):
    """A K/V section ``s`` of a work item: load K, V and K^T (only when a query tile sees a key of it; with the
    streamed keys, ``c.stream``, only allocate them: ``_load_key_tile`` and ``_transpose_key_tile`` fill them by
    key tile), allocate the fp32 dK, dV accumulators (written by the evictions, ``_evict_dv_dk``). Returns its
    ``_SectionBufs``."""
    k_lo, k_len = c.sections[s]
    ks, vs, kts = None, None, None
    if c.streams[s] and c.stream:
        # the streamed keys load K, V by 512-key tile as the visits first need them (``_load_key_tile``)
        ks, vs, kts = [], [], []
        for rt in c.qk_rows:
            ks.append(nl.ndarray((rt[1], k_len), dtype=c.mm_dtype, buffer=nl.sbuf))
            kts.append(nl.ndarray((PMAX, k_len // PMAX * rt[1]), dtype=c.mm_dtype, buffer=nl.sbuf))
        for rt in c.v_rows:
            vs.append(nl.ndarray((rt[1], k_len), dtype=c.mm_dtype, buffer=nl.sbuf))
    elif c.streams[s]:
        ks, vs, kts = _load_kv_section(c, hbm.k, hbm.v, item.b, item.kvh, k_lo, k_len)
    dk_acc, dv_acc = [], []
    for rt in c.qk_rows:
        if c.qk_t[len(dk_acc)]:
            # transposed: [128 keys, rn] per 128-key chunk (fewer bytes than [rn, k_len])
            dk_acc.append(nl.ndarray((PMAX, k_len // PMAX * rt[1]), dtype=nl.float32, buffer=nl.sbuf))
        else:
            dk_acc.append(nl.ndarray((rt[1], k_len), dtype=nl.float32, buffer=nl.sbuf))
    for rt in c.v_rows:
        dv_acc.append(nl.ndarray((rt[1], k_len), dtype=nl.float32, buffer=nl.sbuf))
    return _SectionBufs(s, k_lo, k_len, ks, vs, kts, dk_acc, dv_acc)


def _load_key_tile(c, hbm, item, sec, t):
    """The streamed keys' section load, one 512-key tile ``t`` of section ``sec`` at a time: K and V of its
    keys (one DMA per head-dim tile), at the stage L of the first visit that needs them, so the first visits
    do not wait for the whole section to arrive."""
    x = t * K_TILE
    w = min(K_TILE, sec.k_len - x)
    k0 = sec.k_lo + x
    for dt in range(len(c.qk_rows)):
        r0, rn = c.qk_rows[dt]
        nisa.dma_copy(dst=sec.ks[dt][:, x:x + w], src=hbm.k[item.b, item.kvh, r0:r0 + rn, k0:k0 + w])
    for dt in range(len(c.v_rows)):
        r0, rn = c.v_rows[dt]
        nisa.dma_copy(dst=sec.vs[dt][:, x:x + w], src=hbm.v[item.b, item.kvh, r0:r0 + rn, k0:k0 + w])
    sec.loaded[t] = True


def _transpose_key_tile(c, sec, t):
    """K^T of 512-key tile ``t`` (``_load_kv_section``'s layout: chunk j at columns ``j * rn``), at the stage A of
    the first visit that needs it, ``c.pipe_lead`` visits after its load: TensorE transposes into one PSUM tile
    per Q/K head-dim tile, one VectorE copy each."""
    x = t * K_TILE
    n_ch = min(K_TILE, sec.k_len - x) // PMAX
    ch0 = x // PMAX
    for dt in range(len(c.qk_rows)):
        rn = c.qk_rows[dt][1]
        ps = nl.ndarray((PMAX, n_ch * rn), dtype=c.mm_dtype, buffer=nl.psum)
        for j in range(n_ch):
            ch = ch0 + j
            nisa.nc_transpose(dst=ps[:, j * rn:(j + 1) * rn], data=sec.ks[dt][:, ch * PMAX:(ch + 1) * PMAX])
        nisa.tensor_copy(dst=sec.kts[dt][:, ch0 * rn:(ch0 + n_ch) * rn], src=ps)
    sec.kT_done[t] = True


def _section_end(c, hbm, item, sec):
    """Write dK, dV of a section (cast on the DMA), zeroing first the key chunks no visit reached."""
    b = item.b
    hk = item.kvh
    if c.stream:
        # the written keys went out with their last eviction (``_store_keys``): zeros for the others
        for run in _runs(sec.written, 0, len(sec.written), False):
            _store_keys(c, hbm, item, sec, run[0], run[1], True)
        return
    for run in _runs(sec.written, 0, len(sec.written), False):
        j, e = run
        for t in sec.dk_acc:
            nisa.memset(dst=t[:, j * PMAX:e * PMAX], value=0.0, engine=nisa.engine.gpsimd)
        for t in sec.dv_acc:
            nisa.memset(dst=t[:, j * PMAX:e * PMAX], value=0.0, engine=nisa.engine.gpsimd)
    for dt in range(len(c.qk_rows)):
        r0, rn = c.qk_rows[dt]
        nisa.dma_copy(dst=hbm.dk[b, hk, r0:r0 + rn, sec.k_lo:sec.k_lo + sec.k_len], src=sec.dk_acc[dt])
    for dt in range(len(c.v_rows)):
        r0, rn = c.v_rows[dt]
        nisa.dma_copy(dst=hbm.dv[b, hk, r0:r0 + rn, sec.k_lo:sec.k_lo + sec.k_len], src=sec.dv_acc[dt])


def _store_keys(c, hbm, item, sec, x, y, zero):
    """Streamed keys (``c.stream``): store dK and dV of the section's 128-key chunks ``[x, y)`` (zeros when
    ``zero``: no visit reached them). dV and an untransposed dK tile go out of their accumulators as they are
    (cast on the DMA). A transposed dK tile, ``[128 keys, rn]`` per chunk, goes back to the HBM layout by TensorE transposes (float32, exact), 4 chunks per PSUM bank,
    each bank copied by ScalarE into a staging tile in the output dtype (the one rounding), one DMA per Q/K
    head-dim tile. A run of keys that one eviction completes lies in one key tile; a zero run (``_section_end``)
    may be longer and goes out of one zero tile of at most K_TILE keys."""
    b = item.b
    hk = item.kvh
    k0 = sec.k_lo + x * PMAX
    k1 = sec.k_lo + y * PMAX
    for dt in range(len(c.v_rows)):
        r0, rn = c.v_rows[dt]
        if zero:
            nisa.memset(dst=sec.dv_acc[dt][:, x * PMAX:y * PMAX], value=0.0, engine=nisa.engine.gpsimd)
        nisa.dma_copy(dst=hbm.dv[b, hk, r0:r0 + rn, k0:k1], src=sec.dv_acc[dt][:, x * PMAX:y * PMAX])
    per = K_TILE // PMAX
    for dt in range(len(c.qk_rows)):
        r0, rn = c.qk_rows[dt]
        if not c.qk_t[dt]:
            # an untransposed tile goes out of its accumulator as dV does
            if zero:
                nisa.memset(dst=sec.dk_acc[dt][:, x * PMAX:y * PMAX], value=0.0, engine=nisa.engine.gpsimd)
            nisa.dma_copy(dst=hbm.dk[b, hk, r0:r0 + rn, k0:k1], src=sec.dk_acc[dt][:, x * PMAX:y * PMAX])
            continue
        if zero:
            # one zero tile of at most K_TILE keys, stored as often as the run needs
            zt = nl.ndarray((rn, min(y - x, per) * PMAX), dtype=c.mm_dtype, buffer=nl.sbuf)
            nisa.memset(dst=zt, value=0.0, engine=nisa.engine.gpsimd)
            for g0 in range(x, y, per):
                gn = min(per, y - g0)
                kz = sec.k_lo + g0 * PMAX
                nisa.dma_copy(dst=hbm.dk[b, hk, r0:r0 + rn, kz:kz + gn * PMAX], src=zt[:, 0:gn * PMAX])
            continue
        stage = nl.ndarray((rn, (y - x) * PMAX), dtype=c.mm_dtype, buffer=nl.sbuf)
        for g0 in range(x, y, per):
            gn = min(per, y - g0)
            tp = nl.ndarray((PMAX, gn * PMAX), dtype=nl.float32, buffer=nl.psum)
            for j in range(gn):
                ch = g0 + j
                nisa.nc_transpose(dst=tp[0:rn, j * PMAX:(j + 1) * PMAX], data=sec.dk_acc[dt][:, ch * rn:(ch + 1) * rn])
            _copy_on_scalar(c, stage[:, (g0 - x) * PMAX:(g0 - x + gn) * PMAX], tp[0:rn, :], 1.0)
        nisa.dma_copy(dst=hbm.dk[b, hk, r0:r0 + rn, k0:k1], src=stage)


class _Segment(nl.NKIObject):
    """Pipeline state of one (work item, section) with visits: ``item`` (``steps.Item``), ``sec``
    (``_SectionBufs``), and per block / group / visit what flows between the stages."""

    def __init__(self, c, item, s):
        self.item = item
        self.s = s
        self.sec = None
        self.bbs = []
        for blk in c.blocks[s]:
            self.bbs.append(None)
        self.mems = []
        self.dqs = []
        for gf in range(c.stream_groups[s]):
            self.mems.append(None)
            self.dqs.append(None)
        self.p_mm = []
        self.ds = []
        self.dsT = []
        for j in range(len(c.streams[s])):
            self.p_mm.append(None)
            self.ds.append(None)
            self.dsT.append(None)


class _VisitAt(nl.NKIObject):
    """Visit ``j`` of ``_pipeline``'s flat order, looked up once for whichever stage (L, A, B, D) handles it: its
    segment (``seg``), position in the section's stream (``jj``), work item (``w``), whether it is the item's
    first / last visit, and its plan entries (``st``: ``BwdStep``; ``blk``, ``grp``, ``kt``: the block, group and
    key tile; ``v``: the ``BwdVisit``)."""

    def __init__(self, c, segs, order, j):
        si, jj, w, item_first, item_last = order[j]
        self.seg = segs[si]
        self.jj = jj
        self.w = w
        self.item_first = item_first
        self.item_last = item_last
        self.st = c.streams[self.seg.s][jj]
        self.blk = c.blocks[self.seg.s][self.st.bi]
        self.grp = self.blk.groups[self.st.gi]
        self.kt = self.grp.ktiles[self.st.ki]
        self.v = self.kt.visits[self.st.vi]


def _pipeline(c, hbm, steps, start, end, bounds, seed, ones, ident):
    """Every visit of the work items ``[start, end)``, their sections in order, as ONE software pipeline over the
    flat plans (``c.streams``: blocks, groups, key tiles, members). Each engine runs its instructions in program
    order, so a visit's chain across engines (S on TensorE, the exp on ScalarE, the cast, dS on VectorE, back to
    TensorE for dV, dK and the dS transposes, ScalarE for the dS^T copy, TensorE for dQ) would leave TensorE
    waiting at every hop. Iteration u emits, in this order:

    - stage L of visit u: a work item's first visit starts the item (``_item_start``), a section's first visit
      loads K, V, K^T (``_section_start``), a block's first visit issues the block's loads (``_block_load``):
      ``c.pipe_lead`` visits before their stage A, so DMA latency and the K^T transposes are hidden, also across
      sections and work items (the next one fills while the last one drains). A block of a later section loads
      its dQ partial sums (``_load_dq_prev``) at the first of its stages L, A, D at which the earlier section's
      store of every member has been emitted (``parked``, ``_parked``: the kernel reads them back from HBM);
    - stage A of visit u - lead: a block's first visit computes D (``_rowsum_o_dy``), a group's first visit its
      Q^T, dO^T (``_group_start``); then S, P, the cast, dP and dS (``_visit_a``);
    - stage B of visit u - lead - ``c.pipe_lag_b``: a key tile's first visit allocates its dV / dK PSUM tiles;
      the dV, dK matmuls (``_dv_dk``) and the dS transpose (``_transpose_ds``); a key tile's last visit adds dV,
      dK into the section accumulators (``_evict_dv_dk``); a section's last visit writes them (``_section_end``);
    - stage D of visit u - lead - ``c.pipe_lag_d``: a group's first visit allocates its dQ PSUM tile (and reloads
      the earlier sections' partial sums, ``_reload_dq``); the dQ matmuls (``_dq``); a group's last visit evicts
      dQ (``_evict_dq``); a block's last visit stores it (``_block_store``); a work item's last visit computes
      its dsinks (``_dsinks``).

    So TensorE's stream is S, dP of one visit, dV, dK, dS^T of a visit ``pipe_lag_b`` earlier, dQ of one
    ``pipe_lag_d`` earlier: the other engines' work for a visit has that many visits of TensorE work to finish
    in. With all three at 0 the order is the plain visit-by-visit one. The buffers of a visit live from its stage
    A to its stage D (``sbuf_usage`` counts them).

    With the streamed keys (``c.stream``, ``streamed_keys``): stage L loads K and V by 512-key tile for
    the first visit that needs it (``_load_key_tile``, after the block's loads) and stage A forms its K^T
    (``_transpose_key_tile``) instead of the whole section at its start; a block's O * dO is formed
    ``D_PRODUCT_LAG`` visits after its loads (``_o_dy_products``); a group's dQ leaves PSUM in stage D
    (``_evict_dq_transposed``) and is transposed back and stored ``DQ_T_LAG`` visits later
    (``_finish_pending``); the keys a key tile's eviction completes are transposed back and stored, with their
    dV, ``KEY_STORE_LAG`` visits later (``_store_keys``), the section's end only zeroing the keys no visit
    reached. Each delay keeps TensorE from waiting on the engine that produced the operand it reads."""
    secs_used = []
    for s in range(c.n_sections):
        if c.streams[s]:
            secs_used.append(s)
    if not secs_used:
        # no query tile sees any key: zero gradients (and dsinks from D = 0)
        for w in range(start, end):
            item = _item_start(c, hbm, steps, w, bounds, seed, ones, ident)
            if c.num_sinks:
                _dsinks(c, hbm.sinks, hbm.dsinks, item.b, item.kvh, item.neg_lse, item.dsum)
            for f in steps.item_end:
                f(c, hbm, item)
        return
    segs = []
    order = []
    for w in range(start, end):
        for s in secs_used:
            si = len(segs)
            segs.append(_Segment(c, None, s))
            for j in range(len(c.streams[s])):
                order.append((si, j, w, s == secs_used[0] and j == 0,
                              s == secs_used[len(secs_used) - 1] and j == len(c.streams[s]) - 1))
    n = len(order)
    parked = []
    for w in range(start, end):
        row = []
        for m in range(c.group * c.nq):
            row.append(-1)
        parked.append(row)
    lead = c.pipe_lead
    lag_b = c.pipe_lag_b
    lag_d = c.pipe_lag_d
    item = None
    dv_ps = None
    dk_ps = None
    # streamed keys (``c.stream``): groups whose dQ copy is out of PSUM, waiting for their transposes and store:
    # [due iteration, group, SBUF copy, staging tiles, (segment, block, block buffers, work item) to store or None]
    pending = []
    pi = 0
    # streamed keys (``c.stream``): key runs to store (``_store_keys``), or a section's end (run -1, -1):
    # [due iteration, work item, section buffers, first chunk, end chunk]
    kpending = []
    kpi = 0
    tail = 0
    if c.stream:
        tail = max(DQ_T_LAG, KEY_STORE_LAG)
    for u in range(n + lead + lag_d + tail):
        if u < n:
            at = _VisitAt(c, segs, order, u)
            seg = at.seg
            st = at.st
            if at.item_first:
                item = _item_start(c, hbm, steps, at.w, bounds, seed, ones, ident)
            if at.jj == 0:
                seg.item = item
                seg.sec = _section_start(c, hbm, item, seg.s)
            if st.blk_first:
                seg.bbs[st.bi] = _block_load(c, hbm, item, at.blk)
                if not at.blk.first and _parked(c, parked[at.w - start], at.blk, seg.s):
                    seg.bbs[st.bi].dq_prev = _load_dq_prev(c, hbm, item, at.blk)
            # (after the block's loads: D and the group's transposes need them before S needs K)
            if c.stream and not seg.sec.loaded[(at.v.k0 - seg.sec.k_lo) // K_TILE]:
                _load_key_tile(c, hbm, item, seg.sec, (at.v.k0 - seg.sec.k_lo) // K_TILE)
        j = u - D_PRODUCT_LAG
        if c.stream and lead > D_PRODUCT_LAG and j >= 0 and j < n:
            at = _VisitAt(c, segs, order, j)
            if at.st.blk_first and at.blk.first:
                bb = at.seg.bbs[at.st.bi]
                bb.prods = _o_dy_products(c, at.blk, bb.o, bb.dy)
                bb.o = None
        j = u - lead
        if j >= 0 and j < n:
            at = _VisitAt(c, segs, order, j)
            seg = at.seg
            st = at.st
            blk = at.blk
            jj = at.jj
            bb = seg.bbs[st.bi]
            if st.blk_first and blk.first:
                _rowsum_o_dy(c, blk, bb.o, bb.dy, seg.item.ones, seg.item.dsum, bb.prods)
                bb.o = None
                bb.prods = None
            if st.blk_first and not blk.first and bb.dq_prev is None and \
                    _parked(c, parked[at.w - start], blk, seg.s):
                bb.dq_prev = _load_dq_prev(c, hbm, seg.item, blk)
            if st.grp_first:
                seg.mems[st.gf] = _group_start(c, seg.item, at.grp, bb)
            v = at.v
            if c.stream and not seg.sec.kT_done[(v.k0 - seg.sec.k_lo) // K_TILE]:
                _transpose_key_tile(c, seg.sec, (v.k0 - seg.sec.k_lo) // K_TILE)
            p_mm, ds = _visit_a(c, seg.item, steps, seg.sec, at.grp, seg.mems[st.gf][v.m], v)
            seg.p_mm[jj] = p_mm
            seg.ds[jj] = ds
        j = u - lead - lag_b
        if j >= 0 and j < n:
            at = _VisitAt(c, segs, order, j)
            seg = at.seg
            st = at.st
            jj = at.jj
            kt = at.kt
            v = at.v
            mem = seg.mems[st.gf][v.m]
            if st.kt_first:
                dv_ps, dk_ps = _key_tile_psum(c, kt)
            _dv_dk(c, v, mem.dyT, mem.qT, seg.p_mm[jj], seg.ds[jj], dv_ps, dk_ps)
            seg.dsT[jj] = _transpose_ds(c, v, seg.ds[jj])
            seg.p_mm[jj] = None
            seg.ds[jj] = None
            if st.kt_last:
                _evict_dv_dk(c, kt, seg.sec, dv_ps, dk_ps)
                if c.stream:
                    for run in c.key_stores[seg.s][jj]:
                        kpending.append((u + KEY_STORE_LAG, seg.item, seg.sec, run[0], run[1]))
                # release this key tile's dV / dK banks before the next one allocates its own: with two head-dim
                # tiles (d_head > 128) two generations of them would not fit the 8 PSUM banks next to S, dP, dQ
                dv_ps = None
                dk_ps = None
            if jj == len(c.streams[seg.s]) - 1:
                if c.stream:
                    # (the section's key stores still waiting are emitted at their time, below)
                    kpending.append((u + KEY_STORE_LAG, seg.item, seg.sec, -1, -1))
                else:
                    _section_end(c, hbm, seg.item, seg.sec)
        j = u - lead - lag_d
        if j >= 0 and j < n:
            at = _VisitAt(c, segs, order, j)
            seg = at.seg
            st = at.st
            jj = at.jj
            blk = at.blk
            grp = at.grp
            v = at.v
            bb = seg.bbs[st.bi]
            if st.grp_first and not blk.first and bb.dq_prev is None:
                # (the earlier sections' stores precede this one in stage D's order; with the transposed dQ,
                # the stores still waiting for their transposes are emitted first)
                pi = _finish_pending(c, hbm, pending, pi, -1, parked, start)
                bb.dq_prev = _load_dq_prev(c, hbm, seg.item, blk)
            if st.grp_first:
                seg.dqs[st.gf] = nl.ndarray((PMAX, _dq_width(c)), dtype=nl.float32, buffer=nl.psum)
                if not blk.first:
                    _reload_dq(c, grp, seg.dqs[st.gf], bb.dq_prev, seg.item.ident)
            _dq(c, v, seg.dsT[jj], seg.sec.kts, v.k0 - seg.sec.k_lo, seg.dqs[st.gf], blk.first)
            seg.dsT[jj] = None
            if st.grp_last and c.stream:
                scale = 1.0
                if blk.last:
                    scale = c.scale
                sb = _evict_dq_transposed(c, grp, seg.dqs[st.gf], bb.dq_stage, scale)
                store = None
                if st.blk_last:
                    # only the staging tiles wait for the store: the block's other tiles are released now
                    bb.q = None
                    bb.dy = None
                    bb.dq_prev = None
                    store = (seg, blk, bb, at.w)
                pending.append((u + DQ_T_LAG, grp, sb, bb.dq_stage, store))
                seg.dqs[st.gf] = None
                seg.mems[st.gf] = None
            elif st.grp_last:
                _evict_dq(c, grp, blk, seg.dqs[st.gf], bb.dq_stage)
                seg.dqs[st.gf] = None
                seg.mems[st.gf] = None
            if st.blk_last and not c.stream:
                _block_store(c, hbm, seg.item, blk, bb)
                if not blk.last:
                    _set_parked(c, parked[at.w - start], blk, seg.s)
            if st.blk_last:
                seg.bbs[st.bi] = None
            if jj == len(c.streams[seg.s]) - 1:
                seg.sec = None
            if at.item_last:
                if c.num_sinks:
                    _dsinks(c, hbm.sinks, hbm.dsinks, seg.item.b, seg.item.kvh, seg.item.neg_lse, seg.item.dsum)
                for f in steps.item_end:
                    f(c, hbm, seg.item)
        due = u
        if u == n + lead + lag_d + tail - 1:
            due = -1
        pi = _finish_pending(c, hbm, pending, pi, due, parked, start)
        while kpi < len(kpending) and (due < 0 or kpending[kpi][0] <= due):
            kit, ksec, kx, ky = kpending[kpi][1], kpending[kpi][2], kpending[kpi][3], kpending[kpi][4]
            kpending[kpi] = None
            kpi += 1
            if kx < 0:
                _section_end(c, hbm, kit, ksec)
            else:
                _store_keys(c, hbm, kit, ksec, kx, ky, False)


def _finish_pending(c, hbm, pending, pi, due, parked, start):
    """Streamed keys (``c.stream``): finish the groups of ``pending[pi:]`` (``_pipeline``'s list) due at iteration
    ``due`` or before (all of them with ``due`` < 0): their transposes back to the HBM layout
    (``_finish_dq_transposed``), then the store of a block whose last group it was (``_block_store``, marked
    parked for a later section's reload). Returns the index of the first group left waiting."""
    while pi < len(pending) and (due < 0 or pending[pi][0] <= due):
        entry = pending[pi]
        pending[pi] = None
        pi += 1
        _finish_dq_transposed(c, entry[1], entry[2], entry[3])
        store = entry[4]
        if store is not None:
            sseg, sblk, sbb, sw = store
            _block_store(c, hbm, sseg.item, sblk, sbb)
            if not sblk.last:
                _set_parked(c, parked[sw - start], sblk, sseg.s)
    return pi


def _item_start(c, hbm, steps, w, bounds, seed, ones, ident):
    """Start work item ``w`` (batch ``w // nheads_kv``, kv head ``w % nheads_kv``): the ``item_open`` steps
    (ALiBi's coefficients), -LSE of every member, the D tile, the ``item_start`` steps (the score modifications'
    per-head operands and zero fills), zero dQ for query tiles that see no key, and zero dK / dV for the sections
    no query tile reaches. Returns its ``steps.Item``."""
    b = w // c.nheads_kv
    hk = w % c.nheads_kv
    item = Item(b, hk, seed=seed, bounds=bounds, ones=ones, ident=ident)
    for f in steps.item_open:
        f(c, hbm, item)
    item.neg_lse = _load_neg_lse(c, hbm.lse, b, hk)
    dsum = nl.ndarray((PMAX, c.group, c.nq), dtype=nl.float32, buffer=nl.sbuf)  # D, same layout as -LSE
    item.dsum = dsum
    for f in steps.item_start:
        f(c, hbm, item)
    if c.no_key_tiles:
        # query tiles that see no key: D = 0 (their O is 0), dQ = 0
        nisa.memset(dst=dsum, value=0.0)
        zero = nl.ndarray((PMAX, PMAX), dtype=c.mm_dtype, buffer=nl.sbuf)
        nisa.memset(dst=zero, value=0.0)
        for g in range(c.group):
            for i in c.no_key_tiles:
                for rt in c.qk_rows:
                    r0, rn = rt
                    nisa.dma_copy(dst=hbm.dq[b, hk * c.group + g, r0:r0 + rn, i * PMAX:(i + 1) * PMAX],
                                  src=zero[0:rn, :])
    for s in range(c.n_sections):
        if not c.streams[s]:
            _section_end(c, hbm, item, _section_start(c, hbm, item, s))
    return item


@nki.jit
def attention_bwd(q_ref, k_ref, v_ref, o_ref, dy_ref, lse_ref, sinks_ref=None, bound_min=None, bound_max=None,
                  use_causal_mask=False, mixed_precision=False, softmax_scale=None, sliding_window=None,
                  softcap=0.0, alibi_slopes=None, window_size=None, dropout_p=0.0, dropout_seed=None,
                  k_section_len=None, group_max=None, block_members_max=None, p_cast_on_gpsimd=None,
                  ds_dma_transpose=None, attn_bias=None, bias_grad=False, block_mask=None, block_bits=None,
                  logit_scale=None, ds_dma_every=None, pipe_lead=None, pipe_lag_b=None, pipe_lag_d=None,
                  d_from_o=False, qk_transposed=None, stream_keys=None):
    """Flash-attention backward: ``(dq, dk, dv)`` or ``(dq, dk, dv, dsinks)``, then ``dbias`` when
    ``bias_grad``, then ``dlogit_scale`` (float32 ``[bs, nheads]``, per batch row) with a logit scale (float32
    ``[bs, nheads]``, as in ``attention_fwd``). See the module docstring.

    The additive bias ``attn_bias`` (as in ``attention_fwd``: ``[bb, hb, sqb, skb]``, each dim 1 or the call's
    size, float32 / bfloat16 / float16) is added to the recomputed scores; with ``bias_grad=True`` (trace-time)
    the kernel also returns ``dbias`` float32 ``[bs, nheads, seqlen_q, seqlen_k]``, the gradient of the logits
    (dS before the scale and the cap's chain rule), zero where no key is visible; the caller sums it over the
    bias's broadcast dims. Without ``bias_grad`` no dbias instruction is emitted.

    Tuning keywords (trace-time; None = the default; the modeled time changes, the gradients only by float32
    summation order; docs/kernel-bwd.md, "Tuning keywords"):

    - ``k_section_len``: keys per K/V section, a multiple of 128 (default: the largest multiple of 512 that fits
      the SBUF section budget, at most ``K_SECTION_MAX``);
    - ``group_max``: members per group for a head dim of one partition tile (``GROUP_MAX``, 4; halved per extra
      head-dim tile), whose dV, dK and dQ partial sums stay in PSUM together;
    - ``block_members_max``: members per block at most (``BLOCK_MEMBERS_MAX``, 8), loaded with one DMA per tensor;
    - ``p_cast_on_gpsimd``: the fp32 -> matmul-dtype cast of P on GpSimdE (True, ``P_CAST_ON_GPSIMD``) or ScalarE,
      from trn2 on;
    - ``ds_dma_transpose``: allow dS transposes by DMA where the plan finds they pay (``DS_DMA_TRANSPOSE``, False:
      every dS transpose on TensorE);
    - ``ds_dma_every``: with DMA transposes allowed, every n-th whole 512-key tile takes the DMA path
      (``DS_DMA_EVERY``, 1: all of them);
    - ``pipe_lead``, ``pipe_lag_b``, ``pipe_lag_d``: the software pipeline of the visits (``_pipeline``): block
      loads ``pipe_lead`` visits ahead (``PIPE_LEAD``, 4), dV/dK matmuls and dS transposes ``pipe_lag_b`` visits
      (``PIPE_LAG_B``, 2) and dQ matmuls ``pipe_lag_d`` visits (``PIPE_LAG_D``, 4) behind S / dP / dS; all 0: the
      visit-by-visit order;
    - ``stream_keys``: the streamed keys (K/V loaded by key tile as first needed, dK/dV stored by key as they
      complete, D's product ahead of its block, dQ out of PSUM in two parts) (default: the rule
      ``streamed_keys``, on for every launch; True / False force it);
    - ``qk_transposed``: dQ and dK of the partial Q/K head-dim tile accumulated transposed, with the streamed keys
      (default: the rule ``transposed_qk_grads``, on where it streams fewer TensorE columns, a query tile's band
      spans more than two 128-key chunks and its buffers fit SBUF; True / False force it; True needs the
      streamed keys).

    ``block_mask`` / ``block_bits``: a block mask, as in ``attention_fwd`` (sections end on 512-key tiles).

    ``d_from_o`` (trace-time bool): False (the default) when ``o_ref`` / ``lse_ref`` are the forward's over
    exactly this call's keys; then rows whose keys all fit one 128-key chunk take D = sum_j P dP from their own
    visit, which is exact where rowsum(o * dO) carries o's rounding (``_row_dsum``). True when they come from a
    larger problem (a block of ring attention: the global o and LSE, part of the keys): D is rowsum(o * dO) for
    every row, the only D such a call can know.

    Invalid arguments fail the kernel's assert with the message of ``bwd_problem``;
    ``nki_attn.kernel_api.attention_bwd`` raises it as ``ValueError`` instead."""
    # the score modifications' arguments, by kernel keyword: everything else about them is read from their
    # ``score_mods.SCORE_MODS`` rows (a new modification adds its keyword above and its entry here)
    mods = {"softcap": softcap, "alibi_slopes": alibi_slopes, "attn_bias": attn_bias, "bias_grad": bias_grad,
            "logit_scale": logit_scale}
    problem = _bwd_problem(q_ref, k_ref, v_ref, o_ref, dy_ref, lse_ref, sinks_ref, bound_min, bound_max,
                           use_causal_mask, mixed_precision, softmax_scale, sliding_window, window_size, dropout_p,
                           dropout_seed, k_section_len, group_max, block_members_max, p_cast_on_gpsimd,
                           ds_dma_transpose, block_mask, block_bits, ds_dma_every, pipe_lead, pipe_lag_b, pipe_lag_d,
                           d_from_o, mods, qk_transposed, stream_keys)
    assert problem is None, problem
    if block_mask is not None and pipe_lag_b is None and pipe_lag_d is None:
        lags = _narrow_visit_lags(block_mask[2])
        if lags is not None and _bwd_problem(q_ref, k_ref, v_ref, o_ref, dy_ref, lse_ref, sinks_ref, bound_min,
                                             bound_max, use_causal_mask, mixed_precision, softmax_scale,
                                             sliding_window, window_size, dropout_p, dropout_seed, k_section_len,
                                             group_max, block_members_max, p_cast_on_gpsimd, ds_dma_transpose,
                                             block_mask, block_bits, ds_dma_every, pipe_lead, lags[0], lags[1],
                                             d_from_o, mods, qk_transposed, stream_keys) is None:
            pipe_lag_b = lags[0]
            pipe_lag_d = lags[1]
    c = _configure(q_ref, k_ref, sinks_ref, bound_min, use_causal_mask, mixed_precision, softmax_scale,
                   sliding_window, k_section_len, v_ref, window_size, dropout_p, group_max, block_members_max,
                   p_cast_on_gpsimd, ds_dma_transpose, block_mask, ds_dma_every, pipe_lead, pipe_lag_b, pipe_lag_d,
                   d_from_o, mods, qk_transposed, stream_keys)
    if c.block_mask is not None and c.block_mask.n_slots > 0:
        c.block_mask.bits = block_bits
        c.block_mask.bitsel = block_bitsel()
    steps = _select_steps(c)
    out_dq = nl.ndarray(q_ref.shape, dtype=q_ref.dtype, buffer=nl.shared_hbm)
    out_dk = nl.ndarray(k_ref.shape, dtype=k_ref.dtype, buffer=nl.shared_hbm)
    out_dv = nl.ndarray(v_ref.shape, dtype=v_ref.dtype, buffer=nl.shared_hbm)
    out_dsinks = None
    if c.num_sinks:
        out_dsinks = nl.ndarray(sinks_ref.shape, dtype=nl.float32, buffer=nl.shared_hbm)
    # the score modifications' gradient outputs, in table order (``ScoreMod.grad_out``)
    outs = [out_dq, out_dk, out_dv]
    if c.num_sinks:
        outs.append(out_dsinks)
    grads = {}
    for m in c.active:
        if m.grad_out is not None and m.grad_on(mods):
            grads[m.name] = m.grad_out(c, mods)
            outs.append(grads[m.name])
    dq_scratch = None
    if c.dq_scratch:
        dq_scratch = nl.ndarray((1, c.group, c.d_qk, c.seqlen_q), dtype=nl.float32, buffer=nl.private_hbm)
    hbm = Hbm(q_ref, k_ref, v_ref, o=o_ref, dy=dy_ref, lse=lse_ref, sinks=sinks_ref, dq=out_dq, dk=out_dk,
              dv=out_dv, dsinks=out_dsinks, dq_scratch=dq_scratch, mods=mods, grads=grads)
    seed = None
    if c.dropout:
        seed = load_dropout_seed(dropout_seed)
    start, end = spmd_items(c.bs * c.nheads_kv)

    bounds = None
    if c.packing:
        bounds = _load_bounds(c, bound_min, bound_max)
    # the ones column of the D matmul (sums the head dim over the partitions)
    ones = nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0)
    ident = None
    if c.n_sections > 1:
        ident = _identity(c)
    _pipeline(c, hbm, steps, start, end, bounds, seed, ones, ident)
    return tuple(outs)
