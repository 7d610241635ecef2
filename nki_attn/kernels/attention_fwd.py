"""Flash-attention forward (training): ``o`` and the log-sum-exp ``lse`` the backward kernel consumes.

    attention_fwd(q_ref, k_ref, v_ref, sinks_ref=None, bound_min=None, bound_max=None, use_causal_mask=False,
                  mixed_precision=True, softmax_scale=None, sliding_window=None) -> (o, lse)

Layouts (head_dim on the partition axis): q/o ``[bs, nheads, d_head, seqlen_q]``, k/v
``[bs, nheads_kv, d_head, seqlen_k]``, lse float32 ``[bs, nheads, 128, seqlen_q // 128]`` with
``lse[b, h, p, t]`` the log-sum-exp of query row ``t * 128 + p`` (``+inf`` for a row that sees no key and has no
sink; its ``o`` is 0). Semantics follow ``golden/attention_fwd_torch.py``; docs/kernel-fwd.md explains the design.
Kernel code stays in NKI's compile-time subset (checked by the simulator's frontend check): invalid arguments fail
an ``assert`` on ``fwd_problem``'s message; ``nki_attn.kernel_api.attention_fwd`` raises it as ``ValueError``.

Algorithm (FlashAttention-2, Q outer). The work is sharded over ``bs * nheads_kv`` (LNC2: ``nl.program_id``).
For one (batch, kv head) the (query head, query tile) pairs of the GQA group are processed in blocks of up to
``MAX_UNITS``; a block streams the key axis in tiles of 512 keys (one PSUM bank of fp32 scores), loading K and
V once and transposing V once for all the units of the block. Per unit and key tile::

    S    = (scale*Q)^T K                         TensorE, fp32 PSUM, contraction over the d tiles
    S    = mask(S)                               range_select (packing) / affine_select (causal, window)
    nm'  = min(nm, -rowmax(S))                   negated running max, float32
    a    = exp(nm' - nm)                         rescale factor (0 when the first visible key arrives)
    P    = exp(S + nm'),  rs = rowsum(P)         ONE activation, bias = negated running max, reduce = add
    l    = l * a + rs
    O    = O * a + P V                           P transposed on TensorE, PV accumulated in PSUM over chunks

and at the end ``o = O / l``, ``lse = -nm + log(l)``; rows whose max is still the mask value (no visible key, no
sink) are forced to ``o = 0``, ``lse = +inf`` by a multiply with a 0/1 keep flag and a select.
"""
from ..backend import nisa, nki, nl
from .tiling import tile_fully_visible, tile_visible
from .validation import attention_problem, attention_shape

PMAX = 128
K_TILE = 512  # keys per score tile: 128 x 512 fp32 = one 2 KiB PSUM bank per partition
MAX_UNITS = 8  # (query head, query tile) pairs sharing one K/V load
FP32_MIN = -3.4028235e38  # the mask value (range_select accepts nothing else)
# A row's negated running max stays at -FP32_MIN = 3.4e38 while every score it saw was masked; any real score
# is many orders of magnitude smaller, so "negated max above 1e38" means "the row saw no key".
EMPTY_NEG_MAX = 1.0e38
L_FLOOR = 0.5  # a row that saw a key has l >= 1 (its max contributes exp(0)); keeps log/reciprocal in range
POS_INF = float("inf")  # lse of a row that sees no key (module level: plain Python, not traced)


