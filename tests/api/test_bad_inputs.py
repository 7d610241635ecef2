"""Bad input across the three entry points: every case is refused before any work with the expected exception
whose message names the argument and its value (``<function>: <argument>=<value>: <rule>``), or — for empty
batches, sequences, heads and head_dim — gives exactly torch's result. No case may return numbers silently.
"""
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from nki_attn import flash_attn_func, flash_attn_varlen_func, scaled_dot_product_attention


def _t(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype=dtype, device=device)


# ---------------------------------------------------------------------------------------------- flash_attn_func
def fa(**over):
    a = dict(q=_t(1, 130, 4, 32), k=_t(1, 130, 2, 32), v=_t(1, 130, 2, 32))
    a.update(over)
    return lambda: flash_attn_func(**a)


FA_CASES = [
    ("q-not-tensor", fa(q=[[1.0]]), TypeError, r"q=list"),
    ("q-3d", fa(q=_t(130, 4, 32)), ValueError, r"q\.shape=\(130, 4, 32\)"),
    ("k-5d", fa(k=_t(1, 1, 130, 2, 32)), ValueError, r"k\.shape="),
    ("k-dtype", fa(k=_t(1, 130, 2, 32, dtype=torch.float16)), ValueError, r"k\.dtype=torch\.float16"),
    ("float64", fa(q=_t(1, 130, 4, 32, dtype=torch.float64), k=_t(1, 130, 2, 32, dtype=torch.float64),
                   v=_t(1, 130, 2, 32, dtype=torch.float64)), ValueError, r"q\.dtype=torch\.float64"),
    ("int-dtype", fa(q=torch.ones(1, 130, 4, 32, dtype=torch.int32), k=torch.ones(1, 130, 2, 32, dtype=torch.int32),
                     v=torch.ones(1, 130, 2, 32, dtype=torch.int32)), ValueError, r"q\.dtype=torch\.int32"),
    ("v-shape", fa(v=_t(1, 131, 2, 32)), ValueError, r"v\.shape=\(1, 131, 2, 32\)"),
    ("batch-mismatch", fa(k=_t(2, 130, 2, 32), v=_t(2, 130, 2, 32)), ValueError, r"k\.shape\[0\]=2"),
    ("head-dim-mismatch", fa(k=_t(1, 130, 2, 16), v=_t(1, 130, 2, 16)), ValueError, r"k\.shape\[3\]=16"),
    ("heads-not-divisible", fa(k=_t(1, 130, 3, 32), v=_t(1, 130, 3, 32)), ValueError, r"k\.shape\[2\]=3"),
    ("zero-kv-heads", fa(k=_t(1, 130, 0, 32), v=_t(1, 130, 0, 32)), ValueError, r"k\.shape\[2\]=0"),
    ("head-dim-300", fa(q=_t(1, 130, 4, 300), k=_t(1, 130, 2, 300), v=_t(1, 130, 2, 300)), ValueError,
     r"q\.shape\[3\]=300"),
    ("head-dim-v-300", fa(v=_t(1, 130, 2, 300)), ValueError, r"v\.shape\[3\]=300"),
    ("dropout-seed-and-generator", fa(dropout_p=0.1, dropout_seed=1, generator=torch.Generator()), ValueError,
     r"dropout_seed=1"),
    ("dropout-range", fa(dropout_p=1.5), ValueError, r"dropout_p=1\.5"),
    ("dropout-type", fa(dropout_p="0"), TypeError, r"dropout_p='0'"),
    ("scale-inf", fa(softmax_scale=math.inf), ValueError, r"softmax_scale=inf"),
    ("scale-nan", fa(softmax_scale=math.nan), ValueError, r"softmax_scale=nan"),
    ("scale-negative", fa(softmax_scale=-0.5), ValueError, r"softmax_scale=-0\.5"),
    ("scale-zero", fa(softmax_scale=0.0), ValueError, r"softmax_scale=0\.0"),
    ("scale-string", fa(softmax_scale="0.1"), TypeError, r"softmax_scale='0\.1'"),
    ("scale-bool", fa(softmax_scale=True), TypeError, r"softmax_scale=True"),
    ("causal-string", fa(causal="yes"), TypeError, r"causal='yes'"),
    ("causal-none", fa(causal=None), TypeError, r"causal=None"),
    ("causal-int", fa(causal=1), TypeError, r"causal=1"),
    ("window-float", fa(window_size=3.7), TypeError, r"window_size=3\.7"),
    ("window-float-entry", fa(window_size=(3.7, 0)), TypeError, r"window_size=\(3\.7, 0\)"),
    ("window-triple", fa(window_size=(1, 2, 3)), TypeError, r"window_size=\(1, 2, 3\)"),
    ("window-string", fa(window_size="ab"), TypeError, r"window_size='ab'"),
    ("window-none", fa(window_size=None), TypeError, r"window_size=None"),
    ("window-below-minus-one", fa(window_size=(-2, 0)), ValueError, r"window_size=\(-2, 0\)"),
    ("softcap-negative", fa(softcap=-1.0), ValueError, r"softcap=-1\.0"),
    ("softcap-type", fa(softcap="x"), TypeError, r"softcap='x'"),
    ("alibi-shape", fa(alibi_slopes=torch.ones(3)), ValueError, r"alibi_slopes\.shape=\(3,\)"),
    ("window-tensor-float", fa(window_size=torch.tensor([1.0, 2.0])), TypeError, r"window_size=a torch\.float32"),
    ("window-tensor-3", fa(window_size=torch.tensor([1, 2, 3])), TypeError, r"window_size=a torch\.int64 tensor"),
    ("deterministic-type", fa(deterministic="yes"), TypeError, r"deterministic='yes'"),
    ("return-attn-probs-type", fa(return_attn_probs=1), TypeError, r"return_attn_probs=1"),
    ("return-lse-type", fa(return_lse="no"), TypeError, r"return_lse='no'"),
    ("sinks-shape", fa(sinks=torch.zeros(3)), ValueError, r"sinks\.shape=\(3,\)"),
    ("sinks-dtype", fa(sinks=torch.zeros(4, dtype=torch.int64)), ValueError, r"sinks\.dtype=torch\.int64"),
    ("sinks-list", fa(sinks=[0.0] * 4), TypeError, r"sinks=list"),
    ("sinks-device", fa(sinks=torch.zeros(4, device="meta")), ValueError, r"sinks\.device=meta"),
    ("k-device", fa(k=_t(1, 130, 2, 32, device="meta")), ValueError, r"k\.device=meta"),
]


