"""Torch golden model of the flash-attention forward pass (Trainium layout).

Every forward kernel result in this project is judged against this module.
It is deliberately written the long way (full score matrix, explicit masks)
and imports nothing from ``nki_attn``.  The rules are restated, with worked
examples, in ``docs/semantics.md``.

Layouts (head_dim BEFORE sequence, as the kernels use them)
-----------------------------------------------------------
* ``q``    ``[bs, nheads,    d_qk, seqlen_q]``
* ``k``    ``[bs, nheads_kv, d_qk, seqlen_k]``
* ``v``    ``[bs, nheads_kv, d_v,  seqlen_k]`` (``d_v`` may differ from ``d_qk``)
* ``o``    ``[bs, nheads,    d_v,  seqlen_q]``
* ``lse``  ``[bs, nheads, 128, seqlen_q // 128]``; ``lse[b, h, p, t]`` is the
  log-sum-exp of query row ``t * 128 + p``.  ``seqlen_q`` must therefore be a
  multiple of 128.
* ``probs`` ``[bs, nheads, seqlen_q, seqlen_k + num_sinks]`` (sink columns last)

Semantics (in this order; ``off = seqlen_k - seqlen_q``)
--------------------------------------------------------
* scale: ``S = softmax_scale * (q_i . k_j)`` with ``softmax_scale`` defaulting
  to ``1 / sqrt(d_qk)``; times ``logit_scale[b, h]`` (float32 ``[bs, nheads]``)
  when given, before soft-capping and ALiBi.
* soft-capping ``softcap = c > 0``: ``S = c * tanh(S / c)``.
* ALiBi ``alibi_slopes`` ``[bs, nheads]`` float32: ``S += -slope * |i + off - j|``;
  the additive bias ``attn_bias`` (``compute_o_lse`` also takes it under its
  older name ``logit_bias``) is added after it.
* masks, all ANDed (bottom-right aligned, so any ``seqlen_q``/``seqlen_k``):
  causal ``j <= i + off``; sliding window ``W`` (integer >= 1, causal only)
  ``j >= i + off - W + 1``; ``window_size = (left, right)`` (-1 = unbounded,
  causal or not, not with ``sliding_window``)
  ``i + off - left <= j <= i + off + right``; packing: float32 vectors
  ``bound_min``, ``bound_max`` of length ``seqlen_q`` with
  ``bound_min[i] <= j < bound_max[i]`` (build them from FlashAttention
  ``cu_seqlens`` with :func:`packing_bounds`).
* GQA / MQA: ``nheads % nheads_kv == 0``; query head ``h`` reads kv head
  ``h // (nheads // nheads_kv)``.
* sinks ``[bs, nheads]`` or ``[bs, nheads, num_sinks]``: extra logits per
  head, NOT scaled, capped or biased, that join the softmax denominator (and
  the LSE) but contribute nothing to ``o``.
* empty rows: a query row that sees no key and has no sink gets ``o = 0``,
  ``lse = +inf`` and all-zero probs (FlashAttention's convention: a backward
  pass computing ``exp(S - lse)`` then gets 0, never NaN).
* dropout ``dropout_p = p``: ``o = (P * M / (1 - p)) V`` with the bool keep
  mask ``M`` (from ``dropout_seed`` through ``golden.dropout``, or given as
  ``dropout_mask``); ``lse`` and ``probs`` stay the pre-dropout softmax.

Precision model
---------------
The golden is dtype-generic; let ``dt`` be the common dtype of q, k, v.

* Matmuls (``q.k`` and ``P.v``) take operands in ``dt`` and their results are
  rounded to ``dt`` (torch's CPU matmul accumulates internally at higher
  precision and rounds once).
* The softmax (scale, soft-cap, bias, mask, row max, exp, row sum,
  normalisation, LSE, the dropout multiplier) runs in the *statistics dtype*
  ``sdt``; the ALiBi bias is formed in the accumulator dtype (float32, or
  float64 for float64 inputs) and then rounded to ``sdt``:

  ======================  ======================  ===================
  dt                      mixed_precision=True    mixed_precision=False
  ======================  ======================  ===================
  float64                 float64                 float64
  float32                 float32                 float32
  bfloat16 / float16      float32                 dt
  ======================  ======================  ===================

  ``P`` is rounded to ``dt`` only as the operand of the ``P.v`` matmul.
* With float64 inputs the golden therefore IS the float64 reference.
* ``lse`` is returned in the *accumulator dtype*: float64 for float64 inputs,
  float32 for every other input dtype (whatever ``mixed_precision`` is).
* ``probs`` is returned in ``sdt``.
"""

from __future__ import annotations

import importlib
import math
import numbers
from typing import Callable, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from . import _validate as _v

