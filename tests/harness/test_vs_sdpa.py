"""The harness's second low-precision implementation: torch's SDPA math path in the row's dtype, its error and
our ratio to it on every 16-bit row, and the summary's worst ratio per output."""
import torch

from nki_attn.harness import cases, report, runner


def test_sdpa_in_the_row_dtype_is_a_bf16_computation_of_the_same_problem():
    # sinks as extra zero keys, packing and GQA through the mask and the kv-head sums: SDPA's bf16 error is that of
    # a computation in bf16 (above the output rounding's u / sqrt(3) ~ 2.3e-3 relative, below 4 u ~ 1.6e-2)
    for feature in ("sinks", "packing", "gqa", "causal"):
        case = cases.feature_case(feature, 256, 64, "bfloat16")
        ins = runner.make_inputs(case)
        ref = runner.reference(ins, case, torch.float64)
        got = runner.sdpa_low_precision(ins, case)
        for name in runner.SDPA_OUTPUTS:
            assert got[name].shape == ref[name].shape, (feature, name)
            rel = float((got[name].double() - ref[name]).norm() / ref[name].norm())
            assert 2.3e-3 < rel < 1.6e-2, (feature, name, rel)


def test_16_bit_rows_carry_the_ratio_and_the_summary_its_worst():
    rows = [runner.run_case(cases.feature_case(f, 256, 64, dt), runner.KernelCandidate())
            for f, dt in (("causal", "bfloat16"), ("softcap", "bfloat16"), ("causal", "float32"))]
    causal, softcap, f32 = rows
    for name in runner.SDPA_OUTPUTS:
        o = causal["outputs"][name]
        assert o["vs_sdpa"] == o["rel_fro"] / o["sdpa_rel_fro"]
        assert softcap["outputs"][name]["vs_sdpa"] is None  # SDPA has no soft-capping
        assert "vs_sdpa" not in f32["outputs"][name]
    worst = report.build(rows, {"candidate": "nki-kernels"})["summary"]["worst_vs_sdpa"]
    assert {k: v[0] for k, v in worst.items()} == {n: causal["outputs"][n]["vs_sdpa"] for n in runner.SDPA_OUTPUTS}
