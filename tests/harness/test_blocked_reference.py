"""The golden and the baselines run in blocks of query rows (``runner.query_block_rows``) to bound a long row's
memory. Blocked and unblocked runs must give the same numbers: here every variant family of the harness, with
the block budget forced down to one 128-row block (``NKI_ATTN_GOLDEN_BLOCK_MIB``), against the same row in one
block.

The bound. Both runs do the same floating-point operations on every element except the order of the sums over
query rows (dk, dv, dsinks, a parameter's gradient, dk's residue sums: per block, then over the blocks) and the
order BLAS picks inside a dot product for a block's shape. Two orders of a sum of n terms x_t each lie within
gamma_n * sum|x_t| of the exact sum, gamma_n = n u / (1 - n u) (Higham, "Accuracy and Stability of Numerical
Algorithms", 2nd ed., eq. 4.4), so they differ by at most 2 gamma_n * sum|x_t| <= 2 gamma_n * n * max|x_t|. With
this file's N(0, 1) inputs the terms are no larger than the outputs they add up to (a term is a probability
times an input, or dS times an input, and |dS| <= P (|dP| + |D|)), so max|x_t| <= max|X| and the bound is
``2 gamma_n n max|X|`` with n the row's longest reduction (group * seqlen_q + seqlen_k + d: every sum is
shorter) and u the unit roundoff of the dtype the sums run in (float64 for the reference and the residue,
float32 for the inputs baseline). A golden baseline in a 16-bit dtype rounds its dk and dv once after the
float32 sums, so a float32 difference can flip that rounding: one unit in the last place of the 16-bit dtype,
2 u_dt max|X|, on top.

A planted mistake (a block given the whole problem's diagonal offset) must exceed the bound by far."""
import pytest
import torch

from golden import attention_fwd_torch as gf
from nki_attn.harness import cases, runner

U = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
SEQ = 384  # three blocks of 128 rows
TINY = "1e-9"  # MiB: every block at the 128-row minimum


def _rows():
    """Every feature of the presets at 384 tokens (d 32; odd_head_dim keeps its 199), two dtypes for the
    dtype baseline, and two rows through the API's padding path (300 tokens: a last block of 44 rows)."""
    rows = [cases.feature_case(f, SEQ, 32, "bfloat16") for f in cases.FEATURES]
    rows += [cases.feature_case(f, SEQ, 32, dt) for f, dt in (("causal", "float32"), ("sinks", "float16"),
                                                              ("softcap", "float16"), ("bias", "float32"))]
    rows += [cases.feature_case(f, 300, 32, "bfloat16") for f in ("packing_causal", "local", "causal_sq_lt_sk")]
    return rows


ROWS = _rows()
# the default run checks one row of each family (masks and windows, packing and empty rows, sinks, GQA, dropout,
# each score modification, d_qk != d_v, a block mask, an API row); the rest run with -m slow
DEFAULT = {"causal_sq_gt_sk-s384-d32-bfloat16", "packing_causal-s300-d32-bfloat16", "sinks2-s384-d32-bfloat16",
           "dropout_causal-s384-d32-bfloat16", "bias-s384-d32-bfloat16", "logit_scale-s384-d32-bfloat16",
           "alibi_causal-s384-d32-bfloat16", "dqk_dv-s384-d32-bfloat16", "mask_document-s384-d32-bfloat16",
           "local-s300-d32-bfloat16"}


def _n(case):
    return case.heads // case.kv_heads * case.seqlen_q + case.seqlen_k + case.num_sinks + max(case.d_head, case.dv)


def _bound(n, u, ref):
    gamma = n * u / (1 - n * u)
    return 2 * gamma * n * float(ref.abs().max()) if ref.numel() else 0.0


def _both(fn, monkeypatch):
    monkeypatch.delenv(runner.BLOCK_MIB_ENV, raising=False)
    whole = fn()
    monkeypatch.setenv(runner.BLOCK_MIB_ENV, TINY)
    return whole, fn()


