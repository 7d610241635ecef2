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
    sees no key and has no sink). Differentiable with respect to q, k, v, ``spec.sinks`` and each score
    modification with a gradient (``spec.bias``, computed by the kernel only when it requires one;
    ``spec.logit_scale``); a
    gradient flowing into lse must be zero (NotImplementedError otherwise) and double backward raises
    RuntimeError.

``attention_backward(spec, q, k, v, out, dout, lse) -> (dq, dk, dv, dsinks)``
    The backward alone (ring attention calls it per block with the merged out and lse): dq, dk, dv shaped like
    q, k, v; dsinks like ``spec.sinks`` (an empty float32 ``[0]`` tensor without sinks); with a logit scale a fifth,
    dlogit_scale float32 ``[batch, heads]``.

``kernel_plan(spec, device) -> KernelPlan``, ``kernel_bounds``, ``padded_length``: how a spec reaches the
kernels (used by the probabilities of ``return_attn_probs`` and by ring attention's block geometry).

The block-masked attention of ``nki_attn.flex_attention`` runs on the same pair: the spec's ``block_mask`` (a
``BlockMask``'s kernel operands) reaches the ops as optional inputs and replaces the window (docs/masks.md).

The ops take plain tensors and numbers (the spec's fields); their schema is written from the spec's core fields,
the block mask's operands and one input per row of ``nki_attn.spec.SCORE_MODS`` (and one gradient output per row
with a gradient), so a score modification reaches both ops, their fakes and their autograd without being named
here. Their implementation rebuilds the spec and launches the kernel, their fake kernels give shapes, so ``torch.compile(fullgraph=True)`` holds one opaque node per
direction and FakeTensor / ``meta`` inputs get the right output shapes without running anything. Every output is
a fresh contiguous tensor. ``NKI_ATTN_LNC=2`` launches on two NeuronCores (trn2/trn3; bit-identical results).
"""
import math
import os
from typing import Optional

import torch

from . import kernel_api
from .backend import BACKEND
from .spec import GRAD_MODS, PMAX, SCORE_MODS, AttentionSpec, window_intervals

__all__ = ["attention", "attention_backward", "kernel_plan", "kernel_keywords", "kernel_bounds", "padded_length",
           "spec_intervals", "KernelPlan"]

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
    and the mask goes through per-query bounds unless nothing is masked. A block mask (``spec.block_mask``) is
    the whole mask: both lengths padded at the end, no bounds (its tiles hide the padded keys)."""
    sq, sk, left, right, shift = spec.seqlen_q, spec.seqlen_k, spec.left, spec.right, spec.shift
    if spec.block_mask is not None:
        return KernelPlan(0, padded_length(sq), padded_length(sk))
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
    kw = dict(use_causal_mask=plan.causal, mixed_precision=True, softmax_scale=spec.scale,
              sliding_window=plan.window, window_size=plan.window_size, dropout_p=spec.dropout_p,
              dropout_seed=spec.dropout_seed)
    for m in SCORE_MODS:
        value = getattr(spec, m.name)
        kw[m.kernel] = m.to_kernel(value, plan, spec) if m.to_kernel and value is not None else value
    if spec.block_mask is not None:
        rows, bits, n_b, n_h = spec.block_mask
        kw.update(block_mask=(n_b, n_h, tuple(tuple(r) for r in rows.tolist())), block_bits=bits)
    return kw


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


# ----------------------------------------------------------------------------------------------------- the ops
# On the simulator the ops are implemented for CPU tensors only: XLA tensors (torch-xla, e.g. on its CPU device)
# then reach them through torch-xla's CPU fallback, which hands the implementation CPU copies and moves the results
# back, so they get exactly the CPU path's results. With the real nki the implementation serves every device (XLA
# tensors go to the real kernels).
_OP_DEVICES = "cpu" if BACKEND == "sim" else None

# The ops' inputs, in order: the schema is written from these lists and SCORE_MODS, so a score modification is an
# input (and, with a gradient, an output) of both ops without being named here.
_CORE = (("Tensor? sinks", None), ("Tensor? key_lo", None), ("Tensor? key_hi", None),
         ("Tensor? dropout_seed", None), ("int left", -1), ("int right", -1), ("int shift", 0),
         ("float scale", 1.0), ("float dropout_p", 0.0))
_BLOCK = (("Tensor? block_rows", None), ("Tensor? block_bits", None), ("int block_b", 1), ("int block_h", 1))
_MODS = tuple((f"{'Tensor?' if m.is_tensor else 'float'} {m.name}", m.off) for m in SCORE_MODS)
_WANT = tuple((f"bool want_{m.name}", False) for m in GRAD_MODS if m.grad == "requested")
_FWD_IN = (("Tensor q", None), ("Tensor k", None), ("Tensor v", None)) + _CORE + _MODS + _BLOCK
_BWD_IN = tuple((f"Tensor {n}", None) for n in ("q", "k", "v", "out", "dout", "lse")) + (("Tensor? dlse", None),) \
    + _CORE + _MODS + _BLOCK + _WANT + (("bool d_from_o", False),)
_N_GRADS = 4 + len(GRAD_MODS)  # dq, dk, dv, dsinks, then one per score modification with a gradient
_FWD_NAMES = [d.split()[-1] for d, _ in _FWD_IN]
_FWD_TENSORS = [n for n, (d, _) in zip(_FWD_NAMES, _FWD_IN) if d.startswith("Tensor")]


def _schema(inputs, n_required, n_out):
    """The op's schema: the first ``n_required`` inputs without a default, the others with theirs."""
    args = [d if i < n_required else f"{d}={'None' if v is None else v}" for i, (d, v) in enumerate(inputs)]
    return f"({', '.join(args)}) -> ({', '.join(['Tensor'] * n_out)})"


def _named(inputs, args):
    """The op's inputs as a dict by name (trailing defaults may be left out by the dispatcher)."""
    names = [d.split()[-1] for d, _ in inputs]
    a = {n: v for n, (_, v) in zip(names, inputs)}
    a.update(zip(names, args))
    return a


def _op_spec(a):
    q, k, v = a["q"], a["k"], a["v"]
    b, sq, hq, d = q.shape
    block = None if a["block_rows"] is None else (a["block_rows"], a["block_bits"], a["block_b"], a["block_h"])
    return AttentionSpec("nki_attn", b, sq, k.shape[1], hq, k.shape[2], d, v.shape[3], q.dtype, a["scale"],
                         a["left"], a["right"], a["shift"], a["key_lo"], a["key_hi"], a["dropout_p"],
                         a["dropout_seed"], a["sinks"], block, **{m.name: a[m.name] for m in SCORE_MODS})


def _fwd_impl(*args):
    """q [b, sq, h, d_qk], k [b, sk, hk, d_qk], v [b, sk, hk, d_v] and the spec's fields -> (out [b, sq, h, d_v],
    lse float32 [b, h, sq])."""
    spec = _op_spec(_named(_FWD_IN, args))
    fn = "attention_fwd" if spec.block_mask is None else "flex_attention"
    _check_values(fn, spec)
    q, k, v = args[:3]
    b, sq, hq = spec.batch, spec.seqlen_q, spec.heads
    pl = kernel_plan(spec, q.device)
    o, lse = _launch(fn, kernel_api.attention_fwd,
                     (_to_kernel(q, pl.sq_k, pl.front), _to_kernel(k, pl.sk_k), _to_kernel(v, pl.sk_k),
                      _kernel_sinks(spec.sinks, b), pl.bmin, pl.bmax), kernel_keywords(spec, pl))
    lse = lse.permute(0, 1, 3, 2).reshape(b, hq, pl.sq_k)[..., pl.front:pl.front + sq]
    return _from_kernel(o, pl.front, sq), lse.clone(memory_format=_CONTIG)


def _fwd_fake(*args):
    q, v = args[0], args[2]
    b, sq, hq, _ = q.shape
    return q.new_empty((b, sq, hq, v.shape[3])), q.new_empty((b, hq, sq), dtype=torch.float32)


def _bwd_impl(*args):
    """Gradients of ``attention_fwd``: (dq, dk, dv like q, k, v; dsinks like sinks, or an empty [0] tensor; then
    per score modification with a gradient (``GRAD_MODS``) its gradient like its input, or an empty [0] tensor
    when it is absent or (``want_<name>`` False) not requested: no gradient work for it in the kernel).
    ``d_from_o``: out / lse come from a larger problem than these keys (the kernel's keyword of that name)."""
    a = _named(_BWD_IN, args)
    if a["dlse"] is not None and bool((a["dlse"] != 0).any()):
        raise NotImplementedError("nki_attn attention: a gradient flows into the log-sum-exp output (lse), which "
                                  "the backward kernel does not propagate; use lse only outside the graph "
                                  "(e.g. lse.detach())")
    spec = _op_spec(a)
    q, k, v = a["q"], a["k"], a["v"]
    b, sq, hq, sk = spec.batch, spec.seqlen_q, spec.heads, spec.seqlen_k
    pl = kernel_plan(spec, q.device)
    # Padded query rows get dout = 0 (so D = 0 and dS = 0) and lse = +inf (so P = exp(S - lse) = 0): they add
    # nothing to dk, dv, dsinks, whatever out holds there.
    lse_k = torch.nn.functional.pad(a["lse"], (pl.front, pl.sq_k - sq - pl.front), value=math.inf)
    lse_k = lse_k.reshape(b, hq, pl.sq_k // PMAX, PMAX).transpose(-1, -2).clone(memory_format=_CONTIG)
    kw = kernel_keywords(spec, pl)
    if a["d_from_o"]:
        kw["d_from_o"] = True
    want = _wanted(a)
    for m in GRAD_MODS:
        if m.grad_flag and getattr(spec, m.name) is not None:
            kw[m.grad_flag] = want[m.name]
    grads = _launch(
        "attention_bwd" if spec.block_mask is None else "flex_attention", kernel_api.attention_bwd,
        (_to_kernel(q, pl.sq_k, pl.front), _to_kernel(k, pl.sk_k), _to_kernel(v, pl.sk_k),
         _to_kernel(a["out"], pl.sq_k, pl.front), _to_kernel(a["dout"], pl.sq_k, pl.front), lse_k,
         _kernel_sinks(spec.sinks, b), pl.bmin, pl.bmax), kw)
    dq, dk, dv = grads[:3]
    sinks = spec.sinks
    dsinks = grads[3].sum(0).to(sinks.dtype) if sinks is not None else _empty(q)
    # the kernel's outputs after dq, dk, dv, [dsinks]: one per computed gradient, in SCORE_MODS order
    rest = list(grads[3 + (sinks is not None):])
    mod_grads = []
    for m in GRAD_MODS:
        if want[m.name]:
            g = rest.pop(0)
            value = getattr(spec, m.name)
            mod_grads.append(m.from_kernel(g, value, pl, spec) if m.from_kernel else g.clone(memory_format=_CONTIG))
        else:
            mod_grads.append(_empty(q))
    return (_from_kernel(dq, pl.front, sq), _from_kernel(dk, 0, sk), _from_kernel(dv, 0, sk), dsinks, *mod_grads)


def _empty(q):
    """A fresh empty float32 ``[0]`` output (an absent gradient; outputs must not alias one another)."""
    return q.new_empty((0,), dtype=torch.float32)


def _wanted(a):
    """{name: True when the kernel computes this score modification's gradient} for ``GRAD_MODS`` (``a``: the
    backward op's inputs by name)."""
    return {m.name: a[m.name] is not None and (m.grad == "always" or bool(a[f"want_{m.name}"]))
            for m in GRAD_MODS}


def _bwd_fake(*args):
    a = _named(_BWD_IN, args)
    q, k, v = a["q"], a["k"], a["v"]
    want = _wanted(a)
    dsinks = torch.empty_like(a["sinks"], memory_format=_CONTIG) if a["sinks"] is not None else _empty(q)
    mods = [torch.empty_like(a[m.name], memory_format=_CONTIG) if want[m.name] else _empty(q) for m in GRAD_MODS]
    return (torch.empty_like(q, memory_format=_CONTIG), torch.empty_like(k, memory_format=_CONTIG),
            torch.empty_like(v, memory_format=_CONTIG), dsinks, *mods)


_fwd_op = torch.library.custom_op("nki_attn::attention_fwd", _fwd_impl, mutates_args=(), device_types=_OP_DEVICES,
                                  schema=_schema(_FWD_IN, 3 + len(_CORE), 2))
_bwd_op = torch.library.custom_op("nki_attn::attention_bwd", _bwd_impl, mutates_args=(), device_types=_OP_DEVICES,
                                  schema=_schema(_BWD_IN, 7 + len(_CORE), _N_GRADS))
_fwd_op.register_fake(_fwd_fake)
_bwd_op.register_fake(_bwd_fake)


def _fwd_setup_context(ctx, inputs, output):
    a = _named(_FWD_IN, inputs)
    ctx.save_for_backward(output[0], output[1], *(a[n] for n in _FWD_TENSORS))
    ctx.others = {n: a[n] for n in _FWD_NAMES if n not in _FWD_TENSORS}


def _fwd_backward(ctx, dout, dlse):
    out, lse, *tensors = ctx.saved_tensors
    a = dict(zip(_FWD_TENSORS, tensors), **ctx.others)
    # a "requested" gradient (the bias's) only when autograd asks for it: otherwise no kernel work for it
    want = {m.name: a[m.name] is not None and ctx.needs_input_grad[_FWD_NAMES.index(m.name)] for m in GRAD_MODS}
    bwd_args = dict(a, out=out, dout=dout, lse=lse, dlse=dlse, d_from_o=False,
                    **{f"want_{m.name}": want[m.name] for m in GRAD_MODS if m.grad == "requested"})
    grads = _bwd_op(*[bwd_args[d.split()[-1]] for d, _ in _BWD_IN])
    by_name = dict(q=grads[0], k=grads[1], v=grads[2], sinks=grads[3] if a["sinks"] is not None else None)
    for m, g in zip(GRAD_MODS, grads[4:]):
        by_name[m.name] = g if want[m.name] or (m.grad == "always" and a[m.name] is not None) else None
    return tuple(by_name.get(n) for n in _FWD_NAMES)


def _bwd_setup_context(ctx, inputs, output):
    pass


def _bwd_backward(ctx, *grads):
    raise RuntimeError("nki_attn attention: double backward (differentiating the gradients of the attention, e.g. "
                       "backward(create_graph=True) followed by a gradient penalty) is not implemented: the "
                       "backward kernel is not itself differentiable")


_fwd_op.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)
_bwd_op.register_autograd(_bwd_backward, setup_context=_bwd_setup_context)


def _check_values(fn, spec):
    """The score modifications' value checks (``ScoreMod.values``), where the tensors are real."""
    for m in SCORE_MODS:
        value = getattr(spec, m.name)
        if m.values is not None and value is not None:
            m.values(fn, value)


# ----------------------------------------------------------------------------------------------------- public
def _op_args(spec):
    """The op's inputs after q, k, v (``_FWD_IN``'s order) from ``spec``."""
    block = spec.block_mask or (None, None, 1, 1)
    return (spec.sinks, spec.key_lo, spec.key_hi, spec.dropout_seed, spec.left, spec.right, spec.shift, spec.scale,
            spec.dropout_p, *(getattr(spec, m.name) for m in SCORE_MODS), *block)


def _is_empty(spec):
    return 0 in (spec.batch, spec.seqlen_q, spec.seqlen_k, spec.heads, spec.d_qk, spec.d_v)


def attention(spec, q, k, v):
    """Attention of q, k, v under ``spec`` (module docstring): ``(out [batch, seqlen_q, heads, d_v], lse float32
    [batch, heads, seqlen_q])``, differentiable with respect to q, k, v, ``spec.sinks`` and the score
    modifications with a gradient (``spec.bias``, ``spec.logit_scale``)."""
    if _is_empty(spec):
        if spec.bias is not None:
            if 0 not in (spec.batch, spec.seqlen_q, spec.seqlen_k, spec.heads):
                raise NotImplementedError(f"{spec.fn}: attn_bias with head_dim 0 (q.shape[-1] = {spec.d_qk}, "
                                          f"v.shape[-1] = {spec.d_v}) is not supported")
            out, lse = _empty_attention(spec, q, k, v)
            # no score exists: the bias gets a zero gradient (an empty sum keeps it in the graph, -inf or not)
            return out + spec.bias.reshape(-1)[:0].sum().to(out.dtype), lse
        return _empty_attention(spec, q, k, v)
    return _fwd_op(q, k, v, *_op_args(spec))


def attention_backward(spec, q, k, v, out, dout, lse, d_from_o=False):
    """The backward of ``attention`` for given ``out`` / ``lse`` (``[batch, seqlen_q, heads, d_v]`` /
    float32 ``[batch, heads, seqlen_q]``) and ``dout`` (like out): ``(dq, dk, dv, dsinks)``; dsinks float32
    ``[0]`` without sinks; then the gradient of each given score modification whose gradient is always computed
    (``ScoreMod.grad == "always"``: with ``spec.logit_scale`` a fifth, dlogit_scale float32 ``[batch, heads]``).
    Not differentiable; ``spec.bias`` is added to the scores, its gradient not computed. ``d_from_o=True`` when
    ``out`` / ``lse`` come from a larger problem than these keys (ring attention hands each block the global
    ones): the kernel then takes D = rowsum(out * dout) for every row (its keyword of that name); False gives
    exactly the gradients autograd through ``attention`` gives."""
    grads = _bwd_op(q, k, v, out, dout, lse, None, *_op_args(spec), *(False for _ in _WANT), bool(d_from_o))
    return grads[:4] + tuple(g for m, g in zip(GRAD_MODS, grads[4:])
                             if m.grad == "always" and getattr(spec, m.name) is not None)


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


