"""Determinism check: repeated forward + backward runs must be bit-identical, and so must LNC1 and LNC2."""
import torch

from .runner import KernelCandidate, make_inputs, run_candidate


def _equal(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def check_determinism(case, runs=10, candidate=None, compare_lnc=True, progress=None):
    """Run ``case`` ``runs`` times with the same inputs and require torch.equal on every output; then (when
    ``compare_lnc``) require the LNC2 launch to equal the single-core one.

    ``progress(text)``, when given, is called after each run and after the LNC2 comparison (``runs +
    compare_lnc`` calls). Returns dict: case, runs, identical_runs (how many equal the first), lnc2_equal
    (bool or None), pass.
    """
    cand = candidate or KernelCandidate(lnc=1)
    ins = make_inputs(case)
    first = run_candidate(cand, ins, case)
    same = 1
    if progress:
        progress(f"{case.name}: run 1/{runs}")
    for i in range(runs - 1):
        equal = _equal(first, run_candidate(cand, ins, case))
        same += equal
        if progress:
            progress(f"{case.name}: run {i + 2}/{runs} {'identical' if equal else 'DIFFERS'}")
    lnc2 = None
    if compare_lnc:
        lnc2 = _equal(first, run_candidate(KernelCandidate(lnc=2), ins, case))
        if progress:
            progress(f"{case.name}: LNC2 {'equal' if lnc2 else 'DIFFERS'}")
    ok = same == runs and lnc2 is not False
    return {"case": case.name, "runs": runs, "identical_runs": same, "lnc2_equal": lnc2, "pass": ok}
