"""The NKI attention kernels as torch custom ops (namespace ``nki_attn``), in the kernels' own layout.

This is the layer every PyTorch entry point goes through (``nki_attn.attention``, the Hugging Face integration)
and the one later code (ring attention, which calls the forward and backward once per block pair) builds on.
Its arguments and results are exactly the kernels' (``nki_attn.kernels.attention_fwd`` / ``attention_bwd``,
semantics in docs/semantics.md); it adds host-side validation, autograd and what ``torch.compile`` needs.

Public functions (stable):

``attention_fwd(q, k, v, sinks=None, bound_min=None, bound_max=None, use_causal_mask=False, softmax_scale=None,
sliding_window=None, mixed_precision=True, softcap=0.0, alibi_slopes=None, window_size=None, dropout_p=0.0,
dropout_seed=None) -> (o, lse)``
    Differentiable with respect to q, k, v and sinks (``register_autograd``: the backward runs
    ``attention_bwd``). A gradient flowing into ``lse`` must be zero (NotImplementedError otherwise), and double
    backward raises RuntimeError: neither is ever silently dropped.

``attention_bwd(q, k, v, o, do, lse, sinks=None, bound_min=None, bound_max=None, use_causal_mask=False,
softmax_scale=None, sliding_window=None, mixed_precision=True, softcap=0.0, alibi_slopes=None, window_size=None,
dropout_p=0.0, dropout_seed=None) -> (dq, dk, dv, dsinks)``
    ``dsinks`` is float32 shaped like ``sinks``, or an empty float32 tensor of shape ``[0]`` when ``sinks`` is
    None.

Layouts (head_dim before the sequence, as the kernels want them):

=====================  =====================================================================================
q, dq                  ``[bs, nheads, d_qk, seqlen_q]``, float32 / bfloat16 / float16
k, dk                  ``[bs, nheads_kv, d_qk, seqlen_k]``, q's dtype; ``nheads % nheads_kv == 0``
v, dv                  ``[bs, nheads_kv, d_v, seqlen_k]`` (d_qk, d_v each 1..256)
o, do                  ``[bs, nheads, d_v, seqlen_q]``
lse                    float32 ``[bs, nheads, 128, seqlen_q // 128]``; ``lse[b, h, p, t]`` is row ``t*128 + p``;
                       ``+inf`` for a row that sees no key and has no sink
sinks, dsinks          ``[bs, nheads]`` or ``[bs, nheads, num_sinks]`` logits (not scaled); -inf means no sink
bound_min, bound_max   float32 ``[seqlen_q]``: key j visible to query i iff ``bound_min[i] <= j < bound_max[i]``
alibi_slopes           float32 ``[bs, nheads]``: adds ``-slope * |i + seqlen_k - seqlen_q - j|`` (no gradient)
dropout_seed           int32 / uint32 ``[2]`` = (seed, offset), given iff ``dropout_p > 0`` (nki_attn.dropout)
=====================  =====================================================================================

``seqlen_q`` and ``seqlen_k`` are positive multiples of 128 (the torch API pads for you); ``use_causal_mask`` is
bottom-right (key j visible to query i iff ``j <= i + seqlen_k - seqlen_q``); ``sliding_window`` W >= 1 only with
``use_causal_mask``; ``window_size=(left, right)`` (-1 = unbounded) causal or not, not with ``sliding_window``;
``softcap`` >= 0 (0 = off); ``dropout_p`` in [0, 1); all masks AND together; ``softmax_scale`` defaults to
``1/sqrt(d_qk)``. docs/semantics.md has every rule; ``check_kernel_args`` runs the kernels' own check.

The ops are registered as ``torch.ops.nki_attn.attention_fwd`` / ``attention_bwd`` with fake (meta) kernels, so
``torch.compile(fullgraph=True)`` treats them as opaque nodes and FakeTensor / ``meta`` inputs get the right
output shapes without running anything. Their implementation launches the kernel: on the built-in simulator for
CPU tensors, on the real NKI for XLA (Neuron) tensors when ``nki_attn.backend`` found it. ``NKI_ATTN_LNC=2``
launches on two NeuronCores (trn2/trn3; bit-identical results).
"""
import math
import numbers
import os
from typing import Optional

