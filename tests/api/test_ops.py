"""The custom-op pair (nki_attn.ops): torch.compile, FakeTensor / meta, autograd edges (lse gradient, double
backward), the ops against the golden, sinks of -inf, and torch.library.opcheck.

Compile figures (per-call overhead, first-call time) come from scripts/bench.py compile, not from these tests:
here only facts that cannot be timing-dependent are asserted (graph breaks, recompiles, bit-for-bit results).
"""
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import nki_attn
from golden import attention_bwd_torch_ref, attention_fwd_torch_ref
from nki_attn import ops
from nki_attn.spec import AttentionSpec, flash_spec


def rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def leaves(*ts):
    return [t.detach().clone().requires_grad_(True) for t in ts]


# ---------------------------------------------------------------------------------------------- compile
def _fa_step(q, k, v, s):
    return nki_attn.flash_attn_func(q, k, v, causal=True, window_size=(60, 0), sinks=s)


def _varlen_step(q, k, v, s):
    cu = torch.tensor([0, 70, 200], dtype=torch.int32)
    return nki_attn.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 130, 130, causal=True, sinks=s)[None]


def _sdpa_mask_step(q, k, v, s):
    m = torch.ones(200, 200, dtype=torch.bool).tril().triu(-50)  # a sliding-window mask as a tensor
    return nki_attn.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 attn_mask=m, enable_gqa=True).transpose(1, 2)


@pytest.mark.parametrize("step,backend", [(_fa_step, "inductor"), (_varlen_step, "aot_eager"),
                                          (_sdpa_mask_step, "aot_eager")],
                         ids=["flash-inductor", "varlen", "sdpa-mask"])
def test_compile_fullgraph_is_bit_exact_without_breaks_or_recompiles(step, backend):
    torch._dynamo.reset()
    q, k, v, s = rand(1, 200, 4, 32, seed=1), rand(1, 200, 2, 32, seed=2), rand(1, 200, 2, 32, seed=3), rand(4, seed=4)
    w = rand(1, 200, 4, 32, seed=5)
    use_s = step is not _sdpa_mask_step
    explain = torch._dynamo.explain(lambda *a: (step(*a) * w).sum())(q, k, v, s if use_s else None)
    assert explain.graph_break_count == 0 and explain.graph_count == 1, explain.break_reasons

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    for call in range(2):  # the second call must reuse the first graph
        if call == 1:
            torch._dynamo.config.error_on_recompile = True
        try:
            e_in = leaves(q + call, k, v, s)
            c_in = leaves(q + call, k, v, s)
            out_e = step(*e_in[:3], e_in[3] if use_s else None)
            out_c = compiled(*c_in[:3], c_in[3] if use_s else None)
            (out_e * w).sum().backward()
            (out_c * w).sum().backward()
        finally:
            torch._dynamo.config.error_on_recompile = False
        assert torch.equal(out_e, out_c)
        for a, b in zip(e_in, c_in):
            assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)


# ---------------------------------------------------------------------------------------------- fake / meta
@pytest.mark.parametrize("device", ["meta", "fake"])
def test_fake_and_meta_inputs_get_the_right_shapes(device):
    def run():
        mk = (lambda *s: torch.empty(*s, device="meta")) if device == "meta" else torch.empty
        q, k = mk(2, 1000, 8, 128).requires_grad_(True), mk(2, 700, 2, 128).requires_grad_(True)
        out, lse, probs = nki_attn.flash_attn_func(q, k, k, causal=True, window_size=(100, 0),
                                                   return_attn_probs=True, sinks=mk(8))
        assert out.shape == q.shape and lse.shape == (2, 8, 1000) and lse.dtype == torch.float32
        assert probs.shape == (2, 8, 1000, 700) and probs.dtype == torch.float32
        out.sum().backward()
        assert q.grad.shape == q.shape and k.grad.shape == k.shape
        cu = torch.tensor([0, 300, 1000], dtype=torch.int32, device=q.device)
        o = nki_attn.flash_attn_varlen_func(q[0], k[0], k[0], cu, torch.tensor([0, 200, 700], dtype=torch.int32,
                                                                                device=q.device), 700, 500)
        assert o.shape == (1000, 8, 128)
        o = nki_attn.scaled_dot_product_attention(mk(3, 4, 50, 64), mk(3, 4, 60, 64), mk(3, 4, 60, 64),
                                                  is_causal=True)
        assert o.shape == (3, 4, 50, 64)
        qq, kk, vv = mk(1, 256, 4, 32), mk(1, 256, 2, 32), mk(1, 256, 2, 48)
        o, l = ops.attention(flash_spec("t", qq, kk, vv, causal=True), qq, kk, vv)
        assert o.shape == (1, 256, 4, 48) and l.shape == (1, 4, 256)
        return out
    if device == "meta":
        assert run().device.type == "meta"
    else:
        with FakeTensorMode():
            run()