def _chunk_range(q0, k0, kw, causal, window):
    """Visible 128-key chunks ``[lo, hi)`` of the key tile ``[k0, k0 + kw)`` for the query tile at ``q0``
    (causal and window leave a contiguous run); ``lo == hi`` when none is visible."""
    lo = 0
    hi = 0
    for c in range(kw // PMAX):
        if tile_visible(q0, q0 + PMAX, k0 + c * PMAX, k0 + (c + 1) * PMAX, causal, window):
            if hi == lo:
                lo = c
            hi = c + 1
    return lo, hi


def _load_bounds(bound_min, bound_max, n_qt, causal, window):
    """Packing bounds as SBUF ``[128, n_qt]`` float32 columns (column t = query tile t), with the causal and
    window rules folded in: ``bmax = min(bmax, q + 1)``, ``bmin = max(bmin, q - W + 1)``."""
    bmin = nl.ndarray((PMAX, n_qt), dtype=nl.float32, buffer=nl.sbuf)
    bmax = nl.ndarray((PMAX, n_qt), dtype=nl.float32, buffer=nl.sbuf)
    # element (p, t) <- bound[t * 128 + p]
    nisa.dma_copy(dst=bmin, src=bound_min.ap(pattern=[[1, PMAX], [PMAX, n_qt]], offset=0))
    nisa.dma_copy(dst=bmax, src=bound_max.ap(pattern=[[1, PMAX], [PMAX, n_qt]], offset=0))
    if causal:
        qpos1 = nl.ndarray((PMAX, n_qt), dtype=nl.float32, buffer=nl.sbuf)
        nisa.iota(dst=qpos1, pattern=[[PMAX, n_qt]], offset=1, channel_multiplier=1)  # q + 1
        nisa.tensor_tensor(dst=bmax, data1=bmax, data2=qpos1, op=nl.minimum)
    if window:
        qlo = nl.ndarray((PMAX, n_qt), dtype=nl.float32, buffer=nl.sbuf)
        nisa.iota(dst=qlo, pattern=[[PMAX, n_qt]], offset=1 - window, channel_multiplier=1)  # q - W + 1
        nisa.tensor_tensor(dst=bmin, data1=bmin, data2=qlo, op=nl.maximum)
    return bmin, bmax


class _Unit(nl.NKIObject):
    """Trace-time bookkeeping of one (query head, query tile) pair: its SBUF state and running statistics."""

    def __init__(self, h, t, q_tiles, o_acc, l_sum, neg_max, started):
        self.h = h
        self.t = t
        self.q_tiles = q_tiles  # scaled Q, one [d_tile, 128] tile per d tile
        self.o_acc = o_acc  # [128, d_head] unnormalised output (float32 when mixed_precision)
        self.l_sum = l_sum  # [128, 1] float32 running row sum
        self.neg_max = neg_max  # [128, 1] float32 negated running max (valid once started)
        self.started = started  # statistics hold something (sinks, or a key tile was processed)


def _init_unit(q_ref, sinks_ref, shp, b, h, t, acc_dtype):
    """Load and scale the unit's Q tiles; start its statistics (from the sinks when there are any)."""
    q0 = t * PMAX
    q_tiles = []
    for dt in range(shp.d_tiles):
        qt = nl.ndarray((shp.d_tile, PMAX), dtype=q_ref.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=qt, src=q_ref[b, h, dt * shp.d_tile:(dt + 1) * shp.d_tile, q0:q0 + PMAX])
        # softmax_scale folded into Q at load (as the backward does), rounded to the input dtype
        nisa.tensor_scalar(dst=qt, data=qt, op0=nl.multiply, operand0=shp.scale)
        q_tiles.append(qt)
    o_acc = nl.ndarray((PMAX, shp.d_head), dtype=acc_dtype, buffer=nl.sbuf)
    l_sum = nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    neg_max = nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    started = shp.num_sinks > 0
    if started:
        ns = shp.num_sinks
        # the sink logits of (b, h), broadcast to every partition (stride-0 HBM read); NOT scaled
        sink = nl.ndarray((PMAX, ns), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=sink, src=sinks_ref.ap(pattern=[[0, PMAX], [1, ns]], offset=(b * shp.nheads + h) * ns))
        nisa.tensor_reduce(dst=neg_max, op=nl.maximum, data=sink, axis=1, negate=True)
        # Sinks all -inf mean "no sink": cap the negated max at the mask value's, as for a row that has seen only
        # masked scores, so exp(sink + neg_max) is exactly 0 (not exp(-inf + inf) = NaN) and the result is the
        # no-sink result bit for bit.
        nisa.tensor_scalar(dst=neg_max, data=neg_max, op0=nl.minimum, operand0=-FP32_MIN)
        sink_p = nl.ndarray((PMAX, ns), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=sink_p, op=nl.exp, data=sink, bias=neg_max, scale=1.0, reduce_op=nl.add,
                        reduce_res=l_sum, reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.memset(dst=o_acc, value=0.0)
    return _Unit(h, t, q_tiles, o_acc, l_sum, neg_max, started)


def _score_tile(u, shp, k_tiles, kc0, lo, hi, k0, bounds, idx, packing_isa):
    """Scores of unit ``u`` against the visible chunks ``[lo, hi)`` of the key tile at ``k0`` (K tiles loaded
    from chunk ``kc0``), masked. Returns ``(src, row_max, has_max)``: the tile the exp reads (PSUM when no mask
    applies, else an SBUF float32 copy) and, when ``has_max``, its row max produced by the mask instruction."""
    q0 = u.t * PMAX
    ks = k0 + lo * PMAX
    width = (hi - lo) * PMAX
    s_ps = nl.ndarray((PMAX, width), dtype=nl.float32, buffer=nl.psum)
    for dt in range(shp.d_tiles):
        nisa.nc_matmul(dst=s_ps, stationary=u.q_tiles[dt],
                       moving=k_tiles[dt][:, (lo - kc0) * PMAX:(hi - kc0) * PMAX])
    if shp.packing:
        # Bounds already carry the causal / window rules: one masking instruction, which also yields the max.
        bmin, bmax = bounds
        s_sb = nl.ndarray((PMAX, width), dtype=nl.float32, buffer=nl.sbuf)
        row_max = nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        if packing_isa:
            nisa.range_select(dst=s_sb, on_true_tile=s_ps, comp_op0=nl.greater_equal, comp_op1=nl.less,
                              bound0=bmin[:, u.t:u.t + 1], bound1=bmax[:, u.t:u.t + 1],
                              reduce_cmd=nisa.reduce_cmd.reset_reduce, reduce_res=row_max, reduce_op=nl.maximum,
                              range_start=ks, on_false_value=FP32_MIN)
        else:
            # trn1 has no range_select: keep = (j >= bmin) * (j < bmax), then a select that also takes the max
            j = idx[:, (lo - kc0) * PMAX:(hi - kc0) * PMAX]
            keep = nl.ndarray((PMAX, width), dtype=nl.uint8, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=keep, data=j, op0=nl.greater_equal, operand0=bmin[:, u.t:u.t + 1])
            nisa.scalar_tensor_tensor(dst=keep, data=j, op0=nl.less, operand0=bmax[:, u.t:u.t + 1],
                                      op1=nl.multiply, operand1=keep)
            nisa.select_reduce(dst=s_sb, predicate=keep, on_true=s_ps, on_false=FP32_MIN, reduce_res=row_max,
                               reduce_cmd=nisa.reduce_cmd.reset_reduce, reduce_op=nl.maximum)
        return s_sb, row_max, True
    need_causal = shp.causal and not tile_fully_visible(q0, q0 + PMAX, ks, ks + width, True, 0)
    need_window = shp.window > 0 and not tile_fully_visible(q0, q0 + PMAX, ks, ks + width, False, shp.window)
    if not (need_causal or need_window):
        return s_ps, s_ps, False
    s_sb = nl.ndarray((PMAX, width), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=s_sb, src=s_ps)  # affine_select (GpSimd) reads SBUF only
    if need_causal:
        # keep key ks + j for query q0 + c when (q0 - ks) + c - j >= 0
        nisa.affine_select(dst=s_sb, pattern=[[-1, width]], channel_multiplier=1, on_true_tile=s_sb,
                           on_false_value=FP32_MIN, cmp_op=nl.greater_equal, offset=q0 - ks)
    if need_window:
        # keep when key >= query - W + 1:  (ks + W - 1 - q0) + j - c >= 0
        nisa.affine_select(dst=s_sb, pattern=[[1, width]], channel_multiplier=-1, on_true_tile=s_sb,
                           on_false_value=FP32_MIN, cmp_op=nl.greater_equal, offset=ks + shp.window - 1 - q0)
    return s_sb, s_sb, False


def _online_update(u, shp, src, row_max, has_max, vt, kc0, lo, hi, p_dtype):
    """One online-softmax step of unit ``u`` with the (masked) scores ``src`` of chunks ``[lo, hi)``."""
    width = (hi - lo) * PMAX
    first = not u.started
    neg_max = nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    if first:
        if has_max:
            nisa.tensor_scalar(dst=neg_max, data=row_max, op0=nl.multiply, operand0=-1.0)
        else:
            nisa.tensor_reduce(dst=neg_max, op=nl.maximum, data=src, axis=1, negate=True)
    else:
        if has_max:
            nisa.tensor_scalar(dst=neg_max, data=row_max, op0=nl.multiply, operand0=-1.0, op1=nl.minimum,
                               operand1=u.neg_max)
        else:
            tile_neg_max = nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=tile_neg_max, op=nl.maximum, data=src, axis=1, negate=True)
            nisa.tensor_tensor(dst=neg_max, data1=tile_neg_max, data2=u.neg_max, op=nl.minimum)
        # alpha = exp(old_max - new_max) = exp(-old_neg_max + new_neg_max)
        alpha = nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=alpha, op=nl.exp, data=u.neg_max, bias=neg_max, scale=-1.0)

    # P = exp(S - max) with the row sum, in ONE activation
    p_sb = nl.ndarray((PMAX, width), dtype=p_dtype, buffer=nl.sbuf)
    if first:
        row_sum = u.l_sum
    else:
        row_sum = nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=p_sb, op=nl.exp, data=src, bias=neg_max, scale=1.0, reduce_op=nl.add,
                    reduce_res=row_sum, reduce_cmd=nisa.reduce_cmd.reset_reduce)
    if not first:
        nisa.scalar_tensor_tensor(dst=u.l_sum, data=u.l_sum, op0=nl.multiply, operand0=alpha, op1=nl.add,
                                  operand1=row_sum)

    # P^T per 128-key chunk (keys onto partitions), then O_tile[q, :] = sum_chunks P^T(chunk)^T V^T(chunk)
    n_ch = hi - lo
    pt_ps = nl.ndarray((PMAX, n_ch, PMAX), dtype=p_dtype, buffer=nl.psum)
    for c in range(n_ch):
        nisa.nc_transpose(dst=pt_ps[:, c, :], data=p_sb[:, c * PMAX:(c + 1) * PMAX])
    pt_sb = nl.ndarray((PMAX, n_ch, PMAX), dtype=p_dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=pt_sb, src=pt_ps)
    o_ps = nl.ndarray((PMAX, shp.d_head), dtype=nl.float32, buffer=nl.psum)
    for c in range(n_ch):
        nisa.nc_matmul(dst=o_ps, stationary=pt_sb[:, c, :], moving=vt[:, lo - kc0 + c, :])
    if first:
        nisa.tensor_copy(dst=u.o_acc, src=o_ps)
    else:
        nisa.scalar_tensor_tensor(dst=u.o_acc, data=u.o_acc, op0=nl.multiply, operand0=alpha, op1=nl.add,
                                  operand1=o_ps)
    u.neg_max = neg_max
    u.started = True


