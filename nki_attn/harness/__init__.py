"""The correctness harness behind ``nki-attn check``: rows of forward + backward checks against a float64
golden with dtype-derived tolerances, a determinism check and a training-drift check (docs/harness.md)."""
from .cases import Case, select  # noqa: F401
from .runner import KernelCandidate, run_case  # noqa: F401
