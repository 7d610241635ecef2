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


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_dq_scaled_by_1_01_fails(dtype):
    def scale_dq(res):
        res[0] = res[0] * 1.01
        return res

    r = runner.run_case(row("causal", dtype), Wrapped(bwd_post=scale_dq))
    assert not r["pass"]
    assert not r["outputs"]["dq"]["ok"] and r["outputs"]["dk"]["ok"] and r["outputs"]["o"]["ok"]


def test_window_off_by_one_fails():
    def widen(kw):
        kw["sliding_window"] = kw["sliding_window"] + 1
        return kw

    r = runner.run_case(row("window"), Wrapped(fwd_kwargs=widen))
    assert not r["pass"] and not r["outputs"]["o"]["ok"]


def test_crash_is_a_failing_row():
    def boom(res):
        raise RuntimeError("kernel exploded")

    r = runner.run_case(row("plain"), Wrapped(bwd_post=boom))
    assert not r["pass"] and "kernel exploded" in r["error"]


def test_tolerance_rules():
    ref = torch.linspace(-1, 1, 100, dtype=torch.float64).numpy()
    base = ref + 1e-3
    # bound = K * baseline error + FLOOR * max|ref| (max|ref| = 1 here), written out from the table
    bound = 2.0 * 1e-3 + 2.0 ** -9
    assert tolerance.compare("x", ref + 0.99 * bound, ref, base, "bfloat16")["ok"]
    assert not tolerance.compare("x", ref + 1.01 * bound, ref, base, "bfloat16")["ok"]
    # the fp32 band (1e-5 + 1e-4 * max|ref|) is required where the baseline meets it. At max|ref| = 100 the
    # band is 0.01001: a baseline error of 9e-3 meets it, so a candidate error of 0.05 -- inside rule 1's
    # 10 * 9e-3 + floor -- still fails on the band
    big = ref * 100
    c = tolerance.compare("x", big + 0.05, big, big + 9e-3, "float32")
    assert c["max_abs"] <= c["bound"] and c["band_required"] and not c["band_ok"] and not c["ok"]
    # where the baseline misses the band, the band is not required and rule 1 decides
    c2 = tolerance.compare("x", big + 0.05, big, big + 0.02, "float32")
    assert not c2["band_required"] and c2["ok"]
    # the band is normwise: an error of 5e-5 on an element near 0 is fine when max|ref| = 1 (band 1.1e-4)
    c3 = tolerance.compare("x", ref + 5e-5, ref, ref + 1e-5, "float32")
    assert c3["band_required"] and c3["band_ok"] and c3["ok"]
    # +inf reference rows must be +inf in the candidate too
    r2 = ref.copy()
    r2[3] = float("inf")
    g2 = r2.copy()
    g2[3] = 5.0
    assert tolerance.compare("lse", g2, r2, r2, "float32")["nonfinite"] == 1


def test_determinism_catches_a_noisy_candidate():
    case = row("causal", "float32")
    ok = check_determinism(case, runs=3)
    assert ok["pass"] and ok["identical_runs"] == 3 and ok["lnc2_equal"] is True

    calls = {"n": 0}

    def jitter(res):
        calls["n"] += 1
        res[0] = res[0] + (calls["n"] % 2) * 1e-7 * res[0].sign()
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
    good = drift.check_drift(steps=20, out_dir=str(tmp_path))
    assert good["pass"], good
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
    assert "PASS" in report.table(rep)


def test_quick_preset_covers_every_feature_dtype_and_d_head():
    rows = cases.quick()
    assert {r.dtype for r in rows} == set(cases.DTYPES)
    assert {r.d_head for r in rows} >= {64, 96, 128, 256}
    names = {r.name.split("-")[0] for r in rows}
    assert names >= set(cases.FEATURES)