__all__ = ["compute_o_lse", "attention_fwd_torch_ref", "packing_bounds", "visibility_mask", "alibi_bias",
           "block_offset"]


def stats_dtype(dtype: torch.dtype, mixed_precision: bool) -> torch.dtype:
    """Dtype of the softmax statistics for inputs of ``dtype`` (see module docstring)."""
    if dtype == torch.float64:
        return torch.float64
    if mixed_precision or dtype == torch.float32:
        return torch.float32
    return dtype


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the returned LSE / dsinks: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _validate_fwd(fn: str, q, k, v, *, sinks, sinks_name: str, bound_min, bound_max,
                  use_causal_mask, mixed_precision, softmax_scale, sliding_window, mods: dict,
                  mod_names=None, dropout_mask=None, qkv_names=("q", "k", "v"), window_size=None,
                  dropout_p=None, dropout_seed=None, diag_offset=None) -> dict:
    """The single validation entry point of this module; returns the resolved arguments.

    ``sinks_name``/``qkv_names`` are the caller's parameter names, so that
    messages name the argument the user actually passed.  ``mods`` holds the
    score modifications' values by ``SCORE_STEPS`` keyword (as
    :func:`score_mods` collects them); each row's ``check`` validates its
    value, under the caller's name for it from ``mod_names`` (default: the
    keyword), and the resolved values come back under ``"mods"``.
    ``dropout_p=None`` selects ``compute_o_lse``'s raw-mask dropout (any
    bool/floating mask, no rescale); a number selects the kernels' dropout
    (``dropout_p`` with a seed or a bool keep mask, scaled by ``1/(1-p)``).
    ``diag_offset`` (None: ``seqlen_k - seqlen_q``) comes back resolved as
    ``"diag_offset"``; a block's (not None) rules out ``dropout_seed``, whose
    mask would number the block's rows from 0.
    """
    dims = _v.check_qkv(fn, q, k, v, names=qkv_names)
    causal, window, pair = _v.check_masking(fn, dims, use_causal_mask, sliding_window,
                                            bound_min, bound_max, window_size)
    mixed = _v.check_flag(fn, "mixed_precision", mixed_precision)
    scale = _v.check_scale(fn, softmax_scale, dims["d_head"])
    num_sinks = _v.check_sinks(fn, sinks_name, sinks, dims)
    names = mod_names or {}
    resolved = {row.keyword: row.check(fn, names.get(row.keyword, row.keyword), mods.get(row.keyword, row.off), dims)
                for row in SCORE_STEPS}
    full = (dims["bs"], dims["nheads"], dims["seqlen_q"], dims["seqlen_k"])
    p = 0.0
    if dropout_p is None:
        if dropout_mask is not None:
            _v.check_tensor(fn, "dropout_mask", dropout_mask)
            if tuple(dropout_mask.shape) != full:
                _v.fail(fn, "dropout_mask.shape", tuple(dropout_mask.shape),
                        f"must be [bs, nheads, seqlen_q, seqlen_k] = {list(full)}")
            if not (dropout_mask.dtype == torch.bool or dropout_mask.is_floating_point()):
                _v.fail(fn, "dropout_mask.dtype", dropout_mask.dtype, "must be bool or floating")
    else:
        p = _v.check_dropout(fn, dropout_p, dropout_seed, dropout_mask, dims)
    off = band_offset(dims["seqlen_q"], dims["seqlen_k"])
    if diag_offset is not None:
        if isinstance(diag_offset, bool) or not isinstance(diag_offset, numbers.Integral):
            _v.fail(fn, "diag_offset", repr(diag_offset), "must be an int (block_offset) or None")
        if p and dropout_seed is not None:
            _v.fail(fn, "dropout_seed", "given with diag_offset",
                    "a block of a longer problem takes its rows of the keep mask as dropout_mask")
        off = int(diag_offset)
    return dict(dims, causal=causal, window=window, window_size=pair, mixed=mixed, scale=scale,
                num_sinks=num_sinks, dropout_p=p, mods=resolved, diag_offset=off)


def band_offset(seqlen_q: int, seqlen_k: int) -> int:
    """The diagonal offset ``seqlen_k - seqlen_q``: query i's "own" key is ``i + off``.

    Causal masks, windows and ALiBi are bottom-right aligned (FlashAttention >= 2.1):
    the last query lines up with the last key.
    """
    return seqlen_k - seqlen_q


