"""The score modifications of both kernels, each declared ONCE: ``SCORE_MODS``.

A *score modification* changes the logits before the softmax's exponent (soft-capping, ALiBi, the additive bias,
the per-head logit scale). Each is one ``ScoreMod`` row of ``SCORE_MODS``, and everything the kernels do about it
is read from that row:

- ``keywords``: its kernel keyword(s) (the kernel arguments ``mods[keyword]``, ``steps.Hbm.mods``);
- ``rule``: its argument check, run by ``validation.attention_problem`` before any instruction;
- ``fwd`` / ``bwd``: choosers ``(cfg, mods) -> ModSteps``, its steps by slot in each kernel (``steps``: the
  step protocol; the choosers keep the engine choices, e.g. ALiBi by TensorE in the forward when
  ``_FwdConfig.alibi_mm``, the bias gradient's steps only with ``bias_grad``);
- ``bwd_sbuf``: ``(a, mods) -> (persistent, per_key)``, the SBUF bytes per partition its backward steps add
  (per work item, and per key of a visit's stage-A tiles; ``attention_bwd.sbuf_usage``);
- ``grad_on`` / ``grad_out``: whether the backward returns its gradient, and that output's HBM tensor (the
  backward's outputs are ``dq, dk, dv[, dsinks]`` then one per such row, in table order).

Table order is the order of the backward's gradient outputs (the host's ``nki_attn.spec.SCORE_MODS`` has the same
order); ``rank`` orders the score steps (``SCORE_MODS_BY_RANK``: the logit scale, soft-capping, ALiBi, the bias),
the other slots run in table order. docs/kernel-fwd.md "Variants" says how to add a modification.
"""
from ..backend import nisa, nl
from .steps import (K_TILE, PMAX, is_array, is_number, itemsize, load_slopes, per_member, shape_of,
                    supported_dtype)

_FLOAT_MAX = 3.4028234663852886e38
_DTYPES = ("float32", "bfloat16", "float16")  # for messages


class ModSteps(nl.NKIObject):
    """One score modification's steps in one kernel, by slot (``steps.Steps``; a slot it has no step in stays
    empty): ``score``, ``grad``, ``ds_post`` (lists of ``step(cfg, tile, item, x)``), ``ds`` (a function that
    replaces the kernel's dS step, or None), ``key_block`` / ``lse`` (the forward's), and the hooks
    ``f(cfg, hbm, item)`` ``launch``, ``item_open``, ``item_start``, ``item_end``."""

    def __init__(self, score=None, grad=None, ds=None, ds_post=None, key_block=None, lse=None, launch=None,
                 item_open=None, item_start=None, item_end=None):
        self.score = _listed(score)
        self.grad = _listed(grad)
        self.ds = ds
        self.ds_post = _listed(ds_post)
        self.key_block = _listed(key_block)
        self.lse = _listed(lse)
        self.launch = _listed(launch)
        self.item_open = _listed(item_open)
        self.item_start = _listed(item_start)
        self.item_end = _listed(item_end)


def _listed(fns):
    if fns is None:
        return []
    return fns


class ScoreMod(nl.NKIObject):
    """One score modification (module docstring): ``name`` (the host's ``spec.ScoreMod.name``), ``keywords``
    (kernel keywords; the first is its input, ``off`` that input's "not applied" value), ``rank`` (score-step
    order), ``rule(mods, bs, nheads, seqlen_q, seqlen_k)`` (first problem or None), ``fwd(cfg, mods)`` /
    ``bwd(c, mods)`` (``ModSteps``), ``bwd_sbuf(a, mods)`` (``(persistent, per_key)`` bytes),
    ``grad_on(mods)`` and ``grad_out(c, mods)`` (None: no gradient output)."""

    def __init__(self, name, keywords, off, rank, rule, fwd, bwd, bwd_sbuf, grad_on=None, grad_out=None):
        self.name = name
        self.keywords = keywords
        self.off = off
        self.rank = rank
        self.rule = rule
        self.fwd = fwd
        self.bwd = bwd
        self.bwd_sbuf = bwd_sbuf
        self.grad_on = grad_on
        self.grad_out = grad_out

    def value(self, mods):
        """The modification's kernel input in ``mods`` (``off`` when not given)."""
        if mods is None:
            return self.off
        return mods.get(self.keywords[0], self.off)

    def is_on(self, mods):
        """True when the call applies it: its input is given (a number: > 0)."""
        v = self.value(mods)
        if v is None:
            return False
        if is_number(v):
            return v > 0
        return True


def mod_row(name):
    """The row of ``SCORE_MODS`` named ``name``."""
    for m in SCORE_MODS:
        if m.name == name:
            return m
    return None


