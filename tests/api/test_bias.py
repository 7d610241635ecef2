"""The additive bias ``attn_bias`` through the PyTorch API: forward and gradients (q, k, v and the bias) against
float64 autograd, its broadcast shapes, the SDPA float-mask path, bad input, FakeTensor and torch.compile.

Criterion (FlashAttention's, as tests/api/test_variants_api.py): for the output and every gradient, our error
against the reference in float64 is at most K = 3 times the error of the same reference computed in the input
dtype, plus a floor of 2^-20 * max(max|truth|, 1) (docs/validation.md). The reference is plain torch autograd
(scores, soft-cap, bias, mask, softmax, values), so the bias's gradient is checked against autograd's own
reduction over the broadcast dims.
"""
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import nki_attn
from nki_attn.attention import flash_attn_func, flash_attn_qkvpacked_func, scaled_dot_product_attention

K = 3.0

# bias shapes by name, for [b, h, sq, sk]: the broadcast forms the issue names, the full one, a key-padding bias
SHAPES = {"h_sq_sk": lambda b, h, sq, sk: (h, sq, sk), "b_1_sq_sk": lambda b, h, sq, sk: (b, 1, sq, sk),
          "1_1_sq_sk": lambda b, h, sq, sk: (1, 1, sq, sk), "full": lambda b, h, sq, sk: (b, h, sq, sk),
          "b_1_1_sk": lambda b, h, sq, sk: (b, 1, 1, sk)}


