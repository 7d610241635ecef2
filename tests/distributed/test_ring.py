"""Ring and zigzag attention on 2 and 4 gloo processes against the full sequence in one process.

Every configuration runs forward and backward on every rank (one spawn of ``world_size`` processes per test,
loopback only, bounded by ``run_local``'s timeout); the parent compares out, lse, dq, dk, dv and dsinks with the
float64 golden and with ``nki_attn.flash_attn_func`` on the full sequence by the rule in ``_cases.py`` (derived
in docs/distributed.md).
"""
import pytest
import torch

# _cases and _reference sit next to this file: pytest puts a test file's folder (not a package) on sys.path first
import _cases
from _cases import case
from _reference import golden_full, single_process

from nki_attn.distributed import run_local

TIMEOUT = 300  # seconds for one spawn: a hang fails the test instead of blocking CI

CASES_2 = [
    case("ring-causal-gqa"),
    case("ring-full-mha-b2", causal=False, b=2, h=2, hk=2),
    case("ring-window-sinks-fp32", window=(100, 0), dtype=torch.float32, sinks=2),
    case("ring-uneven-causal", lengths=[200, 312]),
    case("ring-bidir-window-fp32", causal=False, window=(60, 70), dtype=torch.float32, scale=0.2),
    case("zigzag-causal-mqa", layout="zigzag", hk=1),
    case("zigzag-window-sinks", layout="zigzag", window=(150, 0), sinks=1),
]
CASES_4 = [
    case("ring-causal-gqa"),
    case("ring-window-sinks-fp32", window=(100, 0), dtype=torch.float32, sinks=2),
    case("ring-uneven-causal", lengths=[128, 100, 156, 128]),
    case("ring-bidir-window", causal=False, window=(60, 70)),
    case("zigzag-causal-gqa", layout="zigzag"),
    case("zigzag-window-sinks-fp32", layout="zigzag", window=(100, 0), dtype=torch.float32, sinks=1),
]
_REFERENCES = {}


def _references(c):
    """(truth, single) of a configuration, shared by the configurations that differ only in the layout."""
    key = tuple(c[x] for x in ("seed", "b", "seqlen", "h", "hk", "d", "dtype", "sinks", "causal", "window",
                               "scale"))
    if key not in _REFERENCES:
        q, k, v, do, s = _cases.inputs(c)
        _REFERENCES[key] = (golden_full(q, k, v, do, s, c["causal"], c["window"], c["scale"]),
                            single_process(q, k, v, do, s, c["causal"], c["window"], c["scale"]))
    return _REFERENCES[key]


def _check_all(world_size, cases, results):
    failures, report = [], []
    for i, c in enumerate(cases):
        q, k, v, do, s = _cases.inputs(c)
        truth, single = _references(c)
        got = _cases.gather(c, world_size, [r[i] for r in results])
        for row in _cases.judge(c, world_size, got, truth, single, do, s):
            report.append(f"{row['case']:<26}{row['output']:<7} ring {row['err_ring']:.3e} single "
                          f"{row['err_single']:.3e} inputs {row['err_inputs']:.1e} n {row['n']} "
                          f"used {row['used']:.2f}")
            if not row["ok"]:
                failures.append(report[-1])
    assert not failures, "outside the rule (err_ring <= 2 err_single + n/2 u scale):\n" + "\n".join(failures)
    return report


def test_two_ranks():
    results = run_local(_cases.worker, 2, CASES_2, True, timeout=TIMEOUT)
    _check_all(2, CASES_2, [r["cases"] for r in results])
    # misuse fails identically on every rank, with the argument named, instead of hanging
    for r in results:
        bad = r["bad"]
        assert bad["zigzag_uneven"][0] == "ValueError" and "zigzag layout" in bad["zigzag_uneven"][1]
        assert bad["kv_len"][0] == "ValueError" and "k.shape" in bad["kv_len"][1]
        assert bad["dropout"][0] == "NotImplementedError" and "dropout_p" in bad["dropout"][1]
        assert bad["window"][0] == "TypeError" and "window_size" in bad["window"][1]
        assert bad["heads"][0] == "ValueError" and "k.shape[2]" in bad["heads"][1]
        assert bad["sinks"][0] == "ValueError" and "sinks.shape" in bad["sinks"][1]
        assert r["api"]["same"], "packed / return_attn_probs variants differ from the plain call"
        assert r["api"]["probs"] == (3, (1, 2, 256), True)
    assert results[0]["bad"]["zigzag_uneven"] == results[1]["bad"]["zigzag_uneven"]
    one = [r["bad"]["one_rank"] for r in results]
    assert one[0][0] == "NotImplementedError" and "dropout_p" in one[0][1]
    assert one[1][0] == "ValueError" and "ranks [0] rejected" in one[1][1]


SUB_CASES = [case("sub-ring-causal-gqa"), case("sub-zigzag-window-sinks", layout="zigzag", window=(150, 0), sinks=1)]


def test_four_ranks():
    results = run_local(_cases.worker, 4, CASES_4, False, SUB_CASES, timeout=TIMEOUT)
    _check_all(4, CASES_4, [r["cases"] for r in results])
    # the same 4 processes, as two 2-rank groups {0, 2} and {1, 3} running at once (group=...)
    for members in _cases.SUBGROUPS:
        _check_all(2, SUB_CASES, [results[m]["sub"] for m in members])


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [3, 8])
def test_more_ranks(world_size):
    S = 256 * world_size
    cases = [
        case("ring-causal", seqlen=S, d=128, b=2),
        case("ring-full-fp16", seqlen=S, causal=False, dtype=torch.float16),
        case("ring-bidir-window", seqlen=S, causal=False, window=(90, 200), sinks=2),
        case("zigzag-causal-sinks", layout="zigzag", seqlen=S, sinks=1),
        case("zigzag-window", layout="zigzag", seqlen=S, window=(300, 0), dtype=torch.float32),
        case("zigzag-full", layout="zigzag", seqlen=S, causal=False),
    ]
    results = run_local(_cases.worker, world_size, cases, False, timeout=1800)
    _check_all(world_size, cases, [r["cases"] for r in results])
