"""Chooses the NKI implementation the kernels run on: the real ``nki`` or the built-in simulator.

Kernels import ``nki``, ``nl`` and ``nisa`` only from here. The rule (env ``NKI_ATTN_BACKEND``):

- unset or ``nki``: the real ``nki`` package when it imports; unset falls back to the simulator when it does
  not, ``nki`` fails with a clear message instead;
- ``sim``: always the simulator (``nki_attn.sim``), even where the real package is installed.

``BACKEND`` is ``"nki"`` or ``"sim"``.
"""
import importlib
import os

_choice = os.environ.get("NKI_ATTN_BACKEND", "").strip().lower()
if _choice not in ("", "nki", "sim"):
    raise ImportError(f"NKI_ATTN_BACKEND={_choice!r} is not valid; use 'nki' (real package) or 'sim' (simulator)")


def _import_real():
    try:
        mod = importlib.import_module("nki")
    except ImportError:
        return None
    if getattr(mod, "__nki_attn_sim__", False):  # install_as_nki() put the simulator there
        return None
    if getattr(mod, "__file__", None) is None:
        # A plain directory named "nki" on sys.path (e.g. a checkout of the NKI docs) imports as an empty
        # namespace package; it is not the nki package, and leaving it registered would hide the simulator.
        import sys
        sys.modules.pop("nki", None)
        return None
    return mod


_real = None if _choice == "sim" else _import_real()
if _real is not None:
    nki = _real
    try:
        nl = importlib.import_module("nki.language")
        nisa = importlib.import_module("nki.isa")
    except ImportError as exc:
        # Some other module named nki shadows the Neuron SDK's: name it instead of a bare ModuleNotFoundError.
        raise ImportError(
            f"an 'nki' package is importable ({_real.__file__}) but has no nki.language / nki.isa, so it is not "
            "the Neuron SDK's NKI. Install nki from the Neuron pip repository (docs/trainium.md), remove the "
            "other package from the path, or set NKI_ATTN_BACKEND=sim to use the built-in simulator.") from exc
    BACKEND = "nki"
elif _choice == "nki":
    raise ImportError(
        "NKI_ATTN_BACKEND=nki but the real 'nki' package is not importable. It ships with the Neuron SDK "
        "(neuronx-cc) from the Neuron package repository, not from PyPI; install it there, or unset "
        "NKI_ATTN_BACKEND (or set it to 'sim') to use the built-in simulator.")
else:
    from . import sim as nki  # noqa: E402
    from .sim import isa as nisa  # noqa: E402,F401
    from .sim import language as nl  # noqa: E402,F401
    BACKEND = "sim"

__all__ = ["nki", "nl", "nisa", "BACKEND"]
