"""Determinism check: repeated forward + backward runs must be bit-identical, and so must LNC1 and LNC2."""
import torch

from .errors import Unsupported
from .runner import KernelCandidate, make_inputs, run_candidate


def _equal(a, b):
    return all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a)


def check_determinism(case, runs=10, candidate=None, compare_lnc=True, progress=None):
    """Run ``case`` ``runs`` times with the same inputs and require torch.equal on every output; then (when
    ``compare_lnc``) require the LNC2 launch to equal the single-core one.

    ``candidate``: default our kernels; a candidate's ``with_lnc(2)`` gives its two-core launch, or None when
    it does not accept ``[2]`` (then ``lnc2_equal`` is None and ``lnc2_note`` says why). ``progress(text)``,
    when given, is called after each run and after the LNC2 comparison. Returns dict: case, runs,
    identical_runs (how many equal the first), lnc2_equal (bool or None), lnc2_note, pass; a candidate that
    refuses the row gives ``status`` "unsupported" with the message and ``pass`` None.
    """
    cand = candidate or KernelCandidate(lnc=1)
    ins = make_inputs(case)
    try:
        first = run_candidate(cand, ins, case)
    except Unsupported as exc:
        return {"case": case.name, "runs": runs, "identical_runs": 0, "lnc2_equal": None, "lnc2_note": None,
                "status": "unsupported", "error": str(exc), "pass": None}
    same = 1
    if progress:
        progress(f"{case.name}: run 1/{runs}")
    for i in range(runs - 1):
        equal = _equal(first, run_candidate(cand, ins, case))
        same += equal
        if progress:
            progress(f"{case.name}: run {i + 2}/{runs} {'identical' if equal else 'DIFFERS'}")
    lnc2, note = None, None
    if compare_lnc:
        two = cand.with_lnc(2) if hasattr(cand, "with_lnc") else None
        if two is None:
            note = "not compared: the candidate does not accept [2]"
        else:
            lnc2 = _equal(first, run_candidate(two, ins, case))
        if progress:
            progress(f"{case.name}: LNC2 {note or ('equal' if lnc2 else 'DIFFERS')}")
    ok = same == runs and lnc2 is not False
    return {"case": case.name, "runs": runs, "identical_runs": same, "lnc2_equal": lnc2, "lnc2_note": note,
            "status": "pass" if ok else "fail", "pass": ok}
