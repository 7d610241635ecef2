"""``nki.typing`` for the simulator: the names kernels use in type annotations.

The public docs mention ``nki.typing`` (imported as ``nt``) only through examples (``from nki.typing import
tensor``, ``nt.tensor`` in docstrings) and give no API page, so this module provides the annotation names and
nothing else: ``tensor`` is the simulator's tensor type.
"""
from .tensor import NkiTensor

tensor = NkiTensor

__all__ = ["tensor"]
