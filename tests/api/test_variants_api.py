"""The attention variants through the PyTorch API (flash_attn_func, flash_attn_varlen_func, the packed
variants), against the golden (golden.attention_fwd_torch_ref, autograd for the gradients).

Criterion (FlashAttention's, as tests/api/test_api.py): for the output and every input gradient, our error against
the golden in float64 is at most K = 3 times the error of the same golden computed in the input dtype, plus a floor
of 2^-20 * max(max|truth|, 1) (docs/validation.md).

The golden takes the kernels' layout with seqlen_q a multiple of 128; the API's bottom-right alignment is kept by
padding q with zero rows at the FRONT (row i becomes row a + i and the golden's offset sk - (sq + a) shifts back
by a, so every pair keeps its distance i + sk - sq - j), and those rows are dropped.
"""
import pytest
import torch
import torch.nn.functional as F

from golden.attention_fwd_torch import attention_fwd_torch_ref
from nki_attn import attention as api
from nki_attn.attention import flash_attn_func, flash_attn_varlen_func

K = 3.0


def golden_fa(q, k, v, causal=False, window=(-1, -1), softcap=0.0, alibi=None, scale=None, keep=None, p=0.0):
    """The golden on FlashAttention's layout: q [b, sq, h, d_qk], k [b, sk, hk, d_qk], v [b, sk, hk, d_v];
    alibi [h] or [b, h]; keep bool [b, h, sq, sk] (True = kept) with dropout p -> (out [b, sq, h, d_v],
    lse [b, h, sq])."""
    b, sq, h, _ = q.shape
    front = (-sq) % 128
    qk = F.pad(q.permute(0, 2, 3, 1), (front, 0))
    kw = dict(use_causal_mask=causal, softmax_scale=scale, softcap=softcap)
    if tuple(window) != (-1, -1):
        kw["window_size"] = tuple(window)
    if alibi is not None:
        kw["alibi_slopes"] = alibi.to(torch.float32).expand(b, h).contiguous()
    if p > 0.0:
        kw["dropout_p"] = p
        kw["dropout_mask"] = F.pad(keep, (0, 0, front, 0), value=True)
    o, lse = attention_fwd_torch_ref(qk, k.permute(0, 2, 3, 1), v.permute(0, 2, 3, 1), **kw)
    lse = lse.permute(0, 1, 3, 2).reshape(b, h, -1)
    return o[..., front:].permute(0, 3, 1, 2), lse[..., front:]


def _leaves(ts):
    return [t.detach().clone().requires_grad_(True) for t in ts]


def _run(fn, ins, dout):
    ins = _leaves(ins)
    out = fn(*ins)
    out.backward(dout.to(out.dtype))
    return [out.detach()] + [t.grad.detach() for t in ins]


def _assert_fa(name, ours, truth, lowp):
    floor = 2.0 ** -20 * max(float(truth.abs().max()), 1.0)
    err = float((ours.double() - truth).abs().max())
    base = float((lowp.double() - truth).abs().max())
    assert torch.isfinite(ours).all(), f"{name}: non-finite values"
    assert err <= K * base + floor, f"{name}: error {err:.3e} > {K} x baseline {base:.3e} + {floor:.1e}"


def check(fn_ours, fn_ref, ins, dtype=torch.float32, seed=0):
    """fn_ours in ``dtype`` against fn_ref in float64 (truth) and in ``dtype`` (baseline): output and grads."""
    g = torch.Generator().manual_seed(seed + 7)
    ins = [t.to(dtype) for t in ins]
    out_shape = fn_ref(*[t.double() for t in ins]).shape
    dout = torch.randn(out_shape, generator=g, dtype=torch.float64)
    truth = _run(fn_ref, [t.double() for t in ins], dout)
    lowp = _run(fn_ref, ins, dout)
    ours = _run(fn_ours, ins, dout)
    for name, a, t, l in zip(("out", "dq", "dk", "dv"), ours, truth, lowp):
        assert a.shape == t.shape, f"{name}: shape {tuple(a.shape)} != {tuple(t.shape)}"
        _assert_fa(name, a, t, l)