# ---------------------------------------------------------------------------------------------- autograd edges
def test_double_backward_raises_instead_of_a_silent_wrong_gradient():
    q, k, v = leaves(rand(1, 64, 2, 32, seed=6), rand(1, 64, 2, 32, seed=7), rand(1, 64, 2, 32, seed=8))
    out = nki_attn.flash_attn_func(q, k, v, causal=True)
    dq, = torch.autograd.grad((out ** 2).sum(), q, create_graph=True)
    assert dq.grad_fn is not None
    with pytest.raises(RuntimeError, match="double backward"):
        (dq ** 2).sum().backward()  # a gradient penalty


def test_lse_gradient_is_refused_not_dropped():
    q = leaves(rand(1, 64, 2, 32, seed=9))[0]
    out, lse = nki_attn.flash_attn_func(q, q, q, return_lse=True)
    (out.sum() + 0 * lse.sum()).backward()  # a zero lse gradient is fine
    q.grad = None
    out, lse = nki_attn.flash_attn_func(q, q, q, return_lse=True)
    with pytest.raises(NotImplementedError, match="log-sum-exp"):
        (out.sum() + lse.sum()).backward()


# ---------------------------------------------------------------------------------------------- the ops themselves
def _kl(x):
    return x.permute(0, 2, 3, 1).contiguous()


def _fa(x):
    return x.permute(0, 3, 1, 2)


@pytest.mark.parametrize("causal,window,bounds,sinks", [(True, 64, False, True), (False, None, True, False)])
def test_ops_match_the_golden(causal, window, bounds, sinks):
    """The documented ring-attention building blocks: attention (out, lse) and attention_backward per block."""
    b, h, hk, d, s = 1, 4, 2, 64, 256
    q, k, v = rand(b, s, h, d, seed=10), rand(b, s, hk, d, seed=11), rand(b, s, hk, d, seed=12)
    do = rand(b, s, h, d, seed=13)
    sk = rand(h, seed=14) if sinks else None
    bmin = bmax = None
    spec = flash_spec("t", q, k, v, softmax_scale=0.2, causal=causal,
                      window_size=(window - 1 if window else -1, -1), sinks=sk)
    if bounds:
        bmin = torch.cat([torch.zeros(100), torch.full((156,), 100.0)])
        bmax = torch.cat([torch.full((100,), 100.0), torch.full((156,), 230.0)])
        spec = spec.with_mask(s, s, key_lo=bmin.long(), key_hi=bmax.long())
    kw = dict(use_causal_mask=causal, sliding_window=window, softmax_scale=0.2)
    out, lse = ops.attention(spec, q, k, v)
    assert out.is_contiguous() and lse.is_contiguous()
    gsk = None if sk is None else sk.double()[None].expand(b, h).contiguous()
    go, glse = attention_fwd_torch_ref(_kl(q.double()), _kl(k.double()), _kl(v.double()), gsk, bmin, bmax, **kw)
    torch.testing.assert_close(_kl(out).double(), go, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), glse.transpose(-1, -2).reshape(b, h, s), rtol=1e-5, atol=1e-5)
    dq, dk, dv, dsinks = ops.attention_backward(spec, q, k, v, out, do, lse)
    g = attention_bwd_torch_ref(_kl(q.double()), _kl(k.double()), _kl(v.double()), go, _kl(do.double()), glse,
                                gsk, bmin, bmax, **kw)
    for name, a in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert a.is_contiguous()
        torch.testing.assert_close(_kl(a).double(), g[f"out_{name}_ref"], rtol=1e-4, atol=1e-4)
    if sinks:
        torch.testing.assert_close(dsinks.double(), g["out_dsinks_ref"].sum(0), rtol=1e-4, atol=1e-4)
    else:
        assert dsinks.shape == (0,)
    # autograd through the forward op gives the backward op's result
    ql, kl, vl = leaves(q, k, v)
    o2, _ = ops.attention(spec, ql, kl, vl)
    o2.backward(do)
    assert torch.equal(ql.grad, dq) and torch.equal(kl.grad, dk) and torch.equal(vl.grad, dv)


def test_a_kernel_rule_the_host_did_not_check_still_raises_value_error():
    """The op pair trusts its spec (checked once on the host); should a spec built by hand break a kernel rule,
    the kernel's own message comes back as ValueError, not as an AssertionError from inside the trace."""
    q = rand(1, 128, 2, 64)
    spec = AttentionSpec("hand-made", 1, 128, 128, 2, 2, 64, 64, torch.float32, 0.125, softcap=-1.0)
    with pytest.raises(ValueError, match=r"attention_fwd: softcap=-1.0 must be a finite number >= 0"):
        ops.attention(spec, q, q, q)


