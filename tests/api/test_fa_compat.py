"""FlashAttention compatibility: signatures, the causal/window conventions, packed variants, return_attn_probs.

The expected parameter lists below are FlashAttention's published signatures (flash_attn_interface.py of
FlashAttention 2), written out by hand: ours must have exactly these positional parameters, names and defaults
in this order, and may add keyword-only ones after them.
"""
import inspect
import math

import pytest
import torch

import nki_attn
from nki_attn import attention as api
from test_api import check_against_reference, naive, rand

_COMMON = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
           ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False)]
_REQ = inspect.Parameter.empty
FLASH_ATTN_SIGNATURES = {
    "flash_attn_func": [("q", _REQ), ("k", _REQ), ("v", _REQ)] + _COMMON,
    "flash_attn_qkvpacked_func": [("qkv", _REQ)] + _COMMON,
    "flash_attn_kvpacked_func": [("q", _REQ), ("kv", _REQ)] + _COMMON,
    "flash_attn_varlen_func": [("q", _REQ), ("k", _REQ), ("v", _REQ), ("cu_seqlens_q", _REQ),
                               ("cu_seqlens_k", _REQ), ("max_seqlen_q", _REQ), ("max_seqlen_k", _REQ)] + _COMMON
                              + [("block_table", None)],
    "flash_attn_varlen_qkvpacked_func": [("qkv", _REQ), ("cu_seqlens", _REQ), ("max_seqlen", _REQ)] + _COMMON,
    "flash_attn_varlen_kvpacked_func": [("q", _REQ), ("kv", _REQ), ("cu_seqlens_q", _REQ), ("cu_seqlens_k", _REQ),
                                        ("max_seqlen_q", _REQ), ("max_seqlen_k", _REQ)] + _COMMON,
}


@pytest.mark.parametrize("name", sorted(FLASH_ATTN_SIGNATURES))
def test_signature_matches_flash_attention(name):
    params = list(inspect.signature(getattr(nki_attn, name)).parameters.values())
    positional = [(p.name, p.default) for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional == FLASH_ATTN_SIGNATURES[name]
    extras = [p for p in params if p.kind != p.POSITIONAL_OR_KEYWORD]
    assert all(p.kind == p.KEYWORD_ONLY for p in extras), "our additions must be keyword-only"
    assert {p.name for p in extras} == {"sinks", "return_lse", "dropout_seed", "generator"}


def fa_mask(sq, sk, causal, window):
    """FlashAttention's visibility rule, written from its docstring: query i sees keys
    [i + sk - sq - left, i + sk - sq + right]; causal means right = 0."""
    left, right = window
    if causal:
        right = 0
    i = torch.arange(sq)[:, None] + sk - sq
    j = torch.arange(sk)[None, :]
    m = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        m &= j >= i - left
    if right >= 0:
        m &= j <= i + right
    return m


@pytest.mark.parametrize("sq,sk,causal,window", [
    (200, 200, False, (30, 50)),      # symmetric-ish window, no causal: bounds
    (150, 300, False, (-1, 20)),      # right side only, seqlen_q < seqlen_k
    (300, 150, True, (40, -1)),       # causal with left window, seqlen_q > seqlen_k (empty rows)
    (256, 256, True, (17, 9)),        # causal forces right = 0: native causal + window
    (128, 128, False, (1, 1)),        # tri-diagonal band
])
def test_windows_match_flash_attention_rule(sq, sk, causal, window):
    q, k, v = rand(1, sq, 2, 64, seed=21), rand(1, sk, 1, 64, seed=22), rand(1, sk, 1, 64, seed=23)
    m = fa_mask(sq, sk, causal, window)

    def ref(q, k, v):
        return naive(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), m).transpose(1, 2)

    check_against_reference(lambda q, k, v: nki_attn.flash_attn_func(q, k, v, causal=causal, window_size=window),
                            ref, [q, k, v], torch.float32)


def test_causal_forces_right_window_to_zero_bit_for_bit():
    q, k, v = rand(1, 200, 2, 64, seed=1), rand(1, 200, 2, 64, seed=2), rand(1, 200, 2, 64, seed=3)
    a = nki_attn.flash_attn_func(q, k, v, causal=True, window_size=(31, 7))
    b = nki_attn.flash_attn_func(q, k, v, causal=True, window_size=(31, 0))
    c = nki_attn.flash_attn_func(q, k, v, causal=True, window_size=(31, -1))
    assert torch.equal(a, b) and torch.equal(a, c)


def test_positional_flash_attention_call_site():
    """A call written against FlashAttention's positional order runs unchanged."""
    q, k, v = rand(2, 130, 4, 32, seed=4), rand(2, 130, 2, 32, seed=5), rand(2, 130, 2, 32, seed=6)
    out, lse, probs = nki_attn.flash_attn_func(q, k, v, 0.0, 0.2, True, (-1, -1), 0.0, None, True, True)
    assert out.shape == q.shape and out.is_contiguous()
    assert lse.shape == (2, 4, 130) and lse.dtype == torch.float32
    assert probs.shape == (2, 4, 130, 130)
    assert torch.equal(out, nki_attn.flash_attn_func(q, k, v, softmax_scale=0.2, causal=True))