import torch

from .backend import BACKEND

PMAX = 128
MAX_D_HEAD = 256
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

__all__ = ["attention_fwd", "attention_bwd", "check_kernel_args", "PMAX"]


# ----------------------------------------------------------------------------------------------------- launching
def _launcher(kernel):
    lnc = os.environ.get("NKI_ATTN_LNC", "1").strip()
    if lnc not in ("1", "2"):
        raise ValueError(f"NKI_ATTN_LNC={lnc!r} must be 1 or 2")
    return kernel[2] if lnc == "2" else kernel


def check_device(t, name="q"):
    """CPU tensors run on the simulator, XLA tensors on the real nki; ``meta`` tensors only get shapes."""
    if t.device.type == "cpu":
        if BACKEND != "sim":
            raise RuntimeError("CPU tensors run on the simulator; set NKI_ATTN_BACKEND=sim to use it alongside the "
                               "real nki, or move the tensors to the XLA (Neuron) device")
    elif t.device.type == "xla":
        if BACKEND != "nki":
            raise RuntimeError("XLA tensors need the real nki package (torch-neuronx / neuronx-cc); it is not "
                               "importable here")
    elif t.device.type != "meta":
        raise ValueError(f"{name} is on {t.device}: use CPU (simulator), XLA (Trainium) or meta (shapes only)")


def _kernels():
    # The host-side wrappers re-run the kernels' own checks and raise ValueError: a rule only the kernel knows
    # never surfaces as an AssertionError from inside a trace.
    from .kernel_api import attention_bwd as bwd
    from .kernel_api import attention_fwd as fwd
    return fwd, bwd


# ----------------------------------------------------------------------------------------------------- validation
def _fail(fn, name, value, rule, exc=ValueError):
    raise exc(f"{fn}: {name}={value}: {rule}")


def _shape(t):
    return tuple(int(s) for s in t.shape)


def check_kernel_args(fn, q, k, v, o=None, do=None, lse=None, sinks=None, bound_min=None, bound_max=None,
                      use_causal_mask=False, softmax_scale=None, sliding_window=None, mixed_precision=True,
                      softcap=0.0, alibi_slopes=None, window_size=None, dropout_p=0.0, dropout_seed=None):
    """Host-side check of the kernels' arguments; raises ValueError / TypeError naming the argument, its value
    and the rule. Returns the resolved softmax scale.

    What only torch knows (tensor types, devices, bool flags) is checked here; every rule about shapes, dtypes
    and values is the kernel's own check, run on the host through ``nki_attn.kernel_api`` (the same function the
    kernel asserts on at trace time), so the two can never disagree. ``fn`` (``attention_fwd`` /
    ``attention_bwd``) selects the kernel and prefixes the message."""
    for name, t in (("q", q), ("k", k), ("v", v), ("o", o), ("do", do), ("lse", lse), ("sinks", sinks),
                    ("bound_min", bound_min), ("bound_max", bound_max), ("alibi_slopes", alibi_slopes),
                    ("dropout_seed", dropout_seed)):
        if t is not None and not isinstance(t, torch.Tensor):
            _fail(fn, name, type(t).__name__, "must be a torch.Tensor", TypeError)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t is None:
            _fail(fn, name, None, "is required", TypeError)
    for name, x in (("use_causal_mask", use_causal_mask), ("mixed_precision", mixed_precision)):
        if not isinstance(x, bool):
            _fail(fn, name, repr(x), "must be a bool", TypeError)
    for name, t in (("k", k), ("v", v), ("o", o), ("do", do), ("lse", lse), ("sinks", sinks),
                    ("bound_min", bound_min), ("bound_max", bound_max), ("alibi_slopes", alibi_slopes),
                    ("dropout_seed", dropout_seed)):
        if t is not None and t.device != q.device:
            _fail(fn, f"{name}.device", t.device, f"must equal q.device {q.device}")
    check_device(q)
    if isinstance(window_size, list):
        window_size = tuple(window_size)
    variants = {"softcap": softcap, "alibi_slopes": alibi_slopes, "window_size": window_size,
                "dropout_p": dropout_p, "dropout_seed": dropout_seed}
    kernel_api = _kernel_api()
    try:
        if fn == "attention_bwd":
            kernel_api.attention_bwd.check(q, k, v, o, do, lse, sinks, bound_min, bound_max,
                                           use_causal_mask=use_causal_mask, mixed_precision=mixed_precision,
                                           softmax_scale=softmax_scale, sliding_window=sliding_window, **variants)
        else:
            kernel_api.attention_fwd.check(q, k, v, sinks, bound_min, bound_max, use_causal_mask=use_causal_mask,
                                           mixed_precision=mixed_precision, softmax_scale=softmax_scale,
                                           sliding_window=sliding_window, **variants)
    except ValueError as exc:
        raise ValueError(f"{fn}: {exc}") from None
    return resolve_scale(fn, softmax_scale, int(q.shape[2]))


