"""attention_fwd (nki_attn/kernels/attention_fwd.py) on the simulator, against the torch golden.

Accuracy criterion: the project's (tests/kernels/_compare.py, derived in docs/tolerances.md, "Forward" for this
kernel). With ``ref`` the golden run on float64 copies of the dtype-rounded inputs (the exact answer) and
``golden`` the golden run in the kernel's own dtype,

    max |kernel - ref| <= 2 * max |golden - ref| + u(dtype) * max |ref|

for o (dtype of q) and for the finite entries of lse (float32): the kernel may be at most twice as wrong as a
straightforward implementation in the same precision, plus one rounding of the largest result. Rows that see no
key must give o == 0 and lse == +inf exactly (the same rows as the reference), and nothing may be NaN.
"""
import importlib
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import _compare  # noqa: E402

from golden import attention_bwd_torch_ref, attention_fwd_torch_ref, packing_bounds  # noqa: E402
from nki_attn.kernels.attention_fwd import attention_fwd  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ----------------------------------------------------------------------------------------------- helpers
def make_qkv(bs=1, nheads=1, nheads_kv=1, d=64, sq=256, sk=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    sk = sq if sk is None else sk
    q = torch.randn(bs, nheads, d, sq, generator=g).to(dtype)
    k = torch.randn(bs, nheads_kv, d, sk, generator=g).to(dtype)
    v = torch.randn(bs, nheads_kv, d, sk, generator=g).to(dtype)
    return q, k, v


def _max_err(x, ref):
    fin = torch.isfinite(ref)
    if not fin.any():
        return 0.0
    return (x.to(torch.float64) - ref)[fin].abs().max().item()


def check_fa(name, out, gold, ref, dtype):
    """The shared criterion on the finite entries; +inf entries (empty rows) must match exactly."""
    assert not torch.isnan(out).any(), f"{name}: NaN in the kernel result"
    assert torch.equal(torch.isinf(out), torch.isinf(ref)), f"{name}: +inf pattern differs from the reference"
    assert torch.equal(out[torch.isinf(out)], ref[torch.isinf(ref)].to(out.dtype)), f"{name}: inf sign differs"
    fin = torch.isfinite(ref)
    return _compare.check_close(name, out[fin], ref[fin], gold[fin], dtype)


def run_and_check(q, k, v, *, sinks=None, bound_min=None, bound_max=None, causal=False, mixed=True, scale=None,
                  window=None):
    """Run the kernel and check o and lse with the FA criterion; returns (o, lse, o_ref, lse_ref)."""
    o, lse = attention_fwd(q, k, v, sinks_ref=sinks, bound_min=bound_min, bound_max=bound_max,
                           use_causal_mask=causal, mixed_precision=mixed, softmax_scale=scale, sliding_window=window)
    common = dict(bound_min=bound_min, bound_max=bound_max, use_causal_mask=causal, softmax_scale=scale,
                  sliding_window=window)
    o_ref, lse_ref = attention_fwd_torch_ref(q.double(), k.double(), v.double(),
                                             sinks_ref=None if sinks is None else sinks.double(), **common)
    o_gold, lse_gold = attention_fwd_torch_ref(q, k, v, sinks_ref=sinks, mixed_precision=mixed, **common)
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[1], 128, q.shape[3] // 128) and lse.dtype == torch.float32
    check_fa("o", o, o_gold, o_ref, q.dtype)
    check_fa("lse", lse, lse_gold, lse_ref, torch.float32)
    return o, lse, o_ref, lse_ref


def empty_rows(lse):
    """Bool [bs, nheads, seqlen_q] of rows with lse == +inf (lse layout [bs, nheads, 128, n_tiles])."""
    return torch.isposinf(lse).transpose(-1, -2).reshape(lse.shape[0], lse.shape[1], -1)


# ----------------------------------------------------------------------------------------------- features
def test_plain_d64_fp32_one_head():
    run_and_check(*make_qkv())


def test_causal():
    run_and_check(*make_qkv(sq=512), causal=True)


@pytest.mark.parametrize("window", [1, 100, 128, 300])
def test_sliding_window(window):
    run_and_check(*make_qkv(sq=640, seed=window), causal=True, window=window)


def test_window_wider_than_sequence():
    run_and_check(*make_qkv(sq=256), causal=True, window=10_000)


def test_gqa_4_to_1():
    run_and_check(*make_qkv(bs=1, nheads=8, nheads_kv=2, sq=256), causal=True)


def test_mqa():
    run_and_check(*make_qkv(bs=2, nheads=3, nheads_kv=1, sq=256))


def test_gqa_more_units_than_a_block():
    # 4 query heads x 3 query tiles = 12 (head, tile) pairs per kv head: two blocks of the K/V stream
    run_and_check(*make_qkv(nheads=4, nheads_kv=1, sq=384), causal=True, window=200)


@pytest.mark.parametrize("causal", [False, True])
def test_packing_three_sequences(causal):
    bmin, bmax = packing_bounds([0, 100, 333, 512])
    run_and_check(*make_qkv(nheads=2, nheads_kv=1, sq=512), bound_min=bmin, bound_max=bmax, causal=causal)


def test_packing_causal_window():
    bmin, bmax = packing_bounds([0, 100, 333, 512])
    run_and_check(*make_qkv(sq=512), bound_min=bmin, bound_max=bmax, causal=True, window=40)


@pytest.mark.parametrize("causal", [False, True])
def test_rows_with_no_visible_key(causal):
    # padding rows 450..511 see nothing (packing_bounds gives them [0, 0)); row 7 is emptied by hand
    bmin, bmax = packing_bounds([0, 100, 333, 450], seqlen_q=512)
    bmin[7], bmax[7] = 50.0, 50.0
    o, lse, _, lse_ref = run_and_check(*make_qkv(nheads=2, sq=512, seed=3), bound_min=bmin, bound_max=bmax,
                                       causal=causal)
    empty = empty_rows(lse)
    assert torch.equal(empty, empty_rows(lse_ref))
    assert empty[0, 0, 7] and empty[0, 0, 450:].all() and empty.sum() == 2 * 63
    o_rows = o.transpose(-1, -2)  # [bs, h, sq, d]
    assert torch.equal(o_rows[empty], torch.zeros_like(o_rows[empty]))


def test_no_visible_key_bf16_unmixed():
    bmin, bmax = packing_bounds([0, 200, 300], seqlen_q=384)
    run_and_check(*make_qkv(sq=384, dtype=torch.bfloat16), bound_min=bmin, bound_max=bmax, mixed=False)


@pytest.mark.parametrize("num_sinks", [1, 2])
def test_sinks(num_sinks):
    q, k, v = make_qkv(nheads=2, sq=256, seed=num_sinks)
    g = torch.Generator().manual_seed(10)
    shape = (1, 2) if num_sinks == 1 else (1, 2, num_sinks)
    sinks = torch.randn(shape, generator=g) * 3.0
    run_and_check(q, k, v, sinks=sinks, causal=True)


def test_dominant_sinks():
    # sink logits far above the scores: P of the keys is tiny, o small, lse ~ logsumexp(sinks)
    q, k, v = make_qkv(sq=256)
    run_and_check(q, k, v, sinks=torch.tensor([[30.0]]))


def test_sinks_with_empty_rows():
    # a row with no visible key but a sink is not empty: o = 0, lse = the sink logit
    bmin, bmax = packing_bounds([0, 200], seqlen_q=256)
    sinks = torch.tensor([[0.7]])
    o, lse, _, _ = run_and_check(*make_qkv(sq=256), sinks=sinks, bound_min=bmin, bound_max=bmax)
    assert torch.isfinite(lse).all()
    rows = lse.transpose(-1, -2).reshape(-1)
    assert torch.allclose(rows[200:], torch.full((56,), 0.7), atol=1e-6)
    assert torch.equal(o[..., 200:], torch.zeros_like(o[..., 200:]))


@pytest.mark.parametrize("scale", [0.3, 1.0, 2.5])
def test_softmax_scale(scale):
    # scale > 1 makes scale * (mask value) overflow if the kernel applied the scale after masking
    run_and_check(*make_qkv(sq=384, seed=4), causal=True, window=150, scale=scale)


@pytest.mark.parametrize("sq,sk", [(256, 640), (640, 256), (128, 1152)])
def test_seqlen_q_ne_seqlen_k(sq, sk):
    run_and_check(*make_qkv(nheads=2, nheads_kv=1, sq=sq, sk=sk))


@pytest.mark.parametrize("d", [64, 96, 128, 256])
def test_head_dims(d):
    run_and_check(*make_qkv(d=d, sq=256, seed=d), causal=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("mixed", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_dtypes(dtype, mixed, causal):
    run_and_check(*make_qkv(nheads=2, nheads_kv=1, d=128, sq=256, dtype=DTYPES[dtype], seed=1), causal=causal,
                  mixed=mixed)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_d256_packing_sinks(dtype):
    bmin, bmax = packing_bounds([0, 130, 256])
    q, k, v = make_qkv(d=256, sq=256, dtype=DTYPES[dtype], seed=7)
    run_and_check(q, k, v, sinks=torch.tensor([[0.5]]).to(DTYPES[dtype]), bound_min=bmin, bound_max=bmax,
                  causal=True)


def test_large_logits_no_nan():
    # scores of several hundred: exp overflows unless the running max is subtracted
    q, k, v = make_qkv(sq=256, seed=5)
    run_and_check(q * 8.0, k * 8.0, v, causal=True)


# ----------------------------------------------------------------------------------------------- targets / LNC
@pytest.mark.parametrize("target", ["trn1", "trn2", "trn3"])
def test_targets(monkeypatch, target):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", target)
    bmin, bmax = packing_bounds([0, 100, 333, 450], seqlen_q=512)
    run_and_check(*make_qkv(nheads=2, nheads_kv=1, sq=512, seed=11), bound_min=bmin, bound_max=bmax, causal=True,
                  window=120, sinks=torch.tensor([[0.1, -2.0]]))
    run_and_check(*make_qkv(d=96, sq=256, dtype=torch.bfloat16, seed=12), causal=True)


def test_trn1_packing_fallback_matches_range_select(monkeypatch):
    bmin, bmax = packing_bounds([0, 100, 333, 450], seqlen_q=512)
    q, k, v = make_qkv(nheads=2, sq=512, seed=13)
    out = {}
    for target in ("trn1", "trn2"):
        monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", target)
        out[target] = attention_fwd(q, k, v, bound_min=bmin, bound_max=bmax, use_causal_mask=True)
    assert torch.equal(out["trn1"][0], out["trn2"][0]) and torch.equal(out["trn1"][1], out["trn2"][1])


@pytest.mark.parametrize("target", ["trn2", "trn3"])
def test_lnc2_bit_identical(monkeypatch, target):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", target)
    # bs * nheads_kv = 3 work items: an uneven split between the two cores
    q, k, v = make_qkv(bs=1, nheads=6, nheads_kv=3, sq=384, seed=14)
    bmin, bmax = packing_bounds([0, 150, 384])
    kw = dict(bound_min=bmin, bound_max=bmax, use_causal_mask=True, sinks_ref=torch.randn(1, 6))
    o1, l1 = attention_fwd(q, k, v, **kw)
    o1b, l1b = attention_fwd[1](q, k, v, **kw)
    o2, l2 = attention_fwd[2](q, k, v, **kw)
    assert torch.equal(o1, o1b) and torch.equal(l1, l1b)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


def test_lnc2_more_cores_than_work(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    q, k, v = make_qkv(sq=256, seed=15)  # one work item: core 1 idles
    o1, l1 = attention_fwd(q, k, v)
    o2, l2 = attention_fwd[2](q, k, v)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


# ----------------------------------------------------------------------------------------------- tile skipping
def _count_matmuls(**kw):
    from nki_attn.sim.trace import recording
    q, k, v = make_qkv(sq=1024, seed=16)
    with recording() as rec:
        attention_fwd(q, k, v, **kw)
    return rec.count("nc_matmul")


def test_causal_tile_skipping_is_exact():
    # query tile t (128 rows) needs 512-key tiles 0..t//4 (one QK matmul each) and 128-key chunks 0..t (one PV
    # matmul each); nothing else may be computed
    nq = 8
    want_causal = sum(t // 4 + 1 for t in range(nq)) + sum(t + 1 for t in range(nq))
    want_full = nq * 2 + nq * 8
    assert _count_matmuls(use_causal_mask=True) == want_causal
    assert _count_matmuls() == want_full


def test_window_tile_skipping_is_exact():
    # W = 128: query tile t needs chunks t-1 and t (chunk 0 only for t = 0)
    nq, w = 8, 128
    want = 0
    for t in range(nq):
        chunks = [c for c in range(8) if c <= t and (c + 1) * 128 - 1 >= t * 128 - w + 1]
        want += len({c // 4 for c in chunks}) + len(chunks)
    assert _count_matmuls(use_causal_mask=True, sliding_window=w) == want


# ----------------------------------------------------------------------------------------------- fwd -> bwd chain
def _bwd_kernel():
    try:
        mod = importlib.import_module("nki_attn.kernels.attention_bwd")
    except Exception as exc:  # noqa: BLE001 - any import failure means there is nothing to chain with
        pytest.skip(f"nki_attn.kernels.attention_bwd does not import yet ({type(exc).__name__}: {exc})")
    if not hasattr(mod, "attention_bwd"):
        pytest.skip("nki_attn.kernels.attention_bwd has no attention_bwd yet")
    return mod.attention_bwd


CHAIN_CASES = {
    "plain": dict(),
    "causal_window": dict(causal=True, window=150),
    "gqa": dict(nheads=4, nheads_kv=2, causal=True),
    "packing_empty_rows": dict(packing=True, causal=True),
    "sinks": dict(sinks=2, causal=True),
    "bf16": dict(dtype=torch.bfloat16, causal=True),
}


@pytest.mark.parametrize("case", sorted(CHAIN_CASES))
def test_forward_then_backward(case):
    attention_bwd = _bwd_kernel()
    c = dict(CHAIN_CASES[case])
    dtype = c.pop("dtype", torch.float32)
    q, k, v = make_qkv(nheads=c.pop("nheads", 2), nheads_kv=c.pop("nheads_kv", 1), sq=384, dtype=dtype, seed=21)
    g = torch.Generator().manual_seed(22)
    dy = torch.randn(q.shape, generator=g).to(dtype)
    sinks = None
    ns = c.pop("sinks", 0)
    if ns:
        sinks = (torch.randn(q.shape[0], q.shape[1], ns, generator=g) * 2).to(dtype)
    bmin = bmax = None
    if c.pop("packing", False):
        bmin, bmax = packing_bounds([0, 100, 250, 330], seqlen_q=384)
    kw = dict(bound_min=bmin, bound_max=bmax, use_causal_mask=c.pop("causal", False),
              sliding_window=c.pop("window", None))
    assert not c
    o, lse = attention_fwd(q, k, v, sinks_ref=sinks, **kw)
    grads = attention_bwd(q, k, v, o, dy, lse, sinks_ref=sinks, **kw)
    names = ["out_dq_ref", "out_dk_ref", "out_dv_ref"] + (["out_dsinks_ref"] if sinks is not None else [])
    if isinstance(grads, dict):
        grads = [grads[n] for n in names]
    assert len(grads) == len(names)
    # reference: the golden on float64 copies (it recomputes o and lse itself). Baseline: the worse of the golden
    # in the kernel's dtype and the backward KERNEL fed the exact forward (float64 o, lse rounded to the kernel's
    # dtypes). The chain may be at most K = 2 times that (+ one rounding): the forward's o and lse must cost the
    # backward nothing beyond what its own arithmetic costs. (Not _compare's err_inputs term measured on the
    # forward's own o/lse: that would widen the bound exactly when the forward is wrong.)
    o_ex, lse_ex = attention_fwd_torch_ref(q.double(), k.double(), v.double(),
                                           sinks_ref=None if sinks is None else sinks.double(), **kw)
    ref = attention_bwd_torch_ref(q.double(), k.double(), v.double(), o_ex, dy.double(), lse_ex,
                                  sinks_ref=None if sinks is None else sinks.double(), **kw)
    gold = attention_bwd_torch_ref(q, k, v, o_ex.to(dtype), dy, lse_ex.float(), sinks_ref=sinks, **kw)
    exact_fwd = attention_bwd(q, k, v, o_ex.to(dtype), dy, lse_ex.float(), sinks_ref=sinks, **kw)
    if isinstance(exact_fwd, dict):
        exact_fwd = [exact_fwd[n] for n in names]
    for name, got, base in zip(names, grads, exact_fwd):
        res_dtype = torch.float32 if name == "out_dsinks_ref" else dtype
        baseline = gold[name] if _max_err(gold[name], ref[name]) >= _max_err(base, ref[name]) else base
        _compare.check_close(name, got, ref[name], baseline, res_dtype)
    if bmin is not None:
        # rows that see nothing: lse = +inf from the forward, zero dq from the backward
        empty = empty_rows(lse)[0, 0]
        assert empty.any()
        assert torch.equal(grads[0][..., empty], torch.zeros_like(grads[0][..., empty]))


# ----------------------------------------------------------------------------------------------- validation
def _bad(**over):
    q, k, v = make_qkv(nheads=2, nheads_kv=1, sq=256)
    args = dict(q_ref=q, k_ref=k, v_ref=v)
    args.update(over)
    return args


BAD_CASES = {
    "q_rank": (lambda: _bad(q_ref=torch.randn(2, 64, 256)), "q must be 4-D"),
    "v_shape": (lambda: _bad(v_ref=torch.randn(1, 1, 64, 384)), "v shape"),
    "k_batch": (lambda: _bad(k_ref=torch.randn(2, 1, 64, 256), v_ref=torch.randn(2, 1, 64, 256)), "k batch"),
    "k_d_head": (lambda: _bad(k_ref=torch.randn(1, 1, 32, 256), v_ref=torch.randn(1, 1, 32, 256)), "d_head"),
    "gqa_ratio": (lambda: _bad(q_ref=torch.randn(1, 3, 64, 256), k_ref=torch.randn(1, 2, 64, 256),
                               v_ref=torch.randn(1, 2, 64, 256)), "divisible"),
    "seqlen_q": (lambda: _bad(q_ref=torch.randn(1, 2, 64, 200)), "seqlen_q=200"),
    "seqlen_k": (lambda: _bad(k_ref=torch.randn(1, 1, 64, 300), v_ref=torch.randn(1, 1, 64, 300)), "seqlen_k=300"),
    "d_head_too_big": (lambda: _bad(q_ref=torch.randn(1, 2, 264, 256), k_ref=torch.randn(1, 1, 264, 256),
                                    v_ref=torch.randn(1, 1, 264, 256)), "exceeds"),
    "dtype_int32": (lambda: _bad(q_ref=torch.ones(1, 2, 64, 256, dtype=torch.int32),
                                 k_ref=torch.ones(1, 1, 64, 256, dtype=torch.int32),
                                 v_ref=torch.ones(1, 1, 64, 256, dtype=torch.int32)), "not supported"),
    "dtype_mismatch": (lambda: _bad(k_ref=torch.randn(1, 1, 64, 256, dtype=torch.bfloat16)), "k dtype"),
    "window_no_causal": (lambda: _bad(sliding_window=64), "only supported with use_causal_mask"),
    "window_zero": (lambda: _bad(sliding_window=0, use_causal_mask=True), "sliding_window"),
    "window_float": (lambda: _bad(sliding_window=64.0, use_causal_mask=True), "sliding_window"),
    "bound_min_only": (lambda: _bad(bound_min=torch.zeros(256)), "without bound_max"),
    "bound_max_only": (lambda: _bad(bound_max=torch.zeros(256)), "without bound_min"),
    "bound_shape": (lambda: _bad(bound_min=torch.zeros(128), bound_max=torch.zeros(128)), "bound_min shape"),
    "bound_dtype": (lambda: _bad(bound_min=torch.zeros(256, dtype=torch.int32),
                                 bound_max=torch.zeros(256, dtype=torch.int32)), "float32"),
    "sinks_shape": (lambda: _bad(sinks_ref=torch.zeros(1, 3)), "sinks shape"),
    "sinks_dtype": (lambda: _bad(sinks_ref=torch.zeros(1, 2, dtype=torch.int32)), "sinks dtype"),
    "scale_negative": (lambda: _bad(softmax_scale=-1.0), "softmax_scale"),
    "scale_bool": (lambda: _bad(softmax_scale=True), "softmax_scale"),
    "mixed_precision": (lambda: _bad(mixed_precision="yes"), "mixed_precision"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_validation_errors(case):
    from nki_attn import kernel_api
    from nki_attn.sim.trace import recording
    make, match = BAD_CASES[case]
    args = make()
    with pytest.raises(ValueError, match=match) as host:
        kernel_api.attention_fwd(**args)
    # Kernel code cannot raise: called directly, the kernel fails its assert with the same message, before it
    # emits any instruction.
    with recording() as rec, pytest.raises(AssertionError) as kernel:
        attention_fwd(**args)
    assert str(kernel.value) == str(host.value)
    assert rec.count() == 0


def test_kernel_api_launches_the_kernel_unchanged():
    from nki_attn import kernel_api
    q, k, v = make_qkv(bs=2, nheads=2, nheads_kv=1, sq=256, dtype=torch.bfloat16)
    want = attention_fwd[2](q, k, v, use_causal_mask=True)
    got = kernel_api.attention_fwd[2](q, k, v, use_causal_mask=True)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    with pytest.raises(TypeError):
        kernel_api.attention_fwd(q, k, v, no_such_argument=1)  # the kernel's own signature, checked on the host