def test_return_attn_probs_are_the_softmax():
    q, k, v = rand(1, 100, 2, 64, seed=7), rand(1, 150, 2, 64, seed=8), rand(1, 150, 2, 64, seed=9)
    sinks = rand(2, seed=10)
    out, lse, probs = nki_attn.flash_attn_func(q, k, v, causal=True, window_size=(40, 0), return_attn_probs=True,
                                               sinks=sinks)
    m = fa_mask(100, 150, True, (40, 0))
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / 8.0
    s = s.masked_fill(~m, -math.inf)
    full = torch.cat([s, sinks.double().reshape(1, 2, 1, 1).expand(1, 2, 100, 1)], dim=-1)
    want = torch.softmax(full, -1)[..., :150]
    torch.testing.assert_close(probs.double(), want, rtol=0, atol=1e-6)
    torch.testing.assert_close(lse.double(), torch.logsumexp(full, -1), rtol=1e-6, atol=1e-6)
    assert not probs.requires_grad


def test_return_attn_probs_is_none_above_the_size_cap(monkeypatch):
    monkeypatch.setattr(api, "MAX_PROBS_ELEMENTS", 1000)
    q = rand(1, 64, 2, 32, seed=11)
    out, lse, probs = nki_attn.flash_attn_func(q, q, q, return_attn_probs=True)
    assert probs is None and out.shape == q.shape and lse.shape == (1, 2, 64)


def test_packed_variants_equal_the_unpacked_calls():
    q, k, v = rand(2, 140, 4, 32, seed=12), rand(2, 140, 4, 32, seed=13), rand(2, 140, 4, 32, seed=14)
    want = nki_attn.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(nki_attn.flash_attn_qkvpacked_func(torch.stack([q, k, v], 2), causal=True), want)
    assert torch.equal(nki_attn.flash_attn_kvpacked_func(q, torch.stack([k, v], 2), causal=True), want)
    cu = torch.tensor([0, 50, 140], dtype=torch.int32)
    want = nki_attn.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 90, 90, causal=True)
    got = nki_attn.flash_attn_varlen_qkvpacked_func(torch.stack([q[0], k[0], v[0]], 1), cu, 90, causal=True)
    assert torch.equal(got, want)
    got = nki_attn.flash_attn_varlen_kvpacked_func(q[0], torch.stack([k[0], v[0]], 1), cu, cu, 90, 90, causal=True)
    assert torch.equal(got, want)


def test_packed_variants_gradients():
    qkv = rand(1, 130, 3, 2, 32, seed=15).requires_grad_(True)
    nki_attn.flash_attn_qkvpacked_func(qkv, causal=True).sum().backward()
    q, k, v = (t.detach().clone().requires_grad_(True) for t in qkv.detach().unbind(2))
    nki_attn.flash_attn_func(q, k, v, causal=True).sum().backward()
    assert torch.equal(qkv.grad, torch.stack([q.grad, k.grad, v.grad], 2))


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (5, 0)), (False, (3, 8))])
def test_varlen_windows_per_sequence(causal, window):
    lens_q, lens_k = [40, 0, 90, 7], [60, 5, 90, 3]
    cq = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32)
    ck = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32)
    h, d = 2, 32
    q, k, v = rand(sum(lens_q), h, d, seed=16), rand(sum(lens_k), 1, d, seed=17), rand(sum(lens_k), 1, d, seed=18)

    def ref(q, k, v):
        outs = []
        for s in range(4):
            a, e, ka, ke = int(cq[s]), int(cq[s + 1]), int(ck[s]), int(ck[s + 1])
            m = fa_mask(e - a, ke - ka, causal, window)
            outs.append(naive(q[a:e].transpose(0, 1)[None], k[ka:ke].transpose(0, 1)[None],
                              v[ka:ke].transpose(0, 1)[None], m)[0].transpose(0, 1))
        return torch.cat(outs)

    def ours(q, k, v):
        return nki_attn.flash_attn_varlen_func(q, k, v, cq, ck, 90, 90, causal=causal, window_size=window)

    check_against_reference(ours, ref, [q, k, v], torch.float32)
    out, lse, probs = nki_attn.flash_attn_varlen_func(q, k, v, cq, ck, 90, 90, causal=causal, window_size=window,
                                                      return_attn_probs=True)
    assert probs.shape == (4, h, 90, 90) and lse.shape == (h, sum(lens_q))
    a, e, ka, ke = int(cq[2]), int(cq[3]), int(ck[2]), int(ck[3])
    s = torch.einsum("qhd,khd->hqk", q[a:e].double(), k[ka:ke].double().expand(-1, h, -1)) / math.sqrt(d)
    want = torch.softmax(s.masked_fill(~fa_mask(e - a, ke - ka, causal, window), -math.inf), -1)
    torch.testing.assert_close(probs[2, :, :e - a, :ke - ka].double(), want, rtol=0, atol=1e-6)


def test_deterministic_flag_accepted_and_runs_are_identical():
    q = rand(1, 200, 2, 64, seed=19)
    a = nki_attn.flash_attn_func(q, q, q, causal=True, deterministic=True)
    b = nki_attn.flash_attn_func(q, q, q, causal=True, deterministic=False)
    assert torch.equal(a, b)