def _qkv(b, sq, sk, h, hk, d_qk, d_v, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, sq, h, d_qk, generator=g), torch.randn(b, sk, hk, d_qk, generator=g),
            torch.randn(b, sk, hk, d_v, generator=g))


def _slopes(h, batch=None):
    base = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], dtype=torch.float32)
    return base if batch is None else torch.stack([base * (1.0 + 0.25 * n) for n in range(batch)])


# ----------------------------------------------------------------------------------------------------- flash_attn_func
CASES = {
    # name: (shape (b, sq, sk, h, hk, d_qk, d_v), keywords, features)
    "causal-sq<sk": ((1, 130, 300, 2, 1, 64, 64), dict(causal=True), ()),
    "causal-sq>sk": ((1, 300, 130, 2, 2, 32, 32), dict(causal=True), ()),
    "local-64-64": ((1, 256, 256, 2, 1, 64, 64), dict(window_size=(64, 64)), ()),
    "window-unequal": ((1, 100, 260, 2, 1, 32, 32), dict(window_size=(40, 7)), ()),
    "causal-window": ((1, 200, 200, 2, 1, 32, 32), dict(causal=True, window_size=(31, 5)), ()),
    "mla-192-128": ((1, 256, 256, 2, 1, 192, 128), dict(causal=True), ()),
    "d199": ((1, 140, 140, 2, 1, 199, 199), dict(causal=True), ()),
    "d72-v40": ((2, 128, 200, 2, 2, 72, 40), dict(), ()),
    "softcap": ((1, 130, 200, 2, 1, 64, 64), dict(softcap=1.5, causal=True), ("softcap",)),
    "softcap-gemma2": ((1, 256, 256, 2, 1, 256, 256), dict(softcap=50.0, window_size=(63, 0), causal=True),
                       ("softcap",)),
    "alibi-h-causal": ((1, 130, 300, 4, 2, 64, 64), dict(alibi="h", causal=True), ("alibi",)),
    "alibi-bh-local": ((2, 128, 256, 2, 1, 32, 32), dict(alibi="bh", window_size=(50, 20)), ("alibi",)),
    "alibi-softcap-sq>sk": ((1, 260, 140, 2, 1, 64, 48), dict(alibi="h", softcap=2.0, causal=True),
                            ("alibi", "softcap")),
}


def _split_alibi(kw, b, h):
    kw = dict(kw)
    a = kw.pop("alibi", None)
    slopes = None if a is None else (_slopes(h) if a == "h" else _slopes(h, b))
    return kw, slopes


@pytest.mark.parametrize("case", list(CASES))
def test_flash_attn_func_variants_match_golden(case):
    shape, kw, features = CASES[case]
    b, sq, sk, h, hk, d_qk, d_v = shape
    kw, slopes = _split_alibi(kw, b, h)
    causal = kw.get("causal", False)
    window = kw.get("window_size", (-1, -1))
    cap = kw.get("softcap", 0.0)

    def ours(q, k, v):
        return flash_attn_func(q, k, v, alibi_slopes=slopes, **kw)

    def ref(q, k, v):
        return golden_fa(q, k, v, causal, window, cap, slopes)[0]

    check(ours, ref, _qkv(b, sq, sk, h, hk, d_qk, d_v))


def test_bf16_softcap_alibi_window():
    b, sq, sk, h = 1, 200, 330, 2
    slopes = _slopes(h)

    def ours(q, k, v):
        return flash_attn_func(q, k, v, causal=True, window_size=(90, -1), softcap=3.0, alibi_slopes=slopes)

    def ref(q, k, v):
        return golden_fa(q, k, v, True, (90, -1), 3.0, slopes)[0]

    check(ours, ref, _qkv(b, sq, sk, h, 1, 64, 64), torch.bfloat16)


def test_lse_matches_golden():
    """return_lse: our lse is the golden's (logits after soft-cap and ALiBi, docs/api.md on the convention)."""
    q, k, v = _qkv(1, 130, 260, 2, 1, 64, 64)
    kw = dict(causal=True, softcap=2.0)
    slopes = _slopes(2)
    out, lse = flash_attn_func(q, k, v, alibi_slopes=slopes, return_lse=True, **kw)
    o_ref, lse_ref = golden_fa(q.double(), k.double(), v.double(), True, (-1, -1), kw.get("softcap", 0.0), slopes)
    torch.testing.assert_close(lse.double(), lse_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.double(), o_ref, rtol=0, atol=1e-5)


