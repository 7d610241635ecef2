"""The additive bias in the kernels themselves (``nki_attn.kernel_api``, kernel layout): its score step composed
with every other variant, its gradient (``bias_grad``) against the float64 golden, the zeros outside the visited
tiles, and the step lists chosen once per launch (no bias-gradient step without ``bias_grad``).

Criterion: the golden in float64 on the same inputs is the truth; each result's error is at most K = 3 times the
error of the golden run in the input dtype (the rounding any implementation in that dtype makes), plus a floor of
2^-20 * max(max|truth|, 1) (docs/validation.md).
"""
import types

import pytest
import torch

from golden import attention_bwd_torch_ref, attention_fwd_torch_ref
from golden.dropout import make_seed
from nki_attn.kernel_api import attention_bwd, attention_fwd
from nki_attn.kernels import attention_bwd as kb
from nki_attn.kernels import attention_fwd as kf
from nki_attn.kernels import score_mods as sm
from nki_attn.kernels.score_mods import bias_scores

K = 3.0


def rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _close(name, ours, truth, lowp):
    floor = 2.0 ** -20 * max(float(truth.abs().max()), 1.0)
    err = float((ours.double() - truth).abs().max())
    base = float((lowp.double() - truth).abs().max())
    assert torch.isfinite(ours).all(), name
    assert err <= K * base + floor, f"{name}: error {err:.3e} > {K} x {base:.3e} + {floor:.1e}"


def _sum_to(x, shape):
    dims = [i for i in range(4) if shape[i] == 1 and x.shape[i] != 1]
    return x.sum(dim=dims, keepdim=True) if dims else x


CASES = {
    # every variant at once: soft-cap, ALiBi, sinks, dropout, a window, GQA, two K/V sections in the backward
    "all-variants": dict(dtype=torch.bfloat16, bias=(1, 4, 256, 640), kw=dict(
        softcap=4.0, window_size=(300, 100), dropout_p=0.2), alibi=True, sinks=True, k_section_len=256),
    # causal with seqlen_q < seqlen_k, a per-batch bias broadcast over heads and rows (key padding), fp16
    "causal-keys": dict(dtype=torch.float16, bias=(2, 1, 1, 640), kw=dict(use_causal_mask=True)),
    # packing bounds (every tile partial) and a per-head bias broadcast over keys (a per-row constant)
    "packed-rows": dict(dtype=torch.float32, bias=(1, 4, 256, 1), kw=dict(), packed=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bias_forward_and_gradient_match_the_float64_golden(name):
    c = CASES[name]
    dt = c["dtype"]
    b, h, hk, d, sq, sk = 2, 4, 2, 64, 256, 640
    q, k, v, dy = rand(b, h, d, sq, seed=1, dtype=dt), rand(b, hk, d, sk, seed=2, dtype=dt), \
        rand(b, hk, d, sk, seed=3, dtype=dt), rand(b, h, d, sq, seed=4, dtype=dt)
    bias = rand(*c["bias"], seed=5, dtype=dt) * 2
    kw = dict(c["kw"])
    if c.get("alibi"):
        kw["alibi_slopes"] = rand(b, h, seed=6).abs() * 0.05
    if c.get("sinks"):
        kw["sinks_ref"] = rand(b, h, seed=7)
    if c.get("packed"):
        kw["bound_min"] = torch.tensor([0.0] * 128 + [200.0] * 128)
        kw["bound_max"] = torch.tensor([200.0] * 128 + [640.0] * 128)
    if kw.get("dropout_p"):
        kw["dropout_seed"] = make_seed(1234, 5)
    o, lse = attention_fwd(q, k, v, attn_bias=bias, **kw)
    grads = attention_bwd(q, k, v, o, dy, lse, attn_bias=bias, bias_grad=True, mixed_precision=True,
                          k_section_len=c.get("k_section_len"), **kw)
    dbias = grads[-1]
    assert dbias.shape == (b, h, sq, sk) and dbias.dtype == torch.float32

    def golden(x):
        gk = {n: (t.to(x) if isinstance(t, torch.Tensor) and t.is_floating_point() and n.startswith("sinks")
                  else t) for n, t in kw.items()}
        ins = [t.to(x) for t in (q, k, v)]
        oo, ll = attention_fwd_torch_ref(*ins, attn_bias=bias.to(x), **gk)
        g = attention_bwd_torch_ref(*ins, oo, dy.to(x), ll, attn_bias=bias.to(x), mixed_precision=True, **gk)
        return oo, ll, g
    truth = golden(torch.float64)
    low = golden(dt)
    _close("o", o, truth[0], low[0])
    _close("lse", lse, truth[1], low[1])
    for n in ("dq", "dk", "dv"):
        _close(n, grads[("dq", "dk", "dv").index(n)], truth[2][f"out_{n}_ref"], low[2][f"out_{n}_ref"])
    _close("dbias", _sum_to(dbias, c["bias"]), truth[2]["out_dbias_ref"], low[2]["out_dbias_ref"])


def test_dbias_is_zero_outside_the_band_and_finite_everywhere():
    """A causal window: the kernel visits only the band's tiles; every other element of dbias is an exact 0
    (the work-item step's fill), not left uninitialised."""
    b, h, d, s = 1, 2, 32, 768
    q, k, v, dy = (rand(b, h, d, s, seed=10 + i) for i in range(4))
    bias = rand(1, 1, s, s, seed=14)
    kw = dict(use_causal_mask=True, sliding_window=200)
    o, lse = attention_fwd(q, k, v, attn_bias=bias, **kw)
    dbias = attention_bwd(q, k, v, o, dy, lse, attn_bias=bias, bias_grad=True, **kw)[-1]
    i = torch.arange(s)[:, None]
    j = torch.arange(s)[None, :]
    outside = (j > i) | (j < i - 199)
    assert torch.all(dbias[:, :, outside] == 0)
    assert torch.isfinite(dbias).all() and float(dbias[:, :, ~outside].abs().max()) > 0


def _cfg(mods, **over):
    a = dict(packing=False, banded=False, dropout=False, trn1=False, block_mask=None, mods=mods,
             active=sm.active_mods(mods))
    a.update(over)
    return types.SimpleNamespace(**a)


def test_step_lists_are_chosen_once_and_hold_no_bias_gradient_work_without_bias_grad():
    bias = types.SimpleNamespace(shape=(1, 1, 128, 128), dtype="bfloat16")
    plain = kb._select_steps(_cfg({"attn_bias": bias}))
    assert plain.score == [bias_scores] and plain.ds is kb._ds_plain and plain.grad == []
    assert plain.item_start == [sm._bias_item]  # no instruction: only the HBM references
    grad = kb._select_steps(_cfg({"attn_bias": bias, "bias_grad": True, "softcap": 2.0}))
    assert grad.score[-1] is bias_scores and grad.ds is sm._ds_bias
    assert grad.item_start == [sm._bias_item, sm._dbias_zero] and grad.grad == [sm._grad_softcap]
    none = kb._select_steps(_cfg({}))
    assert bias_scores not in none.score and none.item_start == [] and none.ds is kb._ds_plain
    shp = types.SimpleNamespace(mods={"attn_bias": bias, "softcap": 1.0, "alibi_slopes": bias})
    shp.active = sm.active_mods(shp.mods)
    fwd = kf._select_steps(types.SimpleNamespace(mask="bounds", alibi_mm=False, dropout_p=0.0, block_mask=None,
                                                 shp=shp))
    # after soft-capping and ALiBi, as the semantics order them
    assert fwd.score == [sm.softcap_scores, sm._alibi_scores, bias_scores]
