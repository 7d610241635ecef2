"""The harness's own logic: broken candidates must fail, correct ones pass, and the determinism and drift checks
catch what they are for."""
import json

import pytest
import torch

from nki_attn.harness import cases, drift, report, runner, tolerance
from nki_attn.harness.determinism import check_determinism


class Wrapped:
    """A candidate delegating to the real kernels with a hook on the outputs / arguments."""

    def __init__(self, fwd_kwargs=None, bwd_post=None):
        self.inner = runner.KernelCandidate()
        self.fwd_kwargs = fwd_kwargs or (lambda kw: kw)
        self.bwd_post = bwd_post or (lambda res: res)

    def fwd(self, *a, **kw):
        return self.inner.fwd(*a, **self.fwd_kwargs(dict(kw)))

    def bwd(self, *a, **kw):
        return self.bwd_post(list(self.inner.bwd(*a, **self.fwd_kwargs(dict(kw)))))


def row(feature, dtype="bfloat16"):
    return cases.feature_case(feature, 256, 64, dtype)


@pytest.mark.parametrize("feature,dtype", [("causal", "bfloat16"), ("window", "bfloat16"), ("sinks", "float32")])
def test_correct_kernels_pass(feature, dtype):
    r = runner.run_case(row(feature, dtype), runner.KernelCandidate())
    assert r["pass"], r
    assert set(r["outputs"]) >= {"o", "lse", "dq", "dk", "dv"}


# The planted bugs, at every dtype (their margins, err / bound, are tabulated in docs/validation.md by
# scripts/bench.py planted-bugs)
@pytest.mark.parametrize("dtype", cases.DTYPES)
def test_dq_scaled_by_1_01_fails(dtype):
    def scale_dq(res):
        res[0] = res[0] * 1.01
        return res

    r = runner.run_case(row("causal", dtype), Wrapped(bwd_post=scale_dq))
    assert not r["pass"]
    assert not r["outputs"]["dq"]["ok"] and r["outputs"]["dk"]["ok"] and r["outputs"]["o"]["ok"]


@pytest.mark.parametrize("dtype", cases.DTYPES)
def test_window_off_by_one_fails(dtype):
    def widen(kw):
        kw["sliding_window"] = kw["sliding_window"] + 1
        return kw

    r = runner.run_case(row("window", dtype), Wrapped(fwd_kwargs=widen))
    assert not r["pass"] and not r["outputs"]["o"]["ok"]


@pytest.mark.parametrize("dtype", cases.DTYPES)
def test_dk_zero_fails(dtype):
    def zero_dk(res):
        res[1] = torch.zeros_like(res[1])
        return res

    r = runner.run_case(row("causal", dtype), Wrapped(bwd_post=zero_dk))
    assert not r["pass"] and not r["outputs"]["dk"]["ok"] and r["outputs"]["dq"]["ok"]


class ApiWrapped(runner.KernelCandidate):
    """The real kernels through the PyTorch API (rows of any length) with a hook on the outputs."""

    def __init__(self, post):
        super().__init__()
        self.post = post

    def run_api(self, ins, case):
        return self.post(super().run_api(ins, case))


def test_any_length_row_passes_and_catches_a_planted_bug():
    case = cases.feature_case("sinks", 300, 64, "bfloat16")
    assert case.via_api
    good = runner.run_case(case, runner.KernelCandidate())
    assert good["pass"], good
    assert good["outputs"]["o"]["n"] == 300 and good["outputs"]["dsinks"]["n"] == 300

    def scale_dq(out):
        out["dq"] = out["dq"] * 1.01
        return out

    bad = runner.run_case(case, ApiWrapped(scale_dq))
    assert not bad["pass"] and not bad["outputs"]["dq"]["ok"] and bad["outputs"]["dk"]["ok"]