def active_mods(mods):
    """The rows of ``SCORE_MODS`` the call applies, in table order."""
    out = []
    for m in SCORE_MODS:
        if m.is_on(mods):
            out.append(m)
    return out


def mods_problem(mods, bs, nheads, seqlen_q, seqlen_k):
    """The first problem of the score modifications' arguments ``mods`` (by kernel keyword), or None: each row's
    ``rule`` in table order."""
    for m in SCORE_MODS:
        problem = m.rule(mods, bs, nheads, seqlen_q, seqlen_k)
        if problem is not None:
            return problem
    return None


def _get(mods, key, off):
    if mods is None:
        return off
    return mods.get(key, off)


# ----------------------------------------------------------------------------------------------- soft-capping
def _softcap_rule(mods, bs, nheads, seqlen_q, seqlen_k):
    softcap = _get(mods, "softcap", 0.0)
    if not is_number(softcap) or not (softcap >= 0.0 and softcap <= _FLOAT_MAX):
        return f"softcap={softcap!r} must be a finite number >= 0 (0.0 disables soft-capping)"
    return None


def _softcap_fwd(cfg, mods):
    return ModSteps(score=[softcap_scores])


def _softcap_bwd(c, mods):
    return ModSteps(score=[softcap_scores], grad=[_grad_softcap])


def _softcap_sbuf(a, mods):
    return 0, 2 * 4  # per key: tanh(S/c), P * (1 - tanh^2) (fp32)


# ----------------------------------------------------------------------------------------------- ALiBi
def _alibi_rule(mods, bs, nheads, seqlen_q, seqlen_k):
    alibi_slopes = _get(mods, "alibi_slopes", None)
    if alibi_slopes is None:
        return None
    if not is_array(alibi_slopes):
        return f"alibi_slopes={alibi_slopes!r} must be None or a float32 tensor [bs, nheads]"
    if shape_of(alibi_slopes) != (bs, nheads):
        return (f"alibi_slopes shape {shape_of(alibi_slopes)} must be [bs, nheads] = {(bs, nheads)} (the torch "
                f"API broadcasts FlashAttention's [nheads])")
    if str(alibi_slopes.dtype) != str(nl.float32):
        return f"alibi_slopes dtype {alibi_slopes.dtype} must be float32"
    return None


def _alibi_fwd(cfg, mods):
    """The forward's ALiBi: by TensorE (``_alibi_matmul``, with its key-block, LSE and launch steps) where
    ``cfg.alibi_mm`` allows it, else the exact VectorE step (``_alibi_scores``)."""
    if cfg.alibi_mm:
        return ModSteps(score=[_alibi_matmul], key_block=[_alibi_positions], lse=[_alibi_lse],
                        launch=[_alibi_pos_table], item_start=[_alibi_load_fwd])
    return ModSteps(score=[_alibi_scores], item_start=[_alibi_load_fwd])


def _alibi_bwd(c, mods):
    return ModSteps(score=[_bias_alibi], item_open=[_alibi_load_bwd])


def _alibi_sbuf(a, mods):
    # the slope coefficients of the kv head's query heads; per key: distances, bias, biased logits (fp32)
    return 2 * a.group * 4, 3 * 4


def _alibi_load_fwd(cfg, hbm, item):
    """Work-item start step of the forward's ALiBi: the slopes of the kv head's query heads (``load_slopes``)
    as the step's operands (``_alibi_coefs_fwd``) into ``item.slopes`` / ``item.alibi_st``."""
    sl = load_slopes(hbm.mods["alibi_slopes"], cfg.shp.nheads, cfg.group, item.b, item.kvh)
    slopes, alibi_st = _alibi_coefs_fwd(cfg, sl)
    item.slopes = slopes
    item.alibi_st = alibi_st