# ---------------------------------------------------------------------------------------------- varlen
CU = torch.tensor([0, 50, 130], dtype=torch.int32)


def vl(**over):
    a = dict(q=_t(130, 4, 32), k=_t(130, 2, 32), v=_t(130, 2, 32), cu_seqlens_q=CU, cu_seqlens_k=CU,
             max_seqlen_q=80, max_seqlen_k=80)
    a.update(over)
    return lambda: flash_attn_varlen_func(**a)


VARLEN_CASES = [
    ("cu-float", vl(cu_seqlens_q=CU.float()), TypeError, r"cu_seqlens_q\.dtype=torch\.float32"),
    ("cu-bool", vl(cu_seqlens_k=torch.ones(3, dtype=torch.bool)), TypeError, r"cu_seqlens_k\.dtype=torch\.bool"),
    ("cu-2d", vl(cu_seqlens_q=CU[None]), ValueError, r"cu_seqlens_q\.shape=\(1, 3\)"),
    ("cu-one-entry", vl(cu_seqlens_q=CU[:1], cu_seqlens_k=CU[:1]), ValueError, r"cu_seqlens_q\.shape=\(1,\)"),
    ("cu-list", vl(cu_seqlens_q=[0, 50, 130]), TypeError, r"cu_seqlens_q=list"),
    ("cu-not-from-zero", vl(cu_seqlens_q=torch.tensor([5, 50, 130])), ValueError, r"cu_seqlens_q=\[5, 50, 130\]"),
    ("cu-decreasing", vl(cu_seqlens_q=torch.tensor([0, 90, 60, 130]),
                         cu_seqlens_k=torch.tensor([0, 40, 60, 130])), ValueError, r"cu_seqlens_q=\[0, 90, 60"),
    ("cu-q-total", vl(cu_seqlens_q=torch.tensor([0, 50, 120])), ValueError, r"cu_seqlens_q\[-1\]=120"),
    ("cu-k-total", vl(cu_seqlens_k=torch.tensor([0, 50, 129])), ValueError, r"cu_seqlens_k\[-1\]=129"),
    ("cu-count", vl(cu_seqlens_k=torch.tensor([0, 130])), ValueError, r"cu_seqlens_k\.shape=\(2,\)"),
    ("max-seqlen-none", vl(max_seqlen_q=None), TypeError, r"max_seqlen_q=None"),
    ("max-seqlen-float", vl(max_seqlen_k=80.5), TypeError, r"max_seqlen_k=80\.5"),
    ("max-seqlen-small", vl(max_seqlen_q=40), ValueError, r"max_seqlen_q=40"),
    ("max-seqlen-k-small", vl(max_seqlen_k=79), ValueError, r"max_seqlen_k=79"),
    ("max-seqlen-negative", vl(max_seqlen_q=-1), ValueError, r"max_seqlen_q=-1"),
    ("block-table", vl(block_table=torch.zeros(1, 1, dtype=torch.int32)), NotImplementedError, r"block_table"),
    ("q-4d", vl(q=_t(1, 130, 4, 32)), ValueError, r"q\.shape=\(1, 130, 4, 32\)"),
    ("heads-not-divisible", vl(k=_t(130, 3, 32), v=_t(130, 3, 32)), ValueError, r"k\.shape\[1\]=3"),
    ("head-dim-mismatch", vl(k=_t(130, 2, 16), v=_t(130, 2, 16)), ValueError, r"k\.shape\[2\]=16"),
    ("dropout-range", vl(dropout_p=-0.2), ValueError, r"dropout_p=-0\.2"),
    ("scale-inf", vl(softmax_scale=math.inf), ValueError, r"softmax_scale=inf"),
    ("window-float", vl(window_size=(2.5, 0)), TypeError, r"window_size=\(2\.5, 0\)"),
    ("causal-string", vl(causal="no"), TypeError, r"causal='no'"),
    ("softcap-inf", vl(softcap=math.inf), ValueError, r"softcap=inf"),
    ("sinks-shape", vl(sinks=torch.zeros(2, 4)), ValueError, r"sinks\.shape=\(2, 4\)"),
]