@pytest.mark.parametrize("feature", ["causal", "packing", "unequal"])
def test_kernel_only_candidate_runs_any_length_rows_padded(feature):
    # a candidate without the API path (someone else's kernels) gets the problem padded to multiples of 128:
    # bounds hide the padded keys (a causal square row needs none), the padded query rows are cut away
    case = cases.feature_case(feature, 300, 64, "float32")
    bmin, bmax = runner.candidate_bounds(case, 384)
    assert (bmin is None) == (feature == "causal")
    if bmin is not None:
        assert bmax[300:].eq(case.seqlen_k).all() and bmax.max() <= case.seqlen_k  # padded keys never visible
    good = runner.run_case(case, Wrapped())
    assert good["pass"], good

    def scale_dq(res):
        res[0] = res[0] * 1.01
        return res

    bad = runner.run_case(case, Wrapped(bwd_post=scale_dq))
    assert not bad["pass"] and not bad["outputs"]["dq"]["ok"] and bad["outputs"]["dk"]["ok"]


def _plain_attention(ins, case):
    """Independent float64 reference on the UNPADDED problem: dense masked softmax with sink columns and torch
    autograd (nothing from golden/ or nki_attn)."""
    q, k, v, dy = (ins[n].to(torch.float64).clone().requires_grad_(n != "dy") for n in ("q", "k", "v", "dy"))
    group = case.heads // case.kv_heads
    kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = case.scale or case.d_head ** -0.5
    s = torch.einsum("bhdq,bhdk->bhqk", q, kr) * scale
    i = torch.arange(case.seqlen_q)[:, None]
    j = torch.arange(case.seqlen_k)[None, :]
    vis = torch.ones(case.seqlen_q, case.seqlen_k, dtype=torch.bool)
    if case.causal:
        vis &= j <= i
    if case.window:
        vis &= j > i - case.window
    if case.cu_seqlens:
        cu = torch.tensor(case.cu_seqlens)
        seq_i = torch.searchsorted(cu[1:], i.flatten(), right=True)
        seq_j = torch.searchsorted(cu[1:], j.flatten(), right=True)
        vis &= (seq_i[:, None] == seq_j[None, :]) & (i < cu[-1]) & (j < cu[-1])
    s = s.masked_fill(~vis, float("-inf"))
    sinks = None
    if ins["sinks"] is not None:
        sinks = ins["sinks"][0].to(torch.float64).clone().requires_grad_()
        col = sinks.reshape(case.heads, -1)[None, :, None, :].expand(*s.shape[:3], -1)
        s = torch.cat([s, col], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.where(torch.isinf(lse)[..., None], torch.zeros_like(s), torch.exp(s - lse[..., None]))
    o = torch.einsum("bhqk,bhdk->bhdq", p[..., :case.seqlen_k], vr)
    o.backward(dy)
    out = {"o": o.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    if sinks is not None:
        out["dsinks"] = sinks.grad.reshape(ins["sinks"].shape[1:])
    return out


@pytest.mark.parametrize("case", [
    cases.Case("gqa-sinks-window", batch=1, heads=4, kv_heads=2, seqlen_q=300, seqlen_k=300, d_head=32,
               dtype="float32", causal=True, window=77, num_sinks=2),
    cases.Case("packed-gap", batch=1, heads=2, kv_heads=2, seqlen_q=200, seqlen_k=200, d_head=32,
               dtype="bfloat16", causal=True, num_sinks=1, cu_seqlens=(0, 70, 70, 150)),
    cases.Case("unequal", batch=2, heads=2, kv_heads=1, seqlen_q=130, seqlen_k=301, d_head=64, dtype="float16",
               scale=0.3),
], ids=lambda c: c.name)
def test_any_length_reference_is_the_unpadded_problem(case):
    ins = runner.make_inputs(case)
    ref = runner.reference(ins, case, torch.float64)
    plain = _plain_attention(ins, case)
    assert set(ref) == set(plain)
    for name in ref:
        assert ref[name].shape == plain[name].shape, name
        fin = torch.isfinite(plain[name])
        assert torch.equal(fin, torch.isfinite(ref[name])), name
        torch.testing.assert_close(ref[name][fin], plain[name][fin], rtol=1e-10, atol=1e-12, msg=name)


def test_crash_is_a_failing_row():
    def boom(res):
        raise RuntimeError("kernel exploded")

    r = runner.run_case(row("plain"), Wrapped(bwd_post=boom))
    assert not r["pass"] and "kernel exploded" in r["error"]


def test_tolerance_rules():
    ref = torch.linspace(-1, 1, 100, dtype=torch.float64).numpy()
    base = ref + 1e-3
    # bound = K * baseline error + (FLOOR + sqrt(n) * 2^-24) * max|ref| (max|ref| = 1 here), written out
    bound = 2.0 * 1e-3 + 2.0 ** -9 + 16 * 2.0 ** -24
    assert tolerance.compare("x", ref + 0.99 * bound, ref, base, "bfloat16", n=256)["ok"]
    assert not tolerance.compare("x", ref + 1.01 * bound, ref, base, "bfloat16", n=256)["ok"]
    assert tolerance.compare("x", ref, ref, base, "bfloat16", n=256)["bound"] == pytest.approx(bound)
    # the seed's band (fp32: 1e-5 + 1e-4 * max|ref| = 1.1e-4) is reported, not judged: with a baseline error of
    # 2e-5 rule 1 allows 10 * 2e-5 + (4 + 16) * 2^-24 = 2.01e-4, and an error of 1.5e-4, over the band, passes
    c = tolerance.compare("x", ref + 1.5e-4, ref, ref + 2e-5, "float32", n=256)
    assert c["ok"] and not c["band_ok"] and c["band_bound"] == pytest.approx(1.1e-4)
    # +inf reference rows must be +inf in the candidate too
    r2 = ref.copy()
    r2[3] = float("inf")
    g2 = r2.copy()
    g2[3] = 5.0
    assert tolerance.compare("lse", g2, r2, r2, "float32")["nonfinite"] == 1


def test_systematic_error_rule():
    # reference blocks [1, 2, -1, -2] (max|ref| = 2); the baseline's error 0.01 * [1, -0.5, 1, -0.5] is
    # orthogonal to them (projection 0): rule 1 allows 2 * 0.01 + (2^-9 + 16 * 2^-24) * 2 = 0.0239
    import numpy as np
    ref = np.tile([1.0, 2.0, -1.0, -2.0], 64)
    base = ref + 0.01 * np.tile([1.0, -0.5, 1.0, -0.5], 64)
    floor = 2.0 ** -9 + 16 * 2.0 ** -24
    # a gradient scaled by 1.005: error 0.01, inside rule 1, but its projection 0.005 is past rule 2's bound,
    # which here is rule 1's relative floor alone (no noise, baselines without a systematic part)
    c = tolerance.compare("x", 1.005 * ref, ref, base, "bfloat16", n=256)
    assert c["max_abs"] <= c["bound"] and c["proj"] == pytest.approx(0.005) and c["proj_sigma"] < 1e-12
    assert c["proj_bound"] == pytest.approx(floor) and not c["proj_ok"] and not c["ok"]
    # the baseline's own error pattern, twice over: as large, no systematic part, passes both rules
    c = tolerance.compare("x", 2 * base - ref, ref, base, "bfloat16", n=256)
    assert c["ok"] and abs(c["proj"]) < 1e-12
    # a scaling below the floor is what rule 1's floor excuses anyway: passes
    assert tolerance.compare("x", 1.0015 * ref, ref, base, "bfloat16", n=256)["proj_ok"]
    # a baseline with a systematic part of its own widens the bound by K times it
    c = tolerance.compare("x", 1.005 * ref, ref, 1.002 * ref, "bfloat16", n=256)
    assert c["proj_base"] == pytest.approx(0.002) and c["proj_bound"] == pytest.approx(2 * 0.002 + floor)
    assert c["proj_ok"]


def test_projection_noise_counts_vectors_not_elements():
    import numpy as np
    # two vectors (rows); the first one's error has no component along the reference: c = 0
    ref, err = np.array([[1.0, 1.0], [1.0, -1.0]]), np.array([[0.1, -0.1], [0.0, 0.0]])
    c, sigma, n_eff = tolerance.projection(err, ref)
    # as 4 independent elements: sum e^2 r^2 = 0.02, n_eff = 4^2 / 4 = 4, sigma = sqrt(0.02 * 4 / 3) / <r, r>
    assert c == 0.0 and n_eff == pytest.approx(4.0) and sigma == pytest.approx(np.sqrt(0.02 * 4 / 3) / 4)
    # as 2 vectors whose elements share their errors: sum ||e_v||^2 ||r_v||^2 = 0.02 * 2, n_eff = 16 / 8 = 2
    c, sigma, n_eff = tolerance.projection(err, ref, vec_axis=1)
    assert n_eff == pytest.approx(2.0) and sigma == pytest.approx(np.sqrt(0.04 * 2 / 1) / 4)
    # sigma measures the noise around the fitted scaling, not the scaling itself
    c, sigma, _ = tolerance.projection(0.01 * ref, ref, vec_axis=1)
    assert c == pytest.approx(0.01) and sigma == pytest.approx(0.0, abs=1e-15)
    # one vector: a scaling explains any error, so there is no noise to measure it against
    assert tolerance.projection(np.array([0.1]), np.array([1.0]))[1] == float("inf")
    assert tolerance.projection(np.ones(3), np.zeros(3)) == (0.0, 0.0, 0.0)  # no reference: nothing to project on
    # rule 2 applies from SYS_LAMBDA^2 = 25 effective vectors on: a single dsinks value is judged by rule 1 alone
    single = tolerance.compare("dsinks", [1.1], [1.0], [1.0], "float32", n=2048)
    assert not single["proj_applies"] and not single["ok"] and single["max_abs"] > single["bound"]


def test_floor_follows_the_reduction_length():
    # a float32 dsinks row of the full preset: a baseline 17x below the kernel's error (its summation order was
    # lucky) made 10 x baseline + 4u max|ref| too tight on another CPU (error 1.15e-6 against 1.04e-6). The
    # reduction over 2048 query rows gives sqrt(2048) * 2^-24 * max|ref| of floor, whatever the baseline.
    ref = torch.linspace(-2.68, 2.68, 2048, dtype=torch.float64).numpy()
    base = ref + 3.96e-8
    got = ref + 1.15e-6
    old_bound = 10 * 3.96e-8 + 2.0 ** -22 * 2.68  # the rule before: no reduction length
    assert 1.15e-6 > old_bound
    c = tolerance.compare("dsinks", got, ref, base, "float32", n=2048)
    assert c["ok"] and c["max_abs"] / c["bound"] < 0.2
    # the length term uses float32's roundoff for every dtype: for bf16 it is tiny next to the dtype's floor
    assert tolerance.floor_rel("bfloat16", 16384) < 1.1 * 2.0 ** -9


def test_dsinks_input_floor():
    # terms t[i, d] = P_sink[i] * O[d, i] * dO[d, i]: P_sink = exp(0 - [0, log 2]) = [1, 0.5], O * dO = [3, 2]
    import math
    import numpy as np
    o, dy = np.array([[[[1.0, 2.0]]]]), np.array([[[[3.0, 1.0]]]])
    lse = np.array([[[0.0, math.log(2.0)]]])
    scale = tolerance.dsinks_input_scale(o, lse, np.zeros((1, 1)), dy)
    assert scale == pytest.approx(math.sqrt(3.0 ** 2 + 1.0 ** 2))
    # a batch of two identical problems whose dsinks sums over the batch (the API's shared sinks): sqrt(2) x
    two = tolerance.dsinks_input_scale(np.concatenate([o, o]), np.concatenate([lse, lse]), np.zeros((2, 1)),
                                       np.concatenate([dy, dy]), over_batch=True)
    assert two == pytest.approx(math.sqrt(2) * scale)
    # the bfloat16 1000-token sinks row: dsinks cancelled to 0.0028, terms of 2-norm 5.06; the kernels' error
    # 0.0157 is 140 times the baseline's (1.1e-4) but inside the derived input floor 4 u 5.06 = 0.079
    c = tolerance.compare("dsinks", [-0.0185], [-0.0028], [-0.0029], "bfloat16", n=1000, input_scale=5.06)
    assert c["input_floor"] == pytest.approx(4 * 2.0 ** -8 * 5.06) and c["ok"]
    assert not tolerance.compare("dsinks", [-0.0185], [-0.0028], [-0.0029], "bfloat16", n=1000)["ok"]


def test_reduction_lengths():
    n = tolerance.reduction_lengths(cases.feature_case("gqa", 1024, 64, "bfloat16", heads=2))  # 8 q heads, 2 kv
    assert (n["o"], n["dq"], n["dk"], n["dv"]) == (1024, 1024, 4 * 1024, 4 * 1024)
    w = tolerance.reduction_lengths(cases.feature_case("window", 1024, 64, "bfloat16"))  # window 259
    assert w["o"] == w["dk"] == 259
    s = tolerance.reduction_lengths(cases.feature_case("sinks2", 1024, 64, "float32"))
    assert s["dsinks"] == 1024 and s["lse"] == 1026
    p = tolerance.reduction_lengths(cases.feature_case("packing", 300, 64, "float32"))  # sequences 95, 155, 50
    assert p["o"] == p["dv"] == 155


@pytest.mark.parametrize("dtype", cases.DTYPES)
def test_determinism_catches_a_noisy_candidate(dtype):
    case = row("causal", dtype)
    seen = []
    ok = check_determinism(case, runs=3, compare_lnc=dtype == "float32", progress=seen.append)
    assert ok["pass"] and ok["identical_runs"] == 3
    assert len(seen) == 3 + (dtype == "float32")  # one progress line per run (+ the LNC2 comparison)
    if dtype == "float32":
        assert ok["lnc2_equal"] is True

    calls = {"n": 0}

    def jitter(res):
        calls["n"] += 1
        # one unit in the last place of dq on every other run
        res[0] = torch.nextafter(res[0], torch.full_like(res[0], float("inf"))) if calls["n"] % 2 else res[0]
        return res

    bad = check_determinism(case, runs=3, candidate=Wrapped(bwd_post=jitter), compare_lnc=False)
    assert not bad["pass"] and bad["identical_runs"] < 3


class _WrongDk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        with torch.enable_grad():
            q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k, v))
            out = drift.reference_attention(q_, k_, v_)
        ctx.save_for_backward(q_, k_, v_, out)
        return out.detach()

    @staticmethod
    def backward(ctx, do):
        q_, k_, v_, out = ctx.saved_tensors
        dq, dk, dv = torch.autograd.grad(out, (q_, k_, v_), do)
        return dq, torch.zeros_like(dk), dv  # a kernel that forgets to write dK


