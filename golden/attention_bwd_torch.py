"""Torch golden model of the flash-attention backward pass (Trainium layout).

Every backward kernel result in this project is judged against this module.
It imports nothing from ``nki_attn``.  Semantics (scale, soft-capping, ALiBi,
causal, windows, packing bounds, GQA/MQA, sinks, empty rows, dropout, d_qk !=
d_v) are exactly those of :mod:`golden.attention_fwd_torch`; see also
``docs/semantics.md``.

Layouts
-------
* ``q_ref``, ``out_dq_ref``: ``[bs, nheads, d_qk, seqlen_q]``
* ``o_ref``, ``dy_ref``: ``[bs, nheads, d_v, seqlen_q]``
* ``k_ref``, ``out_dk_ref``: ``[bs, nheads_kv, d_qk, seqlen_k]``
* ``v_ref``, ``out_dv_ref``: ``[bs, nheads_kv, d_v, seqlen_k]``
* ``lse_ref``: ``[bs, nheads, 128, seqlen_q // 128]``
* ``sinks_ref``, ``out_dsinks_ref``: ``[bs, nheads]`` or ``[bs, nheads, num_sinks]``

Recompute, not mirror
---------------------
``o_ref`` and ``lse_ref`` are accepted (and shape-checked) only so the
signature matches the kernel's parameter for parameter.  Their values are
NOT used: the golden recomputes ``P`` from scratch with
:func:`golden.attention_fwd_torch.compute_o_lse`.  The golden proves the
arithmetic; it does not mirror the kernel's recompute strategy, so an
inconsistent ``o``/``lse`` handed to a kernel shows up as a mismatch.

Formulas (``P`` includes the sink columns, last)
------------------------------------------------
* ``dP = dO . V^T``, times the dropout multiplier ``M / (1 - p)`` when
  dropout is on, padded with zero columns for the sinks (sinks produce no
  output, so nothing flows back into them through ``o``);
* ``dS = softmax_dx(dP, P)`` = ``P * (dP - rowsum(dP * P))`` — the textbook
  Jacobian-vector product, deliberately NOT the ``rowsum(O * dO)`` shortcut
  the kernels use, so the shortcut is checked against the long way (with
  dropout ``rowsum(dP * P)`` equals ``rowsum(dO * O)`` of the dropped ``O``);
* soft-capping: ``dS_keys *= 1 - tanh^2(S / c)`` (``S`` the scaled, uncapped
  score), the chain rule through ``c * tanh(S / c)``; ALiBi and masks are
  additive constants and change nothing here;
* ``dV = P_drop^T . dO`` (``P_drop = P_keys * M / (1 - p)``, or ``P_keys``);
  ``dQ = scale * dS_keys . K``; ``dK = scale * dS_keys^T . Q`` (i.e.
  ``dS^T . (Q * scale)``);
* ``dK``/``dV`` of a kv head sum over all query heads that read it (GQA/MQA);
* logit scale ``lam = logit_scale[b, h]``: ``dS_keys *= lam`` on the way to
  dQ and dK, and ``dlogit_scale[b, h] = sum_ij dS_keys * S0`` (``dS_keys``
  after the soft-cap factor, ``S0`` the scaled score before the logit scale);
* ``dsinks[b, h, n] = sum_i dS[b, h, i, seqlen_k + n]`` (sinks are not
  scaled, so no scale factor), which equals ``-sum_i P_sink[i] * D_i`` with
  ``D_i = sum_d O * dO``;
* rows with no visible key and no sink have ``P = 0`` hence ``dS = 0`` and
  contribute exactly zero to every gradient (no NaN).

Precision model
---------------
Let ``dt`` be the common dtype of the inputs and ``sdt`` the statistics dtype
(float64 for float64; float32 for float32; for bfloat16/float16, float32 when
``mixed_precision`` else ``dt``).  Note the kernel's default here is
``mixed_precision=False``.

* Forward recompute: as documented in the forward module (``P`` in ``sdt``).
* Matmuls (``dO.V^T``, ``P^T.dO``, ``dS.K``, ``dS^T.Q``) take operands in
  ``dt`` and round their result to ``dt``.  For GQA the head-group sum of
  ``dK``/``dV`` is folded into the matmul's contraction (one rounding, like a
  kernel accumulating in PSUM).
* ``softmax_dx`` (products and row sums), the dropout multiplier, the
  soft-cap factor ``1 - tanh^2`` and the ``dsinks`` column sum run in
  ``sdt``; ``scale`` is applied to ``dS`` in ``sdt`` before its rounding to
  ``dt``; ``P_drop`` is rounded to ``dt`` as the operand of ``dV``'s matmul.
* Outputs: ``dq``, ``dk``, ``dv`` in ``dt``; ``dsinks`` in float32 (float64
  for float64 inputs), whatever the dtype of ``sinks_ref``.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from . import _validate as _v
from .attention_fwd_torch import _forward, _validate_fwd, acc_dtype, dropout_multiplier, score_mods, stats_dtype

__all__ = ["attention_bwd_torch_ref", "softmax_dx"]


def softmax_dx(dy: torch.Tensor, y: torch.Tensor, dim: int,
               mixed_precision: bool = False) -> torch.Tensor:
    """Softmax Jacobian-vector product: ``y * (dy - sum(dy * y, dim, keepdim=True))``.

    ``y = softmax(x, dim)`` and ``dy = dL/dy``; returns ``dL/dx``.  Any shape,
    ``dy`` and ``y`` of equal shape.  Computed in the promoted dtype of
    ``dy``/``y``; with ``mixed_precision=True`` a 16-bit promoted dtype is
    raised to float32.  The result is returned in that computation dtype.
    """
    fn = "softmax_dx"
    _v.check_tensor(fn, "dy", dy)
    _v.check_tensor(fn, "y", y)
    if tuple(dy.shape) != tuple(y.shape):
        _v.fail(fn, "dy.shape", tuple(dy.shape), f"must equal y.shape = {tuple(y.shape)}")
    if not (dy.is_floating_point() and y.is_floating_point()):
        _v.fail(fn, "dy.dtype / y.dtype", (dy.dtype, y.dtype), "must both be floating")
    wdt = torch.promote_types(dy.dtype, y.dtype)
    if _v.check_flag(fn, "mixed_precision", mixed_precision) and wdt in (torch.float16, torch.bfloat16):
        wdt = torch.float32
    dy = dy.to(wdt)
    y = y.to(wdt)
    return y * (dy - (dy * y).sum(dim=dim, keepdim=True))


def _validate_bwd(q, k, v, o, dy, lse, sinks, bound_min, bound_max, use_causal_mask,
                  mixed_precision, softmax_scale, sliding_window, mods, window_size=None,
                  dropout_p=0.0, dropout_seed=None, dropout_mask=None, diag_offset=None) -> dict:
    """The single validation entry point of this module (``mods``: the score
    modifications by keyword, checked by their ``SCORE_STEPS`` rows)."""
    fn = "attention_bwd_torch_ref"
    # The q/k/v/mask/sink rules are the forward's; only the names differ.
    a = _validate_fwd(fn, q, k, v, qkv_names=("q_ref", "k_ref", "v_ref"),
                      sinks=sinks, sinks_name="sinks_ref",
                      bound_min=bound_min, bound_max=bound_max,
                      use_causal_mask=use_causal_mask, mixed_precision=mixed_precision,
                      softmax_scale=softmax_scale, sliding_window=sliding_window, mods=mods,
                      window_size=window_size, dropout_p=dropout_p, dropout_seed=dropout_seed,
                      dropout_mask=dropout_mask, diag_offset=diag_offset)
    # o and dy are [bs, nheads, d_v, seqlen_q]: q's shape unless d_v != d_qk.
    o_shape = None
    if a["d_v"] != a["d_head"]:
        o_shape = (a["bs"], a["nheads"], a["d_v"], a["seqlen_q"])
    ref_name = "q_ref" if o_shape is None else "[bs, nheads, d_v, seqlen_q]"
    _v.check_same_as(fn, "o_ref", o, ref_name, q, o_shape)
    _v.check_same_as(fn, "dy_ref", dy, ref_name, q, o_shape)
    _v.check_tensor(fn, "lse_ref", lse)
    lse_shape = (a["bs"], a["nheads"], _v.PARTITIONS, a["seqlen_q"] // _v.PARTITIONS)
    if tuple(lse.shape) != lse_shape:
        _v.fail(fn, "lse_ref.shape", tuple(lse.shape),
                f"must be [bs, nheads, 128, seqlen_q // 128] = {list(lse_shape)}")
    if not lse.is_floating_point():
        _v.fail(fn, "lse_ref.dtype", lse.dtype, "must be floating")
    return a


def attention_bwd_torch_ref(q_ref: torch.Tensor, k_ref: torch.Tensor, v_ref: torch.Tensor,
                            o_ref: torch.Tensor, dy_ref: torch.Tensor, lse_ref: torch.Tensor,
                            sinks_ref: Optional[torch.Tensor] = None,
                            bound_min: Optional[torch.Tensor] = None,
                            bound_max: Optional[torch.Tensor] = None,
                            use_causal_mask: bool = False,
                            mixed_precision: bool = False,
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
                            diag_offset: Optional[int] = None,
                            kv_partial: bool = False) -> Dict[str, torch.Tensor]:
    """Reference with the backward kernel's signature.

    Args:
        q_ref: ``[bs, nheads, d_qk, seqlen_q]`` (seqlen_q a multiple of 128).
        k_ref: ``[bs, nheads_kv, d_qk, seqlen_k]``; v_ref: ``[bs, nheads_kv, d_v, seqlen_k]``.
        o_ref: ``[bs, nheads, d_v, seqlen_q]``; shape/dtype checked, value unused
            (recomputed).
        dy_ref: dL/do, like o_ref.
        lse_ref: ``[bs, nheads, 128, seqlen_q // 128]``; shape checked, value
            unused (recomputed).
        sinks_ref: optional ``[bs, nheads]`` or ``[bs, nheads, num_sinks]``.
        bound_min, bound_max: optional float32 ``[seqlen_q]`` packing bounds.
        use_causal_mask, mixed_precision, softmax_scale, sliding_window, softcap,
            alibi_slopes, window_size, dropout_p, dropout_seed, dropout_mask: as
            in the forward (defaults are the backward kernel's); the dropout
            keep mask is the forward's (same seed, same mask).
        attn_bias: optional floating tensor broadcastable to ``[bs, nheads,
            seqlen_q, seqlen_k]``, as in the forward.
        logit_scale: optional float32 ``[bs, nheads]``, as in the forward.
        diag_offset: None, or a block of query rows of a longer problem, as in
            the forward (q_ref, o_ref, dy_ref ``[..., rows]``, lse_ref of the
            rows, and the rows of the bounds, ``attn_bias`` and
            ``dropout_mask``): dq is those rows of the whole problem's; dk, dv,
            dsinks, dlogit_scale and dbias (over broadcast rows) are these
            rows' terms of sums over all rows, for the caller to add up.
        kv_partial: True returns ``out_dk_ref`` and ``out_dv_ref`` as their
            matmuls' accumulation, in float32 (float64 for float64 inputs)
            and not rounded to the input dtype: the terms of a block of query
            rows, which the caller sums over the blocks and rounds to the
            input dtype once, as the unblocked matmul does.

    Returns:
        dict with ``out_dq_ref`` ``[bs, nheads, d_qk, seqlen_q]``,
        ``out_dk_ref`` ``[bs, nheads_kv, d_qk, seqlen_k]`` and ``out_dv_ref``
        ``[bs, nheads_kv, d_v, seqlen_k]`` (in the input dtype), and, only when
        sinks are given, ``out_dsinks_ref`` shaped like ``sinks_ref`` (float32;
        float64 for float64 inputs); only when ``attn_bias`` is given,
        ``out_dbias_ref`` shaped like it (float32; float64 for float64 inputs):
        the gradient of the logits (dS before the scale and the cap's chain
        rule) summed over the dims the bias broadcasts.
        Only with a logit scale, ``out_dlogit_scale_ref`` ``[bs, nheads]`` (same
        dtype rule).

    The score modifications' keywords (``softcap``, ``alibi_slopes``,
    ``attn_bias``, ``logit_scale``) are checked and applied by their
    ``SCORE_STEPS`` rows (:mod:`golden.attention_fwd_torch`).

    Raises:
        ValueError: naming the offending argument, its value and the rule.
    """
    a = _validate_bwd(q_ref, k_ref, v_ref, o_ref, dy_ref, lse_ref, sinks_ref, bound_min,
                      bound_max, use_causal_mask, mixed_precision, softmax_scale,
                      sliding_window, score_mods(locals()), window_size, dropout_p,
                      dropout_seed, dropout_mask, diag_offset)
    kv_partial = _v.check_flag("attention_bwd_torch_ref", "kv_partial", kv_partial)
    bs, nheads, nheads_kv = a["bs"], a["nheads"], a["nheads_kv"]
    seqlen_q, seqlen_k, group = a["seqlen_q"], a["seqlen_k"], a["group"]
    dt = q_ref.dtype
    sdt = stats_dtype(dt, a["mixed"])

    drop = dropout_multiplier(a, dropout_seed, dropout_mask, sdt)
    f = _forward(q_ref, k_ref, v_ref, a, drop, sinks_ref, bound_min, bound_max)
    probs = f["probs"]

    qt = q_ref.transpose(-1, -2)                                   # [b, h, sq, d_qk]
    do = dy_ref.transpose(-1, -2)                                  # [b, h, sq, d_v]
    kt = k_ref.transpose(-1, -2).repeat_interleave(group, dim=1)   # [b, h, sk, d_qk]
    vt = v_ref.transpose(-1, -2).repeat_interleave(group, dim=1)   # [b, h, sk, d_v]

    dp = torch.matmul(do, vt.transpose(-1, -2)).to(sdt)
    if drop is not None:
        dp = dp * drop                 # o = (P * drop) V, so dL/dP = dP * drop
    if a["num_sinks"]:
        dp = torch.cat([dp, dp.new_zeros(bs, nheads, seqlen_q, a["num_sinks"])], dim=-1)
    ds = softmax_dx(dp, probs, dim=-1, mixed_precision=a["mixed"])

    ds_keys = ds[..., :seqlen_k]                                   # dL/d(logit) of the keys
    mod_grads = {}
    ctx = dict(a, adt=acc_dtype(dt))
    for row, value, kept in reversed(f["steps"]):                  # back through the score modifications
        if row.backward is not None:
            ds_keys, g = row.backward(ds_keys, value, kept, ctx)
            if row.grad_key is not None:
                mod_grads[row.grad_key] = g
    ds_keys = (ds_keys * a["scale"]).to(dt)                        # scale * dS, [b, h, sq, sk]
    p_keys = probs[..., :seqlen_k]
    if drop is not None:
        p_keys = p_keys * drop
    p_keys = p_keys.to(dt)
    dq = torch.matmul(ds_keys, kt)

    # Query head h = hk * group + g, so viewing [b, h, sq, .] as
    # [b, hk, group * sq, .] stacks the rows of all heads of kv head hk; one
    # matmul over the stacked rows then sums the group.
    def stack(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(bs, nheads_kv, group * seqlen_q, x.shape[-1])

    mm = dt
    if kv_partial:
        # the operands are exact in the accumulation dtype (a product of two 16-bit numbers is exact in
        # float32), so this is the dt matmul without its final rounding
        mm = acc_dtype(dt)
    dv = torch.matmul(stack(p_keys.to(mm)).transpose(-1, -2), stack(do.to(mm)))   # [b, hk, sk, d_v]
    dk = torch.matmul(stack(ds_keys.to(mm)).transpose(-1, -2), stack(qt.to(mm)))  # [b, hk, sk, d_qk]

    out = {
        "out_dq_ref": dq.transpose(-1, -2).contiguous(),
        "out_dk_ref": dk.transpose(-1, -2).contiguous(),
        "out_dv_ref": dv.transpose(-1, -2).contiguous(),
    }
    if sinks_ref is not None:
        dsinks = ds[..., seqlen_k:].sum(dim=2)                      # over query rows, in sdt
        out["out_dsinks_ref"] = dsinks.to(acc_dtype(dt)).reshape(sinks_ref.shape)
    for key, g in mod_grads.items():
        out[key] = g.to(acc_dtype(dt))
    return out
