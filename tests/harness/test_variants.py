"""The attention variants in the harness: their rows and model rows, the reference formulas the tolerances are
derived from, and planted bugs in each variant that the harness must catch."""
import dataclasses
import math

import pytest
import torch

from nki_attn.harness import cases, runner, tolerance


class Bent:
    """The real kernels with the keywords of the forward and of the backward each passed through a hook."""

    def __init__(self, fwd_kw=None, bwd_kw=None):
        self.inner = runner.KernelCandidate()
        self.fwd_kw = fwd_kw or (lambda kw: kw)
        self.bwd_kw = bwd_kw or (lambda kw: kw)

    def fwd(self, *a, **kw):
        return self.inner.fwd(*a, **self.fwd_kw(dict(kw)))

    def bwd(self, *a, **kw):
        return self.inner.bwd(*a, **self.bwd_kw(dict(kw)))


def row(feature, dtype="bfloat16"):
    return cases.feature_case(feature, 256, 64, dtype)


# ------------------------------------------------------------------------------------------------ rows and presets
def test_model_rows_carry_the_variants():
    rows = {r.name.rsplit("-s", 1)[0]: r for r in cases.models()}
    g = rows["gemma2-9b-swa"]
    assert (g.d_head, g.softcap, g.causal, g.heads, g.kv_heads) == (256, 50.0, True, 16, 8)
    assert g.window and "window scaled from 4096" in g.note
    m = rows["deepseek-v3-mla-tp8"]
    assert (m.d_head, m.dv, m.causal) == (192, 128, True) and "heads scaled from 128" in m.note
    mb = rows["modernbert-large-local"]
    assert (mb.window_size, mb.causal, mb.d_head) == ((64, 64), False, 64) and "seqlen scaled" in mb.note
    b = rows["bloom-7b1-alibi"]
    assert b.alibi == "bloom" and b.causal and b.heads == 32
    bert = rows["bert-base-dropout"]
    assert (bert.dropout, bert.d_head, bert.causal, bert.heads) == (0.1, 64, False, 12)
    assert all(r.dtype == "bfloat16" and r.seqlen_q <= 4096 for r in rows.values())


def test_quick_preset_has_every_variant():
    names = {r.name.split("-")[0] for r in cases.quick()}
    assert names >= set(cases.VARIANT_FEATURES)
    assert cases.select("quick", features=["local"])  # usable as --features


def test_harness_mods_declare_every_score_modification_once():
    """One ``mods.HARNESS_MODS`` row per row of ``spec.SCORE_MODS``, same names, same order; the Case fields, the
    preset features, the gradient terms and the profiler's --features entries come from it."""
    from nki_attn import spec
    from nki_attn.harness import mods
    from nki_attn.profiler import cli as pcli
    assert [m.name for m in mods.HARNESS_MODS] == [m.name for m in spec.SCORE_MODS]
    fields = {f.name: f.default for f in dataclasses.fields(cases.Case)}
    for m in mods.HARNESS_MODS:
        assert m.name in fields and fields[m.name] == m.off and not m.off
        assert set(m.features) <= set(cases.VARIANT_FEATURES)
        assert pcli.FEATURES[m.name] == m.profile
        on = row(next(iter(m.features)))
        assert getattr(on, m.name) and m.label(on) in on.features
        assert (m.draw is None) == (not spec.MODS[m.name].is_tensor)
    for m in spec.GRAD_MODS:  # every gradient output has a derived reduction length
        case = row(next(iter(mods.HMODS[m.name].features)))
        assert "d" + m.name in tolerance.reduction_lengths(case)
    # the import-time check refuses a table that reorders or skips a row
    with pytest.raises(ImportError, match="in order"):
        mods.check_table(mods.HARNESS_MODS[::-1], spec.SCORE_MODS)
    with pytest.raises(ImportError, match="in order"):
        mods.check_table(mods.HARNESS_MODS[:-1], spec.SCORE_MODS)
    mods.check_table(mods.HARNESS_MODS, spec.SCORE_MODS)


def test_variant_case_json_round_trip_and_errors():
    for f in cases.VARIANT_FEATURES:
        c = row(f)
        assert cases.case_from_json(c.to_json()) == c
    assert "window(37,18)" in row("local").features and "softcap2" in row("softcap").features
    with pytest.raises(ValueError, match="not both"):
        cases.Case("x", 1, 1, 1, 128, 128, 64, "bfloat16", causal=True, window=8, window_size=(4, 0))
    with pytest.raises(ValueError, match="alibi"):
        cases.Case("x", 1, 1, 1, 128, 128, 64, "bfloat16", alibi="mpt")
    with pytest.raises(ValueError, match="dropout"):
        cases.Case("x", 1, 1, 1, 128, 128, 64, "bfloat16", dropout=1.0)


def test_bloom_slopes():
    # 4 heads: 2^-2, 2^-4, 2^-6, 2^-8; 12 heads: 2^-1 .. 2^-8, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5
    assert runner.bloom_alibi_slopes(4).tolist() == [0.25, 0.0625, 0.015625, 0.00390625]
    want = [2.0 ** -(i + 1) for i in range(8)] + [2.0 ** -(i + 0.5) for i in range(4)]
    assert torch.equal(runner.bloom_alibi_slopes(12), torch.tensor(want, dtype=torch.float32))
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    for n in (32, 112):  # BLOOM-7b1, BLOOM-176B; transformers forms the powers in float32 (a few ulps apart)
        theirs = bloom.build_alibi_tensor(torch.ones(1, 2), n, torch.float32)[:, 0, 1]
        torch.testing.assert_close(runner.bloom_alibi_slopes(n), theirs, rtol=1e-6, atol=0.0)