def block_offset(seqlen_q: int, seqlen_k: int, q_start: int = 0, k_start: int = 0) -> int:
    """The ``diag_offset`` of a block of a longer problem: the block's query row
    ``i'`` is row ``q_start + i'`` and its key ``j'`` key ``k_start + j'`` of a
    problem of ``seqlen_q`` queries and ``seqlen_k`` keys, so its masks and ALiBi
    distances are the whole problem's when ``i' + diag_offset - j'`` equals
    ``(q_start + i') + (seqlen_k - seqlen_q) - (k_start + j')``.

    Pass it (with the block's rows of the packing bounds, shifted by
    ``-k_start``, its slice of ``attn_bias`` and of the dropout keep mask) to
    the golden's ``diag_offset`` keywords to compute the block on its own.
    """
    return band_offset(seqlen_q, seqlen_k) + q_start - k_start


def visibility_mask(seqlen_q: int, seqlen_k: int, causal: bool = False,
                    window: Optional[int] = None,
                    bound_min: Optional[torch.Tensor] = None,
                    bound_max: Optional[torch.Tensor] = None,
                    window_size: Optional[Tuple[int, int]] = None,
                    diag_offset: Optional[int] = None) -> torch.Tensor:
    """Boolean ``[seqlen_q, seqlen_k]`` matrix, True where query i may see key j.

    With ``off = seqlen_k - seqlen_q`` all rules are ANDed: causal
    (``j <= i + off``), sliding window W (``j >= i + off - W + 1``),
    ``window_size = (left, right)`` (``i + off - left <= j <= i + off + right``,
    a side of -1 unbounded), packing (``bound_min[i] <= j < bound_max[i]``,
    float32 ``[seqlen_q]``).  ``diag_offset`` replaces ``off`` (see
    :func:`block_offset`: the mask of a block of a longer problem).
    No argument checking: callers validate first.
    """
    off = band_offset(seqlen_q, seqlen_k) if diag_offset is None else int(diag_offset)
    i = torch.arange(seqlen_q).unsqueeze(1)
    j = torch.arange(seqlen_k).unsqueeze(0)
    vis = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    if causal:
        vis &= j <= i + off
    if window is not None:
        vis &= j >= i + off - window + 1
    if window_size is not None:
        left, right = window_size
        if left >= 0:
            vis &= j >= i + off - left
        if right >= 0:
            vis &= j <= i + off + right
    if bound_min is not None:
        # float64 holds every key index and every float32 bound exactly, so
        # the comparison is the mathematical one.
        jf = j.to(torch.float64)
        vis &= (bound_min.detach().cpu().to(torch.float64).unsqueeze(1) <= jf)
        vis &= (jf < bound_max.detach().cpu().to(torch.float64).unsqueeze(1))
    return vis


def alibi_bias(alibi_slopes: torch.Tensor, seqlen_q: int, seqlen_k: int,
               dtype: torch.dtype = torch.float32, diag_offset: Optional[int] = None) -> torch.Tensor:
    """ALiBi bias ``[bs, nheads, seqlen_q, seqlen_k]``: ``-slope[b, h] * |i + off - j|``.

    ``alibi_slopes`` is ``[bs, nheads]``; ``off = seqlen_k - seqlen_q`` (bottom-right
    alignment, FlashAttention's), or ``diag_offset`` when given (see
    :func:`block_offset`).  The distance is an exact integer; the product
    is formed in ``dtype`` (one rounding).  Causal and non-causal use the same
    formula (see docs/semantics.md on FlashAttention's causal variant, which
    differs by a per-row constant).
    """
    off = band_offset(seqlen_q, seqlen_k) if diag_offset is None else int(diag_offset)
    i = torch.arange(seqlen_q, dtype=torch.int64).unsqueeze(1)
    j = torch.arange(seqlen_k, dtype=torch.int64).unsqueeze(0)
    dist = (i + off - j).abs().to(dtype)
    slopes = alibi_slopes.detach().to(dtype).reshape(*alibi_slopes.shape, 1, 1)
    return -(slopes * dist)


def _keep_mask_from_seed(a: dict, dropout_seed) -> torch.Tensor:
    """The bool keep mask ``[bs, nheads, seqlen_q, seqlen_k]`` of ``dropout_seed``.

    The one call into ``golden.dropout`` (written with the kernels' dropout
    tile step): ``keep_mask(seed, dropout_p, bs, nheads, seqlen_q, seqlen_k)``,
    a pure function of (seed, b, h, i, j) with h the query head.
    """
    try:
        _dropout = importlib.import_module(f"{__package__}.dropout")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__package__}.dropout":
            raise
        _v.fail("golden", "dropout_seed", repr(dropout_seed),
                "golden.dropout (the keep-mask generator) is not available; pass dropout_mask instead")
    return _dropout.keep_mask(dropout_seed, a["dropout_p"], a["bs"], a["nheads"],
                              a["seqlen_q"], a["seqlen_k"])


