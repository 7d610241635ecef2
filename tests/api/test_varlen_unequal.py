"""flash_attn_varlen_func with different query and key lengths per sequence (cu_seqlens_q != cu_seqlens_k).

FlashAttention's convention: within sequence s (len_q queries, len_k keys) causal masking is aligned to the
bottom-right corner, so local query i sees local key j iff ``j <= i + len_k - len_q`` (and, with
``window_size=(left, 0)``, ``j >= i + len_k - len_q - left``); queries of one sequence never see keys of another;
a query that sees no key (len_q > len_k) gets output 0. The reference below is written from that rule alone:
a dense float64 mask, a plain softmax (sinks as extra columns), and torch autograd for the gradients.

Criterion (as tests/api/test_api.py, docs/validation.md): for the output and every gradient, the error against
the float64 reference is at most K = 3 times the error of the same reference run in the input dtype, plus a
floor of 2^-20 * max(max|truth|, 1) for entries that are exactly 0 in float64.
"""
import math

import pytest
import torch

from nki_attn import flash_attn_varlen_func

K = 3.0


def varlen_mask(lens_q, lens_k, causal, left=-1):
    """Bool [total_q, total_k]: True where packed query row r may see packed key row c."""
    mask = torch.zeros(sum(lens_q), sum(lens_k), dtype=torch.bool)
    r0 = c0 = 0
    for lq, lk in zip(lens_q, lens_k):
        i = torch.arange(lq)[:, None]
        j = torch.arange(lk)[None, :]
        m = torch.ones(lq, lk, dtype=torch.bool)
        if causal:
            m &= j <= i + (lk - lq)
            if left >= 0:
                m &= j >= i + (lk - lq) - left
        mask[r0:r0 + lq, c0:c0 + lk] = m
        r0, c0 = r0 + lq, c0 + lk
    return mask


def reference(q, k, v, sinks, mask, scale):
    """out [total_q, h, d] and lse [h, total_q] by the definition (q's dtype); rows with no key and no sink: 0."""
    h, hk = q.shape[1], k.shape[1]
    kk = k.repeat_interleave(h // hk, dim=1)
    vv = v.repeat_interleave(h // hk, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        cols = sinks.to(s.dtype).reshape(h, 1, -1).expand(h, s.shape[1], -1)
        s = torch.cat([s, cols], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)[..., :k.shape[0]]
    return torch.einsum("hqk,khd->qhd", p, vv), lse


def leaves(ts):
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in ts]


def outputs_and_grads(fn, inputs, dout):
    ins = leaves(inputs)
    out = fn(*ins)
    out.backward(dout)
    return [out.detach()] + [t.grad.detach() for t in ins if t is not None]


def check(name, ours, truth, lowp):
    floor = 2.0 ** -20 * max(float(truth.abs().max()), 1.0)
    err = float((ours.double() - truth).abs().max())
    base = float((lowp.double() - truth).abs().max())
    assert torch.isfinite(ours).all(), f"{name}: non-finite values"
    assert err <= K * base + floor, f"{name}: error {err:.3e} > {K} x baseline {base:.3e} + {floor:.1e}"


def run_case(lens_q, lens_k, causal=False, left=-1, h=2, hk=2, d=32, sinks=0, scale=None, dtype=torch.float32,
             seed=0):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq, h, d, generator=g).to(dtype)
    k = torch.randn(tk, hk, d, generator=g).to(dtype)
    v = torch.randn(tk, hk, d, generator=g).to(dtype)
    s = None
    if sinks:
        s = torch.randn((h,) if sinks == 1 else (h, sinks), generator=g).to(dtype)
    dout = torch.randn(tq, h, d, generator=g).to(dtype)
    cu_q = torch.tensor([0] + lens_q, dtype=torch.int32).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, dtype=torch.int32).cumsum(0).to(torch.int32)
    mask = varlen_mask(lens_q, lens_k, causal, left)
    sc = 1.0 / math.sqrt(d) if scale is None else scale
    window = (left, 0) if left >= 0 else (-1, -1)

    lses = []

    def ours(q, k, v, s=None):
        out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), softmax_scale=scale,
                                          causal=causal, window_size=window, sinks=s, return_lse=True)
        lses.append(lse.detach())
        return out

    def ref(q, k, v, s=None):
        return reference(q, k, v, s, mask, sc)[0]

    inputs = [q, k, v, s]
    got = outputs_and_grads(ours, inputs, dout)
    truth = outputs_and_grads(ref, [None if t is None else t.double() for t in inputs], dout.double())
    lowp = outputs_and_grads(ref, inputs, dout)
    names = ["out", "dq", "dk", "dv", "dsinks"]
    assert len(got) == len(truth) == len(lowp)
    for name, a, t, b in zip(names, got, truth, lowp):
        assert a.shape == t.shape, f"{name}: shape {tuple(a.shape)} != {tuple(t.shape)}"
        check(name, a, t, b)

    # lse: log-sum-exp of the visible scores (and sinks), same criterion; +inf exactly for rows that see nothing
    lse = lses[0]
    _, lse_truth = reference(q.double(), k.double(), v.double(), None if s is None else s.double(), mask, sc)
    _, lse_lowp = reference(q, k, v, s, mask, sc)
    empty = torch.isneginf(lse_truth)
    assert lse.shape == (h, tq) and lse.dtype == torch.float32
    assert torch.isposinf(lse[empty]).all() and torch.isfinite(lse[~empty]).all()
    check("lse", lse[~empty], lse_truth[~empty], lse_lowp[~empty])
    return mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_keys_longer(dtype):
    # the case: without the per-sequence offset len_k - len_q the output is off by up to ~2.8
    run_case([50, 80], [90, 120], causal=True, dtype=dtype)


def test_causal_window_keys_longer():
    run_case([50, 80], [90, 120], causal=True, left=40, seed=1)


def test_non_causal_unequal():
    run_case([50, 80], [90, 120], seed=2)


def test_causal_queries_longer_rows_without_keys():
    # sequence 0 has 80 queries and 50 keys: its first 30 queries see nothing (output 0, lse +inf)
    mask = run_case([80, 50], [50, 90], causal=True, seed=3)
    assert not mask[:30].any() and mask[30:80].any(dim=1).all()


def test_causal_window_queries_longer():
    run_case([80, 50], [50, 90], causal=True, left=20, seed=4)


def test_gqa_sinks_three_sequences_across_tiles():
    # 3 sequences, 260 queries and 270 keys packed: sequences straddle the 128-row tiles on both sides
    run_case([50, 80, 130], [90, 120, 60], causal=True, h=4, hk=2, sinks=2, seed=5)


def test_gqa_window_sinks_bf16():
    run_case([50, 80, 130], [90, 120, 60], causal=True, left=64, h=6, hk=2, sinks=1, dtype=torch.bfloat16,
             seed=6)


def test_scale_and_single_key_sequence():
    run_case([60, 1, 70], [1, 40, 100], causal=True, scale=0.4, seed=7)
