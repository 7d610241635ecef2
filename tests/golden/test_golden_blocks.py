"""The golden's hooks for computing a long problem in blocks of query rows: ``diag_offset`` (with
``attention_fwd_torch.block_offset``) and the backward's ``kv_partial``.

A block of query rows given alone, with its rows of the packing bounds, of a bias with a query dim and of the
dropout keep mask, must give those rows of the whole problem's o, lse and dq, and its terms of every sum over
query rows (dk, dv, dsinks, dlogit_scale, a broadcast bias's gradient) must add up to the whole problem's. Only
the order of those sums differs, so the bound is the one derived in tests/harness/test_blocked_reference.py:
``2 gamma_n n max|X|`` with n the longest reduction and u = 2^-53."""
import pytest
import torch

import golden
from golden import attention_fwd_torch as gf

U64 = 2.0 ** -53


def _bound(n, ref):
    gamma = n * U64 / (1 - n * U64)
    return 2 * gamma * n * float(ref.abs().max())


def _close(got, want, n):
    assert got.shape == want.shape
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got)) and torch.equal(got[~fin], want[~fin])
    assert float((got[fin] - want[fin]).abs().max()) <= _bound(n, want[fin])


def _problem(seed, sq, sk, h, hk, d, dv, with_all):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)
    q, k, v, dy = randn(2, h, d, sq), randn(2, hk, d, sk), randn(2, hk, dv, sk), randn(2, h, dv, sq)
    bmin = torch.zeros(sq, dtype=torch.float32)
    bmax = torch.full((sq,), float(sk - 7), dtype=torch.float32)
    bmin[200:], bmax[300:] = 100.0, 0.0  # rows 300.. see no key (and rows 200.. fewer)
    kw = dict(use_causal_mask=True, alibi_slopes=torch.rand(2, h, generator=g).float() * 0.3,
              window_size=(200, -1))
    if with_all:
        kw.update(softcap=3.0, logit_scale=(0.5 + torch.rand(2, h, generator=g)).float(),
                  attn_bias=randn(1, h, sq, sk), dropout_p=0.2,
                  dropout_mask=torch.rand(2, h, sq, sk, generator=g) > 0.2)
    sinks = randn(2, h, 2) if with_all else None
    return q, k, v, dy, sinks, bmin, bmax, kw


@pytest.mark.parametrize("with_all", [False, True], ids=["masks-alibi", "every-variant"])
def test_query_blocks_give_the_whole_problem(with_all):
    sq, sk, h, hk, d, dv = 384, 512, 4, 2, 16, 8
    q, k, v, dy, sinks, bmin, bmax, kw = _problem(7, sq, sk, h, hk, d, dv, with_all)
    o, lse = gf.attention_fwd_torch_ref(q, k, v, sinks, bmin, bmax, **kw)
    gr = golden.attention_bwd_torch_ref(q, k, v, o, dy, lse, sinks, bmin, bmax, **kw)
    n = 2 * sq + sk + d
    sums = {}
    for i0 in range(0, sq, 128):
        r = slice(i0, i0 + 128)
        kb = dict(kw, diag_offset=gf.block_offset(sq, sk, i0))
        if with_all:
            kb.update(attn_bias=kw["attn_bias"][:, :, r], dropout_mask=kw["dropout_mask"][:, :, r])
        ob, lb = gf.attention_fwd_torch_ref(q[..., r], k, v, sinks, bmin[r], bmax[r], **kb)
        _close(ob, o[..., r], n)
        _close(lb, lse[..., i0 // 128:i0 // 128 + 1], n)
        gb = golden.attention_bwd_torch_ref(q[..., r], k, v, ob, dy[..., r], lb, sinks, bmin[r], bmax[r],
                                            kv_partial=True, **kb)
        _close(gb["out_dq_ref"], gr["out_dq_ref"][..., r], n)
        if with_all:
            _close(gb["out_dbias_ref"], gr["out_dbias_ref"][:, :, r], n)
        for key in ("out_dk_ref", "out_dv_ref", "out_dsinks_ref", "out_dlogit_scale_ref"):
            if key in gb:
                sums[key] = sums.get(key, 0.0) + gb[key]
    assert set(sums) == {"out_dk_ref", "out_dv_ref"} | ({"out_dsinks_ref", "out_dlogit_scale_ref"} if with_all
                                                       else set())
    for key, t in sums.items():
        _close(t, gr[key], n)
    # the planted mistake: a middle block with the whole problem's offset is another problem
    wrong, _ = gf.attention_fwd_torch_ref(q[..., 128:256], k, v, sinks, bmin[128:256], bmax[128:256],
                                          **dict(kw, **({} if not with_all else
                                                        dict(attn_bias=kw["attn_bias"][:, :, 128:256],
                                                             dropout_mask=kw["dropout_mask"][:, :, 128:256]))))
    assert float((wrong - o[..., 128:256]).abs().max()) > 1e6 * _bound(n, o)


def test_kv_partial_is_the_unrounded_matmul_in_16_bit():
    """In bfloat16, kv_partial returns float32 dk, dv which, rounded to bfloat16, are the unblocked dk, dv (one
    rounding of the same float32-accumulated products, up to the order of the sum: within one bfloat16 unit)."""
    q, k, v, dy, _, bmin, bmax, kw = _problem(11, 256, 256, 2, 2, 32, 32, False)
    q, k, v, dy = (t.bfloat16() for t in (q, k, v, dy))
    o, lse = gf.attention_fwd_torch_ref(q, k, v, None, bmin[:256], bmax[:256], **kw)
    gr = golden.attention_bwd_torch_ref(q, k, v, o, dy, lse, None, bmin[:256], bmax[:256], **kw)
    gp = golden.attention_bwd_torch_ref(q, k, v, o, dy, lse, None, bmin[:256], bmax[:256], kv_partial=True, **kw)
    for key in ("out_dk_ref", "out_dv_ref"):
        assert gp[key].dtype == torch.float32 and gr[key].dtype == torch.bfloat16
        diff = (gp[key].bfloat16().float() - gr[key].float()).abs()
        assert float(diff.max()) <= 2.0 ** -7 * float(gr[key].float().abs().max())
    assert torch.equal(gp["out_dq_ref"], gr["out_dq_ref"])
    with pytest.raises(ValueError, match="kv_partial"):
        golden.attention_bwd_torch_ref(q, k, v, o, dy, lse, kv_partial="yes")


def test_golden_refuses_a_seed_for_a_block():
    q = torch.randn(1, 1, 8, 128, dtype=torch.float64)
    with pytest.raises(ValueError, match="dropout_seed"):
        gf.attention_fwd_torch_ref(q, q, q, dropout_p=0.1, dropout_seed=torch.tensor([1, 0], dtype=torch.int32),
                                   diag_offset=0)
    with pytest.raises(ValueError, match="diag_offset"):
        gf.attention_fwd_torch_ref(q, q, q, diag_offset=1.5)
    o, lse = gf.attention_fwd_torch_ref(q, q, q, diag_offset=0)  # the default offset given explicitly
    o0, lse0 = gf.attention_fwd_torch_ref(q, q, q)
    assert torch.equal(o, o0) and torch.equal(lse, lse0)
