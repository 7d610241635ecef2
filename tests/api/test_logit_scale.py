"""The per-head logit scale (``logit_scale``) through the PyTorch API: values and gradients (including the scale's
own) against float64 autograd, every entry point that takes it, the argument checks, meta / FakeTensor shapes and
``torch.compile(fullgraph=True)``.

Criterion (FlashAttention's, as tests/api/test_variants_api.py and docs/validation.md): for the output and every
gradient, the error against the float64 reference is at most K = 3 times the error of the same reference computed
in the input dtype, plus a floor of 2^-20 * max(max|truth|, 1).
"""
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from nki_attn.attention import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                flash_attn_varlen_func, interval_attention)

K = 3.0


def reference(q, k, v, lam, causal=False, softcap=0.0, alibi=None, scale=None):
    """The definition in torch ops (differentiable in every input, any dtype): logits ``scale * lam[h] * q.k``,
    then the soft-cap, then ALiBi ``-slope |i + sk - sq - j|``, the bottom-right causal mask, softmax, P V.
    q [b, sq, h, d], k/v [b, sk, hk, d], lam [h] or [b, h] -> out [b, sq, h, d_v]."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    kk, vv = k.repeat_interleave(h // hk, 2), v.repeat_interleave(h // hk, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * (1.0 / math.sqrt(d) if scale is None else scale)
    s = s * (lam[None, :, None, None] if lam.dim() == 1 else lam[:, :, None, None]).to(s.dtype)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    if alibi is not None:
        s = s - alibi.to(s.dtype)[None, :, None, None] * (i - j).abs().to(s.dtype)
    if causal:
        s = s.masked_fill(j > i, float("-inf"))
    p = torch.softmax(s.float() if s.dtype != torch.float64 else s, -1).to(q.dtype)
    return torch.einsum("bhqk,bkhd->bqhd", p, vv)


def _grads(fn, ins, dout):
    ins = [t.detach().clone().requires_grad_(True) for t in ins]
    out = fn(*ins)
    out.backward(dout.to(out.dtype))
    return [out.detach()] + [t.grad.detach() for t in ins]


def check(fn_ours, fn_ref, ins, dtype, seed=0):
    """fn_ours(q, k, v, lam) in ``dtype`` (lam float32) against fn_ref in float64 (truth) and in ``dtype``
    (baseline): the output and the gradients of q, k, v and lam."""
    q, k, v, lam = ins
    low = [q.to(dtype), k.to(dtype), v.to(dtype), lam]
    truth_in = [t.double() for t in low]
    dout = torch.randn(fn_ref(*truth_in).shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    truth = _grads(fn_ref, truth_in, dout)
    base = _grads(fn_ref, low, dout)
    ours = _grads(fn_ours, low, dout)
    for name, a, t, l in zip(("out", "dq", "dk", "dv", "dlogit_scale"), ours, truth, base):
        assert a.shape == t.shape, f"{name}: shape {tuple(a.shape)} != {tuple(t.shape)}"
        assert torch.isfinite(a).all(), f"{name}: non-finite values"
        floor = 2.0 ** -20 * max(float(t.abs().max()), 1.0)
        err = float((a.double() - t).abs().max())
        bound = K * float((l.double() - t).abs().max()) + floor
        assert err <= bound, f"{name}: error {err:.3e} > {K} x baseline + floor = {bound:.3e}"
    return ours


def _qkv(b, sq, sk, h, hk, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, sq, h, d, generator=g), torch.randn(b, sk, hk, d, generator=g),
            torch.randn(b, sk, hk, d, generator=g))


def _lam(*shape, seed=1):
    """Learned temperatures in [0.5, 3): none a power of two."""
    return 0.5 + 2.5 * torch.rand(*shape, generator=torch.Generator().manual_seed(seed))


CASES = {
    # name: ((b, sq, sk, h, hk, d), lam shape "h" | "bh", keywords, dtype)
    "h-plain": ((2, 130, 200, 4, 2, 64), "h", dict(), torch.float32),
    "bh-causal": ((2, 130, 260, 2, 1, 32), "bh", dict(causal=True), torch.float32),
    "h-cap-alibi-causal-bf16": ((1, 256, 256, 4, 4, 64), "h", dict(causal=True, softcap=3.0, alibi=True),
                                torch.bfloat16),
    "bh-scale-fp16": ((2, 128, 256, 2, 2, 64), "bh", dict(scale=0.2), torch.float16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_flash_attn_func_logit_scale_and_its_gradient(case):
    (b, sq, sk, h, hk, d), lam_shape, kw, dtype = CASES[case]
    kw = dict(kw)
    alibi = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)]) if kw.pop("alibi", False) else None
    lam = _lam(h) if lam_shape == "h" else _lam(b, h)

    def ours(q, k, v, lam):
        return flash_attn_func(q, k, v, softmax_scale=kw.get("scale"), causal=kw.get("causal", False),
                               softcap=kw.get("softcap", 0.0), alibi_slopes=alibi, logit_scale=lam)

    def ref(q, k, v, lam):
        return reference(q, k, v, lam, kw.get("causal", False), kw.get("softcap", 0.0), alibi, kw.get("scale"))

    check(ours, ref, [*_qkv(b, sq, sk, h, hk, d), lam], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_attention_logit_scale_marker_under_a_block_mask(dtype):
    """``nki_attn.flex.logit_scale(t)``: the table's row reaches flex_attention's markers with no code of its own;
    under a causal block mask (Sq = Sk, so top-left = bottom-right) and with soft-capping, the output and the
    gradients of q, k, v and the scale match the definition like flash_attn_func's."""
    from nki_attn import flex, masks
    from nki_attn.block_mask import create_block_mask
    b, s, h, hk, d = 2, 200, 4, 2, 32
    bm = create_block_mask(masks.causal_mask, None, None, s, s)

    def ours(q, k, v, lam):
        out = flex.flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                  score_mod=[flex.logit_scale(lam), flex.softcap(3.0)], block_mask=bm,
                                  enable_gqa=True)
        return out.transpose(1, 2)

    def ref(q, k, v, lam):
        return reference(q, k, v, lam, causal=True, softcap=3.0)

    check(ours, ref, [*_qkv(b, s, s, h, hk, d, seed=5), _lam(b, h)], dtype)


