"""The one custom-op pair every PyTorch entry point runs on: ``torch.ops.nki_attn.attention_fwd`` / ``attention_bwd``.

Layers, top to bottom (each calls only the one below it)::

    flash_attn_func, flash_attn_varlen_func, packed variants, scaled_dot_product_attention   (nki_attn.attention)
    ring attention (nki_attn.distributed), Hugging Face integration (nki_attn.integrations)
        │  check the arguments once -> AttentionSpec                                        (nki_attn.spec)
        ▼
    attention(spec, q, k, v) / attention_backward(spec, ...)                               (this module)
        │  one custom op per direction, FlashAttention's layout, autograd, fake (meta) kernels
        ▼
    kernel_plan + kernel_keywords: padding to 128, the mask as the kernels' causal flag, window or per-query
    bounds, the layout [b, h, d, s]; then the NKI kernel (simulator for CPU tensors and, through torch-xla's
    CPU fallback, XLA tensors; the real nki for XLA tensors when it is installed)

Public functions:

``attention(spec, q, k, v) -> (out, lse)``
    q ``[batch, seqlen_q, heads, d_qk]``, k ``[batch, seqlen_k, heads_kv, d_qk]``, v ``[batch, seqlen_k,
    heads_kv, d_v]`` (sizes and every other argument in ``spec``, an ``nki_attn.spec.AttentionSpec``) -> out
    ``[batch, seqlen_q, heads, d_v]`` in q's dtype, lse float32 ``[batch, heads, seqlen_q]`` (+inf for a row that
    sees no key and has no sink). Differentiable with respect to q, k, v, ``spec.sinks``, ``spec.bias`` (the
    additive bias: its gradient is computed by the kernel only when it requires one) and ``spec.logit_scale``; a
    gradient flowing into lse must be zero (NotImplementedError otherwise) and double backward raises
    RuntimeError.

``attention_backward(spec, q, k, v, out, dout, lse) -> (dq, dk, dv, dsinks)``
    The backward alone (ring attention calls it per block with the merged out and lse): dq, dk, dv shaped like
    q, k, v; dsinks like ``spec.sinks`` (an empty float32 ``[0]`` tensor without sinks); with a logit scale a fifth,
    dlogit_scale float32 ``[batch, heads]``.

``kernel_plan(spec, device) -> KernelPlan``, ``kernel_bounds``, ``padded_length``: how a spec reaches the
kernels (used by the probabilities of ``return_attn_probs`` and by ring attention's block geometry).

``block_mask_attention(q, k, v, rows, store, alibi, n_b, n_h, scale, softcap) -> (out, lse)``
    The second op pair, ``torch.ops.nki_attn.flex_fwd`` / ``flex_bwd``: the kernels under a block mask
    (``nki_attn.flex_attention`` checks the arguments and calls it; docs/masks.md).

The ops take plain tensors and numbers (the spec's fields); their implementation rebuilds the spec and launches
the kernel, their fake kernels give shapes, so ``torch.compile(fullgraph=True)`` holds one opaque node per
direction and FakeTensor / ``meta`` inputs get the right output shapes without running anything. Every output is
a fresh contiguous tensor. ``NKI_ATTN_LNC=2`` launches on two NeuronCores (trn2/trn3; bit-identical results).
"""
import math
import os
from typing import Optional

import torch

from . import kernel_api
from .backend import BACKEND
from .spec import PMAX, AttentionSpec, window_intervals

__all__ = ["attention", "attention_backward", "kernel_plan", "kernel_keywords", "kernel_bounds", "padded_length",
           "spec_intervals", "KernelPlan", "block_mask_attention"]

_CONTIG = torch.contiguous_format


