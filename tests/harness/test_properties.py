"""Property-based tests: random attention problems (any length, through the PyTorch API) against the golden,
under the harness's own tolerance rule (nki_attn/harness/tolerance.py).

Hypothesis draws the shape (batch, query heads, kv heads for GQA/MQA, d_head, seqlen_q, seqlen_k of any length),
the dtype, causal masking with or without a sliding window, 0-2 sinks per head, packed sequences (with empty
sequences and trailing rows that see no key) and the softmax scale. Each example is one harness row
(``cases.Case``), run as ``nki-attn check`` runs it, so a failure prints the command that repeats it.

The default run keeps a small, derandomized example budget (8 examples, under a minute on 2 cores);
``-m slow`` runs 150 fresh random examples up to 700 tokens.
"""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nki_attn.harness import cases, runner

D_HEADS = (32, 64, 96, 128)


@st.composite
def attention_cases(draw, max_seqlen=400):
    """A harness row of random shape and features; every row satisfies the API's and the golden's rules."""
    dtype = draw(st.sampled_from(cases.DTYPES))
    d = draw(st.sampled_from(D_HEADS))
    kv_heads = draw(st.integers(1, 2))
    heads = kv_heads * draw(st.integers(1, 3))
    sq = draw(st.integers(cases.MIN_SEQLEN, max_seqlen))
    causal = draw(st.booleans())
    packed = draw(st.booleans())
    # causal masks and packing are defined for self-attention here (the golden's causal mask is top-left
    # aligned, the API's bottom-right: they agree when seqlen_q == seqlen_k)
    sk = sq if (causal or packed) else draw(st.integers(cases.MIN_SEQLEN, max_seqlen))
    batch = 1 if packed else draw(st.integers(1, 2))
    window = draw(st.integers(1, sq)) if causal and draw(st.booleans()) else 0
    cu = ()
    if packed:
        cuts = draw(st.lists(st.integers(0, sq), min_size=1, max_size=4))
        end = draw(st.sampled_from((sq, max(0, sq - draw(st.integers(1, sq))))))  # trailing rows may see no key
        cu = tuple([0] + sorted(min(c, end) for c in cuts) + [end])
    sinks = draw(st.sampled_from((0, 0, 1, 2)))
    scale = draw(st.sampled_from((0.0, 0.0, 0.25, 1.0)))
    # lengths that are multiples of 128 may also take the kernels' direct path
    aligned = sq % 128 == 0 and sk % 128 == 0
    api = True if not aligned else draw(st.booleans())
    return cases.Case(name=f"prop-s{sq}x{sk}-d{d}-h{heads}/{kv_heads}-{dtype}", batch=batch, heads=heads,
                      kv_heads=kv_heads, seqlen_q=sq, seqlen_k=sk, d_head=d, dtype=dtype, causal=causal,
                      window=window, num_sinks=sinks, cu_seqlens=cu, scale=scale, api=api)


def repro_command(case):
    """The shell command that re-runs one example as a harness row."""
    return f"python -m nki_attn.cli check --case '{case.to_json()}'"


def check_case(case):
    row = runner.run_case(case, runner.KernelCandidate())
    if row["pass"]:
        return
    detail = row.get("error") or {n: (f"{o['max_abs']:.3g}/{o['bound']:.3g}", o["ok"])
                                  for n, o in row["outputs"].items()}
    pytest.fail(f"kernels differ from the golden beyond the harness rule: {detail}\n"
                f"reproduce with:\n  {repro_command(case)}", pytrace=False)


_COMMON = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# derandomized: CI sees the same examples on every run; the slow budget below explores afresh each time
@settings(max_examples=8, derandomize=True, **_COMMON)
@given(attention_cases(max_seqlen=300))
def test_kernels_match_golden_on_random_problems(case):
    check_case(case)


@pytest.mark.slow
@settings(max_examples=150, **_COMMON)
@given(attention_cases(max_seqlen=700))
def test_kernels_match_golden_on_random_problems_large_budget(case):
    check_case(case)


# Examples the random budget found, kept as regressions of the tolerance rule: a single-key window (dq, dk are
# exactly 0 by cancellation; the kernels return rounding noise), bfloat16 with softmax_scale 1.0 on a tiny
# problem (the error the handed O and LSE bring exceeds twice the golden baseline's), and one where each
# baseline alone meets the band but the kernels, which make both kinds of error, need their sum.
FOUND = [
    cases.Case(name="found-window1", batch=1, heads=1, kv_heads=1, seqlen_q=16, seqlen_k=16, d_head=32,
               dtype="float32", causal=True, window=1, cu_seqlens=(0, 0, 16), api=True),
    cases.Case(name="found-scale1-bf16", batch=1, heads=1, kv_heads=1, seqlen_q=25, seqlen_k=16, d_head=32,
               dtype="bfloat16", scale=1.0, api=True),
    cases.Case(name="found-scale1-window-band", batch=1, heads=1, kv_heads=1, seqlen_q=25, seqlen_k=25, d_head=32,
               dtype="bfloat16", causal=True, window=6, cu_seqlens=(0, 1, 25), scale=1.0, api=True),
]


@pytest.mark.parametrize("case", FOUND, ids=lambda c: c.name)
def test_examples_found_by_the_random_budget(case):
    check_case(case)


def test_repro_command_round_trips():
    case = cases.Case(name="x", batch=1, heads=2, kv_heads=1, seqlen_q=200, seqlen_k=200, d_head=32,
                      dtype="float16", causal=True, window=50, num_sinks=2, cu_seqlens=(0, 50, 50, 180), scale=0.25,
                      api=True)
    json_arg = repro_command(case).split("--case '", 1)[1].rstrip("'")
    assert cases.case_from_json(json_arg) == case
