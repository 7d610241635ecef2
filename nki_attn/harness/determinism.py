"""Determinism check: repeated forward + backward runs must be bit-identical, and so must LNC1 and LNC2."""
import torch

from .runner import KernelCandidate, make_inputs, run_candidate


def _equal(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def check_determinism(case, runs=10, candidate=None, compare_lnc=True):
    """Run ``case`` ``runs`` times with the same inputs and require torch.equal on every output; then (when
    ``compare_lnc``) require the LNC2 launch to equal the single-core one.

    Returns dict: case, runs, identical_runs (how many equal the first), lnc2_equal (bool or None), pass.
    """
    cand = candidate or KernelCandidate(lnc=1)
    ins = make_inputs(case)
    first = run_candidate(cand, ins, case)
    same = 1
    for _ in range(runs - 1):
        same += _equal(first, run_candidate(cand, ins, case))
    lnc2 = None
    if compare_lnc:
        lnc2 = _equal(first, run_candidate(KernelCandidate(lnc=2), ins, case))
    ok = same == runs and lnc2 is not False
    return {"case": case.name, "runs": runs, "identical_runs": same, "lnc2_equal": lnc2, "pass": ok}