def test_packed_variants_forward_keywords():
    """qkvpacked / kvpacked pass every variant keyword through (same result as flash_attn_func)."""
    q, k, v = _qkv(1, 128, 128, 2, 2, 32, 32)
    kw = dict(causal=True, window_size=(20, 0), softcap=2.0, alibi_slopes=_slopes(2))
    ref = flash_attn_func(q, k, v, **kw)
    assert torch.equal(api.flash_attn_qkvpacked_func(torch.stack([q, k, v], 2), **kw), ref)
    assert torch.equal(api.flash_attn_kvpacked_func(q, torch.stack([k, v], 2), **kw), ref)


# ----------------------------------------------------------------------------------------------------- varlen
def _varlen_ref(q, k, v, cq, ck, causal, window, cap, slopes, scale=None):
    outs = []
    for s in range(len(cq) - 1):
        qs, ks, vs = q[cq[s]:cq[s + 1]], k[ck[s]:ck[s + 1]], v[ck[s]:ck[s + 1]]
        sl = None if slopes is None else (slopes if slopes.dim() == 1 else slopes[s])
        outs.append(golden_fa(qs[None], ks[None], vs[None], causal, window, cap, sl, scale)[0][0])
    return torch.cat(outs, 0)


VARLEN = {
    # name: (cu_q, cu_k, keywords, features)
    "causal-unequal": ([0, 100, 300], [0, 150, 300], dict(causal=True), ()),
    "local-window": ([0, 130, 200], [0, 130, 200], dict(window_size=(16, 16)), ()),
    "mla": ([0, 60, 200], [0, 90, 200], dict(causal=True, d_v=24), ()),
    "softcap": ([0, 100, 300], [0, 150, 300], dict(causal=True, softcap=1.5), ("softcap",)),
    "alibi-packed": ([0, 70, 200], [0, 70, 200], dict(causal=True, alibi="h"), ("alibi",)),
    "alibi-per-seq": ([0, 100, 300], [0, 150, 300], dict(alibi="bh", window_size=(30, 10)), ("alibi",)),
}


@pytest.mark.parametrize("case", list(VARLEN))
def test_flash_attn_varlen_func_variants_match_golden(case):
    cq, ck, kw, features = VARLEN[case]
    kw = dict(kw)
    d_v = kw.pop("d_v", 32)
    kw, slopes = _split_alibi(kw, len(cq) - 1, 2)
    causal = kw.get("causal", False)
    window = kw.get("window_size", (-1, -1))
    cap = kw.get("softcap", 0.0)
    q, k, v = (t[0] for t in _qkv(1, cq[-1], ck[-1], 2, 1, 32, d_v))
    cu_q, cu_k = torch.tensor(cq, dtype=torch.int32), torch.tensor(ck, dtype=torch.int32)
    mq = max(b - a for a, b in zip(cq, cq[1:]))
    mk = max(b - a for a, b in zip(ck, ck[1:]))

    def ours(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, alibi_slopes=slopes, **kw)

    def ref(q, k, v):
        return _varlen_ref(q, k, v, cq, ck, causal, window, cap, slopes)

    check(ours, ref, [q, k, v])


# ----------------------------------------------------------------------------------------------------- dropout
def _dropout_call(q, k, v, **kw):
    return flash_attn_func(q, k, v, dropout_p=0.25, causal=True, return_attn_probs=True, **kw)


def test_dropout_is_deterministic_given_seed_or_generator():
    q, k, v = _qkv(1, 130, 200, 2, 1, 32, 32)
    a = flash_attn_func(q, k, v, dropout_p=0.25, dropout_seed=1234)
    assert torch.equal(a, flash_attn_func(q, k, v, dropout_p=0.25, dropout_seed=1234))
    assert not torch.equal(a, flash_attn_func(q, k, v, dropout_p=0.25, dropout_seed=1235))
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(flash_attn_func(q, k, v, dropout_p=0.25, generator=g1),
                       flash_attn_func(q, k, v, dropout_p=0.25, generator=g2))
    torch.manual_seed(9)
    b1 = flash_attn_func(q, k, v, dropout_p=0.25)
    torch.manual_seed(9)
    assert torch.equal(b1, flash_attn_func(q, k, v, dropout_p=0.25))
    no_drop = flash_attn_func(q, k, v)
    assert not torch.equal(a, no_drop)