def test_reduction_lengths_follow_the_band():
    n = tolerance.reduction_lengths(row("local"))  # (37, 18): 56 keys per query, 56 queries per key
    assert n["o"] == n["dq"] == n["dk"] == n["dv"] == 56
    n = tolerance.reduction_lengths(row("local_causal"))  # (67, 7) with causal: right clipped to 0
    assert n["o"] == n["dk"] == 68
    n = tolerance.reduction_lengths(row("causal_sq_lt_sk"))
    assert n["o"] == 384 and n["dk"] == 256


# ------------------------------------------------------------------- the formulas the tolerances are derived from
@pytest.mark.parametrize("feature", ["softcap", "alibi", "alibi_causal", "local", "local_causal", "causal_sq_gt_sk",
                                     "dqk_dv", "dropout_causal", "logit_scale"])
def test_inputs_baseline_is_the_variant_backward(feature):
    """The backward formula evaluated from the handed O and LSE (one term of every bound) implements the variant:
    in float32 it lands on the float64 reference up to float32 rounding. A formula missing the variant would be
    off by O(1) and would loosen the bound silently."""
    case = row(feature, "float32")
    ins = runner.make_inputs(case)
    ref = runner.reference(ins, case, torch.float64)
    got = runner.inputs_baseline(ins, ref, case)
    assert ("dlogit_scale" in got) == ("dlogit_scale" in ref) == (feature == "logit_scale")
    for name in ("dq", "dk", "dv") + (("dlogit_scale",) if feature == "logit_scale" else ()):
        scale = ref[name].abs().max().item()
        err = (got[name].double() - ref[name]).abs().max().item()
        assert err <= 1e-5 * scale, (name, err, scale)


def test_any_length_padding_keeps_the_diagonal_offset():
    """API rows: the golden's padded problem keeps seqlen_k - seqlen_q, so bottom-right masks and ALiBi distances
    are those of the real rows (300 queries x 428 keys pad to 384 x 512: offset 128 either way)."""
    case = dataclasses.replace(cases.feature_case("causal_sq_lt_sk", 300, 64, "float32"), alibi="random")
    assert case.via_api and (case.seqlen_q, case.seqlen_k) == (300, 428)
    ins = runner.make_inputs(case)
    ref = runner.reference(ins, case, torch.float64)
    q, k, v = (ins[n].double()[0] for n in ("q", "k", "v"))  # [h, d, s]
    s = torch.einsum("hdq,hdk->hqk", q, k) / math.sqrt(case.d_head)
    i = torch.arange(case.seqlen_q)[:, None]
    j = torch.arange(case.seqlen_k)[None, :]
    off = case.seqlen_k - case.seqlen_q
    s = s - ins["alibi_slopes"][0].double()[:, None, None] * (i + off - j).abs()
    s = s.masked_fill(j > i + off, float("-inf"))
    o = torch.einsum("hqk,hdk->hdq", torch.softmax(s, -1), v)
    torch.testing.assert_close(ref["o"][0], o, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------------- planted bugs per variant
def test_softcap_forgotten_in_the_backward_fails():
    def drop_cap(kw):
        kw.pop("softcap")
        return kw

    r = runner.run_case(row("softcap"), Bent(bwd_kw=drop_cap))
    assert not r["pass"] and r["outputs"]["o"]["ok"] and not r["outputs"]["dq"]["ok"], r.get("error")


def test_alibi_slopes_off_by_5_percent_fail():
    def bend(kw):
        kw["alibi_slopes"] = kw["alibi_slopes"] * 1.05
        return kw

    r = runner.run_case(row("alibi_causal"), Bent(fwd_kw=bend, bwd_kw=bend))
    assert not r["pass"] and not r["outputs"]["o"]["ok"], r.get("error")


def test_swapped_window_sides_fail():
    def swap(kw):
        left, right = kw["window_size"]
        kw["window_size"] = (right, left)
        return kw

    r = runner.run_case(row("local"), Bent(fwd_kw=swap, bwd_kw=swap))
    assert not r["pass"] and not r["outputs"]["o"]["ok"], r.get("error")


def test_logit_scale_off_by_2_percent_in_the_backward_fails():
    """A backward that scales dS by another lam than the forward's logits used: the outputs of the forward pass,
    the gradients (the scale's own among them) fail."""
    def bend(kw):
        kw["logit_scale"] = kw["logit_scale"] * 1.02
        return kw

    r = runner.run_case(row("logit_scale"), Bent(bwd_kw=bend))
    out = r["outputs"]
    assert not r["pass"] and out["o"]["ok"] and not out["dq"]["ok"] and not out["dlogit_scale"]["ok"], r.get("error")


def test_dropout_with_another_mask_fails():
    def other_seed(kw):
        kw["dropout_seed"] = kw["dropout_seed"] + torch.tensor([0, 1], dtype=torch.int32)  # next offset
        return kw

    r = runner.run_case(row("dropout"), Bent(fwd_kw=other_seed, bwd_kw=other_seed))
    assert not r["pass"] and not r["outputs"]["o"]["ok"], r.get("error")
    # the backward regenerating another mask than the forward's: the gradients fail
    r = runner.run_case(row("dropout"), Bent(bwd_kw=other_seed))
    assert not r["pass"] and r["outputs"]["o"]["ok"] and not r["outputs"]["dv"]["ok"], r.get("error")