def _kernel_api():
    from . import kernel_api  # noqa: PLC0415 - imports the kernels, which the meta/fake paths never need early
    return kernel_api


def resolve_scale(fn, softmax_scale, d_head, name="softmax_scale"):
    """``softmax_scale`` as a float: default ``1/sqrt(d_head)``; otherwise a finite number > 0."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(d_head)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        _fail(fn, name, repr(softmax_scale), "must be None or a real number", TypeError)
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        _fail(fn, name, softmax_scale, "must be finite and > 0 (the kernels fold it into Q)")
    return float(softmax_scale)


def check_slopes(fn, alibi_slopes):
    """ALiBi slopes' values (the kernels check shapes; values are only seen here, in the ops' bodies, where the
    tensors are real): every slope finite. Any sign is accepted, as FlashAttention does: the bias
    ``-slope * distance`` penalises distant keys for a positive slope and favours them for a negative one."""
    if alibi_slopes is not None and not bool(torch.isfinite(alibi_slopes).all()):
        bad = alibi_slopes[~torch.isfinite(alibi_slopes)]
        _fail(fn, "alibi_slopes", f"a tensor with {bad.numel()} non-finite value(s), e.g. {float(bad[0])}",
              "every slope must be finite (any sign: a negative slope favours distant keys)")


# ----------------------------------------------------------------------------------------------------- the ops
def _variant_kwargs(softcap, alibi_slopes, window_size, dropout_p, dropout_seed):
    """The variant keywords for the kernel call; those at their default are left out, so kernels built before
    the variants (no such parameters) still take the call."""
    kw = {}
    if softcap != 0.0:
        kw["softcap"] = softcap
    if alibi_slopes is not None:
        kw["alibi_slopes"] = alibi_slopes.contiguous()
    if window_size is not None:
        kw["window_size"] = (int(window_size[0]), int(window_size[1]))
    if dropout_p != 0.0:
        kw["dropout_p"] = dropout_p
        kw["dropout_seed"] = dropout_seed
    return kw


@torch.library.custom_op("nki_attn::attention_fwd", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: Optional[torch.Tensor],
            bound_min: Optional[torch.Tensor], bound_max: Optional[torch.Tensor], use_causal_mask: bool,
            softmax_scale: float, sliding_window: Optional[int], mixed_precision: bool, softcap: float = 0.0,
            alibi_slopes: Optional[torch.Tensor] = None, window_size: Optional[list[int]] = None,
            dropout_p: float = 0.0, dropout_seed: Optional[torch.Tensor] = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    check_slopes("attention_fwd", alibi_slopes)
    fwd, _ = _kernels()
    o, lse = _launcher(fwd)(q.contiguous(), k.contiguous(), v.contiguous(), sinks, bound_min, bound_max,
                            use_causal_mask=use_causal_mask, mixed_precision=mixed_precision,
                            softmax_scale=softmax_scale, sliding_window=sliding_window,
                            **_variant_kwargs(softcap, alibi_slopes, window_size, dropout_p, dropout_seed))
    return o, lse


@_fwd_op.register_fake
def _fwd_fake(q, k, v, sinks, bound_min, bound_max, use_causal_mask, softmax_scale, sliding_window,
              mixed_precision, softcap=0.0, alibi_slopes=None, window_size=None, dropout_p=0.0, dropout_seed=None):
    b, h, _, s = q.shape
    return q.new_empty((b, h, v.shape[2], s)), q.new_empty((b, h, PMAX, s // PMAX), dtype=torch.float32)


@torch.library.custom_op("nki_attn::attention_bwd", mutates_args=())
def _bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, do: torch.Tensor,
            lse: torch.Tensor, sinks: Optional[torch.Tensor], bound_min: Optional[torch.Tensor],
            bound_max: Optional[torch.Tensor], use_causal_mask: bool, softmax_scale: float,
            sliding_window: Optional[int], mixed_precision: bool, dlse: Optional[torch.Tensor],
            softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None,
            window_size: Optional[list[int]] = None, dropout_p: float = 0.0,
            dropout_seed: Optional[torch.Tensor] = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if dlse is not None and bool((dlse != 0).any()):
        raise NotImplementedError("nki_attn attention: a gradient flows into the log-sum-exp output (lse), which "
                                  "the backward kernel does not propagate; use lse only outside the graph "
                                  "(e.g. lse.detach())")
    _, bwd = _kernels()
    outs = _launcher(bwd)(q.contiguous(), k.contiguous(), v.contiguous(), o.contiguous(), do.contiguous(), lse,
                          sinks, bound_min, bound_max, use_causal_mask=use_causal_mask,
                          mixed_precision=mixed_precision, softmax_scale=softmax_scale,
                          sliding_window=sliding_window,
                          **_variant_kwargs(softcap, alibi_slopes, window_size, dropout_p, dropout_seed))
    dsinks = outs[3] if sinks is not None else q.new_empty((0,), dtype=torch.float32)
    return outs[0], outs[1], outs[2], dsinks


@_bwd_op.register_fake
def _bwd_fake(q, k, v, o, do, lse, sinks, bound_min, bound_max, use_causal_mask, softmax_scale, sliding_window,
              mixed_precision, dlse, softcap=0.0, alibi_slopes=None, window_size=None, dropout_p=0.0,
              dropout_seed=None):
    dsinks = (torch.empty(sinks.shape, dtype=torch.float32, device=sinks.device) if sinks is not None
              else q.new_empty((0,), dtype=torch.float32))
    c = torch.contiguous_format
    return (torch.empty_like(q, memory_format=c), torch.empty_like(k, memory_format=c),
            torch.empty_like(v, memory_format=c), dsinks)


_FWD_FLAGS = 10  # inputs of _fwd_op before the variant keywords


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, sinks, bound_min, bound_max, causal, scale, window, mixed = inputs[:_FWD_FLAGS]
    variants = list(inputs[_FWD_FLAGS:])
    defaults = [0.0, None, None, 0.0, None]
    variants += defaults[len(variants):]
    softcap, alibi_slopes, window_size, dropout_p, dropout_seed = variants
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, sinks, bound_min, bound_max, alibi_slopes, dropout_seed)
    ctx.flags = (causal, scale, window, mixed, softcap, window_size, dropout_p)
    ctx.n_inputs = len(inputs)


def _fwd_backward(ctx, do, dlse):
    q, k, v, o, lse, sinks, bound_min, bound_max, alibi_slopes, dropout_seed = ctx.saved_tensors
    causal, scale, window, mixed, softcap, window_size, dropout_p = ctx.flags
    dq, dk, dv, dsinks = _bwd_op(q, k, v, o, do, lse, sinks, bound_min, bound_max, causal, scale, window, mixed,
                                 dlse, softcap, alibi_slopes, window_size, dropout_p, dropout_seed)
    grads = [dq, dk, dv, (dsinks.to(sinks.dtype) if sinks is not None else None)]
    return tuple(grads + [None] * (ctx.n_inputs - len(grads)))


_fwd_op.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


def _bwd_setup_context(ctx, inputs, output):
    pass


def _bwd_backward(ctx, *grads):
    raise RuntimeError("nki_attn attention: double backward (differentiating the gradients of the attention, e.g. "
                       "backward(create_graph=True) followed by a gradient penalty) is not implemented: the "
                       "backward kernel is not itself differentiable")


_bwd_op.register_autograd(_bwd_backward, setup_context=_bwd_setup_context)


# ----------------------------------------------------------------------------------------------------- public
def attention_fwd(q, k, v, sinks=None, bound_min=None, bound_max=None, use_causal_mask=False, softmax_scale=None,
                  sliding_window=None, mixed_precision=True, softcap=0.0, alibi_slopes=None, window_size=None,
                  dropout_p=0.0, dropout_seed=None):
    """Forward kernel as a differentiable torch op: ``(o [bs, nheads, d_v, seqlen_q] in q's dtype,
    lse float32 [bs, nheads, 128, seqlen_q // 128])``. Layouts, variant keywords and rules: module docstring."""
    scale = check_kernel_args("attention_fwd", q, k, v, sinks=sinks, bound_min=bound_min, bound_max=bound_max,
                              use_causal_mask=use_causal_mask, softmax_scale=softmax_scale,
                              sliding_window=sliding_window, mixed_precision=mixed_precision, softcap=softcap,
                              alibi_slopes=alibi_slopes, window_size=window_size, dropout_p=dropout_p,
                              dropout_seed=dropout_seed)
    return _fwd_op(q, k, v, sinks, bound_min, bound_max, use_causal_mask, scale, sliding_window, mixed_precision,
                   float(softcap), alibi_slopes, _window_list(window_size), float(dropout_p), dropout_seed)


def attention_bwd(q, k, v, o, do, lse, sinks=None, bound_min=None, bound_max=None, use_causal_mask=False,
                  softmax_scale=None, sliding_window=None, mixed_precision=True, softcap=0.0, alibi_slopes=None,
                  window_size=None, dropout_p=0.0, dropout_seed=None):
    """Backward kernel as a torch op: ``(dq like q, dk like k, dv like v, dsinks)``, dsinks float32 shaped like
    ``sinks`` (an empty ``[0]`` tensor when sinks is None). ``o`` and ``lse`` are the forward's outputs for the
    same arguments (per block pair, for ring attention: the block's o and lse, or the merged ones); with dropout,
    the same ``dropout_seed`` regenerates the forward's mask."""
    scale = check_kernel_args("attention_bwd", q, k, v, o=o, do=do, lse=lse, sinks=sinks, bound_min=bound_min,
                              bound_max=bound_max, use_causal_mask=use_causal_mask, softmax_scale=softmax_scale,
                              sliding_window=sliding_window, mixed_precision=mixed_precision, softcap=softcap,
                              alibi_slopes=alibi_slopes, window_size=window_size, dropout_p=dropout_p,
                              dropout_seed=dropout_seed)
    return _bwd_op(q, k, v, o, do, lse, sinks, bound_min, bound_max, use_causal_mask, scale, sliding_window,
                   mixed_precision, None, float(softcap), alibi_slopes, _window_list(window_size),
                   float(dropout_p), dropout_seed)


def _window_list(window_size):
    return None if window_size is None else [int(window_size[0]), int(window_size[1])]