# ---------------------------------------------------------------------------------------------- SDPA
def sd(**over):
    a = dict(query=_t(1, 4, 130, 32), key=_t(1, 2, 130, 32), value=_t(1, 2, 130, 32), enable_gqa=True)
    a.update(over)
    return lambda: scaled_dot_product_attention(**a)


_gappy = torch.ones(130, 130, dtype=torch.bool)
_gappy[:, 10] = False

SDPA_CASES = [
    ("mask-int", sd(attn_mask=torch.zeros(130, 130, dtype=torch.int32)), NotImplementedError,
     r"attn_mask\.dtype=torch\.int32"),
    ("mask-gaps", sd(attn_mask=_gappy), NotImplementedError, r"contiguous run"),
    ("mask-per-head", sd(attn_mask=torch.ones(1, 4, 130, 130, dtype=torch.bool)), NotImplementedError,
     r"attn_mask\.shape=\(1, 4, 130, 130\)"),
    ("mask-shape", sd(attn_mask=torch.ones(7, 7, dtype=torch.bool)), ValueError, r"attn_mask\.shape=\(7, 7\)"),
    ("mask-and-causal", sd(attn_mask=torch.ones(130, 130, dtype=torch.bool), is_causal=True), ValueError,
     r"attn_mask=.*is_causal=True"),
    ("is-causal-string", sd(is_causal="yes"), TypeError, r"is_causal='yes'"),
    ("scale-inf", sd(scale=math.inf), ValueError, r"scale=inf"),
    ("scale-string", sd(scale="x"), TypeError, r"scale='x'"),
    ("dropout-range", sd(dropout_p=1.0), ValueError, r"dropout_p=1\.0"),
    ("gqa-not-enabled", sd(enable_gqa=False), ValueError, r"key\.shape\[-3\]=2.*enable_gqa=True"),
    ("enable-gqa-type", sd(enable_gqa="yes"), TypeError, r"enable_gqa='yes'"),
    ("query-1d", sd(query=_t(32)), ValueError, r"query\.shape=\(32,\)"),
    ("rank-mismatch", sd(key=_t(2, 130, 32), value=_t(2, 130, 32)), ValueError, r"key\.dim\(\)/value\.dim\(\)"),
    ("value-head-dim", sd(value=_t(1, 2, 130, 300)), ValueError, r"value\.shape\[-1\]=300: head_dim must be at most 256"),
    ("value-seqlen", sd(value=_t(1, 2, 131, 32)), ValueError, r"value\.shape=\(1, 2, 131, 32\)"),
    ("key-dtype", sd(key=_t(1, 2, 130, 32, dtype=torch.bfloat16)), ValueError, r"key\.dtype=torch\.bfloat16"),
    ("float64", sd(query=_t(1, 4, 130, 32, dtype=torch.float64), key=_t(1, 2, 130, 32, dtype=torch.float64),
                   value=_t(1, 2, 130, 32, dtype=torch.float64)), ValueError, r"query\.dtype=torch\.float64"),
    ("leading-dims", sd(key=_t(2, 2, 130, 32), value=_t(2, 2, 130, 32)), ValueError, r"key\.shape=\(2, 2, 130"),
]