@pytest.mark.parametrize("varlen", [False, True], ids=["flash", "varlen"])
def test_dropout_matches_golden_with_its_mask(varlen):
    """The keep mask the API reports (S_dmask's sign, FlashAttention's encoding: negative = dropped) is the one the
    kernels applied, forward and backward: out and the gradients equal the golden's with that mask."""
    p = 0.25
    q, k, v = _qkv(1, 130, 200, 2, 1, 32, 32)
    if varlen:
        cq, ck = [0, 50, 130], [0, 80, 200]
        cu_q, cu_k = torch.tensor(cq, dtype=torch.int32), torch.tensor(ck, dtype=torch.int32)
        q, k, v = q[0], k[0], v[0]
        _, _, dmask = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 80, 120, dropout_p=p, causal=True,
                                             return_attn_probs=True, dropout_seed=77)
        assert dmask is not None, "S_dmask must carry the dropout pattern (golden.dropout installed)"
        keeps = [~torch.signbit(dmask[s, :, :cq[s + 1] - cq[s], :ck[s + 1] - ck[s]])[None] for s in range(2)]

        def ours(q, k, v):
            return flash_attn_varlen_func(q, k, v, cu_q, cu_k, 80, 120, dropout_p=p, causal=True, dropout_seed=77)

        def ref(q, k, v):
            outs = []
            for s in range(2):
                qs, ks, vs = q[cq[s]:cq[s + 1]], k[ck[s]:ck[s + 1]], v[ck[s]:ck[s + 1]]
                outs.append(golden_fa(qs[None], ks[None], vs[None], True, keep=keeps[s], p=p)[0][0])
            return torch.cat(outs, 0)
    else:
        _, _, dmask = _dropout_call(q, k, v, dropout_seed=77)
        assert dmask is not None, "S_dmask must carry the dropout pattern (golden.dropout installed)"
        keep = ~torch.signbit(dmask)
        rate = float(keep.double().mean())
        assert 0.6 < rate < 0.9, f"keep rate {rate:.3f} is far from 1 - p = 0.75"

        def ours(q, k, v):
            return flash_attn_func(q, k, v, dropout_p=p, causal=True, dropout_seed=77)

        def ref(q, k, v):
            return golden_fa(q, k, v, True, keep=keep, p=p)[0]

    check(ours, ref, [q, k, v])


# ----------------------------------------------------------------------------------------------------- bad inputs
def _fa(**kw):
    q, k, v = _qkv(1, 128, 128, 4, 2, 32, 32)
    args = dict(q=q, k=k, v=v)
    args.update(kw)
    return lambda: flash_attn_func(**args)


BAD = [
    ("softcap-negative", _fa(softcap=-1.0), ValueError, r"flash_attn_func: softcap=-1.0: must be finite and >= 0"),
    ("softcap-inf", _fa(softcap=float("inf")), ValueError, r"softcap=inf: must be finite"),
    ("softcap-type", _fa(softcap="x"), TypeError, r"softcap='x'"),
    ("alibi-shape", _fa(alibi_slopes=torch.ones(3)), ValueError,
     r"alibi_slopes\.shape=\(3,\): must be \[nheads\] = \[4\] or \[batch, nheads\] = \[1, 4\]"),
    ("alibi-dtype", _fa(alibi_slopes=torch.ones(4, dtype=torch.float16)), ValueError,
     r"alibi_slopes\.dtype=torch\.float16: must be torch\.float32"),
    ("alibi-type", _fa(alibi_slopes=[1.0] * 4), TypeError, r"alibi_slopes=list"),
    ("dropout-one", _fa(dropout_p=1.0), ValueError, r"dropout_p=1\.0: must be a probability in \[0, 1\)"),
    ("dropout-seed-range", _fa(dropout_seed=-3), ValueError, r"dropout_seed=-3: must be an int in \[0, "),
    ("dropout-seed-type", _fa(dropout_seed=1.5), ValueError, r"dropout_seed=1\.5"),
    ("generator-type", _fa(generator=3), TypeError, r"generator=int: must be a torch\.Generator"),
    ("seed-and-generator", _fa(dropout_seed=1, generator=torch.Generator()), ValueError,
     r"give dropout_seed or generator, not both"),
    ("head-dim", _fa(q=torch.randn(1, 128, 4, 257), k=torch.randn(1, 128, 2, 257), v=torch.randn(1, 128, 2, 257)),
     ValueError, r"q\.shape\[3\]=257: head_dim must be at most 256"),
    ("head-dim-v", _fa(v=torch.randn(1, 128, 2, 300)), ValueError, r"v\.shape\[3\]=300: head_dim must be at most"),
    ("v-shape", _fa(v=torch.randn(1, 100, 2, 32)), ValueError, r"v\.shape=\(1, 100, 2, 32\): must equal k\.shape"),
    ("window", _fa(window_size=(-2, 0)), ValueError, r"window_size=\(-2, 0\)"),
]