# ----------------------------------------------------------------------------------------------------- the plan
def padded_length(n):
    """The kernels' length for n tokens: n rounded up to a multiple of 128 (at least 128)."""
    return max(PMAX, -(-n // PMAX) * PMAX)


def kernel_bounds(lo, hi, pad_to, front=0):
    """Kernel packing bounds: float32 ``[pad_to]`` (bound_min, bound_max) from int64 ``[n]`` intervals placed at
    rows ``front .. front + n``; the padded rows see no key."""
    n = lo.shape[0]
    f = lo.new_zeros(front)
    z = lo.new_zeros(pad_to - n - front)
    return torch.cat([f, lo, z]).to(torch.float32), torch.cat([f, hi, z]).to(torch.float32)


class KernelPlan:
    """How one spec reaches the kernels: query row i becomes kernel row ``front + i`` of ``sq_k`` (front > 0
    only to keep a bottom-right alignment, for ALiBi or a native band), key j stays key j of ``sk_k``; the mask
    is the kernels' ``causal`` flag with ``window`` (sliding window W), their ``window_size`` (left, right), or
    packing bounds ``bmin`` / ``bmax`` (float32 ``[sq_k]``), which also hide the padded keys."""

    __slots__ = ("front", "sq_k", "sk_k", "causal", "window", "window_size", "bmin", "bmax")

    def __init__(self, front, sq_k, sk_k, causal=False, window=None, window_size=None, bmin=None, bmax=None):
        self.front, self.sq_k, self.sk_k = front, sq_k, sk_k
        self.causal, self.window, self.window_size = causal, window, window_size
        self.bmin, self.bmax = bmin, bmax


def spec_intervals(spec, device):
    """The key interval ``[lo, hi)`` of every query of ``spec`` (int64 ``[seqlen_q]`` each)."""
    if spec.key_lo is not None:
        return spec.key_lo, spec.key_hi
    return window_intervals(spec.seqlen_q, spec.seqlen_k, spec.left, spec.right, spec.shift, device)


def kernel_plan(spec, device):
    """The ``KernelPlan`` of ``spec``. A window (no explicit intervals) that masks something, or any window with
    ALiBi (whose distances must be the call's), becomes the kernels' own band on a layout whose bottom-right
    offset equals ``spec.shift`` (query rows padded at the front); otherwise both lengths are padded at the end
    and the mask goes through per-query bounds unless nothing is masked."""
    sq, sk, left, right, shift = spec.seqlen_q, spec.seqlen_k, spec.left, spec.right, spec.shift
    if spec.key_lo is None and (spec.alibi is not None or left != -1 or right != -1):
        # kernel lengths with sk_k - (front + sq + back) + front == shift: back = sk_k - shift - sq >= 0
        sk_k = padded_length(max(sk, sq + shift))
        back = sk_k - shift - sq
        front = (-(sq + back)) % PMAX
        sq_k = front + sq + back
        causal, window, window_size = False, None, None
        if right == 0:
            causal, window = True, (left + 1 if left >= 0 else None)
        elif left != -1 or right != -1:
            window_size = (left, right)
        # padded keys j >= sk are visible to a real row unless the band's right side hides them
        hidden = right >= 0 and sq - 1 + shift + right <= sk - 1
        bmin = bmax = None
        if sk_k > sk and not hidden:
            lo = torch.zeros(sq, dtype=torch.int64, device=device)
            bmin, bmax = kernel_bounds(lo, lo + sk, sq_k, front)
        return KernelPlan(front, sq_k, sk_k, causal, window, window_size, bmin, bmax)
    sq_k, sk_k = padded_length(sq), padded_length(sk)
    if spec.key_lo is None and sk == sk_k:
        return KernelPlan(0, sq_k, sk_k)
    bmin, bmax = kernel_bounds(*spec_intervals(spec, device), sq_k)
    return KernelPlan(0, sq_k, sk_k, bmin=bmin, bmax=bmax)


def kernel_keywords(spec, plan):
    """The kernels' keyword arguments for ``spec`` under ``plan``: the one place a spec becomes kernel
    arguments (``nki_attn.kernels.attention_fwd`` / ``attention_bwd`` signatures)."""
    return dict(use_causal_mask=plan.causal, mixed_precision=True, softmax_scale=spec.scale,
                sliding_window=plan.window, softcap=spec.softcap, alibi_slopes=spec.alibi,
                window_size=plan.window_size, dropout_p=spec.dropout_p, dropout_seed=spec.dropout_seed,
                logit_scale=spec.logit_scale)


def _launch(fn, checked, args, kwargs):
    """Run the kernel; its own assert is the only check here (the spec was checked on the host). Should a kernel
    rule the host checks do not cover still fail (e.g. a size beyond what fits on chip), the kernel's message is
    raised as ValueError, as from a host check."""
    lnc = os.environ.get("NKI_ATTN_LNC", "1").strip()
    if lnc not in ("1", "2"):
        raise ValueError(f"NKI_ATTN_LNC={lnc!r} must be 1 or 2")
    kernel = checked.kernel[2] if lnc == "2" else checked.kernel
    try:
        return kernel(*args, **kwargs)
    except AssertionError:
        problem = checked.problem_of(*args, **kwargs)
        if problem is not None:
            raise ValueError(f"{fn}: {problem}") from None
        raise


def _to_kernel(x, pad_to, front=0):
    """``[b, s, h, d]`` -> a fresh contiguous ``[b, h, d, pad_to]``: ``front`` zero rows before the sequence,
    zeros after it."""
    s = x.shape[1]
    x = x.permute(0, 2, 3, 1)
    if pad_to > s:
        x = torch.nn.functional.pad(x, (front, pad_to - s - front))
        if x.is_contiguous():
            return x
    return x.clone(memory_format=_CONTIG)


def _from_kernel(x, front, n):
    """Kernel ``[b, h, d, s_k]`` -> a fresh contiguous ``[b, n, h, d]`` of rows ``front .. front + n``."""
    return x[..., front:front + n].permute(0, 3, 1, 2).clone(memory_format=_CONTIG)


def _kernel_sinks(sinks, b):
    if sinks is None:
        return None
    s = sinks.to(torch.float32)
    return s.unsqueeze(0).expand(b, *s.shape).clone(memory_format=_CONTIG)


def check_slopes(fn, alibi_slopes):
    """ALiBi slopes' values, float32 ``[batch, heads]`` (the host checks shapes; values are only seen here, in the
    ops' bodies, where the tensors are real even under ``torch.compile``): every slope finite. Any sign is
    accepted, as FlashAttention does: the bias ``-slope * distance`` penalises distant keys for a positive slope
    and favours them for a negative one."""
    if alibi_slopes is not None and not bool(torch.isfinite(alibi_slopes).all()):
        bad = alibi_slopes[~torch.isfinite(alibi_slopes)]
        raise ValueError(f"{fn}: alibi_slopes=a tensor with {bad.numel()} non-finite value(s), e.g. "
                         f"{float(bad[0])}: every slope must be finite (any sign: a negative slope favours "
                         f"distant keys)")


def check_logit_scale(fn, logit_scale):
    """The per-head logit scale's values, float32 ``[batch, heads]`` (the host checks shape and dtype; values are
    only seen here, in the ops' bodies, where the tensors are real even under ``torch.compile``): every scale
    finite. Any sign and zero are accepted (a negative temperature inverts the ranking, zero gives uniform
    attention over the visible keys)."""
    if logit_scale is not None and not bool(torch.isfinite(logit_scale).all()):
        bad = logit_scale[~torch.isfinite(logit_scale)]
        raise ValueError(f"{fn}: logit_scale=a [batch, heads] tensor with {bad.numel()} non-finite value(s), e.g. "
                         f"{float(bad[0])}: every scale must be finite")


def _op_spec(q, k, v, sinks, key_lo, key_hi, alibi, seed, left, right, shift, scale, softcap, dropout_p, bias=None,
             logit_scale=None):
    b, sq, hq, d = q.shape
    return AttentionSpec("nki_attn", b, sq, k.shape[1], hq, k.shape[2], d, v.shape[3], q.dtype, scale, left, right,
                         shift, key_lo, key_hi, softcap, alibi, dropout_p, seed, sinks, bias, logit_scale=logit_scale)


def _kernel_bias(bias, pl, sq, sk):
    """The spec's bias ``[bb, hb, sqb, skb]`` (each dim 1 or the call's size) in the kernels' lengths: a full
    query dim gets ``pl.front`` zero rows before and zeros after (to ``pl.sq_k``), a full key dim zeros after
    (to ``pl.sk_k``; padded keys are masked), a broadcast dim stays 1. Contiguous, in the bias's dtype."""
    if bias is None:
        return None
    rows = (pl.front, pl.sq_k - sq - pl.front) if bias.shape[2] > 1 else (0, 0)
    cols = (0, pl.sk_k - sk) if bias.shape[3] > 1 else (0, 0)
    if rows != (0, 0) or cols != (0, 0):
        bias = torch.nn.functional.pad(bias, (*cols, *rows))
    return bias.contiguous()


def _bias_grad(dbias, bias, pl, sq, sk):
    """The kernel's float32 dbias ``[b, h, sq_k, sk_k]`` -> the gradient of the spec's bias: the call's rows and
    keys, summed over the bias's broadcast dims (on the host: see docs/kernel-bwd.md, "The additive bias"), in
    the bias's dtype."""
    g = dbias[:, :, pl.front:pl.front + sq, :sk]
    dims = [i for i in range(4) if bias.shape[i] == 1 and g.shape[i] != 1]
    if dims:
        g = g.sum(dim=dims, keepdim=True)
    return g.to(bias.dtype).clone(memory_format=_CONTIG)


# ----------------------------------------------------------------------------------------------------- the ops
# On the simulator the ops are implemented for CPU tensors only: XLA tensors (torch-xla, e.g. on its CPU device)
# then reach them through torch-xla's CPU fallback, which hands the implementation CPU copies and moves the results
# back, so they get exactly the CPU path's results. With the real nki the implementation serves every device (XLA
# tensors go to the real kernels).
_OP_DEVICES = "cpu" if BACKEND == "sim" else None

@torch.library.custom_op("nki_attn::attention_fwd", mutates_args=(), device_types=_OP_DEVICES)
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: Optional[torch.Tensor],
            key_lo: Optional[torch.Tensor], key_hi: Optional[torch.Tensor], alibi: Optional[torch.Tensor],
            dropout_seed: Optional[torch.Tensor], left: int, right: int, shift: int, scale: float, softcap: float,
            dropout_p: float, bias: Optional[torch.Tensor] = None, logit_scale: Optional[torch.Tensor] = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [b, sq, h, d_qk], k [b, sk, hk, d_qk], v [b, sk, hk, d_v] and the spec's fields (bias: the spec's
    ``[bb, hb, sqb, skb]`` additive bias; logit_scale: float32 ``[b, h]``) -> (out [b, sq, h, d_v], lse float32
    [b, h, sq])."""
    check_slopes("attention_fwd", alibi)
    check_logit_scale("attention_fwd", logit_scale)
    spec = _op_spec(q, k, v, sinks, key_lo, key_hi, alibi, dropout_seed, left, right, shift, scale, softcap,
                    dropout_p, bias, logit_scale)
    b, sq, hq = spec.batch, spec.seqlen_q, spec.heads
    pl = kernel_plan(spec, q.device)
    kw = kernel_keywords(spec, pl)
    if bias is not None:
        kw["attn_bias"] = _kernel_bias(bias, pl, sq, spec.seqlen_k)
    o, lse = _launch("attention_fwd", kernel_api.attention_fwd,
                     (_to_kernel(q, pl.sq_k, pl.front), _to_kernel(k, pl.sk_k), _to_kernel(v, pl.sk_k),
                      _kernel_sinks(sinks, b), pl.bmin, pl.bmax), kw)
    lse = lse.permute(0, 1, 3, 2).reshape(b, hq, pl.sq_k)[..., pl.front:pl.front + sq]
    return _from_kernel(o, pl.front, sq), lse.clone(memory_format=_CONTIG)


@_fwd_op.register_fake
def _fwd_fake(q, k, v, sinks, key_lo, key_hi, alibi, dropout_seed, left, right, shift, scale, softcap, dropout_p,
              bias=None, logit_scale=None):
    b, sq, hq, _ = q.shape
    return q.new_empty((b, sq, hq, v.shape[3])), q.new_empty((b, hq, sq), dtype=torch.float32)


@torch.library.custom_op("nki_attn::attention_bwd", mutates_args=(), device_types=_OP_DEVICES)
def _bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
            lse: torch.Tensor, dlse: Optional[torch.Tensor], sinks: Optional[torch.Tensor],
            key_lo: Optional[torch.Tensor], key_hi: Optional[torch.Tensor], alibi: Optional[torch.Tensor],
            dropout_seed: Optional[torch.Tensor], left: int, right: int, shift: int, scale: float, softcap: float,
            dropout_p: float, bias: Optional[torch.Tensor] = None, bias_grad: bool = False,
            logit_scale: Optional[torch.Tensor] = None, d_from_o: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``attention_fwd``: (dq, dk, dv like q, k, v; dsinks like sinks, or an empty [0] tensor; dbias
    like bias when ``bias_grad``, else an empty [0] tensor: no dbias work in the kernel; dlogit_scale like
    logit_scale, or an empty [0] tensor). ``d_from_o``: out / lse come from a larger problem than these keys
    (the kernel's keyword of that name)."""
    if dlse is not None and bool((dlse != 0).any()):
        raise NotImplementedError("nki_attn attention: a gradient flows into the log-sum-exp output (lse), which "
                                  "the backward kernel does not propagate; use lse only outside the graph "
                                  "(e.g. lse.detach())")
    spec = _op_spec(q, k, v, sinks, key_lo, key_hi, alibi, dropout_seed, left, right, shift, scale, softcap,
                    dropout_p, bias, logit_scale)
    b, sq, hq, sk = spec.batch, spec.seqlen_q, spec.heads, spec.seqlen_k
    pl = kernel_plan(spec, q.device)
    # Padded query rows get dout = 0 (so D = 0 and dS = 0) and lse = +inf (so P = exp(S - lse) = 0): they add
    # nothing to dk, dv, dsinks, whatever out holds there.
    lse_k = torch.nn.functional.pad(lse, (pl.front, pl.sq_k - sq - pl.front), value=math.inf)
    lse_k = lse_k.reshape(b, hq, pl.sq_k // PMAX, PMAX).transpose(-1, -2).clone(memory_format=_CONTIG)
    kw = kernel_keywords(spec, pl)
    if d_from_o:
        kw["d_from_o"] = True
    bias_grad = bool(bias_grad) and bias is not None
    if bias is not None:
        kw["attn_bias"] = _kernel_bias(bias, pl, sq, sk)
        kw["bias_grad"] = bias_grad
    grads = _launch(
        "attention_bwd", kernel_api.attention_bwd,
        (_to_kernel(q, pl.sq_k, pl.front), _to_kernel(k, pl.sk_k), _to_kernel(v, pl.sk_k),
         _to_kernel(out, pl.sq_k, pl.front), _to_kernel(dout, pl.sq_k, pl.front), lse_k, _kernel_sinks(sinks, b),
         pl.bmin, pl.bmax), kw)
    dq, dk, dv = grads[:3]
    dsinks = grads[3].sum(0).to(sinks.dtype) if sinks is not None else q.new_empty((0,), dtype=torch.float32)
    # the kernel's outputs after dq, dk, dv: [dsinks], [dbias], [dlogit_scale] (float32 [b, h] like logit_scale)
    dlogit = grads[-1].clone() if logit_scale is not None else q.new_empty((0,), dtype=torch.float32)
    n_dbias = len(grads) - (1 if logit_scale is not None else 0) - 1
    dbias = _bias_grad(grads[n_dbias], bias, pl, sq, sk) if bias_grad else q.new_empty((0,), dtype=torch.float32)
    return _from_kernel(dq, pl.front, sq), _from_kernel(dk, 0, sk), _from_kernel(dv, 0, sk), dsinks, dbias, dlogit


@_bwd_op.register_fake
def _bwd_fake(q, k, v, out, dout, lse, dlse, sinks, key_lo, key_hi, alibi, dropout_seed, left, right, shift, scale,
              softcap, dropout_p, bias=None, bias_grad=False, logit_scale=None, d_from_o=False):
    dsinks = torch.empty_like(sinks, memory_format=_CONTIG) if sinks is not None else \
        q.new_empty((0,), dtype=torch.float32)
    dbias = torch.empty_like(bias, memory_format=_CONTIG) if bias is not None and bias_grad else \
        q.new_empty((0,), dtype=torch.float32)
    dlogit = torch.empty_like(logit_scale, memory_format=_CONTIG) if logit_scale is not None else \
        q.new_empty((0,), dtype=torch.float32)
    return (torch.empty_like(q, memory_format=_CONTIG), torch.empty_like(k, memory_format=_CONTIG),
            torch.empty_like(v, memory_format=_CONTIG), dsinks, dbias, dlogit)


_N_FLAGS = 6  # left, right, shift, scale, softcap, dropout_p: the op's inputs after its first 8 tensors


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, sinks, key_lo, key_hi, alibi, seed = inputs[:8]
    bias = inputs[8 + _N_FLAGS] if len(inputs) > 8 + _N_FLAGS else None
    # (a trailing None may be left out of the inputs: bias and logit_scale have defaults)
    logit_scale = inputs[9 + _N_FLAGS] if len(inputs) > 9 + _N_FLAGS else None
    ctx.save_for_backward(q, k, v, output[0], output[1], sinks, key_lo, key_hi, alibi, seed, bias, logit_scale)
    ctx.flags = tuple(inputs[8:8 + _N_FLAGS])


def _fwd_backward(ctx, dout, dlse):
    q, k, v, out, lse, sinks, key_lo, key_hi, alibi, seed, bias, logit_scale = ctx.saved_tensors
    # the bias's gradient only when autograd asks for it: otherwise the kernel runs without its dbias steps
    bias_grad = bias is not None and ctx.needs_input_grad[8 + _N_FLAGS]
    dq, dk, dv, dsinks, dbias, dlogit = _bwd_op(q, k, v, out, dout, lse, dlse, sinks, key_lo, key_hi, alibi, seed,
                                                *ctx.flags, bias, bias_grad, logit_scale)
    return (dq, dk, dv, (dsinks if sinks is not None else None)) + (None,) * 10 + \
        ((dbias if bias_grad else None), (dlogit if logit_scale is not None else None))


def _bwd_setup_context(ctx, inputs, output):
    pass


def _bwd_backward(ctx, *grads):
    raise RuntimeError("nki_attn attention: double backward (differentiating the gradients of the attention, e.g. "
                       "backward(create_graph=True) followed by a gradient penalty) is not implemented: the "
                       "backward kernel is not itself differentiable")


_fwd_op.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)
_bwd_op.register_autograd(_bwd_backward, setup_context=_bwd_setup_context)


# ----------------------------------------------------------------------------------------------------- public
def _op_args(spec):
    return (spec.sinks, spec.key_lo, spec.key_hi, spec.alibi, spec.dropout_seed, spec.left, spec.right, spec.shift,
            spec.scale, spec.softcap, spec.dropout_p, spec.bias)


def _is_empty(spec):
    return 0 in (spec.batch, spec.seqlen_q, spec.seqlen_k, spec.heads, spec.d_qk, spec.d_v)


def attention(spec, q, k, v):
    """Attention of q, k, v under ``spec`` (module docstring): ``(out [batch, seqlen_q, heads, d_v], lse float32
    [batch, heads, seqlen_q])``, differentiable with respect to q, k, v, ``spec.sinks``, ``spec.bias`` and
    ``spec.logit_scale``."""
    if _is_empty(spec):
        if spec.bias is not None:
            if 0 not in (spec.batch, spec.seqlen_q, spec.seqlen_k, spec.heads):
                raise NotImplementedError(f"{spec.fn}: attn_bias with head_dim 0 (q.shape[-1] = {spec.d_qk}, "
                                          f"v.shape[-1] = {spec.d_v}) is not supported")
            out, lse = _empty_attention(spec, q, k, v)
            # no score exists: the bias gets a zero gradient (an empty sum keeps it in the graph, -inf or not)
            return out + spec.bias.reshape(-1)[:0].sum().to(out.dtype), lse
        return _empty_attention(spec, q, k, v)
    return _fwd_op(q, k, v, *_op_args(spec), spec.logit_scale)


def attention_backward(spec, q, k, v, out, dout, lse, d_from_o=False):
    """The backward of ``attention`` for given ``out`` / ``lse`` (``[batch, seqlen_q, heads, d_v]`` /
    float32 ``[batch, heads, seqlen_q]``) and ``dout`` (like out): ``(dq, dk, dv, dsinks)``; dsinks float32
    ``[0]`` without sinks; with ``spec.logit_scale`` a fifth, dlogit_scale float32 ``[batch, heads]``. Not
    differentiable; ``spec.bias`` is added to the scores, its gradient not computed. ``d_from_o=True`` when
    ``out`` / ``lse`` come from a larger problem than these keys (ring attention hands each block the global
    ones): the kernel then takes D = rowsum(out * dout) for every row (its keyword of that name); False gives
    exactly the gradients autograd through ``attention`` gives."""
    grads = _bwd_op(q, k, v, out, dout, lse, None, *_op_args(spec), False, spec.logit_scale, bool(d_from_o))
    return grads[:4] + (grads[5],) if spec.logit_scale is not None else grads[:4]


def _empty_attention(spec, q, k, v):
    """Some size is 0: torch's result (zeros when no key exists, else an empty output), with gradients."""
    b, sq, hq, hk = spec.batch, spec.seqlen_q, spec.heads, spec.heads_kv
    kk, vv = k, v
    if hq and hk and hq != hk:
        kk, vv = k.repeat_interleave(hq // hk, dim=2), v.repeat_interleave(hq // hk, dim=2)
    # with no key or an empty head_dim the scores are an empty sum (exact zeros), so this is exact
    s = torch.matmul(q.transpose(1, 2), kk.permute(0, 2, 3, 1))
    out = torch.matmul(s, vv.transpose(1, 2)).transpose(1, 2).clone(memory_format=_CONTIG)
    lo, hi = spec_intervals(spec, q.device)
    n = (hi - lo).to(torch.float32)  # zero scores: lse = log(#visible keys)
    lse = torch.log(n).expand(b, hq, sq)
    if spec.sinks is not None:
        s = spec.sinks.detach().float()
        s = s if s.dim() == 2 else s[:, None]
        lse = torch.logaddexp(lse, torch.logsumexp(s, -1)[None, :, None])
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse)
    return out, lse.clone(memory_format=_CONTIG)


# The op pair of block-masked attention (``nki_attn.flex_attention``): the kernels with a ``BlockMask``'s operands
# (``BlockMask.kernel_operands``: the union classes as a uint8 tensor, the bitmap store) instead of a spec's mask.
_FLEX = "flex_attention"


def _rows_tuple(rows):
    """The trace-time classes of a launch from their uint8 ``[n_qt, n_kc]`` tensor."""
    return tuple(tuple(r) for r in rows.tolist())


def _flex_keywords(rows, store, alibi_t, n_b, n_h, scale, cap, bias, sq, sk):
    kw = dict(mixed_precision=True, softmax_scale=scale, softcap=cap, alibi_slopes=alibi_t,
              block_mask=(n_b, n_h, _rows_tuple(rows)), block_bits=store)
    if bias is not None:
        kw["attn_bias"] = _kernel_bias(bias, KernelPlan(0, padded_length(sq), padded_length(sk)), sq, sk)
    return kw


@torch.library.custom_op("nki_attn::flex_fwd", mutates_args=(), device_types=_OP_DEVICES)
def _flex_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, store: Optional[torch.Tensor],
              alibi_t: Optional[torch.Tensor], n_b: int, n_h: int, scale: float, cap: float,
              bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [b, sq, h, d], k [b, sk, hk, d], v [b, sk, hk, dv] (FlashAttention's layout), the block mask's kernel
    operands (rows uint8 [ceil(sq/128), ceil(sk/128)], store uint8 [128, n] or None), the additive bias
    [bb, hb, sqb, skb] or None -> (out [b, sq, h, dv], lse float32 [b, h, sq])."""
    check_slopes(_FLEX, alibi_t)
    b, sq, hq, _ = q.shape
    sk = k.shape[1]
    sq_k, sk_k = padded_length(sq), padded_length(sk)
    o, lse = _launch(_FLEX, kernel_api.attention_fwd,
                     (_to_kernel(q, sq_k), _to_kernel(k, sk_k), _to_kernel(v, sk_k)),
                     _flex_keywords(rows, store, alibi_t, n_b, n_h, scale, cap, bias, sq, sk))
    lse = lse.permute(0, 1, 3, 2).reshape(b, hq, sq_k)[..., :sq]
    return _from_kernel(o, 0, sq), lse.clone(memory_format=_CONTIG)


@_flex_fwd.register_fake
def _flex_fwd_fake(q, k, v, rows, store, alibi_t, n_b, n_h, scale, cap, bias=None):
    b, sq, hq, _ = q.shape
    return q.new_empty((b, sq, hq, v.shape[3])), q.new_empty((b, hq, sq), dtype=torch.float32)


@torch.library.custom_op("nki_attn::flex_bwd", mutates_args=(), device_types=_OP_DEVICES)
def _flex_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
              lse: torch.Tensor, dlse: Optional[torch.Tensor], rows: torch.Tensor, store: Optional[torch.Tensor],
              alibi_t: Optional[torch.Tensor], n_b: int, n_h: int, scale: float, cap: float,
              bias: Optional[torch.Tensor] = None, bias_grad: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``flex_fwd``: (dq, dk, dv like q, k, v; dbias like bias when ``bias_grad``, else an empty
    [0] tensor) (``dlse``, the gradient reaching lse, must be 0)."""
    if dlse is not None and bool((dlse != 0).any()):
        raise NotImplementedError(f"{_FLEX}: a gradient flows into the returned lse, which the backward kernel does "
                                  f"not propagate; use lse.detach()")
    b, sq, hq, _ = q.shape
    sk = k.shape[1]
    sq_k, sk_k = padded_length(sq), padded_length(sk)
    # padded query rows: dout = 0 and lse = +inf, so P = 0 and they add nothing
    lse_k = torch.nn.functional.pad(lse, (0, sq_k - sq), value=math.inf)
    lse_k = lse_k.reshape(b, hq, sq_k // PMAX, PMAX).transpose(-1, -2).clone(memory_format=_CONTIG)
    kw = _flex_keywords(rows, store, alibi_t, n_b, n_h, scale, cap, bias, sq, sk)
    bias_grad = bool(bias_grad) and bias is not None
    if bias is not None:
        kw["bias_grad"] = bias_grad
    grads = _launch(_FLEX, kernel_api.attention_bwd,
                    (_to_kernel(q, sq_k), _to_kernel(k, sk_k), _to_kernel(v, sk_k), _to_kernel(out, sq_k),
                     _to_kernel(dout, sq_k), lse_k), kw)
    dq, dk, dv = grads[:3]
    dbias = _bias_grad(grads[-1], bias, KernelPlan(0, sq_k, sk_k), sq, sk) if bias_grad else \
        q.new_empty((0,), dtype=torch.float32)
    return _from_kernel(dq, 0, sq), _from_kernel(dk, 0, sk), _from_kernel(dv, 0, sk), dbias


@_flex_bwd.register_fake
def _flex_bwd_fake(q, k, v, out, dout, lse, dlse, rows, store, alibi_t, n_b, n_h, scale, cap, bias=None,
                   bias_grad=False):
    dbias = torch.empty_like(bias, memory_format=_CONTIG) if bias is not None and bias_grad else \
        q.new_empty((0,), dtype=torch.float32)
    return (torch.empty_like(q, memory_format=_CONTIG), torch.empty_like(k, memory_format=_CONTIG),
            torch.empty_like(v, memory_format=_CONTIG), dbias)


def _flex_setup(ctx, inputs, output):
    q, k, v, rows, store, alibi_t = inputs[:6]
    bias = inputs[10] if len(inputs) > 10 else None
    ctx.save_for_backward(q, k, v, output[0], output[1], rows, store, alibi_t, bias)
    ctx.flags = tuple(inputs[6:10])


def _flex_backward(ctx, dout, dlse):
    q, k, v, out, lse, rows, store, alibi_t, bias = ctx.saved_tensors
    # dbias only when autograd asks for it (no dbias instruction otherwise)
    bias_grad = bias is not None and len(ctx.needs_input_grad) > 10 and ctx.needs_input_grad[10]
    dq, dk, dv, dbias = _flex_bwd(q, k, v, out, dout, lse, dlse, rows, store, alibi_t, *ctx.flags, bias, bias_grad)
    return (dq, dk, dv) + (None,) * 7 + ((dbias if bias_grad else None),)


def _flex_double_backward(ctx, *grads):
    raise RuntimeError(f"{_FLEX}: double backward is not implemented (the backward kernel is not differentiable)")


_flex_fwd.register_autograd(_flex_backward, setup_context=_flex_setup)
_flex_bwd.register_autograd(_flex_double_backward, setup_context=lambda ctx, inputs, output: None)


def block_mask_attention(q, k, v, rows, store, alibi, n_b, n_h, scale, softcap, bias=None):
    """Attention of q ``[b, sq, h, d_qk]``, k ``[b, sk, hk, d_qk]``, v ``[b, sk, hk, d_v]`` (FlashAttention's
    layout, any lengths) under a block mask given by its kernel operands (``BlockMask.kernel_operands`` /
    ``union_rows``: ``rows`` uint8 ``[ceil(sq / 128), ceil(sk / 128)]``, ``store`` uint8 ``[128, n]`` or None,
    its batch / head extents ``n_b``, ``n_h``), with the float32 ALiBi slopes ``alibi`` ``[b, h]`` or None, the
    softmax ``scale``, ``softcap`` (0: off) and the additive ``bias`` ``[bb, hb, sqb, skb]`` (each dim 1 or the
    call's size; float32 / bfloat16 / float16) or None: ``(out [b, sq, h, d_v], lse float32 [b, h, sq])``,
    differentiable with respect to q, k, v and the bias. Checked by ``nki_attn.flex.flex_attention``, trusted
    here."""
    return _flex_fwd(q, k, v, rows, store, alibi, n_b, n_h, scale, softcap, bias)
