"""The references the block-mask tests judge against: attention by its definition with a DENSE element mask.

``dense_attention`` runs in the dtype it is given (float64: the truth; the row's dtype: the baseline, with the
softmax statistics in float32 as the kernels and the golden keep them for 16-bit inputs), differentiable by
torch's autograd. ``from_stats`` is the backward's own formula evaluated in float32 from the O and LSE the
kernel hands its backward (the harness's "inputs" baseline). ``judge`` applies the harness's two rules
(``nki_attn.harness.tolerance.compare``) to one output.
"""
import math

import torch

from nki_attn.harness.tolerance import compare


def _expand(x, hq):
    return x.repeat_interleave(hq // x.shape[1], dim=1) if x.shape[1] != hq else x


def scores(q, k, mask, scale, cap=0.0, slopes=None, stat=None, bias=None):
    """Masked scaled scores ``[B, Hq, Sq, Sk]`` in the statistics dtype ``stat`` (-inf where hidden); ``bias``
    (broadcastable) added after soft-capping and ALiBi."""
    hq, sq, sk = q.shape[1], q.shape[2], k.shape[2]
    s = torch.matmul(q, _expand(k, hq).transpose(-1, -2))
    s = s.to(stat or s.dtype) * scale
    if cap:
        s = cap * torch.tanh(s / cap)
    if slopes is not None:
        i = torch.arange(sq)[:, None] + (sk - sq)
        j = torch.arange(sk)[None, :]
        s = s - slopes.to(s.dtype).expand(q.shape[0], hq)[:, :, None, None] * (i - j).abs().to(s.dtype)
    if bias is not None:
        s = s + bias.to(s.dtype)
    return s.masked_fill(~mask, -math.inf)


def dense_attention(q, k, v, mask, scale, cap=0.0, slopes=None, bias=None):
    """(out ``[B, Hq, Sq, Dv]``, lse ``[B, Hq, Sq]`` with +inf for empty rows); mask bool broadcastable to
    ``[B, Hq, Sq, Sk]``. 16-bit inputs: matmuls in the dtype, softmax in float32, P rounded to the dtype."""
    hq = q.shape[1]
    stat = torch.float32 if q.dtype in (torch.bfloat16, torch.float16) else q.dtype
    s = scores(q, k, mask, scale, cap, slopes, stat, bias)
    lse = torch.logsumexp(s, -1)
    empty = torch.isneginf(lse)
    p = torch.exp(s - torch.where(empty, torch.zeros_like(lse), lse)[..., None])
    out = torch.matmul(p.to(q.dtype), _expand(v, hq))
    return out, torch.where(empty, torch.full_like(lse, math.inf), lse).detach()


def run(fn, q, k, v, dout):
    """fn(q, k, v) -> (out, lse) on fresh leaves; returns (out, lse, dq, dk, dv) detached."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out, lse = fn(q, k, v)
    out.backward(dout.to(out.dtype))
    return out.detach(), lse.detach(), q.grad.detach(), k.grad.detach(), v.grad.detach()


def from_stats(q, k, v, out, lse, dout, mask, scale, cap=0.0, slopes=None):
    """The backward formula in float32 from the handed out (rounded to its dtype) and lse: (dq, dk, dv)."""
    hq, hk = q.shape[1], k.shape[1]
    f = [t.float() for t in (q, k, v, out, dout)]
    q32, k32, v32, o32, do32 = f
    with torch.enable_grad():
        qq = q32.clone().requires_grad_(True)
        s = scores(qq, k32, mask, scale, cap, slopes)  # to differentiate through the cap
        ls = torch.where(torch.isinf(lse), torch.full_like(lse, math.inf), lse)
        p = torch.exp(s - ls[..., None])
        dp = torch.matmul(do32, _expand(v32, hq).transpose(-1, -2))
        d = (do32 * o32).sum(-1, keepdim=True)
        ds = p * (dp - d)
        g = torch.autograd.grad(s, qq, grad_outputs=ds.detach(), retain_graph=True)[0]
    kk = _expand(k32, hq)
    # dS is the gradient w.r.t. the (modified) scores: chain through the score mods via autograd for dq; dk by
    # the same chain with the roles of q and k exchanged
    with torch.enable_grad():
        kk2 = kk.clone().requires_grad_(True)
        s2 = torch.matmul(q32, kk2.transpose(-1, -2)) * scale
        if cap:
            s2 = cap * torch.tanh(s2 / cap)
        dk = torch.autograd.grad(s2, kk2, grad_outputs=ds.detach().masked_fill(~mask, 0.0))[0]
    dv = torch.matmul(p.transpose(-1, -2), do32)
    grp = hq // hk
    b = q.shape[0]
    dk = dk.reshape(b, hk, grp, *dk.shape[2:]).sum(2)
    dv = dv.reshape(b, hk, grp, *dv.shape[2:]).sum(2)
    return g, dk, dv


def judge(name, got, ref64, base, dtype, n, inputs=None, vec_axis=3):
    """The harness's verdict on one output; asserts it passes, naming the numbers."""
    dname = str(dtype).replace("torch.", "")
    r = compare(name, got.detach().double().numpy(), ref64.detach().double().numpy(), base.detach().double().numpy(), dname, n=n,
                inputs=None if inputs is None else inputs.detach().double().numpy(), vec_axis=vec_axis)
    assert r["ok"], (f"{name} ({dname}): max err {r['max_abs']:.3e} vs bound {r['bound']:.3e}, projection "
                     f"{r['proj']:.3e} vs {r['proj_bound']:.3e}, nonfinite {r['nonfinite']}")
    return r
