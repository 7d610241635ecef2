"""The PyTorch API against torch's own attention (float64) and an explicit autograd reference.

Criterion (FlashAttention's): for every output and input gradient, the error of our result against the float64
reference may be at most K times the error of the same reference computed in the input dtype, plus a small
absolute floor relative to the reference's magnitude. See docs/validation.md.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import nki_attn
from nki_attn import flash_attn_func, flash_attn_varlen_func, scaled_dot_product_attention

K = 3.0  # allowed multiple of the low-precision reference's own error


def naive(q, k, v, mask=None, scale=None, sinks=None):
    """[b, h, sq, d] attention computed the plain way in q's dtype; mask [sq, sk] bool (True = visible)."""
    hq, hk = q.shape[1], k.shape[1]
    if hk != hq:
        k = k.repeat_interleave(hq // hk, dim=1)
        v = v.repeat_interleave(hq // hk, dim=1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sk = sinks.to(s.dtype).reshape(1, -1, 1, 1 if sinks.dim() == 1 else sinks.shape[-1])
        s = torch.cat([s, sk.expand(s.shape[0], -1, s.shape[2], -1)], dim=-1)
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)  # rows with no visible key: output 0
    if sinks is not None:
        p = p[..., :k.shape[2]]
    return p @ v


def causal_mask(sq, sk, bottom_right, left=-1):
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    shift = sk - sq if bottom_right else 0
    m = j <= i + shift
    if left >= 0:
        m &= j >= i + shift - left
    return m


def leaves(*ts):
    return [t.detach().clone().requires_grad_(True) for t in ts]


def grads_of(fn, inputs, dout):
    out = fn(*inputs)
    out.backward(dout)
    return [out.detach()] + [t.grad.detach() for t in inputs]


def assert_close_fa(name, ours, truth, lowp):
    """err(ours) <= K * err(lowp reference) + floor.

    floor = 2^-20 * max(max|truth|, 1): a few fp32 ulps at the problem's unit scale (inputs are N(0, 1)), so an
    output that is exactly zero in float64 (dq with a single key) may carry fp32 cancellation noise.
    """
    floor = 2.0 ** -20 * max(float(truth.abs().max()), 1.0)
    err = float((ours.double() - truth).abs().max())
    base = float((lowp.double() - truth).abs().max())
    assert torch.isfinite(ours).all(), f"{name}: non-finite values"
    assert err <= K * base + floor, f"{name}: error {err:.3e} > {K} x baseline {base:.3e} + {floor:.1e}"


def check_against_reference(fn_ours, fn_ref, inputs, dtype, seed=0):
    """Run ours in ``dtype``, the reference in float64 (truth) and in ``dtype`` (baseline); compare all."""
    g = torch.Generator().manual_seed(seed + 1)
    ins = [t.to(dtype) for t in inputs]
    out_shape = fn_ref(*leaves(*[t.double() for t in ins])).shape
    dout = torch.randn(out_shape, generator=g, dtype=torch.float64)
    ours = grads_of(fn_ours, leaves(*ins), dout.to(dtype))
    truth = grads_of(fn_ref, leaves(*[t.double() for t in ins]), dout)
    lowp = grads_of(fn_ref, leaves(*[t.to(dtype) if dtype != torch.float32 else t for t in ins]), dout.to(dtype))
    for name, a, t, b in zip(["out"] + [f"d{i}" for i in range(len(inputs))], ours, truth, lowp):
        assert a.shape == t.shape, f"{name}: shape {tuple(a.shape)} != {tuple(t.shape)}"
        assert a.dtype == ins[0].dtype or name.startswith("d"), f"{name}: dtype {a.dtype}"
        assert_close_fa(name, a, t, b)


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------- flash_attn_func
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen", [1, 127, 200, 384])
def test_flash_attn_func_lengths(seqlen, causal, dtype):
    b, h, d = 1, 2, 64
    q, k, v = rand(b, seqlen, h, d, seed=1), rand(b, seqlen, h, d, seed=2), rand(b, seqlen, h, d, seed=3)

    def ref(q, k, v):
        m = causal_mask(seqlen, seqlen, True) if causal else None
        return naive(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), m).transpose(1, 2)

    check_against_reference(lambda q, k, v: flash_attn_func(q, k, v, causal=causal), ref, [q, k, v], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_attn_func_gqa_window_sinks(dtype):
    b, sq, hq, hk, d, left = 2, 256, 4, 2, 64, 100
    q, k, v = rand(b, sq, hq, d, seed=4), rand(b, sq, hk, d, seed=5), rand(b, sq, hk, d, seed=6)
    sinks = rand(hq, seed=7)

    def ours(q, k, v, s):
        return flash_attn_func(q, k, v, causal=True, window_size=(left, 0), sinks=s)

    def ref(q, k, v, s):
        m = causal_mask(sq, sq, True, left)
        return naive(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), m, sinks=s).transpose(1, 2)

    check_against_reference(ours, ref, [q, k, v, sinks], dtype)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func_unequal_lengths_bottom_right(causal):
    b, sq, sk, h, d = 1, 200, 300, 2, 64
    q, k, v = rand(b, sq, h, d, seed=8), rand(b, sk, h, d, seed=9), rand(b, sk, h, d, seed=10)

    def ref(q, k, v):
        m = causal_mask(sq, sk, True) if causal else None
        return naive(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), m, scale=0.3).transpose(1, 2)

    check_against_reference(lambda q, k, v: flash_attn_func(q, k, v, causal=causal, softmax_scale=0.3), ref,
                            [q, k, v], torch.float32)