def compute_o_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  use_causal_mask: bool = True, mixed_precision: bool = True,
                  softmax_scale: Optional[float] = None,
                  logit_bias: Optional[torch.Tensor] = None,
                  sliding_window: Optional[int] = None,
                  dropout_mask: Optional[torch.Tensor] = None,
                  sinks: Optional[torch.Tensor] = None,
                  bound_min: Optional[torch.Tensor] = None,
                  bound_max: Optional[torch.Tensor] = None,
                  softcap: float = 0.0,
                  alibi_slopes: Optional[torch.Tensor] = None,
                  window_size: Optional[Tuple[int, int]] = None,
                  logit_scale: Optional[torch.Tensor] = None,
                  attn_bias: Optional[torch.Tensor] = None):
    """Attention forward by the definition; returns ``(o, lse, probs)``.

    The score modifications' keywords (``logit_scale``, ``softcap``,
    ``alibi_slopes``, ``attn_bias``) are the kernels'; each is checked and
    applied by its ``SCORE_STEPS`` row.

    Args:
        q: ``[bs, nheads, d_qk, seqlen_q]``, seqlen_q a multiple of 128.
        k: ``[bs, nheads_kv, d_qk, seqlen_k]``; v: ``[bs, nheads_kv, d_v, seqlen_k]``;
            same dtype as q.
        use_causal_mask: mask key j for query i when ``j > i + seqlen_k - seqlen_q``
            (bottom-right aligned; top-left when the lengths are equal).
        mixed_precision: softmax statistics in float32 for 16-bit inputs
            (see the module's precision model).
        softmax_scale: multiplies ``q.k``; default ``1 / sqrt(d_qk)``.
        logit_bias: the additive bias under its older name (``attn_bias``,
            the kernels' name, is the same argument; give one of the two).
        sliding_window: W >= 1 (causal only): query i sees keys ``i+off-W+1 .. i+off``.
        dropout_mask: optional bool/floating ``[bs, nheads, seqlen_q, seqlen_k]``;
            ``o = (probs[..., :seqlen_k] * dropout_mask) @ v``.  No
            ``1/(1-p)`` rescale here: put it in the mask values if wanted (the
            kernel-signature functions take ``dropout_p`` and do it).
            ``probs`` and ``lse`` are the pre-dropout softmax.
        sinks: optional ``[bs, nheads]`` or ``[bs, nheads, num_sinks]`` logits
            (not scaled, capped or biased) appended as the last softmax columns.
        bound_min, bound_max: optional float32 ``[seqlen_q]`` packing bounds
            (both or neither); key j visible iff ``bound_min[i] <= j < bound_max[i]``.
        softcap: c >= 0; c > 0 replaces the scaled score S by ``c * tanh(S / c)``.
        alibi_slopes: optional float32 ``[bs, nheads]``; adds
            ``-slope * |i + off - j|`` after soft-capping.
        window_size: optional ``(left, right)``, -1 = unbounded: query i sees keys
            ``i + off - left .. i + off + right``; not with ``sliding_window``.
        logit_scale: optional float32 ``[bs, nheads]``, multiplies the scaled
            scores before soft-capping and ALiBi.
        attn_bias: optional floating tensor broadcastable to
            ``[bs, nheads, seqlen_q, seqlen_k]``, added to the scaled (and capped)
            scores after ALiBi.

    Returns:
        o: ``[bs, nheads, d_v, seqlen_q]`` in q's dtype (0 for empty rows).
        lse: ``[bs, nheads, 128, seqlen_q // 128]``, float32 (float64 for
            float64 inputs); ``lse[b, h, p, t]`` belongs to query row
            ``t * 128 + p``; ``+inf`` for empty rows.
        probs: ``[bs, nheads, seqlen_q, seqlen_k + num_sinks]`` in the
            statistics dtype, sink columns last (all 0 for empty rows).

    Raises:
        ValueError: naming the offending argument, its value and the rule.
    """
    mods = score_mods(locals())
    names = None
    if logit_bias is not None:
        if attn_bias is not None:
            _v.fail("compute_o_lse", "logit_bias", "a tensor",
                    "is attn_bias under its older name; give one of the two, not both")
        mods["attn_bias"], names = logit_bias, {"attn_bias": "logit_bias"}
    a = _validate_fwd("compute_o_lse", q, k, v, sinks=sinks, sinks_name="sinks",
                      bound_min=bound_min, bound_max=bound_max,
                      use_causal_mask=use_causal_mask, mixed_precision=mixed_precision,
                      softmax_scale=softmax_scale, sliding_window=sliding_window, mods=mods,
                      mod_names=names, dropout_mask=dropout_mask, window_size=window_size)
    f = _forward(q, k, v, a, dropout_mask, sinks, bound_min, bound_max)
    return f["o"], f["lse"], f["probs"]