def _finish_unit(u, shp, o_ref, lse_ref, b):
    """``o = O / l`` and ``lse = max + log(l)``; rows that saw no key (and have no sink) get 0 and +inf."""
    q0 = u.t * PMAX
    # keep = 1 for a row that saw a key: its negated max is a real number, not the mask's 3.4e38
    keep = nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=keep, data=u.neg_max, op0=nl.less, operand0=EMPTY_NEG_MAX)
    keep_u8 = nl.ndarray((PMAX, 1), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.tensor_copy(dst=keep_u8, src=keep)
    l_safe = nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=l_safe, data=u.l_sum, op0=nl.maximum, operand0=L_FLOOR)
    recip = nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(dst=recip, data=l_safe)
    nisa.tensor_tensor(dst=recip, data1=recip, data2=keep, op=nl.multiply)  # 0 for empty rows
    # lse = log(l) - neg_max, or +inf for empty rows
    log_l = nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=log_l, op=nl.log, data=l_safe)
    lse_real = nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=lse_real, data1=log_l, data2=u.neg_max, op=nl.subtract)
    lse_t = nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.select_reduce(dst=lse_t, predicate=keep_u8, on_true=lse_real, on_false=POS_INF)
    nisa.dma_copy(dst=lse_ref[b, u.h, :, u.t], src=lse_t)

    # normalise in [q, d] (per-partition scale), cast to the output dtype, transpose back to [d, q]
    o_n = nl.ndarray((PMAX, shp.d_head), dtype=o_ref.dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=o_n, data=u.o_acc, op0=nl.multiply, operand0=recip)
    for dt in range(shp.d_tiles):
        ot_ps = nl.ndarray((shp.d_tile, PMAX), dtype=o_ref.dtype, buffer=nl.psum)
        nisa.nc_transpose(dst=ot_ps, data=o_n[:, dt * shp.d_tile:(dt + 1) * shp.d_tile])
        ot_sb = nl.ndarray((shp.d_tile, PMAX), dtype=o_ref.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=ot_sb, src=ot_ps)
        nisa.dma_copy(dst=o_ref[b, u.h, dt * shp.d_tile:(dt + 1) * shp.d_tile, q0:q0 + PMAX], src=ot_sb)