def _same(whole, blocked, n, u, extra_u=0.0):
    assert whole.keys() == blocked.keys()
    for name in whole:
        a, b = whole[name], blocked[name]
        if not isinstance(a, torch.Tensor):
            assert b == pytest.approx(a, rel=4 * n * n * u, abs=0.0), name
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, name
        a64, b64 = a.to(torch.float64), b.to(torch.float64)
        fin = torch.isfinite(a64)
        assert torch.equal(fin, torch.isfinite(b64)) and torch.equal(a64[~fin], b64[~fin]), name  # inf rows alike
        bound = _bound(n, u, a64[fin]) + 2 * extra_u * (float(a64[fin].abs().max()) if a64[fin].numel() else 0.0)
        diff = float((a64[fin] - b64[fin]).abs().max()) if a64[fin].numel() else 0.0
        assert diff <= bound, (name, diff, bound)


def test_blocks_are_what_the_budget_gives(monkeypatch):
    monkeypatch.delenv(runner.BLOCK_MIB_ENV, raising=False)
    # the presets' rows up to 4096 tokens (one head) are one block; 16K tokens are 2048-row blocks
    assert runner.query_block_rows(1, 1, 4096, 4096) == 4096
    assert runner.query_block_rows(1, 1, 16384, 16384) == 2048
    assert runner.query_block_rows(1, 1, 300, 300) == 300
    monkeypatch.setenv(runner.BLOCK_MIB_ENV, TINY)
    assert runner.query_block_rows(1, 1, 384, 384) == 128
    assert [(r.start, r.stop) for r in runner._row_blocks(1, 1, 300, 300)] == [(0, 128), (128, 256), (256, 300)]
    for bad in ("0", "-1", "nan", "inf", "lots"):
        monkeypatch.setenv(runner.BLOCK_MIB_ENV, bad)
        with pytest.raises(ValueError, match=runner.BLOCK_MIB_ENV):
            runner.block_mib()


@pytest.mark.parametrize("case", [c if c.name in DEFAULT else pytest.param(c, marks=pytest.mark.slow) for c in ROWS],
                         ids=lambda c: c.name)
def test_blocked_reference_and_baselines_match_one_block(case, monkeypatch):
    ins = runner.make_inputs(case)
    n = _n(case)
    ref, ref_b = _both(lambda: runner.reference(ins, case, torch.float64), monkeypatch)
    _same(ref, ref_b, n, U[torch.float64])
    base, base_b = _both(lambda: runner.reference(ins, case, None), monkeypatch)
    _same(base, base_b, n, U[torch.float32], U[runner._TORCH[case.dtype]])
    inp, inp_b = _both(lambda: runner.inputs_baseline(ins, ref, case), monkeypatch)
    _same(inp, inp_b, n, U[torch.float32])
    res, res_b = _both(lambda: runner.residue_scales(ins, ref, case), monkeypatch)
    _same(res, res_b, n, U[torch.float64])
    for name in ("dq", "dk"):
        zs, zs_b = _both(lambda: runner.zero_scale(name, ins, case, 100), monkeypatch)
        assert zs_b == pytest.approx(zs, rel=4 * case.d_head * U[torch.float64], abs=0.0)


def test_a_wrong_block_offset_is_far_outside_the_bound(monkeypatch):
    """The check above can fail: blocks that keep the whole problem's diagonal offset (every block masked as if
    it were the last rows) give a reference off by far more than the bound."""
    case = cases.feature_case("alibi_causal", SEQ, 32, "bfloat16")
    ins = runner.make_inputs(case)
    ref, _ = _both(lambda: runner.reference(ins, case, torch.float64), monkeypatch)
    real = gf.block_offset
    monkeypatch.setattr(gf, "block_offset", lambda sq, sk, q_start=0, k_start=0: real(sq, sk))
    bent = runner.reference(ins, case, torch.float64)
    diff = float((bent["o"] - ref["o"]).abs().max())
    assert diff > 1e6 * _bound(_n(case), U[torch.float64], ref["o"])