def _sum_to(x: torch.Tensor, shape: tuple) -> torch.Tensor:
    """``x`` ``[bs, nheads, seqlen_q, seqlen_k]`` summed over the dims a tensor of
    ``shape`` (broadcastable to it) broadcasts, viewed as ``shape``."""
    lead = x.dim() - len(shape)
    dims = list(range(lead))
    for i, n in enumerate(shape):
        if n == 1 and x.shape[lead + i] != 1:
            dims.append(lead + i)
    if dims:
        x = x.sum(dim=dims, keepdim=True)
    return x.reshape(shape)


class ScoreStep(NamedTuple):
    """One score modification of the golden, declared once (a row of ``SCORE_STEPS``).

    * ``keyword``: its keyword in the golden's entry points, the kernels' keyword;
    * ``forward(s, value, a)``: the scores S ``[bs, nheads, seqlen_q, seqlen_k]``
      (statistics dtype) modified, and what its backward keeps;
    * ``backward(ds, value, kept, a)`` (None: dS passes unchanged): dL/d(its
      output) to dL/d(its input), and the gradient of ``value`` (None: none);
    * ``grad_key``: the key ``attention_bwd_torch_ref`` reports that gradient
      under (None: none);
    * ``check(fn, name, value, dims)``: its argument rule, run by the golden's
      validation before any work; raises ``ValueError`` (``_validate.fail``:
      function, argument ``name`` as the caller spells it, value, rule) and
      returns the value as the steps take it;
    * ``off``: the value meaning "not applied" (the keyword's default).

    ``a`` is the validated arguments plus ``adt`` (acc_dtype); the steps read
    only its ``bs``, ``nheads``, ``seqlen_q``, ``seqlen_k``, ``scale`` and ``adt``.
    """
    keyword: str
    forward: Callable
    backward: Optional[Callable]
    grad_key: Optional[str]
    check: Callable
    off: object = None


def _logit_scale_fwd(s, lam, a):
    return s * lam.to(device=s.device, dtype=s.dtype)[..., None, None], s


def _logit_scale_bwd(ds, lam, s0, a):
    return ds * lam.to(device=ds.device, dtype=ds.dtype)[..., None, None], (ds * s0).sum(dim=(2, 3))


def _logit_scale_check(fn, name, logit_scale, dims):
    """The per-head logit scale: float32 ``[bs, nheads]``, finite (None = none)."""
    if logit_scale is None:
        return None
    _v.check_tensor(fn, name, logit_scale)
    want = (dims["bs"], dims["nheads"])
    if tuple(logit_scale.shape) != want:
        _v.fail(fn, f"{name}.shape", tuple(logit_scale.shape), f"must be [bs, nheads] = {list(want)}")
    if logit_scale.dtype not in (torch.float32, torch.float64):
        _v.fail(fn, f"{name}.dtype", logit_scale.dtype, "must be float32 (float64 for a float64 reference)")
    if not bool(torch.isfinite(logit_scale).all()):
        _v.fail(fn, name, "tensor with inf/NaN", "scales must be finite")
    return logit_scale


def _softcap_fwd(s, c, a):
    th = torch.tanh(s / c)
    return c * th, 1.0 - th * th     # d(c tanh(x / c)) / dx


def _softcap_bwd(ds, c, cap_grad, a):
    return ds * cap_grad, None


def _softcap_check(fn, name, softcap, dims):
    """``softcap`` as a float: a finite number >= 0 (0 = off, FlashAttention's convention)."""
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        _v.fail(fn, name, repr(softcap), "must be a real number >= 0 (0 disables soft-capping)")
    cap = float(softcap)
    if not (math.isfinite(cap) and cap >= 0.0):
        _v.fail(fn, name, cap, "must be finite and >= 0 (0 disables soft-capping)")
    return cap


def _alibi_fwd(s, slopes, a):
    return s + alibi_bias(slopes, a["seqlen_q"], a["seqlen_k"], a["adt"],
                          a.get("diag_offset")).to(device=s.device, dtype=s.dtype), None


def _alibi_check(fn, name, alibi_slopes, dims):
    """ALiBi slopes: float32 ``[bs, nheads]``, finite (None = no ALiBi)."""
    if alibi_slopes is None:
        return None
    _v.check_tensor(fn, name, alibi_slopes)
    want = (dims["bs"], dims["nheads"])
    if tuple(alibi_slopes.shape) != want:
        _v.fail(fn, f"{name}.shape", tuple(alibi_slopes.shape),
                f"must be [bs, nheads] = {list(want)} (broadcast FlashAttention's [nheads] first)")
    if alibi_slopes.dtype != torch.float32:
        _v.fail(fn, f"{name}.dtype", alibi_slopes.dtype, "must be float32 (FlashAttention's convention)")
    if not bool(torch.isfinite(alibi_slopes).all()):
        _v.fail(fn, name, "tensor with inf/NaN", "slopes must be finite")
    return alibi_slopes


