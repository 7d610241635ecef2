"""Helpers for simulator tests: on-chip tiles filled straight from numpy."""
import ml_dtypes
import numpy as np

from nki_attn.sim import language as nl

BF16 = ml_dtypes.bfloat16


def tile(arr, dtype=None, buffer=None):
    """An on-chip tensor holding ``arr`` (test set-up only: bypasses the instruction checks)."""
    arr = np.asarray(arr)
    t = nl.ndarray(arr.shape, dtype or arr.dtype, buffer=buffer or nl.sbuf)
    t.np()[...] = arr.astype(t.np().dtype)
    return t


def empty(shape, dtype=nl.float32, buffer=None):
    return nl.ndarray(shape, dtype, buffer=buffer or nl.sbuf)


def val(t):
    """float64 copy of a tensor's elements."""
    return np.asarray(t.np()).astype(np.float64)


