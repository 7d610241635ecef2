"""Flash-attention backward pass (training) for Trainium, in NKI.

``attention_bwd(q_ref, k_ref, v_ref, o_ref, dy_ref, lse_ref, sinks_ref=None, bound_min=None, bound_max=None,
use_causal_mask=False, mixed_precision=False, softmax_scale=None, sliding_window=None, k_section_len=None)``
returns ``(dq, dk, dv)`` or, with sinks, ``(dq, dk, dv, dsinks)``: the layouts and semantics of
``golden.attention_bwd_torch.attention_bwd_torch_ref`` (see docs/semantics.md). docs/kernel-bwd.md explains the
design; each step below is named there after the function that implements it. Kernel code stays in NKI's
compile-time subset (checked by the simulator's frontend check): invalid arguments fail an ``assert`` on
``bwd_problem``'s message; ``nki_attn.kernel_api.attention_bwd`` raises it as ``ValueError`` before launching.

Layouts (head_dim on the partition axis in HBM): q, o, dy, dq ``[bs, nheads, d_head, seqlen_q]``; k, v, dk, dv
``[bs, nheads_kv, d_head, seqlen_k]``; lse float32 ``[bs, nheads, 128, seqlen_q // 128]`` (``lse[b, h, p, t]`` is
the log-sum-exp of query row ``t * 128 + p``, ``+inf`` for a row that sees no key); dsinks float32 shaped like
sinks.

The FlashAttention-2 recipe, per (batch, kv head) work item:

    for each K/V section (<= K_SECTION_MAX keys so SBUF holds it, or k_section_len)  KV-outer
        load K, V (+ K^T for dQ); zero the fp32 dK, dV section accumulators
        for each query head of the kv head (GQA/MQA), for each 128-row query tile   Q-inner
            first section only: D = rowsum(O * dO)                              _rowsum_o_dy
            reload dQ (from HBM) unless this is the tile's first section
            for each 512-key tile the masks leave visible (decided at trace time)
                S = (scale*Q)^T K;  mask;  P = exp(S - LSE)   (ONE activation)  _recompute_p
                dP = dO V^T;  dS = (dP - D) * P               (ONE fused op)   _softmax_bwd
                dV += P^T dO;  dK += (scale*Q)^T dS                             _dv_dk
                dQ += (dS K) * scale                          (ONE fused op)   _dq
            write dQ to HBM
        write dK, dV of the section
        first section only, with sinks: dsinks = -sum_rows exp(sink - LSE) * D   _dsinks
"""

from ..backend import nisa, nki, nl
from .tiling import tile_fully_visible, tile_visible
from .validation import PMAX, attention_problem, attention_shape, sbuf_bytes_per_partition

FP32_MIN = -3.4028235e38

# Key tile width: S, dP, dV, dK of one (query tile, key tile) pair are each one 2 KiB PSUM bank
# (512 fp32) and 512 is the matmul's moving free-size limit on trn1/trn2.
K_TILE = 512
# Longest K/V section. The section length is the largest multiple of K_TILE whose section buffers fit
# SECTION_BUDGET_BYTES per partition, capped by K_SECTION_MAX; the kernel argument k_section_len (a multiple of
# 128) overrides it per call (tests use it to force several sections at small seqlen). Both are constants:
# a kernel must be a pure function of its arguments (NKI caches compiled kernels by argument).
K_SECTION_MAX = 8192
SECTION_BUDGET_BYTES = 112 * 1024


def _itemsize(dtype):
    """Bytes per element of the kernel's input dtypes (float32, bfloat16, float16)."""
    if str(dtype) == str(nl.float32):
        return 4
    return 2


# ----------------------------------------------------------------------------------------------- planning
def section_bytes_per_key(d_head, d_tiles, itemsize):
    """SBUF bytes per partition that one key of a K/V section costs: K and V (input dtype, d_tiles tiles),
    K^T (128 keys per partition row, d_head wide) and the fp32 dK, dV accumulators."""
    return 2 * d_tiles * itemsize + d_head * itemsize / PMAX + 2 * d_tiles * 4