def _bias_fwd(s, bias, a):
    return s + bias.to(device=s.device, dtype=s.dtype), None


def _bias_bwd(ds, bias, kept, a):
    return ds, _sum_to(ds.to(a["adt"]), tuple(bias.shape))


def _bias_check(fn, name, bias, dims):
    """The additive bias: a floating tensor broadcastable to ``[bs, nheads, seqlen_q, seqlen_k]`` (None = none)."""
    if bias is None:
        return None
    _v.check_tensor(fn, name, bias)
    if not bias.is_floating_point():
        _v.fail(fn, f"{name}.dtype", bias.dtype, "must be a floating dtype")
    full = (dims["bs"], dims["nheads"], dims["seqlen_q"], dims["seqlen_k"])
    try:
        ok = torch.broadcast_shapes(tuple(bias.shape), full) == full
    except RuntimeError:
        ok = False
    if not ok:
        _v.fail(fn, f"{name}.shape", tuple(bias.shape),
                f"must broadcast to [bs, nheads, seqlen_q, seqlen_k] = {list(full)}")
    return bias


# In the order the modifications apply to the scaled scores; the backward runs
# them in reverse.
SCORE_STEPS = (
    ScoreStep("logit_scale", _logit_scale_fwd, _logit_scale_bwd, "out_dlogit_scale_ref", _logit_scale_check),
    ScoreStep("softcap", _softcap_fwd, _softcap_bwd, None, _softcap_check, 0.0),
    ScoreStep("alibi_slopes", _alibi_fwd, None, None, _alibi_check),
    ScoreStep("attn_bias", _bias_fwd, _bias_bwd, "out_dbias_ref", _bias_check),
)


def score_mods(args: dict) -> dict:
    """The score modifications' values ``{keyword: value}`` taken from an entry
    point's ``locals()`` (its parameters), one per ``SCORE_STEPS`` row."""
    return {row.keyword: args[row.keyword] for row in SCORE_STEPS}


def _is_on(value) -> bool:
    return value is not None and not (isinstance(value, float) and value == 0.0)