def test_drift_passes_kernels_and_catches_a_wrong_gradient(tmp_path):
    seen = []
    good = drift.check_drift(steps=20, out_dir=str(tmp_path), progress=seen.append)
    assert good["pass"], good
    assert len(seen) == 2 * len(drift.progress_steps(20)) and "step 20/20" in seen[-1]
    saved = json.loads((tmp_path / "drift.json").read_text())
    assert len(saved["loss_candidate"]) == 20 == len(saved["loss_reference"])
    bad = drift.check_drift(steps=150, out_dir=str(tmp_path), attn=_WrongDk.apply)
    assert not bad["pass"], bad


def test_report_json_and_table(tmp_path):
    rows = [runner.run_case(row("plain", "float32"), runner.KernelCandidate())]
    rep = report.build(rows, {"backend": "sim"})
    path = tmp_path / "r.json"
    report.write(rep, str(path))
    back = json.loads(path.read_text())
    assert back["summary"]["pass"] and back["summary"]["rows"] == 1
    assert back["machine"]["cpu_model"] and "torch" in back["machine"]["blas"] and "numpy" in back["machine"]["blas"]
    assert back["rows"][0]["outputs"]["dq"]["n"] == 256
    assert "PASS" in report.table(rep)


def test_quick_preset_covers_every_feature_dtype_and_d_head():
    rows = cases.quick()
    assert {r.dtype for r in rows} == set(cases.DTYPES)
    assert {r.d_head for r in rows} >= {64, 96, 128, 256}
    names = {r.name.split("-")[0] for r in rows}
    assert names >= set(cases.FEATURES)