CASES = [("flash_attn_func",) + c for c in FA_CASES] + [("flash_attn_varlen_func",) + c for c in VARLEN_CASES] \
    + [("scaled_dot_product_attention",) + c for c in SDPA_CASES]


def test_matrix_is_large_enough():
    assert len(CASES) + len(EMPTY_CASES) >= 60
    assert {c[0] for c in CASES} == {"flash_attn_func", "flash_attn_varlen_func", "scaled_dot_product_attention"}


@pytest.mark.parametrize("entry,name,call,exc,pattern", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_bad_input_is_refused(entry, name, call, exc, pattern):
    with pytest.raises(exc, match=pattern) as info:
        call()
    assert str(info.value).startswith(f"{entry}: "), f"message should name the function: {info.value}"


# ---------------------------------------------------------------------------------------------- empty sizes
def _torch_ref(q, k, v):
    """torch's math SDPA in [b, s, h, d] (GQA by repetition)."""
    hq, hk = q.shape[2], k.shape[2]
    if hk and hq != hk:
        k, v = k.repeat_interleave(hq // hk, 2), v.repeat_interleave(hq // hk, 2)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


EMPTY_CASES = [
    ("batch-0", (0, 130, 4, 32), (0, 130, 2, 32)),
    ("seqlen-q-0", (1, 0, 4, 32), (1, 130, 2, 32)),
    ("seqlen-k-0", (1, 130, 4, 32), (1, 0, 2, 32)),
    ("heads-0", (1, 130, 0, 32), (1, 130, 0, 32)),
    ("head-dim-0", (1, 130, 4, 0), (1, 130, 2, 0)),
]


EMPTY_CALLS = [(entry,) + c for entry in ("flash_attn_func", "flash_attn_varlen_func", "scaled_dot_product_attention")
               for c in EMPTY_CASES if not (entry == "flash_attn_varlen_func" and c[0] == "batch-0")]  # no batch dim


@pytest.mark.parametrize("entry,name,qs,ks", EMPTY_CALLS, ids=[f"{c[0]}-{c[1]}" for c in EMPTY_CALLS])
def test_empty_sizes_behave_like_torch(entry, name, qs, ks):
    q, k, v = _t(*qs).requires_grad_(True), _t(*ks).requires_grad_(True), _t(*ks).requires_grad_(True)
    if entry == "flash_attn_func":
        out = flash_attn_func(q, k, v)
    elif entry == "flash_attn_varlen_func":
        cq = torch.tensor([0, qs[1]], dtype=torch.int32)
        ck = torch.tensor([0, ks[1]], dtype=torch.int32)
        out = flash_attn_varlen_func(q[0], k[0], v[0], cq, ck, qs[1], ks[1])[None]
    else:
        out = scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           enable_gqa=True).transpose(1, 2)
    qr, kr, vr = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    want = _torch_ref(qr, kr, vr)
    assert out.shape == want.shape and torch.equal(out, want)
    g = _t(*want.shape)
    out.backward(g)
    want.backward(g)
    for a, b in ((q, qr), (k, kr), (v, vr)):
        ga = a.grad if a.grad is not None else torch.zeros_like(a)
        gb = b.grad if b.grad is not None else torch.zeros_like(b)
        assert torch.equal(ga, gb)


def test_empty_keys_give_infinite_lse_or_the_sinks():
    q = _t(1, 5, 2, 16)
    k = _t(1, 0, 2, 16)
    out, lse = flash_attn_func(q, k, k, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isposinf(lse).all())
    sinks = torch.tensor([0.5, -1.0])
    out, lse = flash_attn_func(q, k, k, return_lse=True, sinks=sinks)
    assert torch.equal(lse, sinks.reshape(1, 2, 1).expand(1, 2, 5))
    out, lse = flash_attn_func(_t(1, 5, 0, 16), _t(1, 5, 0, 16), _t(1, 5, 0, 16), return_lse=True,
                               sinks=torch.zeros(0, 3))
    assert out.shape == (1, 5, 0, 16) and lse.shape == (1, 0, 5)


# ---------------------------------------------------------------------------------------------- non-finite inputs
def test_non_finite_inputs_raise_no_warnings_and_stay_where_ieee_puts_them():
    """NaN / inf inputs: no numpy warning escapes the simulator; a NaN key poisons only the rows that see it;
    an inf value gives inf where its probability is > 0 and NaN (0 * inf, as in FlashAttention and torch's SDPA)
    in that column of the rows whose tile holds it masked; finite elements equal the clean run's."""
    q, k, v = _t(1, 130, 2, 32), _t(1, 130, 2, 32), _t(1, 130, 2, 32)
    clean = flash_attn_func(q, k, v, causal=True)
    k[0, 5, 0, 0] = math.nan
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = flash_attn_func(q, k, v, causal=True)
    assert bool(torch.isnan(out[0, 5:, 0]).all()) and bool(torch.isfinite(out[0, :5, 0]).all())
    assert torch.equal(out[0, :5, 0], clean[0, :5, 0]) and torch.equal(out[0, :, 1], clean[0, :, 1])
    k[0, 5, 0, 0] = 0.0
    v[0, 7, 1, 3] = math.inf
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = flash_attn_func(q, k, v, causal=True)
    col = out[0, :, 1, 3]
    assert bool(torch.isposinf(col[7:]).all()) and bool(torch.isnan(col[:7]).all())
    rest = torch.ones_like(out, dtype=torch.bool)
    rest[0, :, 1, 3] = False
    assert bool(torch.isfinite(out[rest]).all())