def test_opcheck():
    q, k, v = rand(1, 128, 2, 32, seed=15), rand(1, 128, 1, 32, seed=16), rand(1, 128, 1, 32, seed=17)
    sk = rand(2, seed=18)
    spec = flash_spec("t", q, k, v, causal=True, window_size=(31, 0), sinks=sk)
    out, lse = ops.attention(spec, q, k, v)
    flags = (31, 0, 0, 0.25, 0.0)  # left, right, shift, scale, dropout_p (the score modifications: their defaults)
    torch.library.opcheck(torch.ops.nki_attn.attention_fwd.default, (q, k, v, sk, None, None, None) + flags,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
    torch.library.opcheck(torch.ops.nki_attn.attention_bwd.default,
                          (q, k, v, out, rand(1, 128, 2, 32, seed=19), lse, None, sk, None, None, None) + flags,
                          test_utils=("test_schema", "test_faketensor"))


# ---------------------------------------------------------------------------------------------- sinks = -inf
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask", ["causal", "bounds"])
def test_minus_inf_sinks_are_exactly_no_sink_in_kernels_and_golden(mask, dtype):
    b, h, d, s = 2, 2, 64, 256
    q, k, v, do = (rand(b, s, h, d, seed=20 + i, dtype=dtype) for i in range(4))
    sinks = torch.full((h, 2), -math.inf)
    kw = dict(use_causal_mask=mask == "causal")
    spec = flash_spec("t", q, k, v, causal=mask == "causal")
    if mask == "bounds":  # rows 200.. see no key at all: empty rows with (no) sinks
        kw["bound_min"] = torch.cat([torch.zeros(200), torch.full((56,), 300.0)])
        kw["bound_max"] = torch.cat([torch.full((200,), 180.0), torch.full((56,), 300.0)])
        spec = spec.with_mask(s, s, key_lo=kw["bound_min"].long(), key_hi=kw["bound_max"].long().clamp(max=s))
    with_sinks = spec.with_mask(s, s, spec.left, spec.right, spec.shift, spec.key_lo, spec.key_hi, sinks=sinks)
    o, lse = ops.attention(with_sinks, q, k, v)
    o0, lse0 = ops.attention(spec, q, k, v)
    assert torch.equal(o, o0) and torch.equal(lse, lse0)
    dq, dk, dv, dsinks = ops.attention_backward(with_sinks, q, k, v, o, do, lse)
    dq0, dk0, dv0, _ = ops.attention_backward(spec, q, k, v, o0, do, lse0)
    assert torch.equal(dq, dq0) and torch.equal(dk, dk0) and torch.equal(dv, dv0)
    assert torch.equal(dsinks, torch.zeros_like(dsinks))
    # the golden, in float64
    g = [_kl(t.double()) for t in (q, k, v, do)]
    gs = sinks.double()[None].expand(b, h, 2).contiguous()
    go, gl = attention_fwd_torch_ref(g[0], g[1], g[2], gs, **kw)
    go0, gl0 = attention_fwd_torch_ref(g[0], g[1], g[2], None, **kw)
    assert torch.equal(go, go0) and torch.equal(gl, gl0)
    gb = attention_bwd_torch_ref(g[0], g[1], g[2], go, g[3], gl, gs, **kw)
    gb0 = attention_bwd_torch_ref(g[0], g[1], g[2], go0, g[3], gl0, None, **kw)
    for key in gb0:
        assert torch.equal(gb[key], gb0[key])
    assert torch.equal(gb["out_dsinks_ref"], torch.zeros_like(gb["out_dsinks_ref"]))


def test_minus_inf_sinks_through_the_api():
    q, k, v = leaves(rand(1, 200, 2, 64, seed=30), rand(1, 200, 2, 64, seed=31), rand(1, 200, 2, 64, seed=32))
    sinks = torch.tensor([-math.inf, -math.inf], requires_grad=True)
    out = nki_attn.flash_attn_func(q, k, v, causal=True, sinks=sinks)
    out.sum().backward()
    ref_in = leaves(q, k, v)
    ref = nki_attn.flash_attn_func(*ref_in, causal=True)
    ref.sum().backward()
    assert torch.equal(out, ref) and torch.equal(sinks.grad, torch.zeros(2))
    for a, b in zip((q, k, v), ref_in):
        assert torch.equal(a.grad, b.grad)
