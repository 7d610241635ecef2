"""The NKI attention kernels as torch custom ops (namespace ``nki_attn``), in the kernels' own layout.

This is the layer every PyTorch entry point goes through (``nki_attn.attention``, the Hugging Face integration)
and the one later code (ring attention, which calls the forward and backward once per block pair) builds on.
Its arguments and results are exactly the kernels' (``nki_attn.kernels.attention_fwd`` / ``attention_bwd``,
semantics in docs/semantics.md); it adds host-side validation, autograd and what ``torch.compile`` needs.

Public functions (stable):

``attention_fwd(q, k, v, sinks=None, bound_min=None, bound_max=None, use_causal_mask=False, softmax_scale=None,
sliding_window=None, mixed_precision=True) -> (o, lse)``
    Differentiable with respect to q, k, v and sinks (``register_autograd``: the backward runs
    ``attention_bwd``). A gradient flowing into ``lse`` must be zero (NotImplementedError otherwise), and double
    backward raises RuntimeError: neither is ever silently dropped.

``attention_bwd(q, k, v, o, do, lse, sinks=None, bound_min=None, bound_max=None, use_causal_mask=False,
softmax_scale=None, sliding_window=None, mixed_precision=True) -> (dq, dk, dv, dsinks)``
    ``dsinks`` is float32 shaped like ``sinks``, or an empty float32 tensor of shape ``[0]`` when ``sinks`` is
    None.

Layouts (head_dim before the sequence, as the kernels want them):

=====================  =====================================================================================
q, o, do, dq           ``[bs, nheads, d_head, seqlen_q]``, float32 / bfloat16 / float16
k, v, dk, dv           ``[bs, nheads_kv, d_head, seqlen_k]``, q's dtype; ``nheads % nheads_kv == 0``
lse                    float32 ``[bs, nheads, 128, seqlen_q // 128]``; ``lse[b, h, p, t]`` is row ``t*128 + p``;
                       ``+inf`` for a row that sees no key and has no sink
sinks, dsinks          ``[bs, nheads]`` or ``[bs, nheads, num_sinks]`` logits (not scaled); -inf means no sink
bound_min, bound_max   float32 ``[seqlen_q]``: key j visible to query i iff ``bound_min[i] <= j < bound_max[i]``
=====================  =====================================================================================

``seqlen_q`` and ``seqlen_k`` are positive multiples of 128 (the torch API pads for you); ``use_causal_mask``
(top-left, key j > query i masked) needs ``seqlen_q == seqlen_k``; ``sliding_window`` W >= 1 only with
``use_causal_mask`` (query i sees keys i-W+1..i); all masks AND together; ``softmax_scale`` defaults to
``1/sqrt(d_head)``.

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
                      use_causal_mask=False, softmax_scale=None, sliding_window=None, mixed_precision=True):
    """Host-side check of the kernels' arguments (the kernels' own checks are trace-time assertions); raises
    ValueError / TypeError naming the argument, its value and the rule. Returns the resolved softmax scale."""
    for name, t in (("q", q), ("k", k), ("v", v), ("o", o), ("do", do), ("lse", lse), ("sinks", sinks),
                    ("bound_min", bound_min), ("bound_max", bound_max)):
        if t is not None and not isinstance(t, torch.Tensor):
            _fail(fn, name, type(t).__name__, "must be a torch.Tensor", TypeError)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            _fail(fn, f"{name}.shape", _shape(t), "must be 4-D [bs, heads, d_head, seqlen]")
    bs, nheads, d_head, sq = _shape(q)
    bk, nkv, dk, sk = _shape(k)
    if _shape(v) != _shape(k):
        _fail(fn, "v.shape", _shape(v), f"must equal k.shape {_shape(k)}")
    if bk != bs or dk != d_head:
        _fail(fn, "k.shape", _shape(k), f"must match q.shape {_shape(q)} in batch (dim 0) and d_head (dim 2)")
    if nkv < 1 or nheads % nkv != 0:
        _fail(fn, "k.shape[1]", nkv, f"nheads_kv must be >= 1 and divide nheads = {nheads}")
    for name, n in (("seqlen_q", sq), ("seqlen_k", sk)):
        if n <= 0 or n % PMAX != 0:
            _fail(fn, name, n, f"must be a positive multiple of {PMAX}")
    if d_head < 1 or d_head > MAX_D_HEAD or d_head % -(-d_head // PMAX) != 0:
        _fail(fn, "d_head", d_head, f"must be 1..{PMAX}, or up to {MAX_D_HEAD} splitting into equal tiles of at "
                                    f"most {PMAX}")
    if q.dtype not in DTYPES:
        _fail(fn, "q.dtype", q.dtype, "must be float32, bfloat16 or float16")
    for name, t in (("k", k), ("v", v), ("o", o), ("do", do)):
        if t is not None and t.dtype != q.dtype:
            _fail(fn, f"{name}.dtype", t.dtype, f"must equal q.dtype {q.dtype}")
    for name, t in (("o", o), ("do", do)):
        if t is not None and _shape(t) != _shape(q):
            _fail(fn, f"{name}.shape", _shape(t), f"must equal q.shape {_shape(q)}")
    if lse is not None:
        want = (bs, nheads, PMAX, sq // PMAX)
        if _shape(lse) != want or lse.dtype != torch.float32:
            _fail(fn, "lse", f"{lse.dtype} {_shape(lse)}", f"must be float32 [bs, nheads, 128, seqlen_q // 128] = "
                                                           f"{list(want)}")
    for name, t in (("k", k), ("v", v), ("o", o), ("do", do), ("lse", lse), ("sinks", sinks),
                    ("bound_min", bound_min), ("bound_max", bound_max)):
        if t is not None and t.device != q.device:
            _fail(fn, f"{name}.device", t.device, f"must equal q.device {q.device}")
    check_device(q)
    if not isinstance(use_causal_mask, bool):
        _fail(fn, "use_causal_mask", repr(use_causal_mask), "must be a bool", TypeError)
    if not isinstance(mixed_precision, bool):
        _fail(fn, "mixed_precision", repr(mixed_precision), "must be a bool", TypeError)
    if use_causal_mask and sq != sk:
        _fail(fn, "use_causal_mask", True, f"needs seqlen_q == seqlen_k, got {sq} and {sk}")
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            _fail(fn, "sliding_window", repr(sliding_window), "must be None or an int >= 1")
        if not use_causal_mask:
            _fail(fn, "sliding_window", sliding_window, "needs use_causal_mask=True")
    if (bound_min is None) != (bound_max is None):
        _fail(fn, "bound_min/bound_max", "one of them None", "give both or neither")
    for name, t in (("bound_min", bound_min), ("bound_max", bound_max)):
        if t is not None and (_shape(t) != (sq,) or t.dtype != torch.float32):
            _fail(fn, name, f"{t.dtype} {_shape(t)}", f"must be float32 [seqlen_q] = [{sq}]")
    if sinks is not None:
        ss = _shape(sinks)
        if not (ss[:2] == (bs, nheads) and (len(ss) == 2 or (len(ss) == 3 and ss[2] >= 1))):
            _fail(fn, "sinks.shape", ss, f"must be [bs, nheads] = [{bs}, {nheads}] or [bs, nheads, num_sinks]")
        if sinks.dtype not in DTYPES:
            _fail(fn, "sinks.dtype", sinks.dtype, "must be float32, bfloat16 or float16")
    return resolve_scale(fn, softmax_scale, d_head)


def resolve_scale(fn, softmax_scale, d_head, name="softmax_scale"):
    """``softmax_scale`` as a float: default ``1/sqrt(d_head)``; otherwise a finite number > 0."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(d_head)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        _fail(fn, name, repr(softmax_scale), "must be None or a real number", TypeError)
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        _fail(fn, name, softmax_scale, "must be finite and > 0 (the kernels fold it into Q)")
    return float(softmax_scale)