def _alibi_pos_table(cfg, hbm, launch):
    """Launch step of ``_alibi_matmul``: the key-position table ``launch.pos_tab`` bfloat16 ``[35, kb_tiles *
    512]``, zeroed once (rows 3-31 stay 0; ``_alibi_positions`` writes the others per key block)."""
    pos_tab = nl.ndarray((35, cfg.kb_tiles * K_TILE), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.memset(dst=pos_tab, value=0.0, engine=nisa.engine.gpsimd)
    launch.pos_tab = pos_tab


def _alibi_load_bwd(c, hbm, item):
    """Work-item open step of the backward's ALiBi (before the work item's -LSE load): the coefficients
    ``item.slopes`` / ``item.slopes_pos`` (``_alibi_coefs_bwd``)."""
    sl = load_slopes(hbm.mods["alibi_slopes"], c.nheads, c.group, item.b, item.kvh)
    neg, pos = _alibi_coefs_bwd(c, sl)
    item.slopes = neg
    item.slopes_pos = pos


# ----------------------------------------------------------------------------------------------- the additive bias
def _bias_rule(mods, bs, nheads, seqlen_q, seqlen_k):
    return bias_problem(_get(mods, "attn_bias", None), bs, nheads, seqlen_q, seqlen_k, _get(mods, "bias_grad", False))


def bias_problem(attn_bias, bs, nheads, seqlen_q, seqlen_k, bias_grad=False):
    """The additive bias ``attn_bias`` (None = none) and the backward's ``bias_grad`` (first problem or None): a
    float32 / bfloat16 / float16 tensor ``[bb, hb, sqb, skb]`` with each dim 1 (broadcast) or the call's size
    ``[bs, nheads, seqlen_q, seqlen_k]``; ``bias_grad`` a bool, True only with a bias."""
    if not isinstance(bias_grad, bool):
        return f"bias_grad={bias_grad!r} must be True or False"
    if attn_bias is None:
        if bias_grad:
            return "bias_grad=True needs attn_bias (the gradient of which bias?), got attn_bias=None"
        return None
    if not is_array(attn_bias):
        return f"attn_bias={attn_bias!r} must be None or a tensor [bs or 1, nheads or 1, seqlen_q or 1, seqlen_k or 1]"
    full = (bs, nheads, seqlen_q, seqlen_k)
    shape = shape_of(attn_bias)
    ok = len(shape) == 4
    if ok:
        for i in range(4):
            if shape[i] != 1 and shape[i] != full[i]:
                ok = False
    if not ok:
        return (f"attn_bias shape {shape} must be 4-D with each dim 1 (broadcast) or the call's size "
                f"[bs, nheads, seqlen_q, seqlen_k] = {full}")
    if not supported_dtype(attn_bias.dtype):
        return f"attn_bias dtype {attn_bias.dtype} is not supported; use one of {_DTYPES}"
    return None


def _bias_fwd(cfg, mods):
    return ModSteps(score=[bias_scores], item_start=[_bias_item])


def _bias_bwd(c, mods):
    """The backward's bias: its score step; with ``bias_grad`` also its dS step (``_ds_bias``, replacing the
    kernel's) and the zero fill of the gradient's unvisited keys (``_dbias_zero``)."""
    if _get(mods, "bias_grad", False):
        return ModSteps(score=[bias_scores], ds=_ds_bias, item_start=[_bias_item, _dbias_zero])
    return ModSteps(score=[bias_scores], item_start=[_bias_item])


def _bias_sbuf(a, mods):
    """The bias tile in its dtype and the biased float32 scores (``bias_scores``), with ``bias_grad`` the float32
    dL of ``_ds_bias``: bytes per key of a visit."""
    n = itemsize(_get(mods, "attn_bias", None).dtype) + 4
    if _get(mods, "bias_grad", False):
        n += 4
    return 0, n


def _bias_grad_on(mods):
    return _get(mods, "bias_grad", False)


def _bias_grad_out(c, mods):
    """The backward's ``dbias``: float32 ``[bs, nheads, seqlen_q, seqlen_k]``, the gradient of the logits (the
    caller sums it over the bias's broadcast dims)."""
    return nl.ndarray((c.bs, c.nheads, c.seqlen_q, c.seqlen_k), dtype=nl.float32, buffer=nl.shared_hbm)


def _bias_item(cfg, hbm, item):
    """Work-item start step of the bias (no instruction): its HBM tensor into ``item.bias`` and the backward's
    gradient output into ``item.dbias`` (None without one)."""
    item.bias = hbm.mods["attn_bias"]
    item.dbias = hbm.grads.get("bias", None)


# ------------------------------------------------------------------------------------ the per-head logit scale
def _logit_scale_rule(mods, bs, nheads, seqlen_q, seqlen_k):
    """The per-head logit scale: None or a float32 tensor ``[bs, nheads]`` (its values are the host's to check,
    docs/semantics.md "Per-head logit scale")."""
    logit_scale = _get(mods, "logit_scale", None)
    if logit_scale is None:
        return None
    if not is_array(logit_scale):
        return f"logit_scale={logit_scale!r} must be None or a float32 tensor [bs, nheads]"
    if shape_of(logit_scale) != (bs, nheads):
        return (f"logit_scale shape {shape_of(logit_scale)} must be [bs, nheads] = {(bs, nheads)} (the torch API "
                f"broadcasts [nheads])")
    if str(logit_scale.dtype) != str(nl.float32):
        return f"logit_scale dtype {logit_scale.dtype} must be float32"
    return None


def _logit_scale_fwd(cfg, mods):
    return ModSteps(score=[logit_scale_scores], item_start=[load_logit_scale])


def _logit_scale_bwd(c, mods):
    return ModSteps(score=[_logit_scale_keep_s], ds_post=[_ds_logit_scale],
                    item_start=[load_logit_scale, _zero_dlogit], item_end=[_store_dlogit])


def _logit_scale_sbuf(a, mods):
    # the scales; the per-row partial sums of the gradient; per key: scaled S, fp32 dS, dS * S (fp32)
    return a.group * 4 + a.group * (a.seqlen_q // PMAX) * 4, 3 * 4


def _always(mods):
    return True


def _logit_scale_grad_out(c, mods):
    """The backward's ``dlogit_scale``: float32, shaped like the scale (``[bs, nheads]``)."""
    return nl.ndarray(mods["logit_scale"].shape, dtype=nl.float32, buffer=nl.shared_hbm)


# ----------------------------------------------------------------------------------------------- the table
# Table order: the backward's gradient outputs (as the host's ``spec.SCORE_MODS``); rank: the score-step order.
SCORE_MODS = (
    ScoreMod("softcap", ("softcap",), 0.0, 1, _softcap_rule, _softcap_fwd, _softcap_bwd, _softcap_sbuf),
    ScoreMod("alibi", ("alibi_slopes",), None, 2, _alibi_rule, _alibi_fwd, _alibi_bwd, _alibi_sbuf),
    ScoreMod("bias", ("attn_bias", "bias_grad"), None, 3, _bias_rule, _bias_fwd, _bias_bwd, _bias_sbuf,
             _bias_grad_on, _bias_grad_out),
    ScoreMod("logit_scale", ("logit_scale",), None, 0, _logit_scale_rule, _logit_scale_fwd, _logit_scale_bwd,
             _logit_scale_sbuf, _always, _logit_scale_grad_out),
)
SCORE_MODS_BY_RANK = tuple(sorted(SCORE_MODS, key=lambda m: m.rank))  # (host Python, at import)
MOD_KEYWORDS = tuple(k for m in SCORE_MODS for k in m.keywords)  # every kernel keyword of the table


# ----------------------------------------------------------------------------------------------- the steps
# shared by both kernels
def softcap_scores(cfg, tile, item, s):
    """Score step, soft-capping: ``t = tanh(cap_scale * S)`` (ONE ScalarE activation, PSUM -> float32 SBUF). With
    ``c`` the cap, ``c t`` is the capped logit ``c tanh(scale q.k / c)``; the exponent applies the factor c (the
    config's ``exp_scale``), so the softmax keeps its single exponent. ``t`` is saved for the backward's
    chain rule (``tile.saved["tanh"]``)."""
    t = nl.ndarray((PMAX, tile.kw), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=t, op=nl.tanh, data=s, scale=cfg.cap_scale)
    tile.saved["tanh"] = t
    return t


def logit_scale_scores(cfg, tile, item, s):
    """Score step, the per-head logit scale: ``z = S * scale[h]`` (ONE ScalarE copy, PSUM -> float32 SBUF, the
    head's scale a per-partition column of ``item.state["logit_scale"]`` as the activation's ``scale``; on ScalarE
    rather than VectorE, as the modeled schedule prefers in both kernels, docs/semantics.md "Per-head logit
    scale"). First of the score steps: the soft-cap's tanh and the ALiBi bias read z, and the exponent's float32
    ``exp_scale`` (softmax_scale) stays the kernel-wide factor, so the logit is ``softmax_scale * scale[h] * q.k``
    with every factor applied in float32 (``steps``, "The scale convention"). (The backward wraps it to keep the
    unscaled S for the gradient.)"""
    z = nl.ndarray((PMAX, tile.kw), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=z, op=nl.copy, data=s, scale=item.state["logit_scale"][:, tile.h:tile.h + 1])
    return z


def load_logit_scale(cfg, hbm, item):
    """Work-item start step of the logit scale: the kv head's query heads' scales broadcast to the partitions,
    ``item.state["logit_scale"]`` ``[128, group]`` float32 (``load_slopes``: the same ``[bs, nheads]`` HBM layout)."""
    ls = hbm.mods["logit_scale"]
    item.state["logit_scale"] = load_slopes(ls, ls.shape[1], cfg.group, item.b, item.kvh)


def bias_scores(cfg, tile, item, s):
    """Score step, the additive bias: ``S + bias / e`` with e the exponent's float32 scale (``cfg.exp_scale``:
    softmax_scale, or the cap with soft-capping), so the exponent's ``e (S + bias / e)`` is the scaled (and
    capped) logit plus the bias, as torch's SDPA adds ``attn_mask`` to the scaled scores. The tile of the bias
    ``[128 query rows, kw keys]`` is ONE DMA in the bias's dtype (``bias_tile``: broadcast dims are stride 0),
    then ONE VectorE ``scalar_tensor_tensor`` ``bias * (1 / e) + S`` reading S from PSUM (or from an earlier
    score step's SBUF output). Only the tiles the band visits are loaded."""
    bt = nl.ndarray((PMAX, tile.kw), dtype=item.bias.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=bt, src=bias_tile(item.bias, tile.b, tile.hq, tile.q0, tile.k0, tile.kw))
    out = nl.ndarray((PMAX, tile.kw), dtype=nl.float32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=out, data=bt, op0=nl.multiply, operand0=1.0 / cfg.exp_scale, op1=nl.add,
                              operand1=s)
    return out


def bias_tile(bias, b, hq, q0, k0, kw):
    """HBM view ``[128, kw]`` of the bias ``[bb, hb, sqb, skb]`` (each dim 1 = broadcast, or the full size) for
    query rows ``[q0, q0 + 128)`` of query head ``hq`` of batch ``b`` and keys ``[k0, k0 + kw)``: a plain slice
    when neither sequence dim is broadcast (its row stride may exceed the access pattern's int16 field), else an
    access pattern with stride 0 along the broadcast dim(s)."""
    bb, hb, sqb, skb = bias.shape
    bi = 0
    if bb > 1:
        bi = b
    hi = 0
    if hb > 1:
        hi = hq
    if sqb > 1 and skb > 1:
        return bias[bi, hi, q0:q0 + PMAX, k0:k0 + kw]
    row_stride = 0
    qi = 0
    if sqb > 1:
        row_stride = skb
        qi = q0
    col_stride = 0
    ki = 0
    if skb > 1:
        col_stride = 1
        ki = k0
    return bias.ap(pattern=[[row_stride, PMAX], [col_stride, kw]], offset=((bi * hb + hi) * sqb + qi) * skb + ki)


# the forward's ALiBi
def _alibi_scores(cfg, tile, item, s):
    """Score step, ALiBi: ``S - slope |i + off - j| / exp_scale`` (the exponent multiplies by exp_scale again).
    The distance comes from one GpSimd ``iota`` whose signs are chosen at trace time: the tile's pairs all lie on
    one side of the diagonal (``j <= i + off``: ``i + off - j``; ``j >= i + off``: ``j - i - off``), or every
    visible pair does (the band ends at the diagonal: causal); only a non-causal tile crossing the diagonal takes
    ``|d| = max(-d, d)``. Then ONE VectorE ``scalar_tensor_tensor`` (``|d| * -slope/e + S``) from PSUM."""
    q0 = tile.q0
    ks = tile.k0
    w = tile.kw
    h = tile.h
    d0 = q0 + cfg.off - ks  # i + off - j at the tile's first query and first key
    dist = nl.ndarray((PMAX, w), dtype=nl.float32, buffer=nl.sbuf)
    if ks >= q0 + PMAX - 1 + cfg.off:
        nisa.iota(dst=dist, pattern=[[1, w]], offset=-d0, channel_multiplier=-1)  # j - i - off >= 0
    else:
        nisa.iota(dst=dist, pattern=[[-1, w]], offset=d0, channel_multiplier=1)  # i + off - j
        if ks + w - 1 > q0 + cfg.off and cfg.hi_rel > cfg.off:
            # the tile crosses the diagonal and keys right of it are visible: |d|
            nisa.scalar_tensor_tensor(dst=dist, data=dist, op0=nl.multiply, operand0=-1.0, op1=nl.maximum,
                                      operand1=dist)
    out = nl.ndarray((PMAX, w), dtype=nl.float32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=out, data=dist, op0=nl.multiply, operand0=item.slopes[:, h:h + 1], op1=nl.add,
                              operand1=s)
    return out


def _alibi_matmul(cfg, tile, item, s):
    """Score step, ALiBi by TensorE (causal, bfloat16): with every visible key left of the diagonal the bias is
    ``-slope (i + off) + slope j``; the first term is a per-row constant, which the softmax ignores and
    ``_alibi_lse`` subtracts from the LSE at the end (FlashAttention's causal ALiBi does the same). The second,
    ``slope j / exp_scale``, is added to the scores in PSUM by ONE more matmul accumulating onto QK: stationary
    ``item.alibi_st[h]`` (the slope as three bfloat16 parts on partitions 0-2 and 32-34), moving the key-position
    table of the key block (``_alibi_positions``: ``j = 256 jh + jl`` as exact bfloat16 rows), so every product
    is exact and the sum is float32."""
    ks = tile.k0
    w = tile.kw
    kbw = cfg.kb_tiles * K_TILE
    col = ks - (ks // kbw) * kbw
    nisa.nc_matmul(dst=s, stationary=item.alibi_st[tile.h], moving=item.pos_tab[:, col:col + w])
    return s


def _alibi_positions(cfg, kt0, item):
    """Key-block step of ``_alibi_matmul``: the key positions ``j = k0 + x`` of the key block starting at key
    ``k0 = kt0 * 512`` as bfloat16 rows of ``item.pos_tab``: rows 0-2 ``256 floor(j / 256)``, rows 32-34
    ``j mod 256`` (both exact in bfloat16); rows 3-31 stay 0 (set once per launch)."""
    k0 = kt0 * K_TILE
    kbw = cfg.kb_tiles * K_TILE
    nisa.iota(dst=item.pos_tab[0:3, :], pattern=[[256, kbw // 256], [0, 256]], offset=k0, channel_multiplier=0)
    nisa.iota(dst=item.pos_tab[32:35, :], pattern=[[0, kbw // 256], [1, 256]], offset=0, channel_multiplier=0)


def _alibi_stationaries(cfg, slope_e):
    """Per query head of the group a bfloat16 ``[35, 128]`` stationary for ``_alibi_matmul``: ``slope / e``
    split into three bfloat16 parts ``s1 + s2 + s3`` (float32-exact), on partitions 0-2 and again 32-34 (the
    rows that meet the high and the low part of the key position), zero elsewhere. Built as ``[128, 35]``
    columns and transposed by TensorE (a partition slice may only start at 0/32/64/96)."""
    g = cfg.group
    parts = nl.ndarray((PMAX, g, 3), dtype=nl.bfloat16, buffer=nl.sbuf)
    rest = nl.ndarray((PMAX, g), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=parts[:, :, 0], src=slope_e)
    nisa.tensor_tensor(dst=rest, data1=slope_e, data2=parts[:, :, 0], op=nl.subtract)
    nisa.tensor_copy(dst=parts[:, :, 1], src=rest)
    nisa.tensor_tensor(dst=rest, data1=rest, data2=parts[:, :, 1], op=nl.subtract)
    nisa.tensor_copy(dst=parts[:, :, 2], src=rest)
    cols = nl.ndarray((PMAX, 35), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.memset(dst=cols, value=0.0, engine=nisa.engine.gpsimd)
    out = []
    for h in range(g):
        nisa.tensor_copy(dst=cols[:, 0:3], src=parts[:, h, :])
        nisa.tensor_copy(dst=cols[:, 32:35], src=parts[:, h, :])
        st_ps = nl.ndarray((35, PMAX), dtype=nl.bfloat16, buffer=nl.psum)
        nisa.nc_transpose(dst=st_ps, data=cols)
        st = nl.ndarray((35, PMAX), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_copy(dst=st, src=st_ps)
        out.append(st)
    return out


def _alibi_lse(cfg, t0, j0, lse_real, item):
    """Finishing step of ``_alibi_matmul``: add the dropped per-row term ``-slope (i + off)`` to the LSE of the
    block's members (member j: query tile ``t0 + j // group``, head ``j % group``)."""
    g = cfg.group
    n = lse_real.shape[1]
    qpos = nl.ndarray((PMAX, n), dtype=nl.float32, buffer=nl.sbuf)
    first = (t0 + j0 // g) * PMAX + cfg.off
    if g <= cfg.block_members_max:
        nisa.iota(dst=qpos, pattern=[[PMAX, n // g], [0, g]], offset=first, channel_multiplier=1)
    else:
        nisa.iota(dst=qpos, pattern=[[0, n]], offset=first, channel_multiplier=1)
    nisa.tensor_tensor(dst=qpos, data1=qpos, data2=per_member(cfg, item.slopes, j0, n), op=nl.multiply)
    nisa.tensor_tensor(dst=lse_real, data1=lse_real, data2=qpos, op=nl.add)


def _alibi_coefs_fwd(cfg, sl):
    """The forward's ALiBi operands from the broadcast slopes ``sl`` (``steps.load_slopes``): for
    ``_alibi_scores`` ``(-slope / exp_scale, None)`` (the factor it multiplies the distance by), for
    ``_alibi_matmul`` ``(-slope, stationaries)`` (``-slope`` for the LSE correction)."""
    g = cfg.group
    if cfg.alibi_mm:
        # -slope for the LSE correction; slope / e for the stationaries
        slope_e = nl.ndarray((PMAX, g), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=slope_e, data=sl, op0=nl.multiply, operand0=1.0 / cfg.exp_scale)
        nisa.tensor_scalar(dst=sl, data=sl, op0=nl.multiply, operand0=-1.0)
        return sl, _alibi_stationaries(cfg, slope_e)
    nisa.tensor_scalar(dst=sl, data=sl, op0=nl.multiply, operand0=-1.0 / cfg.exp_scale)
    return sl, None


# the backward's
def _bias_alibi(c, tile, item, s):
    """Score step, ALiBi, logits += -slope * |i + off - j|, generated in the kernel: the distance x = i + off - j
    is ONE GpSimdE iota (exact integers in fp32), then ONE VectorE ``scalar_tensor_tensor`` data + x * coef, with
    coef = -slope / e (``item.slopes``, per query head, the exp's scale e divided out). Where the tile's
    band-visible entries lie on one side of the diagonal (every causal tile), |x| = +-x; a tile that straddles it
    (non-causal) takes one more VectorE op for |x|. Entries outside the band get a wrong bias but are masked
    after the exp."""
    g = tile.h
    neg_col = item.slopes[:, g:g + 1]
    pos_col = item.slopes_pos[:, g:g + 1]
    x = nl.ndarray((PMAX, tile.kw), dtype=nl.float32, buffer=nl.sbuf)
    base = tile.q0 + c.off - tile.k0
    nisa.iota(dst=x, pattern=[[-1, tile.kw]], offset=base, channel_multiplier=1)
    # range of x over the tile's entries that the band leaves visible (trace time)
    x_lo = max(base - (tile.kw - 1), c.off - c.hi_rel)
    x_hi = min(base + PMAX - 1, c.off - c.lo_rel)
    out = nl.ndarray((PMAX, tile.kw), dtype=nl.float32, buffer=nl.sbuf)
    if x_lo >= 0:
        nisa.scalar_tensor_tensor(dst=out, data=x, op0=nl.multiply, operand0=neg_col, op1=nl.add, operand1=s)
    elif x_hi <= 0:
        nisa.scalar_tensor_tensor(dst=out, data=x, op0=nl.multiply, operand0=pos_col, op1=nl.add, operand1=s)
    else:
        nisa.tensor_scalar(dst=x, data=x, op0=nl.abs, operand0=0.0, op1=nl.multiply, operand1=neg_col)
        nisa.tensor_tensor(dst=out, data1=s, data2=x, op=nl.add)
    return out


def _grad_softcap(c, tile, item, p):
    """Soft-capping's chain rule: dS = (dP - D) * P * (1 - tanh^2(S / cap)), so the dS step gets
    P * (1 - t^2) (fp32; t saved by ``softcap_scores``): t^2 on GpSimdE, (1 - t^2) * P on VectorE. P
    itself still feeds the dV matmul."""
    t = tile.saved["tanh"]
    u = nl.ndarray((PMAX, tile.kw), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=u, data1=t, data2=t, op=nl.multiply, engine=nisa.engine.gpsimd)
    pc = nl.ndarray((PMAX, tile.kw), dtype=nl.float32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=pc, data=u, op0=nl.subtract, operand0=1.0, reverse0=True, op1=nl.multiply,
                              operand1=p)
    return pc


def _alibi_coefs_bwd(c, sl):
    """ALiBi coefficients of the kv head's query heads from the broadcast slopes ``sl`` (``steps.load_slopes``),
    [128, group] fp32 each: (-slope / e, +slope / e) with e the scale of the exp's input (``c.exp_scale``: the
    cap with soft-capping). Two ops per work item."""
    neg = nl.ndarray((PMAX, c.group), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=neg, data=sl, op0=nl.multiply, operand0=-1.0 / c.exp_scale)
    pos = nl.ndarray((PMAX, c.group), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=pos, data=sl, op0=nl.multiply, operand0=1.0 / c.exp_scale)
    return neg, pos


def _logit_scale_keep_s(c, tile, item, s):
    """The logit scale's score step (``logit_scale_scores``), keeping the unscaled S (PSUM) for the
    gradient: ``tile.saved["s_raw"]`` (the visit's S bank stays live until its dS, as ``psum_banks`` counts;
    the forward, which holds many tiles' scores at once, keeps none)."""
    tile.saved["s_raw"] = s
    return logit_scale_scores(c, tile, item, s)


def _ds_logit_scale(c, tile, item, ds):
    """The logit scale's dS step: with z = lam S the exp's input (``logit_scale_scores``; lam = scale[h]),
    the float32 dS of z gives its gradient, d lam = softmax_scale * sum dS * S (``_logit_scale_keep_s`` kept S),
    and the dS operand of dK and dQ,
    lam dS (rounded ONCE to the matmul dtype: dS reaches this step in float32, ``c.ds_dtype``). Per visit: dS * S
    (VectorE, S read from PSUM where it still lies), its row sum added into the member's column of
    ``item.state["dlogit"]`` (the rows' partial sums: reduced over rows, query tiles and keys once per work item,
    ``_store_dlogit``), and lam dS on ScalarE (a per-partition ``scale``)."""
    h = tile.h
    prod = nl.ndarray((PMAX, tile.kw), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=prod, data1=ds, data2=tile.saved["s_raw"], op=nl.multiply)
    part = nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=part, op=nl.add, data=prod, axis=1)
    acc = item.state["dlogit"][:, h, tile.t:tile.t + 1]
    nisa.tensor_tensor(dst=acc, data1=acc, data2=part, op=nl.add)
    out = nl.ndarray((PMAX, tile.kw), dtype=c.mm_dtype, buffer=nl.sbuf)
    nisa.activation(dst=out, op=nl.copy, data=ds, scale=item.state["logit_scale"][:, h:h + 1])
    return out


def _zero_dlogit(c, hbm, item):
    """Work-item start step of the logit scale: the per-row partial sums of its gradient, ``item.state["dlogit"]``
    ``[128, group, nq]`` float32, zeroed."""
    acc = nl.ndarray((PMAX, c.group, c.nq), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=acc, value=0.0, engine=nisa.engine.gpsimd)
    item.state["dlogit"] = acc


def _store_dlogit(c, hbm, item):
    """Work-item end step of the logit scale: d lam of the kv head's query heads = softmax_scale * the sum of
    ``item.state["dlogit"]`` over query tiles (VectorE) and partitions (GpSimdE), one DMA into the gradient output
    ``dlogit_scale[b, heads]`` (``hbm.grads["logit_scale"]``, ``[bs, nheads]``; the host sums over the batch for a
    ``[nheads]`` scale)."""
    g = c.group
    red = nl.ndarray((PMAX, g), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=red, op=nl.add, data=item.state["dlogit"], axis=2)
    tot = nl.ndarray((1, g), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_partition_reduce(dst=tot, op=nl.add, data=red)
    nisa.tensor_scalar(dst=tot, data=tot, op0=nl.multiply, operand0=c.scale)
    nisa.dma_copy(dst=hbm.grads["logit_scale"][item.b, item.kvh * g:(item.kvh + 1) * g], src=tot)


def _ds_bias(c, tile, item, dp):
    """dS step when the bias takes a gradient: dL = (dP [* keep] - D) * P in float32, the gradient of the logit
    the bias is added to (after the scale and the cap), which IS the bias's gradient at this (query, key); ONE
    DMA writes it into the float32 ``item.dbias`` ``[bs, nheads, seqlen_q, seqlen_k]`` at the tile's place.
    Then dS for the matmuls, rounded once to the matmul dtype: a GpSimdE cast of dL, or with soft-capping
    ``(dP - D) * P (1 - tanh^2)`` (the fused op of ``_ds_plain`` on the grad steps' operand). One float32
    VectorE op and one DMA per tile more than ``_ds_plain`` (a cast on the otherwise idle GpSimdE)."""
    dl = dp
    if c.dropout:
        dl = nl.ndarray((PMAX, tile.kw), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=dl, data1=dp, data2=tile.saved["keep"], op=nl.multiply)
    dsl = nl.ndarray((PMAX, tile.kw), dtype=nl.float32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=dsl, data=dl, op0=nl.subtract, operand0=tile.d_col, op1=nl.multiply,
                              operand1=tile.saved["p"])  # P as the exponent left it (``_visit_a``)
    nisa.dma_copy(dst=item.dbias[tile.b, tile.hq, tile.q0:tile.q0 + PMAX, tile.k0:tile.k0 + tile.kw], src=dsl)
    ds = nl.ndarray((PMAX, tile.kw), dtype=c.ds_dtype, buffer=nl.sbuf)
    if c.softcap > 0.0:
        nisa.scalar_tensor_tensor(dst=ds, data=dl, op0=nl.subtract, operand0=tile.d_col, op1=nl.multiply,
                                  operand1=tile.saved["p_ds"])
    else:
        nisa.tensor_copy(dst=ds, src=dsl, engine=nisa.engine.gpsimd)
    return ds


def _dbias_zero(c, hbm, item):
    """Work-item start step of the bias gradient: zeros into ``item.dbias`` wherever no visit writes dS, i.e. the keys
    outside the visited 128-key chunks of every (query head, query tile) of the kv head (the band's skipped
    tiles and trimmed chunks, the rows that see no key), so the output is defined everywhere. One float32
    ``[128, 512]`` zero tile and one DMA per 512 keys of each gap; the visits' keys come from the trace-time plan
    (``c.tiles``), in increasing key order."""
    zero = nl.ndarray((PMAX, K_TILE), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=zero, value=0.0, engine=nisa.engine.gpsimd)
    for i in range(c.nq):
        gaps = []
        pos = 0
        for s in range(c.n_sections):
            for kt in c.tiles[s][i]:
                if kt.k0 > pos:
                    gaps.append((pos, kt.k0))
                pos = kt.k1
        if pos < c.seqlen_k:
            gaps.append((pos, c.seqlen_k))
        for g in range(c.group):
            hq = item.kvh * c.group + g
            for gap in gaps:
                a, e = gap
                for j0 in range(a, e, K_TILE):
                    j1 = min(j0 + K_TILE, e)
                    nisa.dma_copy(dst=item.dbias[item.b, hq, i * PMAX:(i + 1) * PMAX, j0:j1], src=zero[:, 0:j1 - j0])