def reference(q, k, v, bias, causal=False, window=(-1, -1), softcap=0.0, scale=None):
    """Attention by the definition, FlashAttention's layout (q ``[b, sq, h, d]``, k/v ``[b, sk, hk, d]``, bias
    broadcastable to ``[b, h, sq, sk]``), bottom-right aligned masks; a row that sees no key gives 0."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    kk, vv = k.repeat_interleave(h // hk, 2), v.repeat_interleave(h // hk, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    if softcap > 0.0:
        s = softcap * torch.tanh(s / softcap)
    s = s + bias
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    vis = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        vis &= j <= i
    if window[0] >= 0:
        vis &= j >= i - window[0]
    if window[1] >= 0:
        vis &= j <= i + window[1]
    s = s.masked_fill(~vis, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
    e = torch.exp(s - m)
    den = e.sum(-1, keepdim=True)
    p = e / torch.where(den > 0, den, torch.ones_like(den))
    return torch.einsum("bhqk,bkhd->bqhd", p, vv)


def _run(fn, ins, dout):
    ins = [t.detach().clone().requires_grad_(True) for t in ins]
    out = fn(*ins)
    out.backward(dout.to(out.dtype))
    return [out.detach()] + [t.grad.detach() for t in ins]


def _assert_fa(name, ours, truth, lowp):
    assert ours.shape == truth.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(truth.shape)}"
    assert torch.isfinite(ours).all(), f"{name}: non-finite values"
    floor = 2.0 ** -20 * max(float(truth.abs().max()), 1.0)
    err = float((ours.double() - truth).abs().max())
    base = float((lowp.double() - truth).abs().max())
    assert err <= K * base + floor, f"{name}: error {err:.3e} > {K} x baseline {base:.3e} + {floor:.1e}"


def check(fn_ours, fn_ref, ins, dtype, seed=0):
    """fn_ours in ``dtype`` against fn_ref in float64 (truth) and in ``dtype`` (baseline): out and every grad."""
    ins = [t.to(dtype) for t in ins]
    out_shape = fn_ref(*[t.double() for t in ins]).shape
    dout = torch.randn(out_shape, generator=torch.Generator().manual_seed(seed + 7), dtype=torch.float64)
    truth = _run(fn_ref, [t.double() for t in ins], dout)
    lowp = _run(fn_ref, ins, dout)
    ours = _run(fn_ours, ins, dout)
    for name, a, t, low in zip(("out", "dq", "dk", "dv", "dbias"), ours, truth, lowp):
        _assert_fa(name, a, t, low)


def rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _inputs(b, sq, sk, h, hk, d, bias_shape, seed=0):
    return [rand(b, sq, h, d, seed=seed), rand(b, sk, hk, d, seed=seed + 1), rand(b, sk, hk, d, seed=seed + 2),
            rand(*bias_shape, seed=seed + 3, scale=2.0)]


# ---------------------------------------------------------------------------------------------- gradients
# every (mask, shape, dtype); the default run keeps one case per shape that covers both masks and both dtypes,
# the rest run with -m slow
_DEFAULT = {("causal", "h_sq_sk", "fp32"), ("window", "b_1_sq_sk", "bf16"), ("causal", "1_1_sq_sk", "bf16"),
            ("window", "h_sq_sk", "bf16")}
_GRAD_CASES = [pytest.param(m, s, dt, id=f"{m}-{s}-{name}",
                            marks=() if (m, s, name) in _DEFAULT else pytest.mark.slow)
               for m in ("causal", "window") for s in ("h_sq_sk", "b_1_sq_sk", "1_1_sq_sk")
               for dt, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"))]


@pytest.mark.parametrize("mask,shape,dtype", _GRAD_CASES)
def test_bias_gradients_match_float64_autograd_gqa(mask, shape, dtype):
    b, sq, sk, h, hk, d = 2, 200, 260, 4, 2, 32
    causal, window = (True, (-1, -1)) if mask == "causal" else (False, (90, 40))
    ins = _inputs(b, sq, sk, h, hk, d, SHAPES[shape](b, h, sq, sk), seed=11)

    def ours(q, k, v, bias):
        return flash_attn_func(q, k, v, causal=causal, window_size=window, attn_bias=bias)

    def ref(q, k, v, bias):
        return reference(q, k, v, bias, causal, window)
    check(ours, ref, ins, dtype)


@pytest.mark.parametrize("shape", ["full", "b_1_1_sk"])
def test_bias_full_and_key_padding_shapes_with_softcap(shape):
    """The bias sits after the cap: ``c tanh(scale q.k / c) + bias`` (its gradient is the logit's, without the
    cap's chain rule), for a full bias and a key-padding one ``[b, 1, 1, sk]``."""
    b, sq, sk, h, hk, d = 2, 130, 300, 2, 1, 48
    ins = _inputs(b, sq, sk, h, hk, d, SHAPES[shape](b, h, sq, sk), seed=21)

    def ours(q, k, v, bias):
        return flash_attn_func(q, k, v, causal=True, softcap=3.0, attn_bias=bias)

    def ref(q, k, v, bias):
        return reference(q, k, v, bias, True, softcap=3.0)
    check(ours, ref, ins, torch.float32)


def test_minus_inf_bias_masks_keys_and_empty_rows_give_zero():
    """-inf in the bias masks a key (as in torch's float attn_mask); a row whose every key is masked gives 0
    and passes no gradient (no NaN anywhere)."""
    b, s, h, d = 1, 160, 2, 32
    q, k, v = rand(b, s, h, d, seed=31), rand(b, s, h, d, seed=32), rand(b, s, h, d, seed=33)
    bias = rand(h, s, s, seed=34)
    bias[:, :, 100:] = -math.inf
    bias[0, 7, :] = -math.inf  # row 7 of head 0 sees nothing
    ins = [t.clone().requires_grad_(True) for t in (q, k, v, bias)]
    out = flash_attn_func(*ins[:3], attn_bias=ins[3])
    out.sum().backward()
    assert torch.all(out[0, 7, 0] == 0)
    for t in ins:
        assert torch.isfinite(t.grad).all()
    assert torch.all(ins[3].grad[:, :, 100:] == 0)
    truth = reference(q.double(), k.double(), v.double(), bias.double())
    assert float((out.detach().double() - truth).abs().max()) < 1e-5


def test_no_bias_gradient_work_when_the_bias_needs_none():
    """A bias that does not require grad still shifts the scores, and the backward runs the plain dS step:
    q's gradient is bit-identical to the one computed alongside the bias's gradient (the dS the matmuls see is
    the same float32 value rounded once either way)."""
    b, s, h, d = 1, 256, 2, 32
    q, k, v, bias = rand(b, s, h, d, seed=41), rand(b, s, h, d, seed=42), rand(b, s, h, d, seed=43), \
        rand(h, s, s, seed=44)
    grads = []
    for bias_grad in (False, True):
        qq = q.clone().requires_grad_(True)
        bb = bias.clone().requires_grad_(bias_grad)
        flash_attn_func(qq, k, v, causal=True, attn_bias=bb).sum().backward()
        grads.append(qq.grad)
        assert (bb.grad is not None) == bias_grad
    assert torch.equal(grads[0], grads[1])


def test_expanded_bias_reads_one_copy_and_sums_its_gradient():
    """A bias ``expand``-ed along the batch (stride 0) is taken as a broadcast dim: the gradient reaching the
    un-expanded tensor is the sum over the batch, as autograd gives it."""
    b, s, h, d = 3, 130, 2, 32
    q, k, v = rand(b, s, h, d, seed=51), rand(b, s, h, d, seed=52), rand(b, s, h, d, seed=53)
    base = rand(1, h, s, s, seed=54).requires_grad_(True)
    flash_attn_func(q, k, v, attn_bias=base.expand(b, h, s, s)).sum().backward()
    ref = base.detach().double().requires_grad_(True)
    reference(q.double(), k.double(), v.double(), ref.expand(b, h, s, s)).sum().backward()
    assert float((base.grad.double() - ref.grad).abs().max()) < 1e-5 * max(1.0, float(ref.grad.abs().max()))


def test_packed_entry_point_takes_the_bias():
    b, s, h, d = 1, 140, 2, 32
    qkv = rand(b, s, 3, h, d, seed=61)
    bias = rand(h, s, s, seed=62)
    out = flash_attn_qkvpacked_func(qkv, causal=True, attn_bias=bias)
    truth = reference(*(t.double() for t in qkv.unbind(2)), bias.double(), causal=True)
    assert float((out.double() - truth).abs().max()) < 1e-5


# ---------------------------------------------------------------------------------------------- SDPA float mask
@pytest.mark.parametrize("mask_shape", [(4, 150, 170), (2, 1, 1, 170), (150, 170)], ids=["h", "b-keys", "2d"])
def test_sdpa_float_attn_mask_is_the_bias(mask_shape):
    """torch's SDPA adds a float attn_mask to the scaled scores: ours matches torch's own SDPA in float64, forward
    and the gradients of query, key, value and the mask."""
    b, h, hk, sq, sk, d = 2, 4, 2, 150, 170, 32
    q, k, v = rand(b, h, sq, d, seed=71), rand(b, hk, sk, d, seed=72), rand(b, hk, sk, d, seed=73)
    m = rand(*mask_shape, seed=74)
    dout = rand(b, h, sq, d, seed=75)

    def grads(fn, dt):
        ins = [t.detach().to(dt).clone().requires_grad_(True) for t in (q, k, v, m)]
        out = fn(*ins[:3], attn_mask=ins[3], enable_gqa=True)
        out.backward(dout.to(dt))
        return [out.detach()] + [t.grad for t in ins]
    ours = grads(scaled_dot_product_attention, torch.float32)
    truth = grads(torch.nn.functional.scaled_dot_product_attention, torch.float64)
    low = grads(torch.nn.functional.scaled_dot_product_attention, torch.float32)
    for name, a, t, lo in zip(("out", "dq", "dk", "dv", "dmask"), ours, truth, low):
        _assert_fa(name, a, t, lo)


# ---------------------------------------------------------------------------------------------- bad input
def _fa(**over):
    a = dict(q=rand(2, 130, 4, 32), k=rand(2, 130, 2, 32), v=rand(2, 130, 2, 32))
    a.update(over)
    return lambda: flash_attn_func(a.pop("q"), a.pop("k"), a.pop("v"), **a)


BAD = [
    ("shape", _fa(attn_bias=torch.zeros(3, 130, 130)), ValueError,
     r"flash_attn_func: attn_bias\.shape=\(3, 130, 130\): must broadcast to \[batch, heads, seqlen_q, seqlen_k\] "
     r"= \[2, 4, 130, 130\]"),
    ("rank", _fa(attn_bias=torch.zeros(1, 2, 4, 130, 130)), ValueError, r"attn_bias\.shape=\(1, 2, 4, 130, 130\)"),
    ("dtype-int", _fa(attn_bias=torch.zeros(130, 130, dtype=torch.int32)), TypeError,
     r"attn_bias\.dtype=torch\.int32: must be float32, bfloat16 or float16"),
    ("dtype-f64", _fa(attn_bias=torch.zeros(130, 130, dtype=torch.float64)), TypeError,
     r"attn_bias\.dtype=torch\.float64"),
    ("not-a-tensor", _fa(attn_bias=[[0.0]]), TypeError, r"attn_bias=list: must be a torch\.Tensor"),
    ("device", _fa(attn_bias=torch.zeros(130, 130, device="meta")), ValueError,
     r"attn_bias\.device=meta: must equal q\.device cpu"),
    ("sdpa-shape", lambda: scaled_dot_product_attention(rand(2, 4, 130, 32), rand(2, 4, 130, 32),
                                                        rand(2, 4, 130, 32), attn_mask=torch.zeros(3, 130, 130)),
     ValueError, r"scaled_dot_product_attention: attn_mask\.shape=\(3, 130, 130\)"),
    ("sdpa-f64", lambda: scaled_dot_product_attention(rand(1, 2, 130, 32), rand(1, 2, 130, 32), rand(1, 2, 130, 32),
                                                      attn_mask=torch.zeros(130, 130, dtype=torch.float64)),
     TypeError, r"attn_mask\.dtype=torch\.float64"),
]


@pytest.mark.parametrize("name,call,exc,match", BAD, ids=[c[0] for c in BAD])
def test_bad_bias_raises_before_any_kernel_runs(name, call, exc, match, monkeypatch):
    from nki_attn import ops

    def no_launch(*a, **kw):
        raise AssertionError("a kernel was launched")
    monkeypatch.setattr(ops, "_launch", no_launch)
    with pytest.raises(exc, match=match):
        call()


def test_kernel_rejects_a_bias_shape_the_host_would_not_build():
    from nki_attn.kernel_api import attention_bwd, attention_fwd
    q = torch.zeros(1, 2, 32, 128)
    with pytest.raises(ValueError, match=r"attn_bias shape \(1, 3, 128, 128\) must be 4-D with each dim 1"):
        attention_fwd(q, q, q, attn_bias=torch.zeros(1, 3, 128, 128))
    lse = torch.zeros(1, 2, 128, 1)
    with pytest.raises(ValueError, match=r"bias_grad=True needs attn_bias"):
        attention_bwd(q, q, q, q, q, lse, bias_grad=True)


# ---------------------------------------------------------------------------------------------- fake, compile
def test_fake_tensor_shapes_with_a_bias():
    with FakeTensorMode():
        q = torch.empty(2, 300, 4, 64, requires_grad=True)
        k = torch.empty(2, 200, 2, 64)
        bias = torch.empty(4, 300, 200, dtype=torch.bfloat16, requires_grad=True)
        out = flash_attn_func(q, k, k, causal=True, attn_bias=bias.float())
        assert out.shape == q.shape
        out.sum().backward()
        assert bias.grad.shape == bias.shape and bias.grad.dtype == torch.bfloat16
    m = torch.empty(2, 1, 300, 200, device="meta")
    o = scaled_dot_product_attention(torch.empty(2, 4, 300, 64, device="meta"), torch.empty(2, 4, 200, 64, device="meta"),
                                     torch.empty(2, 4, 200, 64, device="meta"), attn_mask=m)
    assert o.shape == (2, 4, 300, 64) and o.device.type == "meta"


def _bias_step(q, k, v, bias):
    return nki_attn.flash_attn_func(q, k, v, causal=True, window_size=(70, 0), attn_bias=bias)


def test_compile_fullgraph_with_a_bias_is_bit_exact_without_breaks():
    torch._dynamo.reset()
    q, k, v = rand(1, 200, 4, 32, seed=81), rand(1, 200, 2, 32, seed=82), rand(1, 200, 2, 32, seed=83)
    bias = rand(4, 200, 200, seed=84)
    w = rand(1, 200, 4, 32, seed=85)
    explain = torch._dynamo.explain(lambda *a: (_bias_step(*a) * w).sum())(q, k, v, bias)
    assert explain.graph_break_count == 0 and explain.graph_count == 1, explain.break_reasons
    compiled = torch.compile(_bias_step, fullgraph=True, backend="aot_eager")
    e_in = [t.clone().requires_grad_(True) for t in (q, k, v, bias)]
    c_in = [t.clone().requires_grad_(True) for t in (q, k, v, bias)]
    out_e = _bias_step(*e_in)
    out_c = compiled(*c_in)
    (out_e * w).sum().backward()
    (out_c * w).sum().backward()
    assert torch.equal(out_e, out_c)
    for a, b in zip(e_in, c_in):
        assert torch.equal(a.grad, b.grad)