# ----------------------------------------------------------------------------------------------------- the ops
@torch.library.custom_op("nki_attn::attention_fwd", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: Optional[torch.Tensor],
            bound_min: Optional[torch.Tensor], bound_max: Optional[torch.Tensor], use_causal_mask: bool,
            softmax_scale: float, sliding_window: Optional[int], mixed_precision: bool
            ) -> tuple[torch.Tensor, torch.Tensor]:
    fwd, _ = _kernels()
    o, lse = _launcher(fwd)(q.contiguous(), k.contiguous(), v.contiguous(), sinks, bound_min, bound_max,
                            use_causal_mask=use_causal_mask, mixed_precision=mixed_precision,
                            softmax_scale=softmax_scale, sliding_window=sliding_window)
    return o, lse


@_fwd_op.register_fake
def _fwd_fake(q, k, v, sinks, bound_min, bound_max, use_causal_mask, softmax_scale, sliding_window,
              mixed_precision):
    b, h, _, s = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), \
        q.new_empty((b, h, PMAX, s // PMAX), dtype=torch.float32)


@torch.library.custom_op("nki_attn::attention_bwd", mutates_args=())
def _bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, do: torch.Tensor,
            lse: torch.Tensor, sinks: Optional[torch.Tensor], bound_min: Optional[torch.Tensor],
            bound_max: Optional[torch.Tensor], use_causal_mask: bool, softmax_scale: float,
            sliding_window: Optional[int], mixed_precision: bool, dlse: Optional[torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if dlse is not None and bool((dlse != 0).any()):
        raise NotImplementedError("nki_attn attention: a gradient flows into the log-sum-exp output (lse), which "
                                  "the backward kernel does not propagate; use lse only outside the graph "
                                  "(e.g. lse.detach())")
    _, bwd = _kernels()
    outs = _launcher(bwd)(q.contiguous(), k.contiguous(), v.contiguous(), o.contiguous(), do.contiguous(), lse,
                          sinks, bound_min, bound_max, use_causal_mask=use_causal_mask,
                          mixed_precision=mixed_precision, softmax_scale=softmax_scale,
                          sliding_window=sliding_window)
    dsinks = outs[3] if sinks is not None else q.new_empty((0,), dtype=torch.float32)
    return outs[0], outs[1], outs[2], dsinks


@_bwd_op.register_fake
def _bwd_fake(q, k, v, o, do, lse, sinks, bound_min, bound_max, use_causal_mask, softmax_scale, sliding_window,
              mixed_precision, dlse):
    dsinks = (torch.empty(sinks.shape, dtype=torch.float32, device=sinks.device) if sinks is not None
              else q.new_empty((0,), dtype=torch.float32))
    c = torch.contiguous_format
    return (torch.empty_like(q, memory_format=c), torch.empty_like(k, memory_format=c),
            torch.empty_like(v, memory_format=c), dsinks)


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, sinks, bound_min, bound_max, causal, scale, window, mixed = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, sinks, bound_min, bound_max)
    ctx.flags = (causal, scale, window, mixed)


def _fwd_backward(ctx, do, dlse):
    q, k, v, o, lse, sinks, bound_min, bound_max = ctx.saved_tensors
    causal, scale, window, mixed = ctx.flags
    dq, dk, dv, dsinks = _bwd_op(q, k, v, o, do, lse, sinks, bound_min, bound_max, causal, scale, window, mixed,
                                 dlse)
    return dq, dk, dv, (dsinks.to(sinks.dtype) if sinks is not None else None), None, None, None, None, None, None


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
                  sliding_window=None, mixed_precision=True):
    """Forward kernel as a differentiable torch op: ``(o [bs, nheads, d_head, seqlen_q] in q's dtype,
    lse float32 [bs, nheads, 128, seqlen_q // 128])``. Layouts and rules: module docstring."""
    scale = check_kernel_args("attention_fwd", q, k, v, sinks=sinks, bound_min=bound_min, bound_max=bound_max,
                              use_causal_mask=use_causal_mask, softmax_scale=softmax_scale,
                              sliding_window=sliding_window, mixed_precision=mixed_precision)
    return _fwd_op(q, k, v, sinks, bound_min, bound_max, use_causal_mask, scale, sliding_window, mixed_precision)


def attention_bwd(q, k, v, o, do, lse, sinks=None, bound_min=None, bound_max=None, use_causal_mask=False,
                  softmax_scale=None, sliding_window=None, mixed_precision=True):
    """Backward kernel as a torch op: ``(dq like q, dk like k, dv like v, dsinks)``, dsinks float32 shaped like
    ``sinks`` (an empty ``[0]`` tensor when sinks is None). ``o`` and ``lse`` are the forward's outputs for the
    same arguments (per block pair, for ring attention: the block's o and lse, or the merged ones)."""
    scale = check_kernel_args("attention_bwd", q, k, v, o=o, do=do, lse=lse, sinks=sinks, bound_min=bound_min,
                              bound_max=bound_max, use_causal_mask=use_causal_mask, softmax_scale=softmax_scale,
                              sliding_window=sliding_window, mixed_precision=mixed_precision)
    return _bwd_op(q, k, v, o, do, lse, sinks, bound_min, bound_max, use_causal_mask, scale, sliding_window,
                   mixed_precision, None)
