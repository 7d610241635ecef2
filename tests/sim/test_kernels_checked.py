"""The project's own kernels under every checking mode: strict (no uninitialised reads, outputs fully written),
capacity (SBUF bytes per partition and PSUM banks within the target's limits, per core), the NKI frontend check
(no construct the compiler refuses, in any kernel, including code never run) and, under LNC2, no two cores
writing one HBM region. The results are compared loosely with the float64 golden; the precise accuracy criteria
live in tests/kernels/.
"""
import importlib

import numpy as np
import pytest
import torch

import nki_attn.sim as sim


def _kernel(module, name):
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        pytest.skip(f"{module} is not importable yet ({exc})")
    if not hasattr(mod, name):
        pytest.skip(f"{module} does not define {name} yet")
    return getattr(mod, name)


@pytest.fixture(autouse=True)
def _trn2(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")


def _np(x):
    import ml_dtypes
    x = x.detach().contiguous()
    return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if x.dtype == torch.bfloat16 else x.numpy()


def _close(got, ref, dtype):
    got = np.asarray(got).astype(np.float64)
    ref = ref.detach().to(torch.float64).numpy() if isinstance(ref, torch.Tensor) else np.asarray(ref, np.float64)
    fin = np.isfinite(ref)
    assert np.array_equal(np.isfinite(got), fin)
    rtol = 2e-2 if dtype == "bfloat16" else 1e-4
    scale = max(float(np.abs(ref[fin]).max()), 1.0)
    assert float(np.abs(got[fin] - ref[fin]).max()) <= rtol * scale


def _checked(fn, *args, lnc=None, **kwargs):
    kern = fn if lnc is None else fn[lnc]
    with sim.checking(strict=True, capacity=True, frontend="full"):
        out = kern(*args, **kwargs)
    stats = sim.last_launch_stats()
    assert stats.strict and stats.capacity_checked and stats.frontend == "full"
    assert 0 < stats.peak_sbuf_bytes <= stats.sbuf_capacity_bytes and stats.peak_psum_banks <= 8
    return out


def test_demo_matmul_exp_checked(rng):
    matmul_exp = _kernel("nki_attn.kernels.demo", "matmul_exp")
    a = rng.standard_normal((128, 256)).astype(np.float32) * 0.1
    b = rng.standard_normal((128, 512)).astype(np.float32) * 0.1
    out = _checked(matmul_exp, a, b, scale=0.5)
    np.testing.assert_allclose(out, np.exp(0.5 * (a.astype(np.float64).T @ b)), rtol=1e-5)


FWD_CASES = [
    dict(bs=1, h=1, hk=1, d=64, sq=512, dtype="float32", causal=True, window=None, lnc=None),
    dict(bs=1, h=4, hk=2, d=128, sq=256, dtype="bfloat16", causal=True, window=100, lnc=None),
    dict(bs=1, h=2, hk=2, d=64, sq=384, dtype="bfloat16", causal=False, window=None, lnc=2),
]


def _qkv(bs, h, hk, d, sq, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    tdt = getattr(torch, dtype)
    return [torch.randn(*s, generator=g).to(tdt) for s in ((bs, h, d, sq), (bs, hk, d, sq), (bs, hk, d, sq))]


@pytest.mark.parametrize("case", FWD_CASES, ids=lambda c: f"{c['dtype']}-h{c['h']}/{c['hk']}-sq{c['sq']}-lnc{c['lnc']}")
def test_attention_fwd_checked(case):
    attention_fwd = _kernel("nki_attn.kernels.attention_fwd", "attention_fwd")
    from golden import attention_fwd_torch_ref
    q, k, v = _qkv(case["bs"], case["h"], case["hk"], case["d"], case["sq"], case["dtype"])
    opts = dict(use_causal_mask=case["causal"], sliding_window=case["window"])
    o, lse = _checked(attention_fwd, _np(q), _np(k), _np(v), lnc=case["lnc"], mixed_precision=True, **opts)
    o_ref, lse_ref = attention_fwd_torch_ref(q.double(), k.double(), v.double(), **opts)
    _close(o, o_ref, case["dtype"])
    _close(lse, lse_ref, "float32" if case["dtype"] == "float32" else "bfloat16")


BWD_CASES = [
    dict(bs=1, h=1, hk=1, d=64, sq=256, dtype="float32", causal=True, window=None, sinks=0, lnc=None),
    dict(bs=1, h=2, hk=1, d=64, sq=256, dtype="bfloat16", causal=True, window=130, sinks=1, lnc=None),
    dict(bs=1, h=2, hk=2, d=128, sq=256, dtype="float32", causal=False, window=None, sinks=0, lnc=2),
]


@pytest.mark.parametrize("case", BWD_CASES, ids=lambda c: f"{c['dtype']}-h{c['h']}/{c['hk']}-sq{c['sq']}-lnc{c['lnc']}")
def test_attention_bwd_checked(case):
    attention_bwd = _kernel("nki_attn.kernels.attention_bwd", "attention_bwd")
    from golden import attention_bwd_torch_ref, attention_fwd_torch_ref
    tdt = getattr(torch, case["dtype"])
    q, k, v = _qkv(case["bs"], case["h"], case["hk"], case["d"], case["sq"], case["dtype"], seed=1)
    dy = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(tdt)
    sinks = torch.randn(case["bs"], case["h"], generator=torch.Generator().manual_seed(3)).to(tdt) \
        if case["sinks"] else None
    opts = dict(use_causal_mask=case["causal"], sliding_window=case["window"])
    o, lse = attention_fwd_torch_ref(q.double(), k.double(), v.double(),
                                     sinks_ref=None if sinks is None else sinks.double(), **opts)
    extra = {} if sinks is None else {"sinks_ref": _np(sinks)}
    out = _checked(attention_bwd, _np(q), _np(k), _np(v), _np(o.to(tdt)), _np(dy), _np(lse.to(torch.float32)),
                   lnc=case["lnc"], mixed_precision=True, **opts, **extra)
    ref = attention_bwd_torch_ref(q.double(), k.double(), v.double(), o, dy.double(), lse,
                                  sinks_ref=None if sinks is None else sinks.double(), **opts)
    names = ["out_dq_ref", "out_dk_ref", "out_dv_ref", "out_dsinks_ref"]
    assert len(out) == (4 if sinks is not None else 3)
    for got, name in zip(out, names):
        _close(got, ref[name], case["dtype"])


# ------------------------------------------------------------------------------------------- NKI frontend
def _project_kernels():
    import pkgutil

    import nki_attn.kernels
    from nki_attn.sim.runtime import Kernel
    found = {}
    for info in pkgutil.iter_modules(nki_attn.kernels.__path__):
        mod = importlib.import_module(f"nki_attn.kernels.{info.name}")
        for name, obj in vars(mod).items():
            if isinstance(obj, Kernel) and obj.fn.__module__ == mod.__name__:
                found[f"{info.name}.{name}"] = obj
    return found


def test_every_project_kernel_passes_the_frontend_gathering():
    from nki_attn.sim import frontend
    kernels = _project_kernels()
    assert {"attention_fwd.attention_fwd", "attention_bwd.attention_bwd", "demo.matmul_exp"} <= set(kernels)
    for name, k in kernels.items():
        g = frontend.check_kernel(k)  # raises NkiFrontendError listing every refused construct
        assert not g.problems, name
    # the gathering reaches the validation, tiling and config code, not just the kernel function
    names = {d.name for d in frontend.gather(kernels["attention_bwd.attention_bwd"]).definitions}
    # (and the score modifications' table: its rows' classes and the step functions they name)
    assert {"attention_problem", "attention_band", "band_tile_visible", "BwdConfig", "AttentionShape",
            "_bwd_problem", "ScoreMod", "ModSteps", "_ds_logit_scale", "_ds_bias"} <= names


@pytest.mark.parametrize("frontend", ["full", "gather", "off"])
@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("capacity", [True, False])
def test_kernels_in_every_checking_mode(frontend, strict, capacity):
    attention_fwd = _kernel("nki_attn.kernels.attention_fwd", "attention_fwd")
    attention_bwd = _kernel("nki_attn.kernels.attention_bwd", "attention_bwd")
    q, k, v = _qkv(1, 2, 1, 64, 256, "bfloat16", seed=4)
    dy = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    args = [_np(x) for x in (q, k, v)]
    with sim.checking(strict=strict, capacity=capacity, frontend=frontend):
        o, lse = attention_fwd(*args, use_causal_mask=True, sliding_window=100)
        stats = sim.last_launch_stats()
        assert (stats.strict, stats.capacity_checked, stats.frontend) == (strict, capacity, frontend)
        out = attention_bwd[2](*args, o, _np(dy), lse, use_causal_mask=True, sliding_window=100,
                               mixed_precision=True, k_section_len=128)
    from golden import attention_bwd_torch_ref, attention_fwd_torch_ref
    opts = dict(use_causal_mask=True, sliding_window=100)
    o_ref, lse_ref = attention_fwd_torch_ref(q.double(), k.double(), v.double(), **opts)
    _close(o, o_ref, "bfloat16")
    ref = attention_bwd_torch_ref(q.double(), k.double(), v.double(), o_ref, dy.double(), lse_ref, **opts)
    for got, name in zip(out, ["out_dq_ref", "out_dk_ref", "out_dv_ref"]):
        _close(got, ref[name], "bfloat16")
