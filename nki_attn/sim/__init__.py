"""A CPU simulator of the public NKI API (``nki``, ``nki.language``, ``nki.isa``).

Shaped like the real package so kernels run unchanged: ``nki_attn.sim`` plays ``nki`` (``jit``, ``simulate``,
``simulate_kernel``), ``nki_attn.sim.language`` plays ``nki.language`` and ``nki_attn.sim.isa`` plays
``nki.isa``. ``install_as_nki()`` registers them under those names when no real ``nki`` is importable, so a
third-party kernel doing ``import nki`` runs here. Every launch first applies the NKI compiler frontend's rules
(``nki_attn.sim.frontend``). docs/simulator.md says what is modelled.
"""
import importlib.util
import sys

from . import frontend, isa, language  # noqa: F401
from . import nki_typing as typing  # noqa: F401 - nki.typing
from .benchmark import benchmark  # noqa: F401 - nki.benchmark, with modeled latencies (benchmark.py)
from .checks import LaunchStats, checking, last_launch_stats  # noqa: F401
from .errors import NkiValidationError  # noqa: F401
from .runtime import Kernel, jit, simulate, simulate_kernel  # noqa: F401

__all__ = ["jit", "simulate", "simulate_kernel", "Kernel", "NkiValidationError", "language", "isa", "typing",
           "install_as_nki", "real_nki_available", "checking", "last_launch_stats", "LaunchStats", "frontend",
           "benchmark"]


def real_nki_available():
    """True when a real ``nki`` package (not this simulator) can be imported."""
    mod = sys.modules.get("nki")
    if mod is not None and getattr(mod, "__file__", None) is not None:
        return not getattr(mod, "__nki_attn_sim__", False)
    spec = importlib.util.find_spec("nki")
    # A directory that merely happens to be called "nki" on sys.path (e.g. a checkout of the NKI docs, whose
    # examples live under nki/) is found as a namespace package with no origin; it is not the nki package.
    return spec is not None and spec.origin not in (None, "namespace")


def install_as_nki(force=False):
    """Register this simulator as ``nki``, ``nki.language`` and ``nki.isa`` in ``sys.modules``.

    Does nothing (and returns False) when a real ``nki`` is importable, unless ``force=True``. Returns True when
    the simulator is installed.
    """
    if not force and real_nki_available():
        return False
    me = sys.modules[__name__]
    sys.modules["nki"] = me
    sys.modules["nki.language"] = language
    sys.modules["nki.isa"] = isa
    sys.modules["nki.typing"] = typing
    return True


__nki_attn_sim__ = True