def test_logit_scale_one_is_no_logit_scale():
    """lam = 1 everywhere: the same output and gradients as without it, bit for bit (the step multiplies by 1.0,
    exactly), and a gradient for lam."""
    q, k, v = _qkv(1, 130, 200, 2, 1, 32)
    ones = torch.ones(2, requires_grad=True)
    qa = q.clone().requires_grad_(True)
    qb = q.clone().requires_grad_(True)
    with_one = flash_attn_func(qa, k, v, causal=True, logit_scale=ones)
    without = flash_attn_func(qb, k, v, causal=True)
    assert torch.equal(with_one, without)
    with_one.sum().backward()
    without.sum().backward()
    assert torch.equal(qa.grad, qb.grad)
    assert ones.grad is not None and ones.grad.shape == (2,) and torch.isfinite(ones.grad).all()


def test_packed_and_interval_entry_points_take_it():
    """qkvpacked, kvpacked, interval_attention (per-entry intervals: one launch per batch entry) and varlen
    (one [nheads] scale shared by the sequences) equal flash_attn_func with the same scale."""
    b, s, h, d = 2, 160, 2, 32
    q, k, v = _qkv(b, s, s, h, h, d)
    lam = _lam(b, h)
    want = flash_attn_func(q, k, v, causal=True, logit_scale=lam)
    assert torch.equal(flash_attn_qkvpacked_func(torch.stack([q, k, v], 2), causal=True, logit_scale=lam), want)
    assert torch.equal(flash_attn_kvpacked_func(q, torch.stack([k, v], 2), causal=True, logit_scale=lam), want)
    i = torch.arange(s)
    lo = torch.zeros(b, s, dtype=torch.int64)
    hi = torch.stack([i + 1, i + 1])
    out, _ = interval_attention(q, k, v, lo, hi, logit_scale=lam)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
    cu = torch.tensor([0, 70, s], dtype=torch.int32)
    lam_h = lam[0]
    out = flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 90, 90, causal=True, logit_scale=lam_h)
    for a, e in ((0, 70), (70, s)):
        one = flash_attn_func(q[:1, a:e], k[:1, a:e], v[:1, a:e], causal=True, logit_scale=lam_h)
        torch.testing.assert_close(out[a:e], one[0], rtol=0, atol=1e-6)