def default_section_len(d_head, d_tiles, itemsize, seqlen_k, cap=K_SECTION_MAX):
    """Keys per K/V section: the largest multiple of K_TILE within SECTION_BUDGET_BYTES, at most ``cap``
    (default K_SECTION_MAX) and seqlen_k, rounded down to a multiple of 128."""
    fit = int(SECTION_BUDGET_BYTES // section_bytes_per_key(d_head, d_tiles, itemsize)) // K_TILE * K_TILE
    n = min(min(cap, fit), seqlen_k) // PMAX * PMAX  # (NKI's min takes two values)
    return max(n, PMAX)


def sbuf_usage(d_head, d_tiles, itemsize, section_len, group, seqlen_q, mixed_precision=False, packing=False,
               num_sinks=0, trn1_packing=False):
    """SBUF bytes per partition of the kernel's live tensors, by category. The per-tile working set is counted
    twice in ``total`` (room for the compiler to double-buffer tiles allocated inside loops). Used by the
    trace-time budget check and docs/kernel-bwd.md."""
    e = itemsize
    d_tile = d_head // d_tiles
    nq = seqlen_q // PMAX
    pe = 4 if mixed_precision else e
    section = int(section_len * section_bytes_per_key(d_head, d_tiles, itemsize))
    persistent = 2 * group * nq * 4                        # -LSE and D of every query row of the kv head
    if packing:
        persistent += 3 * nq * 4                           # bound_min, bound_max (+ query index for clamping)
    if num_sinks:
        persistent += 2 * group * num_sinks * 4 + group * num_sinks * 4   # sink logits, accumulator, sum
    per_q_tile = (d_tiles * PMAX * e * 3                   # dO, raw Q, scaled Q   (d_tile partitions each)
                  + 2 * d_head * e                         # dO^T, Q^T             (128 partitions)
                  + d_tiles * PMAX * e + d_head * 4        # O and the O*dO^T product (first section only)
                  + d_tiles * PMAX * 4)                    # fp32 dQ accumulator
    per_k_tile = (K_TILE * 4                               # masked S (fp32)
                  + K_TILE * pe                            # P
                  + (K_TILE * e if pe != e else 0)         # P cast for the dV matmul (mixed precision)
                  + 2 * K_TILE * e                         # dS, dS^T
                  + (K_TILE * 5 if trn1_packing else 0))   # key index (fp32) and visibility (uint8)
    total = section + persistent + 2 * (per_q_tile + per_k_tile)
    return {"section": section, "persistent": persistent, "per_q_tile": per_q_tile, "per_k_tile": per_k_tile,
            "total": total, "d_tile": d_tile}


# PSUM tiles of the kernel (each <= 2 KiB per partition, so one bank each) and which are live at once.
PSUM_TILES = {
    "S": "S = (scale*Q)^T K, [128, 512] fp32",
    "dP": "dP = dO V^T, [128, 512] fp32",
    "dV": "P^T dO for one d tile, [d_tile, 512] fp32",
    "dK": "(scale*Q)^T dS for one d tile, [d_tile, 512] fp32",
    "dS^T": "4 TensorE transposes of dS, [128, 512] input dtype",
    "dQ": "dS K for one d tile, [d_tile, 128] fp32",
    "T": "TensorE transposes of Q, dO, O, K, [128, <= 512] input dtype",
}
PSUM_PEAK_BANKS = 7  # 7 kinds of one bank each: they fit the 8 banks even if all were live at once


def _visible_tiles(c, q0, k_lo, k_len):
    """Trace-time list of the key tiles of one section that query tile [q0, q0+128) needs, each trimmed to its
    visible 128-key chunks: (k0, kw, needs_causal_mask, needs_window_mask)."""
    out = []
    q1 = q0 + PMAX
    for t0 in range(k_lo, k_lo + k_len, K_TILE):
        t1 = min(t0 + K_TILE, k_lo + k_len)
        k0, k1 = -1, -1
        for c0 in range(t0, t1, PMAX):
            if tile_visible(q0, q1, c0, c0 + PMAX, c.causal, c.window):
                if k0 < 0:
                    k0 = c0
                k1 = c0 + PMAX  # causal and window leave a contiguous run of chunks
        if k0 < 0:
            continue  # masked entirely by causal / window: skipped at trace time
        cmask = not tile_fully_visible(q0, q1, k0, k1, c.causal, 0)
        wmask = not tile_fully_visible(q0, q1, k0, k1, False, c.window)
        out.append((k0, k1 - k0, cmask, wmask))
    return out


class BwdConfig(nl.NKIObject):
    """Trace-time plan of one attention_bwd call (shapes, dtypes, sections, visible tiles)."""

    def __init__(self, a, dtype, mixed, section_len, trn1):
        # (NKI binds one target per attribute assignment: no tuple unpacking into attributes)
        self.bs = a.bs
        self.nheads = a.nheads
        self.nheads_kv = a.nheads_kv
        self.group = a.group
        self.d_head = a.d_head
        self.d_tiles = a.d_tiles
        self.d_tile = a.d_tile
        self.seqlen_q = a.seqlen_q
        self.seqlen_k = a.seqlen_k
        self.nq = a.seqlen_q // PMAX
        self.scale = a.scale
        self.causal = a.causal
        self.window = a.window
        self.packing = a.packing
        self.num_sinks = a.num_sinks
        self.sinks_3d = a.sinks_3d
        self.mm_dtype = dtype
        self.mixed = mixed
        # P is kept in fp32 with mixed precision (cast for the dV matmul), else in the input dtype.
        self.p_dtype = nl.float32 if mixed else dtype
        self.p_cast = mixed and str(dtype) != str(nl.float32)
        self.trn1 = trn1
        self.section_len = section_len
        self.sections = []
        for lo in range(0, a.seqlen_k, section_len):
            self.sections.append((lo, min(section_len, a.seqlen_k - lo)))
        self.n_sections = len(self.sections)
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
        for i in range(self.nq):
            first, last = -1, -1
            for s in range(self.n_sections):
                if self.tiles[s][i]:
                    if first < 0:
                        first = s
                    last = s
            self.first_sec.append(first)
            self.last_sec.append(last)
        # dQ partial sums between sections: fp32 scratch in HBM with mixed precision, else out_dq itself.
        self.dq_scratch = mixed and str(dtype) != str(nl.float32) and self.n_sections > 1


def _section_len(d_head, d_tiles, itemsize, seqlen_k, k_section_len):
    if k_section_len is None:
        return default_section_len(d_head, d_tiles, itemsize, seqlen_k)
    return min(k_section_len, seqlen_k)


def _is_trn1():
    return not nisa.get_nc_version() >= nisa.nc_version.gen3  # no range_select before trn2


def bwd_problem(q_ref, k_ref, v_ref, o_ref, dy_ref, lse_ref, sinks_ref=None, bound_min=None, bound_max=None,
                use_causal_mask=False, mixed_precision=False, softmax_scale=None, sliding_window=None,
                k_section_len=None):
    """``None`` when ``attention_bwd`` accepts these arguments on the current target, else the first problem as
    a message (argument, value, rule). The kernel asserts on it; ``nki_attn.kernel_api.attention_bwd`` raises it
    as ``ValueError`` before launching."""
    if lse_ref is None or o_ref is None or dy_ref is None:
        return "o_ref, dy_ref and lse_ref are required by attention_bwd (got None)"
    problem = attention_problem(q_ref, k_ref, v_ref, o=o_ref, dy=dy_ref, lse=lse_ref, sinks=sinks_ref,
                                bound_min=bound_min, bound_max=bound_max, use_causal_mask=use_causal_mask,
                                softmax_scale=softmax_scale, sliding_window=sliding_window)
    if problem is not None:
        return problem
    if not isinstance(mixed_precision, bool):
        return f"mixed_precision={mixed_precision!r} must be a bool"
    if k_section_len is not None:
        if isinstance(k_section_len, bool) or not isinstance(k_section_len, int) or k_section_len < PMAX \
                or k_section_len % PMAX != 0:
            return f"k_section_len={k_section_len!r} must be a positive multiple of {PMAX}"
    a = attention_shape(q_ref, k_ref, sinks=sinks_ref, bound_min=bound_min, use_causal_mask=use_causal_mask,
                        softmax_scale=softmax_scale, sliding_window=sliding_window)
    isz = _itemsize(q_ref.dtype)
    sec = _section_len(a.d_head, a.d_tiles, isz, a.seqlen_k, k_section_len)
    trn1 = _is_trn1()
    use = sbuf_usage(a.d_head, a.d_tiles, isz, sec, a.group, a.seqlen_q, mixed_precision, a.packing,
                     a.num_sinks, trn1 and a.packing)
    cap = sbuf_bytes_per_partition()
    if use["total"] > cap:
        return (f"attention_bwd needs {use['total']} SBUF bytes per partition (section {use['section']}, per-row "
                f"statistics {use['persistent']} for nheads/nheads_kv={a.group} x seqlen_q={a.seqlen_q}), more "
                f"than the {cap} available: shorten seqlen_q or the query-head group per kv head")
    return None


def _configure(q_ref, k_ref, sinks_ref, bound_min, use_causal_mask, mixed_precision, softmax_scale,
               sliding_window, k_section_len):
    """The ``BwdConfig`` of arguments ``bwd_problem`` accepted."""
    a = attention_shape(q_ref, k_ref, sinks=sinks_ref, bound_min=bound_min, use_causal_mask=use_causal_mask,
                        softmax_scale=softmax_scale, sliding_window=sliding_window)
    sec = _section_len(a.d_head, a.d_tiles, _itemsize(q_ref.dtype), a.seqlen_k, k_section_len)
    return BwdConfig(a, q_ref.dtype, mixed_precision, sec, _is_trn1())


# ----------------------------------------------------------------------------------------------- loads
def _load_d_tiles(c, src4, b, h, q0, dtype):
    """[d_tile, 128] SBUF tiles (one per head-dim tile) of rows q0..q0+127 of src4[b, h] (head_dim on the
    partition axis, as in HBM)."""
    tiles = []
    for dt in range(c.d_tiles):
        t = nl.ndarray((c.d_tile, PMAX), dtype=dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=src4[b, h, dt * c.d_tile:(dt + 1) * c.d_tile, q0:q0 + PMAX])
        tiles.append(t)
    return tiles


def _load_q_scaled(c, q_ref, b, h, q0):
    """Q tiles with softmax_scale folded in at load: S = (scale*Q)^T K needs no scaling op, and dK = (scale*Q)^T dS
    carries the scale through its Q factor."""
    raw = _load_d_tiles(c, q_ref, b, h, q0, c.mm_dtype)
    scaled = []
    for dt in range(c.d_tiles):
        t = nl.ndarray((c.d_tile, PMAX), dtype=c.mm_dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=t, data=raw[dt], op0=nl.multiply, operand0=c.scale)
        scaled.append(t)
    return scaled


def _transpose_psum(c, tiles):
    """TensorE transposes of [d_tile, 128] tiles into one [128, d_head] PSUM tile (input dtype)."""
    ps = nl.ndarray((PMAX, c.d_head), dtype=c.mm_dtype, buffer=nl.psum)
    for dt in range(c.d_tiles):
        nisa.nc_transpose(dst=ps[:, dt * c.d_tile:(dt + 1) * c.d_tile], data=tiles[dt])
    return ps


def _transpose_sbuf(c, tiles):
    """[128, d_head] SBUF copy of the transposes (a matmul stationary operand: rows on the partition axis)."""
    ps = _transpose_psum(c, tiles)
    sb = nl.ndarray((PMAX, c.d_head), dtype=c.mm_dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=sb, src=ps)
    return sb


def _load_kv_section(c, k_ref, v_ref, b, hk, k_lo, k_len):
    """K and V of one section ([d_tile, k_len] per head-dim tile) and K^T ([128, n_chunks * d_tile] per head-dim
    tile: chunk j of 128 keys at columns j*d_tile) for the dQ matmul, which contracts over keys."""
    ks, vs, kts = [], [], []
    n_ch = k_len // PMAX
    per = max(1, K_TILE // c.d_tile)  # chunks per PSUM transpose tile (<= 512 elements: one bank)
    for dt in range(c.d_tiles):
        kt = nl.ndarray((c.d_tile, k_len), dtype=c.mm_dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=kt, src=k_ref[b, hk, dt * c.d_tile:(dt + 1) * c.d_tile, k_lo:k_lo + k_len])
        vt = nl.ndarray((c.d_tile, k_len), dtype=c.mm_dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=vt, src=v_ref[b, hk, dt * c.d_tile:(dt + 1) * c.d_tile, k_lo:k_lo + k_len])
        ktr = nl.ndarray((PMAX, n_ch * c.d_tile), dtype=c.mm_dtype, buffer=nl.sbuf)
        for g0 in range(0, n_ch, per):
            gn = min(per, n_ch - g0)
            ps = nl.ndarray((PMAX, gn * c.d_tile), dtype=c.mm_dtype, buffer=nl.psum)
            for j in range(gn):
                ch = g0 + j
                nisa.nc_transpose(dst=ps[:, j * c.d_tile:(j + 1) * c.d_tile], data=kt[:, ch * PMAX:(ch + 1) * PMAX])
            nisa.tensor_copy(dst=ktr[:, g0 * c.d_tile:(g0 + gn) * c.d_tile], src=ps)
        ks.append(kt)
        vs.append(vt)
        kts.append(ktr)
    return ks, vs, kts


def _load_neg_lse(c, lse_ref, b, hk, neg_lse):
    """-LSE of every query row of the kv head's query heads, [128, group * nq] fp32 (column g*nq + t holds rows
    t*128 .. t*128+127 of head g): the exp bias of the P recompute. Loaded once per work item."""
    for g in range(c.group):
        cols = neg_lse[:, g * c.nq:(g + 1) * c.nq]
        nisa.dma_copy(dst=cols, src=lse_ref[b, hk * c.group + g])
        nisa.tensor_scalar(dst=cols, data=cols, op0=nl.multiply, operand0=-1.0)


def _load_bounds(c, bound_min, bound_max):
    """Packing bounds as [128, nq] fp32 columns (query row t*128+p at [p, t]), loaded once per launch. Causal
    and the sliding window are folded in here (bound_max = min(bound_max, q+1), bound_min = max(bound_min,
    q-W+1)) so one range test per score masks all three rules."""
    bmin = nl.ndarray((PMAX, c.nq), dtype=nl.float32, buffer=nl.sbuf)
    bmax = nl.ndarray((PMAX, c.nq), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=bmin, src=bound_min.ap(pattern=[[1, PMAX], [PMAX, c.nq]], offset=0))
    nisa.dma_copy(dst=bmax, src=bound_max.ap(pattern=[[1, PMAX], [PMAX, c.nq]], offset=0))
    if c.causal:
        qidx = nl.ndarray((PMAX, c.nq), dtype=nl.float32, buffer=nl.sbuf)
        nisa.iota(dst=qidx, pattern=[[PMAX, c.nq]], offset=0, channel_multiplier=1)
        nisa.scalar_tensor_tensor(dst=bmax, data=qidx, op0=nl.add, operand0=1.0, op1=nl.minimum, operand1=bmax)
        if c.window:
            nisa.scalar_tensor_tensor(dst=bmin, data=qidx, op0=nl.add, operand0=float(1 - c.window),
                                      op1=nl.maximum, operand1=bmin)
    return bmin, bmax


# ----------------------------------------------------------------------------------------------- steps
def _rowsum_o_dy(c, o_ref, b, h, q0, dyT, d_col):
    """Step 1: D = rowsum(O * dO) for 128 query rows, into the fp32 column ``d_col`` [128, 1]. Equals
    sum_j P_ij dP_ij (O = P V), so the softmax Jacobian needs no key-axis reduction. Run once per (query head,
    query tile), on the first K-section only; D stays in SBUF for the later sections."""
    o_t = _load_d_tiles(c, o_ref, b, h, q0, c.mm_dtype)
    oT = _transpose_psum(c, o_t)
    prod = nl.ndarray((PMAX, c.d_head), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=prod, data1=dyT, data2=oT, op=nl.multiply)
    nisa.tensor_reduce(dst=d_col, op=nl.add, data=prod, axis=1)


def _mask_scores(c, s_ps, q0, k0, kw, cmask, wmask, bcols):
    """Masked scores in SBUF (fp32), or the PSUM scores themselves when the tile is fully visible. Masked
    entries become -3.4e38 so exp() gives exactly 0."""
    if c.packing:
        bmin_col, bmax_col = bcols
        s_sb = nl.ndarray((PMAX, kw), dtype=nl.float32, buffer=nl.sbuf)
        if not c.trn1:
            # one Vector instruction: copy PSUM -> SBUF keeping bound_min <= key < bound_max
            nisa.range_select(dst=s_sb, on_true_tile=s_ps, comp_op0=nl.greater_equal, comp_op1=nl.less,
                              bound0=bmin_col, bound1=bmax_col, range_start=k0, on_false_value=FP32_MIN)
        else:
            # trn1 has no range_select: key index (iota), two compares into a 0/1 mask, predicated fill
            kidx = nl.ndarray((PMAX, kw), dtype=nl.float32, buffer=nl.sbuf)
            nisa.iota(dst=kidx, pattern=[[1, kw]], offset=k0, channel_multiplier=0)
            vis = nl.ndarray((PMAX, kw), dtype=nl.uint8, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=vis, data=kidx, op0=nl.greater_equal, operand0=bmin_col)
            nisa.scalar_tensor_tensor(dst=vis, data=kidx, op0=nl.less, operand0=bmax_col, op1=nl.multiply,
                                      operand1=vis)
            nisa.tensor_copy(dst=s_sb, src=s_ps)
            nisa.tensor_copy_predicated(dst=s_sb, src=FP32_MIN, predicate=vis, reverse_pred=True)
        return s_sb
    if not (cmask or wmask):
        return s_ps
    s_sb = nl.ndarray((PMAX, kw), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=s_sb, src=s_ps)
    if cmask:  # keep key k0+j <= query q0+p
        nisa.affine_select(dst=s_sb, pattern=[[-1, kw]], channel_multiplier=1, on_true_tile=s_sb,
                           on_false_value=FP32_MIN, cmp_op=nl.greater_equal, offset=q0 - k0)
    if wmask:  # keep key k0+j >= query q0+p - W + 1
        nisa.affine_select(dst=s_sb, pattern=[[1, kw]], channel_multiplier=-1, on_true_tile=s_sb,
                           on_false_value=FP32_MIN, cmp_op=nl.greater_equal, offset=k0 + c.window - 1 - q0)
    return s_sb


def _recompute_p(c, q_s, ks, kk, q0, k0, kw, cmask, wmask, bcols, nlse_col):
    """Step 2: S = (scale*Q)^T K (contracting head_dim on the partitions), element mask, then P = exp(S - LSE)
    as ONE activation with bias -LSE: no max subtraction, no division (LSE = max + log(sum))."""
    s_ps = nl.ndarray((PMAX, kw), dtype=nl.float32, buffer=nl.psum)
    for dt in range(c.d_tiles):
        nisa.nc_matmul(dst=s_ps, stationary=q_s[dt], moving=ks[dt][:, kk:kk + kw])
    src = _mask_scores(c, s_ps, q0, k0, kw, cmask, wmask, bcols)
    p = nl.ndarray((PMAX, kw), dtype=c.p_dtype, buffer=nl.sbuf)
    nisa.activation(dst=p, op=nl.exp, data=src, bias=nlse_col, scale=1.0)
    return p


def _softmax_bwd(c, dy_t, vs, kk, kw, p, d_col):
    """Steps 3.2 + 4: dP = dO V^T in PSUM, then dS = (dP - D) * P as ONE scalar_tensor_tensor. dS is computed
    in fp32 by the Vector engine and rounded once, on write, to the matmul dtype."""
    dp_ps = nl.ndarray((PMAX, kw), dtype=nl.float32, buffer=nl.psum)
    for dt in range(c.d_tiles):
        nisa.nc_matmul(dst=dp_ps, stationary=dy_t[dt], moving=vs[dt][:, kk:kk + kw])
    ds = nl.ndarray((PMAX, kw), dtype=c.mm_dtype, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=ds, data=dp_ps, op0=nl.subtract, operand0=d_col, op1=nl.multiply, operand1=p)
    return ds


def _dv_dk(c, dyT, qT, p_mm, ds, kk, kw, dv_acc, dk_acc):
    """Steps 3.1 + 5.2: dV += P^T dO and dK += (scale*Q)^T dS (contracting the 128 query rows), added into the
    section's fp32 SBUF accumulators, which also sum the query heads of the kv head (GQA/MQA)."""
    for dt in range(c.d_tiles):
        cols = slice(dt * c.d_tile, (dt + 1) * c.d_tile)
        dv_ps = nl.ndarray((c.d_tile, kw), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=dv_ps, stationary=dyT[:, cols], moving=p_mm)
        nisa.tensor_tensor(dst=dv_acc[dt][:, kk:kk + kw], data1=dv_acc[dt][:, kk:kk + kw], data2=dv_ps, op=nl.add)
        dk_ps = nl.ndarray((c.d_tile, kw), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=dk_ps, stationary=qT[:, cols], moving=ds)
        nisa.tensor_tensor(dst=dk_acc[dt][:, kk:kk + kw], data1=dk_acc[dt][:, kk:kk + kw], data2=dk_ps, op=nl.add)


def _dq(c, ds, kts, kk, kw, dq_acc):
    """Step 5.1: dQ += (dS K) * scale. dS is transposed 128 keys at a time (TensorE) so the matmul contracts
    keys on the partition axis; the scale and the running accumulation are ONE scalar_tensor_tensor."""
    n_ch = kw // PMAX
    dsT_ps = nl.ndarray((PMAX, kw), dtype=c.mm_dtype, buffer=nl.psum)
    for ch in range(n_ch):
        nisa.nc_transpose(dst=dsT_ps[:, ch * PMAX:(ch + 1) * PMAX], data=ds[:, ch * PMAX:(ch + 1) * PMAX])
    dsT = nl.ndarray((PMAX, kw), dtype=c.mm_dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=dsT, src=dsT_ps)
    ch0 = kk // PMAX
    for dt in range(c.d_tiles):
        dq_ps = nl.ndarray((c.d_tile, PMAX), dtype=nl.float32, buffer=nl.psum)
        for ch in range(n_ch):
            nisa.nc_matmul(dst=dq_ps, stationary=kts[dt][:, (ch0 + ch) * c.d_tile:(ch0 + ch + 1) * c.d_tile],
                           moving=dsT[:, ch * PMAX:(ch + 1) * PMAX])
        nisa.scalar_tensor_tensor(dst=dq_acc[dt], data=dq_ps, op0=nl.multiply, operand0=c.scale, op1=nl.add,
                                  operand1=dq_acc[dt])


def _dsinks(c, sinks_ref, out_dsinks, b, hk, neg_lse, dsum):
    """dsinks[b, h, n] = sum over query rows of dS_sink = -exp(sink_n - LSE) * D (a sink gets no dP: it has no
    value). p_sink is one exp activation with the same -LSE bias as P; the accumulation is one
    scalar_tensor_tensor with reverse1=True (acc - p_sink*D); the row sum is one tensor_partition_reduce."""
    ns, g_n = c.num_sinks, c.group
    width = g_n * ns
    sink_sb = nl.ndarray((PMAX, width), dtype=nl.float32, buffer=nl.sbuf)
    # the group's sink logits, broadcast to every partition (stride-0 partition pattern)
    nisa.dma_copy(dst=sink_sb, src=sinks_ref.ap(pattern=[[0, PMAX], [1, width]],
                                                offset=(b * c.nheads + hk * g_n) * ns))
    acc = nl.ndarray((PMAX, width), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=acc, value=0.0)
    for g in range(g_n):
        cols = slice(g * ns, (g + 1) * ns)
        for i in range(c.nq):
            col = g * c.nq + i
            p_sink = nl.ndarray((PMAX, ns), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=p_sink, op=nl.exp, data=sink_sb[:, cols], bias=neg_lse[:, col:col + 1], scale=1.0)
            nisa.scalar_tensor_tensor(dst=acc[:, cols], data=p_sink, op0=nl.multiply, operand0=dsum[:, col:col + 1],
                                      op1=nl.subtract, operand1=acc[:, cols], reverse1=True)
    red = nl.ndarray((1, width), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_partition_reduce(dst=red, op=nl.add, data=acc)
    if c.sinks_3d:
        nisa.dma_copy(dst=out_dsinks[b, hk * g_n:(hk + 1) * g_n, :], src=red)
    else:
        nisa.dma_copy(dst=out_dsinks[b, hk * g_n:(hk + 1) * g_n], src=red)


# ----------------------------------------------------------------------------------------------- driver
def _work_item(c, b, hk, q_ref, k_ref, v_ref, o_ref, dy_ref, lse_ref, sinks_ref, bounds, out_dq, out_dk, out_dv,
               out_dsinks, dq_scratch):
    """All gradients of one (batch, kv head): KV sections outer, query heads and query tiles inner."""
    neg_lse = nl.ndarray((PMAX, c.group * c.nq), dtype=nl.float32, buffer=nl.sbuf)
    dsum = nl.ndarray((PMAX, c.group * c.nq), dtype=nl.float32, buffer=nl.sbuf)  # D, same layout as -LSE
    _load_neg_lse(c, lse_ref, b, hk, neg_lse)
    for s in range(c.n_sections):
        k_lo, k_len = c.sections[s]
        ks, vs, kts = _load_kv_section(c, k_ref, v_ref, b, hk, k_lo, k_len)
        dk_acc, dv_acc = [], []
        for dt in range(c.d_tiles):
            a_k = nl.ndarray((c.d_tile, k_len), dtype=nl.float32, buffer=nl.sbuf)
            nisa.memset(dst=a_k, value=0.0)
            dk_acc.append(a_k)
            a_v = nl.ndarray((c.d_tile, k_len), dtype=nl.float32, buffer=nl.sbuf)
            nisa.memset(dst=a_v, value=0.0)
            dv_acc.append(a_v)
        for g in range(c.group):
            h = hk * c.group + g
            for i in range(c.nq):
                tiles = c.tiles[s][i]
                if s != 0 and not tiles:
                    continue  # nothing of this query tile in this section (trace-time)
                q0 = i * PMAX
                col = g * c.nq + i
                nlse_col = neg_lse[:, col:col + 1]
                d_col = dsum[:, col:col + 1]
                dy_t = _load_d_tiles(c, dy_ref, b, h, q0, c.mm_dtype)
                dyT = _transpose_sbuf(c, dy_t)
                if s == 0:
                    _rowsum_o_dy(c, o_ref, b, h, q0, dyT, d_col)
                dq_acc = []
                for dt in range(c.d_tiles):
                    dq_acc.append(nl.ndarray((c.d_tile, PMAX), dtype=nl.float32, buffer=nl.sbuf))
                if not tiles:
                    if c.first_sec[i] < 0:  # no key visible to this tile anywhere: dQ = 0
                        for dt in range(c.d_tiles):
                            nisa.memset(dst=dq_acc[dt], value=0.0)
                            nisa.dma_copy(dst=out_dq[b, h, dt * c.d_tile:(dt + 1) * c.d_tile, q0:q0 + PMAX],
                                          src=dq_acc[dt])
                    continue
                q_s = _load_q_scaled(c, q_ref, b, h, q0)
                qT = _transpose_sbuf(c, q_s)
                for dt in range(c.d_tiles):
                    rows = slice(dt * c.d_tile, (dt + 1) * c.d_tile)
                    if s == c.first_sec[i]:
                        nisa.memset(dst=dq_acc[dt], value=0.0)
                    elif c.dq_scratch:
                        nisa.dma_copy(dst=dq_acc[dt], src=dq_scratch[g, rows, q0:q0 + PMAX])
                    else:
                        nisa.dma_copy(dst=dq_acc[dt], src=out_dq[b, h, rows, q0:q0 + PMAX])
                bcols = None
                if c.packing:
                    bcols = (bounds[0][:, i:i + 1], bounds[1][:, i:i + 1])
                for tile in tiles:
                    k0, kw, cmask, wmask = tile
                    kk = k0 - k_lo
                    p = _recompute_p(c, q_s, ks, kk, q0, k0, kw, cmask, wmask, bcols, nlse_col)
                    p_mm = p
                    if c.p_cast:
                        p_mm = nl.ndarray((PMAX, kw), dtype=c.mm_dtype, buffer=nl.sbuf)
                        nisa.tensor_copy(dst=p_mm, src=p)
                    ds = _softmax_bwd(c, dy_t, vs, kk, kw, p, d_col)
                    _dv_dk(c, dyT, qT, p_mm, ds, kk, kw, dv_acc, dk_acc)
                    _dq(c, ds, kts, kk, kw, dq_acc)
                for dt in range(c.d_tiles):
                    rows = slice(dt * c.d_tile, (dt + 1) * c.d_tile)
                    if c.dq_scratch and s != c.last_sec[i]:
                        nisa.dma_copy(dst=dq_scratch[g, rows, q0:q0 + PMAX], src=dq_acc[dt])
                    else:
                        nisa.dma_copy(dst=out_dq[b, h, rows, q0:q0 + PMAX], src=dq_acc[dt])
        for dt in range(c.d_tiles):
            rows = slice(dt * c.d_tile, (dt + 1) * c.d_tile)
            nisa.dma_copy(dst=out_dk[b, hk, rows, k_lo:k_lo + k_len], src=dk_acc[dt])
            nisa.dma_copy(dst=out_dv[b, hk, rows, k_lo:k_lo + k_len], src=dv_acc[dt])
        if s == 0 and c.num_sinks:
            _dsinks(c, sinks_ref, out_dsinks, b, hk, neg_lse, dsum)


def attention_bwd_core(q_ref, k_ref, v_ref, o_ref, dy_ref, lse_ref, sinks_ref=None, bound_min=None,
                       bound_max=None, use_causal_mask=False, mixed_precision=False, softmax_scale=None,
                       sliding_window=None, k_section_len=None):
    """Body of attention_bwd (inlined at trace time); ``k_section_len`` (a multiple of 128) overrides the K/V
    section length chosen from the SBUF budget."""
    problem = bwd_problem(q_ref, k_ref, v_ref, o_ref, dy_ref, lse_ref, sinks_ref, bound_min, bound_max,
                          use_causal_mask, mixed_precision, softmax_scale, sliding_window, k_section_len)
    assert problem is None, problem
    c = _configure(q_ref, k_ref, sinks_ref, bound_min, use_causal_mask, mixed_precision, softmax_scale,
                   sliding_window, k_section_len)
    out_dq = nl.ndarray(q_ref.shape, dtype=q_ref.dtype, buffer=nl.shared_hbm)
    out_dk = nl.ndarray(k_ref.shape, dtype=k_ref.dtype, buffer=nl.shared_hbm)
    out_dv = nl.ndarray(v_ref.shape, dtype=v_ref.dtype, buffer=nl.shared_hbm)
    out_dsinks = None
    if c.num_sinks:
        out_dsinks = nl.ndarray(sinks_ref.shape, dtype=nl.float32, buffer=nl.shared_hbm)
    dq_scratch = None
    if c.dq_scratch:
        dq_scratch = nl.ndarray((c.group, c.d_head, c.seqlen_q), dtype=nl.float32, buffer=nl.private_hbm)

    # SPMD: the bs * nheads_kv work items are split into contiguous blocks over the cores (LNC2).
    if nl.program_ndim() == 0:
        n_shards, shard = 1, 0
    else:
        n_shards, shard = nl.num_programs(0), nl.program_id(0)
    n_items = c.bs * c.nheads_kv
    per_shard = (n_items + n_shards - 1) // n_shards
    start = shard * per_shard
    end = min(start + per_shard, n_items)

    bounds = None
    if c.packing:
        bounds = _load_bounds(c, bound_min, bound_max)
    for item in range(start, end):
        _work_item(c, item // c.nheads_kv, item % c.nheads_kv, q_ref, k_ref, v_ref, o_ref, dy_ref, lse_ref,
                   sinks_ref, bounds, out_dq, out_dk, out_dv, out_dsinks, dq_scratch)
    if c.num_sinks:
        return out_dq, out_dk, out_dv, out_dsinks
    return out_dq, out_dk, out_dv


@nki.jit
def attention_bwd(q_ref, k_ref, v_ref, o_ref, dy_ref, lse_ref, sinks_ref=None, bound_min=None, bound_max=None,
                  use_causal_mask=False, mixed_precision=False, softmax_scale=None, sliding_window=None,
                  k_section_len=None):
    """Flash-attention backward: ``(dq, dk, dv)`` or ``(dq, dk, dv, dsinks)``. See the module docstring.

    ``k_section_len``: keys per K/V section, a multiple of 128 (default: the largest multiple of 512 that fits
    the SBUF section budget, at most ``K_SECTION_MAX``). Invalid arguments fail the kernel's assert with the
    message of ``bwd_problem``; ``nki_attn.kernel_api.attention_bwd`` raises it as ``ValueError`` instead."""
    return attention_bwd_core(q_ref, k_ref, v_ref, o_ref, dy_ref, lse_ref, sinks_ref, bound_min, bound_max,
                              use_causal_mask, mixed_precision, softmax_scale, sliding_window, k_section_len)
