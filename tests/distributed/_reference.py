"""Full-sequence references for the distributed tests: the float64 golden (truth) and the single-process API.

Both take the full sequence in FlashAttention's layout ``[batch, seqlen, heads, head_dim]`` (seqlen a multiple
of 128, as the golden needs) and return a dict with ``out``, ``lse`` (``[batch, heads, seqlen]``), ``dq``,
``dk``, ``dv`` and ``dsinks`` (``[heads]`` / ``[heads, n]``, or None).
"""
import math

import torch

import nki_attn
from golden import attention_bwd_torch_ref, attention_fwd_torch_ref
from nki_attn.spec import window_intervals


def _kl(x):
    return x.permute(0, 2, 3, 1).contiguous()


def _fa(x):
    return x.permute(0, 3, 1, 2).contiguous()


def golden_full(q, k, v, do, sinks, causal, window, scale=None):
    """The float64 golden on the rounded inputs, with the window as per-query bounds over the full sequence."""
    b, S, h, d = q.shape
    left, right = window[0], (0 if causal else window[1])
    lo, hi = window_intervals(S, S, left, right, 0)
    qd, kd, vd, dod = (_kl(t.double()) for t in (q, k, v, do))
    sk = None if sinks is None else sinks.double().unsqueeze(0).expand(b, *sinks.shape).contiguous()
    args = dict(sinks_ref=sk, bound_min=lo.float(), bound_max=hi.float(), softmax_scale=scale)
    o, lse = attention_fwd_torch_ref(qd, kd, vd, **args)
    g = attention_bwd_torch_ref(qd, kd, vd, o, dod, lse, **args)
    lse = lse.permute(0, 1, 3, 2).reshape(b, h, S)
    lse = torch.where(torch.isneginf(lse), math.inf, lse)
    ds = g.get("out_dsinks_ref")
    return {"out": _fa(o), "lse": lse, "dq": _fa(g["out_dq_ref"]), "dk": _fa(g["out_dk_ref"]),
            "dv": _fa(g["out_dv_ref"]), "dsinks": None if ds is None else ds.sum(0)}


def single_process(q, k, v, do, sinks, causal, window, scale=None):
    """nki_attn.flash_attn_func on the full sequence (the same kernels, one process)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    s = None if sinks is None else sinks.detach().clone().requires_grad_()
    out, lse = nki_attn.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, window_size=window, sinks=s,
                                        return_lse=True)
    out.backward(do)
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
            "dsinks": None if s is None else s.grad}