def _fa(**kw):
    q, k, v = _qkv(2, 128, 128, 4, 2, 32)
    return lambda: flash_attn_func(q, k, v, **kw)


BAD = [
    ("type", _fa(logit_scale=[1.0] * 4), TypeError, r"flash_attn_func: logit_scale=list: must be a float32 "
                                                    r"torch\.Tensor"),
    ("shape", _fa(logit_scale=torch.ones(3)), ValueError,
     r"flash_attn_func: logit_scale\.shape=\(3,\): must be \[nheads\] = \[4\] or \[batch, nheads\] = \[2, 4\]"),
    ("dtype", _fa(logit_scale=torch.ones(4, dtype=torch.float64)), TypeError,
     r"logit_scale\.dtype=torch\.float64: must be torch\.float32"),
    ("nan", _fa(logit_scale=torch.tensor([1.0, float("nan"), 1.0, 1.0])), ValueError,
     r"logit_scale=a \[batch, heads\] tensor with 2 non-finite value\(s\), e\.g\. nan: every scale must "
     r"be finite"),
    ("inf", _fa(logit_scale=torch.full((2, 4), float("inf"))), ValueError, r"8 non-finite value\(s\), e\.g\. inf"),
]


@pytest.mark.parametrize("name,call,exc,match", BAD, ids=[b[0] for b in BAD])
def test_bad_logit_scale(name, call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_varlen_logit_scale_is_per_head_only():
    q, k, v = (t[0] for t in _qkv(1, 200, 200, 2, 1, 32))
    cu = torch.tensor([0, 80, 200], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"flash_attn_varlen_func: logit_scale\.shape=\(2, 2\): must be \[nheads\] "
                                         r"= \[2\] \(one scale per head, shared by the packed sequences\)"):
        flash_attn_varlen_func(q, k, v, cu, cu, 120, 120, logit_scale=torch.ones(2, 2))


def test_meta_and_fake_tensors_get_shapes():
    """meta tensors and FakeTensorMode (what torch.compile traces with): output, lse and the scale's gradient
    have their shapes without any kernel running."""
    q = torch.empty(2, 130, 4, 64, device="meta")
    k = torch.empty(2, 300, 2, 64, device="meta")
    out, lse = flash_attn_func(q, k, k, causal=True, logit_scale=torch.empty(4, device="meta"), return_lse=True)
    assert out.shape == (2, 130, 4, 64) and lse.shape == (2, 4, 130)
    with FakeTensorMode():
        q = torch.empty(2, 130, 4, 64)
        k = torch.empty(2, 300, 2, 64)
        lam = torch.empty(2, 4, requires_grad=True)
        out = flash_attn_func(q, k, k, causal=True, logit_scale=lam)
        out.sum().backward()
        assert out.shape == (2, 130, 4, 64) and lam.grad.shape == (2, 4)


def test_compile_fullgraph_with_logit_scale():
    """torch.compile(fullgraph=True): the scale rides through the custom ops, forward and backward equal eager
    bit for bit."""
    q, k, v = _qkv(1, 130, 200, 2, 1, 64)

    def f(q, k, v, lam):
        return flash_attn_func(q, k, v, causal=True, softcap=2.0, logit_scale=lam)

    lam_e = _lam(2).requires_grad_(True)
    lam_c = lam_e.detach().clone().requires_grad_(True)
    eager = f(q, k, v, lam_e)
    compiled = torch.compile(f, fullgraph=True)(q, k, v, lam_c)
    assert torch.equal(compiled, eager)
    eager.sum().backward()
    compiled.sum().backward()
    assert torch.equal(lam_c.grad, lam_e.grad)