def _forward(q, k, v, a, dropout_mask, sinks, bound_min, bound_max) -> dict:
    """Forward on validated arguments ``a`` (the dict from ``_validate_fwd``).

    ``a["mods"]``: ``{keyword: value}`` of the score modifications (``SCORE_STEPS``).
    ``dropout_mask`` here is the multiplier of the probabilities as given
    (bool, or floating values already holding any ``1/(1-p)``).  Returns a dict:
    ``o``, ``lse``, ``probs`` (as :func:`compute_o_lse`) and, for the backward,
    ``steps`` (the modifications applied, in order, as ``(row, value, kept)``)
    and ``drop`` (the dropout multiplier in ``sdt``, or None).
    """
    bs, nheads, seqlen_q, seqlen_k = a["bs"], a["nheads"], a["seqlen_q"], a["seqlen_k"]
    dt = q.dtype
    sdt = stats_dtype(dt, a["mixed"])
    adt = acc_dtype(dt)

    # Work in [b, h, s, d]; each query head gets its own copy of its kv head.
    qt = q.transpose(-1, -2)
    kt = k.transpose(-1, -2).repeat_interleave(a["group"], dim=1)
    vt = v.transpose(-1, -2).repeat_interleave(a["group"], dim=1)

    # Matmul rounded to dt, everything softmax-related in sdt.
    s = torch.matmul(qt, kt.transpose(-1, -2)).to(sdt) * a["scale"]
    ctx = dict(a, adt=adt)
    steps = []
    for row in SCORE_STEPS:
        value = a["mods"][row.keyword]
        if _is_on(value):
            s, kept = row.forward(s, value, ctx)
            steps.append((row, value, kept))
    vis = visibility_mask(seqlen_q, seqlen_k, a["causal"], a["window"], bound_min, bound_max,
                          a["window_size"], a["diag_offset"])
    s = s.masked_fill(~vis.to(s.device), float("-inf"))
    if sinks is not None:
        sink_cols = sinks.to(device=s.device, dtype=sdt).reshape(bs, nheads, 1, a["num_sinks"])
        s = torch.cat([s, sink_cols.expand(bs, nheads, seqlen_q, a["num_sinks"])], dim=-1)

    m = s.amax(dim=-1, keepdim=True)
    # A row whose max is -inf has nothing to attend to.  Shifting by 0
    # instead of -inf keeps exp() at exactly 0 (no inf - inf = NaN), and
    # dividing by 1 instead of 0 keeps the probs at 0.
    empty = torch.isneginf(m)
    m_safe = torch.where(empty, torch.zeros_like(m), m)
    e = torch.exp(s - m_safe)
    row_sum = e.sum(dim=-1, keepdim=True)
    probs = e / torch.where(empty, torch.ones_like(row_sum), row_sum)
    lse_rows = torch.where(empty, torch.full_like(m, float("inf")),
                           m_safe + torch.log(row_sum)).squeeze(-1)

    p_keys = probs[..., :seqlen_k]
    drop = None
    if dropout_mask is not None:
        drop = dropout_mask.to(device=p_keys.device, dtype=sdt)
        p_keys = p_keys * drop
    o = torch.matmul(p_keys.to(dt), vt).transpose(-1, -2).contiguous()

    # Row r = t * 128 + p goes to [p, t]: split rows into tiles of 128, then
    # put the within-tile index first.
    lse = (lse_rows.to(adt)
           .reshape(bs, nheads, seqlen_q // _v.PARTITIONS, _v.PARTITIONS)
           .transpose(-1, -2).contiguous())
    return dict(o=o, lse=lse, probs=probs, steps=steps, drop=drop)


def dropout_multiplier(a: dict, dropout_seed, dropout_mask, dtype: torch.dtype):
    """The kernels' dropout as a probability multiplier: ``M / (1 - p)`` in ``dtype``
    (``M`` the bool keep mask, from ``dropout_mask`` or regenerated from
    ``dropout_seed``), or None when ``dropout_p == 0``."""
    if a["dropout_p"] == 0.0:
        return None
    keep = dropout_mask if dropout_mask is not None else _keep_mask_from_seed(a, dropout_seed)
    return keep.to(dtype) * (1.0 / (1.0 - a["dropout_p"]))


def attention_fwd_torch_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            sinks_ref: Optional[torch.Tensor] = None,
                            bound_min: Optional[torch.Tensor] = None,
                            bound_max: Optional[torch.Tensor] = None,
                            use_causal_mask: bool = False,
                            mixed_precision: bool = True,
                            softmax_scale: Optional[float] = None,
                            sliding_window: Optional[int] = None,
                            softcap: float = 0.0,
                            alibi_slopes: Optional[torch.Tensor] = None,
                            window_size: Optional[Tuple[int, int]] = None,
                            dropout_p: float = 0.0,
                            dropout_seed=None,
                            dropout_mask: Optional[torch.Tensor] = None,
                            attn_bias: Optional[torch.Tensor] = None,
                            logit_scale: Optional[torch.Tensor] = None,
                            diag_offset: Optional[int] = None):
    """Reference with the forward kernel's signature; returns ``(o, lse)``.

    Args:
        q: ``[bs, nheads, d_qk, seqlen_q]`` (seqlen_q a multiple of 128).
        k: ``[bs, nheads_kv, d_qk, seqlen_k]``; v: ``[bs, nheads_kv, d_v, seqlen_k]``.
        sinks_ref: optional ``[bs, nheads]`` or ``[bs, nheads, num_sinks]``.
        bound_min, bound_max: optional float32 ``[seqlen_q]`` packing bounds.
        use_causal_mask, mixed_precision, softmax_scale, sliding_window, softcap,
            alibi_slopes, window_size: as in :func:`compute_o_lse` (note the
            causal default here is False, as in the kernel).
        dropout_p: in [0, 1); the kept probabilities are scaled by ``1/(1-p)``;
            ``lse`` stays the pre-dropout one.
        dropout_seed: the kernel's seed (given iff ``dropout_p > 0``); the keep
            mask is regenerated with ``golden.dropout.keep_mask``.
        dropout_mask: golden only, instead of ``dropout_seed``: the bool keep
            mask ``[bs, nheads, seqlen_q, seqlen_k]`` (True = keep).
        attn_bias: optional floating tensor broadcastable to ``[bs, nheads,
            seqlen_q, seqlen_k]`` (the kernels take it 4-D, each dim 1 or full),
            added to the scaled and capped scores after ALiBi (as in
            :func:`compute_o_lse`).
        logit_scale: optional float32 ``[bs, nheads]`` (see :func:`compute_o_lse`).
        diag_offset: None, or the :func:`block_offset` of a block of query
            rows (all keys) of a longer problem, given as q ``[bs, nheads,
            d_qk, rows]`` with the block's rows of ``bound_min``/``bound_max``
            ``[rows]``, of ``attn_bias`` and of ``dropout_mask``: its o and lse
            are those rows of the whole problem's (every row's softmax sees
            all its keys), so a caller can bound its memory by blocks.

    Returns:
        o: ``[bs, nheads, d_v, seqlen_q]`` in q's dtype.
        lse: ``[bs, nheads, 128, seqlen_q // 128]``, float32 (float64 for
            float64 inputs), ``lse[b, h, p, t]`` for query row ``t * 128 + p``.
    """
    a = _validate_fwd("attention_fwd_torch_ref", q, k, v, sinks=sinks_ref,
                      sinks_name="sinks_ref", bound_min=bound_min, bound_max=bound_max,
                      use_causal_mask=use_causal_mask, mixed_precision=mixed_precision,
                      softmax_scale=softmax_scale, sliding_window=sliding_window,
                      mods=score_mods(locals()), window_size=window_size,
                      dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_mask=dropout_mask,
                      diag_offset=diag_offset)
    drop = dropout_multiplier(a, dropout_seed, dropout_mask, stats_dtype(q.dtype, a["mixed"]))
    f = _forward(q, k, v, a, drop, sinks_ref, bound_min, bound_max)
    return f["o"], f["lse"]