@pytest.mark.parametrize("name,call,exc,match", BAD, ids=[b[0] for b in BAD])
def test_bad_variant_inputs(name, call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_varlen_alibi_shape_is_per_sequence():
    q, k, v = (t[0] for t in _qkv(1, 200, 200, 2, 1, 32, 32))
    cu = torch.tensor([0, 80, 200], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"alibi_slopes\.shape=\(3, 2\): must be \[nheads\] = \[2\] or "
                                         r"\[batch, nheads\] = \[2, 2\]"):
        flash_attn_varlen_func(q, k, v, cu, cu, 120, 120, alibi_slopes=torch.ones(3, 2))


def test_meta_shapes_with_d_v():
    """meta tensors: shapes only (what torch.compile's fake tensors see), head_dim_v != head_dim."""
    q = torch.empty(2, 130, 4, 192, device="meta")
    k = torch.empty(2, 300, 2, 192, device="meta")
    v = torch.empty(2, 300, 2, 128, device="meta")
    out, lse = flash_attn_func(q, k, v, causal=True, window_size=(64, 0), return_lse=True)
    assert out.shape == (2, 130, 4, 128) and lse.shape == (2, 4, 130)


def test_compile_fullgraph_with_variants():
    """torch.compile(fullgraph=True) carries soft-capping, ALiBi, a two-sided window, head_dim_v and (with an
    explicit seed) dropout through the custom ops: no graph break, output equal to eager bit for bit."""
    q, k, v = _qkv(1, 130, 200, 2, 1, 64, 48)
    slopes = _slopes(2)
    kw = dict(causal=True, softcap=2.0, alibi_slopes=slopes, window_size=(50, -1), dropout_p=0.1, dropout_seed=5)

    def f(q, k, v):
        return flash_attn_func(q, k, v, **kw)

    compiled = torch.compile(f, fullgraph=True)
    assert torch.equal(compiled(q, k, v), f(q, k, v))


def test_window_size_as_a_tensor_or_any_pair():
    """FlashAttention's tests pass window_size as a 1-D integer tensor of 2 elements (torch.randint(0, seqlen_k,
    (2,))); it, a list and a tuple give the same result bit for bit. Other tensors are refused naming them."""
    q, k, v = _qkv(1, 130, 200, 2, 1, 32, 32)
    ref = flash_attn_func(q, k, v, window_size=(17, 40))
    for w in ([17, 40], torch.tensor([17, 40]), torch.tensor([17, 40], dtype=torch.int32)):
        assert torch.equal(flash_attn_func(q, k, v, window_size=w), ref)
    cu = torch.tensor([0, 130], dtype=torch.int32)
    cuk = torch.tensor([0, 200], dtype=torch.int32)
    assert torch.equal(flash_attn_varlen_func(q[0], k[0], v[0], cu, cuk, 130, 200,
                                              window_size=torch.tensor([17, 40]))[None], ref)
    for bad in (torch.tensor([[17, 40]]), torch.tensor([17.0, 40.0]), torch.tensor([True, False])):
        with pytest.raises(TypeError, match=r"flash_attn_func: window_size=a torch\.\w+ tensor of shape"):
            flash_attn_func(q, k, v, window_size=bad)