def _attend_block(q_ref, k_ref, v_ref, sinks_ref, o_ref, lse_ref, shp, b, kvh, block, bounds, packing_isa,
                  acc_dtype):
    """All (query head, query tile) pairs of ``block`` (same batch and kv head) against every key tile."""
    units = []
    for i in range(len(block)):
        units.append(_init_unit(q_ref, sinks_ref, shp, b, kvh * shp.group + block[i][0], block[i][1], acc_dtype))
    n_kt = (shp.seqlen_k + K_TILE - 1) // K_TILE
    for kt in range(n_kt):
        k0 = kt * K_TILE
        kw = min(K_TILE, shp.seqlen_k - k0)
        ranges = []
        kc0 = kw // PMAX
        kc1 = 0
        for i in range(len(units)):
            lo, hi = _chunk_range(units[i].t * PMAX, k0, kw, shp.causal, shp.window)
            ranges.append((lo, hi))
            if hi > lo:
                kc0 = min(kc0, lo)
                kc1 = max(kc1, hi)
        if kc1 <= kc0:
            continue  # every unit's mask hides this whole key tile (decided at trace time)
        n_ch = kc1 - kc0
        kb = k0 + kc0 * PMAX
        width = n_ch * PMAX
        k_tiles = []
        v_tiles = []
        for dt in range(shp.d_tiles):
            kt_sb = nl.ndarray((shp.d_tile, width), dtype=k_ref.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=kt_sb, src=k_ref[b, kvh, dt * shp.d_tile:(dt + 1) * shp.d_tile, kb:kb + width])
            k_tiles.append(kt_sb)
            vt_in = nl.ndarray((shp.d_tile, width), dtype=v_ref.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=vt_in, src=v_ref[b, kvh, dt * shp.d_tile:(dt + 1) * shp.d_tile, kb:kb + width])
            v_tiles.append(vt_in)
        # V^T: keys onto partitions, [128 keys, chunk, d_head], shared by the block's units
        vt = nl.ndarray((PMAX, n_ch, shp.d_head), dtype=v_ref.dtype, buffer=nl.sbuf)
        for c in range(n_ch):
            vt_ps = nl.ndarray((PMAX, shp.d_head), dtype=v_ref.dtype, buffer=nl.psum)
            for dt in range(shp.d_tiles):
                nisa.nc_transpose(dst=vt_ps[:, dt * shp.d_tile:(dt + 1) * shp.d_tile],
                                  data=v_tiles[dt][:, c * PMAX:(c + 1) * PMAX])
            nisa.tensor_copy(dst=vt[:, c, :], src=vt_ps)
        idx = None
        if shp.packing and not packing_isa:
            idx = nl.ndarray((PMAX, width), dtype=nl.float32, buffer=nl.sbuf)
            nisa.iota(dst=idx, pattern=[[1, width]], offset=kb, channel_multiplier=0)  # key index per column
        for i in range(len(units)):
            lo, hi = ranges[i]
            if hi > lo:
                src, row_max, has_max = _score_tile(units[i], shp, k_tiles, kc0, lo, hi, k0, bounds, idx,
                                                    packing_isa)
                _online_update(units[i], shp, src, row_max, has_max, vt, kc0, lo, hi, q_ref.dtype)
    # Every unit has seen a key tile: causal/window never hide the diagonal chunk (seqlen_q == seqlen_k there),
    # and without causal nothing is skipped.
    for i in range(len(units)):
        _finish_unit(units[i], shp, o_ref, lse_ref, b)