def _as_cu(name: str, cu) -> torch.Tensor:
    """Validate one cu_seqlens argument and return it as a 1-D int64 CPU tensor."""
    fn = "packing_bounds"
    t = torch.as_tensor(cu)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        _v.fail(fn, f"{name}.dtype", t.dtype, "cu_seqlens must be an integer tensor")
    if t.dim() != 1 or t.numel() < 2:
        _v.fail(fn, f"{name}.shape", tuple(t.shape),
                "must be 1-D [num_seqs + 1] with at least 2 entries")
    t = t.to(device="cpu", dtype=torch.int64)
    if int(t[0]) != 0:
        _v.fail(fn, f"{name}[0]", int(t[0]), "cu_seqlens must start at 0")
    if bool((t[1:] < t[:-1]).any()):
        _v.fail(fn, name, t.tolist(), "cu_seqlens must be non-decreasing")
    # float32 represents every integer up to 2**24 exactly; beyond that the
    # bounds could round onto a neighbouring key.
    if int(t[-1]) > 2 ** 24:
        _v.fail(fn, f"{name}[-1]", int(t[-1]), "must be <= 2**24 to be exact in float32")
    return t


def packing_bounds(cu_seqlens_q: Union[torch.Tensor, Sequence[int]],
                   cu_seqlens_k: Union[torch.Tensor, Sequence[int], None] = None,
                   seqlen_q: Optional[int] = None):
    """Turn FlashAttention ``cu_seqlens`` into per-query packing bounds.

    Args:
        cu_seqlens_q: int ``[num_seqs + 1]``, starting at 0, non-decreasing;
            sequence s owns query rows ``cu_seqlens_q[s] .. cu_seqlens_q[s+1]-1``.
        cu_seqlens_k: int ``[num_seqs + 1]`` for the keys; defaults to
            ``cu_seqlens_q`` (self-attention).
        seqlen_q: padded query length (>= ``cu_seqlens_q[-1]``); defaults to
            ``cu_seqlens_q[-1]``.

    Returns:
        ``(bound_min, bound_max)``, float32 ``[seqlen_q]``: query i of sequence
        s gets ``[cu_seqlens_k[s], cu_seqlens_k[s+1])``; padding rows
        (``i >= cu_seqlens_q[-1]``) get ``0, 0`` and so see no key.
    """
    fn = "packing_bounds"
    cu_q = _as_cu("cu_seqlens_q", cu_seqlens_q)
    cu_k = cu_q if cu_seqlens_k is None else _as_cu("cu_seqlens_k", cu_seqlens_k)
    if cu_k.numel() != cu_q.numel():
        _v.fail(fn, "cu_seqlens_k.shape", tuple(cu_k.shape),
                f"must have the same number of sequences as cu_seqlens_q (shape {tuple(cu_q.shape)})")
    total_q = int(cu_q[-1])
    if seqlen_q is None:
        seqlen_q = total_q
    if isinstance(seqlen_q, bool) or not isinstance(seqlen_q, int) or seqlen_q < total_q:
        _v.fail(fn, "seqlen_q", repr(seqlen_q),
                f"must be an int >= cu_seqlens_q[-1] = {total_q}")
    rows = torch.arange(seqlen_q)
    # right=True puts row i after every boundary <= i, i.e. into the last
    # sequence that starts at or before i (empty sequences are skipped).
    seq = torch.searchsorted(cu_q[1:], rows, right=True).clamp(max=cu_q.numel() - 2)
    inside = rows < total_q
    zero = torch.zeros(seqlen_q, dtype=torch.int64)
    bound_min = torch.where(inside, cu_k[seq], zero).to(torch.float32)
    bound_max = torch.where(inside, cu_k[seq + 1], zero).to(torch.float32)
    return bound_min, bound_max