def test_return_lse_matches_logsumexp():
    q, k, v = rand(1, 200, 2, 64, seed=11), rand(1, 200, 2, 64, seed=12), rand(1, 200, 2, 64, seed=13)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    s = (q.transpose(1, 2).double() @ k.transpose(1, 2).double().transpose(-1, -2)) / 8.0
    s = s.masked_fill(~causal_mask(200, 200, True), float("-inf"))
    assert lse.shape == (1, 2, 200) and lse.dtype == torch.float32
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- SDPA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_causal,sq,sk", [(False, 384, 384), (True, 200, 200), (True, 128, 300),
                                             (False, 127, 200)])
def test_sdpa_matches_torch(is_causal, sq, sk, dtype):
    b, hq, hk, d = 1, 4, 1, 64
    q, k, v = rand(b, hq, sq, d, seed=14), rand(b, hk, sk, d, seed=15), rand(b, hk, sk, d, seed=16)

    def ref(q, k, v):
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)

    check_against_reference(
        lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True), ref,
        [q, k, v], dtype)


# ---------------------------------------------------------------------------------------------- varlen
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_three_sequences(causal):
    lens = [70, 200, 33]
    cu = torch.tensor([0, 70, 270, 303], dtype=torch.int32)
    h, d, total = 2, 64, sum(lens)
    q, k, v = rand(total, h, d, seed=17), rand(total, h, d, seed=18), rand(total, h, d, seed=19)

    def ref(q, k, v):
        outs = []
        for s in range(3):
            a, e = int(cu[s]), int(cu[s + 1])
            m = causal_mask(e - a, e - a, True) if causal else None
            outs.append(naive(q[a:e].transpose(0, 1)[None], k[a:e].transpose(0, 1)[None],
                              v[a:e].transpose(0, 1)[None], m)[0].transpose(0, 1))
        return torch.cat(outs)

    def ours(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal)

    check_against_reference(ours, ref, [q, k, v], torch.bfloat16)


# ---------------------------------------------------------------------------------------------- errors
# Bad input: tests/api/test_bad_inputs.py (the matrix of refused arguments and empty sizes).


def test_non_contiguous_inputs_are_accepted():
    base = torch.randn(1, 4, 128, 64)
    q = base.transpose(1, 2)  # [1, 128, 4, 64] non-contiguous view
    out = flash_attn_func(q, q, q, causal=True)
    torch.testing.assert_close(out, flash_attn_func(q.contiguous(), q.contiguous(), q.contiguous(), causal=True),
                               rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- training
class TinyBlock(torch.nn.Module):
    def __init__(self, dim, heads, attn):
        super().__init__()
        self.heads, self.attn = heads, attn
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim))

    def forward(self, x):
        b, s, dim = x.shape
        q, k, v = self.qkv(x).reshape(b, s, 3, self.heads, dim // self.heads).unbind(2)
        x = x + self.proj(self.attn(q, k, v).reshape(b, s, dim))
        return x + self.mlp(x)


def _train(attn, steps=4):
    torch.manual_seed(0)
    dim, heads, vocab, s = 64, 2, 16, 96
    emb = torch.nn.Embedding(vocab, dim)
    blocks = torch.nn.ModuleList([TinyBlock(dim, heads, attn) for _ in range(2)])
    head = torch.nn.Linear(dim, vocab)
    params = list(emb.parameters()) + list(blocks.parameters()) + list(head.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, vocab, (2, s), generator=g)
        h = emb(x)
        for blk in blocks:
            h = blk(h)
        loss = F.cross_entropy(head(h)[:, :-1].reshape(-1, vocab), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_two_layer_transformer_trains_like_reference():
    ours = _train(lambda q, k, v: nki_attn.flash_attn_func(q, k, v, causal=True))

    def ref(q, k, v):
        m = causal_mask(q.shape[1], q.shape[1], True)
        return naive(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), m).transpose(1, 2)

    theirs = _train(ref)
    assert ours[-1] < ours[0], f"loss did not decrease: {ours}"
    for a, b in zip(ours, theirs):
        assert abs(a - b) <= 1e-4 * abs(b), f"loss curves diverge: {ours} vs {theirs}"