def fwd_problem(q_ref, k_ref, v_ref, sinks_ref=None, bound_min=None, bound_max=None, use_causal_mask=False,
                mixed_precision=True, softmax_scale=None, sliding_window=None):
    """``None`` when ``attention_fwd`` accepts these arguments, else the first problem as a message. The kernel
    asserts on it; ``nki_attn.kernel_api.attention_fwd`` raises it as ``ValueError`` before launching."""
    problem = attention_problem(q_ref, k_ref, v_ref, sinks=sinks_ref, bound_min=bound_min, bound_max=bound_max,
                                use_causal_mask=use_causal_mask, softmax_scale=softmax_scale,
                                sliding_window=sliding_window)
    if problem is None and not isinstance(mixed_precision, bool):
        problem = f"mixed_precision={mixed_precision!r} must be True or False"
    return problem


@nki.jit
def attention_fwd(q_ref, k_ref, v_ref, sinks_ref=None, bound_min=None, bound_max=None, use_causal_mask=False,
                  mixed_precision=True, softmax_scale=None, sliding_window=None):
    """Flash-attention forward; returns ``(o, lse)`` in shared HBM.

    Args:
        q_ref: ``[bs, nheads, d_head, seqlen_q]`` float32 / bfloat16 / float16.
        k_ref, v_ref: ``[bs, nheads_kv, d_head, seqlen_k]``, q's dtype; query head h reads kv head
            ``h // (nheads // nheads_kv)``.
        sinks_ref: optional ``[bs, nheads]`` or ``[bs, nheads, num_sinks]`` logits (not scaled) that join the
            softmax denominator and produce no output.
        bound_min, bound_max: optional float32 ``[seqlen_q]`` packing bounds: key j is visible to query i iff
            ``bound_min[i] <= j < bound_max[i]``.
        use_causal_mask: mask key j > query i (needs seqlen_q == seqlen_k).
        mixed_precision: True keeps the O accumulator in float32; False keeps it in the input dtype. The
            softmax statistics (max, sum, LSE) are float32 either way; P is the input dtype for the PV matmul.
        softmax_scale: multiplies q.k; default ``1 / sqrt(d_head)``.
        sliding_window: W >= 1 (causal only): query i sees keys ``i - W + 1 .. i``.

    Returns:
        o: like q; lse: float32 ``[bs, nheads, 128, seqlen_q // 128]``.
    """
    problem = fwd_problem(q_ref, k_ref, v_ref, sinks_ref, bound_min, bound_max, use_causal_mask, mixed_precision,
                          softmax_scale, sliding_window)
    assert problem is None, problem
    shp = attention_shape(q_ref, k_ref, sinks=sinks_ref, bound_min=bound_min, use_causal_mask=use_causal_mask,
                          softmax_scale=softmax_scale, sliding_window=sliding_window)
    packing_isa = nisa.get_nc_version() >= nisa.nc_version.gen3  # range_select exists on trn2+
    acc_dtype = nl.float32 if mixed_precision else q_ref.dtype
    n_qt = shp.seqlen_q // PMAX

    o_ref = nl.ndarray((shp.bs, shp.nheads, shp.d_head, shp.seqlen_q), dtype=q_ref.dtype, buffer=nl.shared_hbm)
    lse_ref = nl.ndarray((shp.bs, shp.nheads, PMAX, n_qt), dtype=nl.float32, buffer=nl.shared_hbm)

    # LNC sharding over bs * nheads_kv: core `pid` of `n_prog` takes a contiguous range of (batch, kv head)
    if nl.program_ndim() == 0:
        n_prog = 1
        pid = 0
    else:
        n_prog = nl.num_programs(0)
        pid = nl.program_id(0)
    n_items = shp.bs * shp.nheads_kv
    per_core = (n_items + n_prog - 1) // n_prog
    start = pid * per_core
    stop = min(n_items, start + per_core)

    bounds = None
    if shp.packing:
        bounds = _load_bounds(bound_min, bound_max, n_qt, shp.causal, shp.window)

    # (query head, query tile) pairs of one kv head, query tile major, in blocks of MAX_UNITS
    pairs = []
    for t in range(n_qt):
        for hl in range(shp.group):
            pairs.append((hl, t))
    blocks = []
    for i in range(0, len(pairs), MAX_UNITS):
        blocks.append(pairs[i:min(i + MAX_UNITS, len(pairs))])  # NKI refuses slices past the end
    for item in range(start, stop):
        b = item // shp.nheads_kv
        kvh = item % shp.nheads_kv
        for block in blocks:
            _attend_block(q_ref, k_ref, v_ref, sinks_ref, o_ref, lse_ref, shp, b, kvh, block, bounds,
                          packing_isa, acc_dtype)
    return o_ref, lse_ref
