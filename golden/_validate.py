"""Argument checks shared by the golden modules (private).

Every failure raises ``ValueError`` with a message of the form::

    <function>: <argument> = <value>: <rule>

so that a caller (or a test) can see at a glance which argument was wrong,
what was passed and which rule it broke.  Each golden module has exactly one
private validation entry point built from these helpers.
"""

from __future__ import annotations

import math
import numbers

import torch

# Query rows are stored 128 to a tile in the LSE layout (one row per SBUF
# partition on Trainium), so the golden refuses query lengths it cannot tile.
PARTITIONS = 128

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def fail(fn: str, arg: str, value, rule: str):
    """Raise the uniformly formatted ``ValueError``."""
    raise ValueError(f"{fn}: {arg} = {value}: {rule}")


def _shape(x: torch.Tensor) -> tuple:
    return tuple(x.shape)


def check_flag(fn: str, name: str, value) -> bool:
    """Accept True/False (or 0/1, numpy bools); reject anything else.

    A tensor or a string passed by mistake would otherwise be silently
    truth-tested, which hides argument-order bugs in callers.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral) and int(value) in (0, 1):
        return bool(value)
    if type(value).__name__ == "bool_":  # numpy.bool_ without importing numpy
        return bool(value)
    fail(fn, name, repr(value), "must be a bool")


def check_tensor(fn: str, name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        fail(fn, name, type(x).__name__, "must be a torch.Tensor")
    return x


def check_qkv(fn: str, q, k, v, names=("q", "k", "v")) -> dict:
    """Check the three attention operands and return their dimensions.

    Layouts: q ``[bs, nheads, d_head, seqlen_q]``; k, v
    ``[bs, nheads_kv, d_head, seqlen_k]``.
    """
    qn, kn, vn = names
    for name, x in zip(names, (q, k, v)):
        check_tensor(fn, name, x)
        if x.dim() != 4:
            fail(fn, f"{name}.shape", _shape(x),
                 f"{name} must have rank 4 ([bs, nheads, d_head, seqlen]), got rank {x.dim()}")
        if x.dtype not in _FLOAT_DTYPES:
            fail(fn, f"{name}.dtype", x.dtype,
                 "must be one of float16, bfloat16, float32, float64")
    for name, x in ((kn, k), (vn, v)):
        if x.dtype != q.dtype:
            fail(fn, f"{name}.dtype", x.dtype,
                 f"must equal {qn}.dtype = {q.dtype} (all operands share one dtype)")
    bs, nheads, d_head, seqlen_q = q.shape
    bs_k, nheads_kv, d_head_k, seqlen_k = k.shape
    if bs_k != bs:
        fail(fn, f"{kn}.shape[0]", bs_k, f"batch size must equal {qn}.shape[0] = {bs}")
    if d_head_k != d_head:
        fail(fn, f"{kn}.shape[2]", d_head_k, f"d_head must equal {qn}.shape[2] = {d_head}")
    if tuple(v.shape) != tuple(k.shape):
        # Name the first disagreeing dimension so the message is specific.
        labels = ("batch size", "nheads_kv", "d_head", "seqlen_k")
        for dim, label in enumerate(labels):
            if v.shape[dim] != k.shape[dim]:
                fail(fn, f"{vn}.shape[{dim}]", v.shape[dim],
                     f"{label} must equal {kn}.shape[{dim}] = {k.shape[dim]} "
                     f"({vn}.shape {_shape(v)} vs {kn}.shape {_shape(k)})")
    if nheads_kv == 0 or nheads % nheads_kv != 0:
        fail(fn, f"nheads_kv ({kn}.shape[1])", nheads_kv,
             f"nheads ({qn}.shape[1]) = {nheads} must be divisible by nheads_kv (GQA/MQA rule: nheads % nheads_kv == 0)")
    if seqlen_q % PARTITIONS != 0 or seqlen_q == 0:
        fail(fn, f"seqlen_q ({qn}.shape[3])", seqlen_q,
             f"must be a positive multiple of {PARTITIONS} (LSE layout [bs, nheads, 128, seqlen_q // 128])")
    if seqlen_k == 0:
        fail(fn, f"seqlen_k ({kn}.shape[3])", seqlen_k, "must be positive")
    return dict(bs=bs, nheads=nheads, nheads_kv=nheads_kv, d_head=d_head,
                seqlen_q=seqlen_q, seqlen_k=seqlen_k, group=nheads // max(nheads_kv, 1))


def check_scale(fn: str, softmax_scale, d_head: int) -> float:
    """Return the effective scale: ``1/sqrt(d_head)`` unless given."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(d_head)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        fail(fn, "softmax_scale", repr(softmax_scale), "must be a real number or None")
    if not math.isfinite(float(softmax_scale)):
        fail(fn, "softmax_scale", softmax_scale, "must be finite")
    return float(softmax_scale)


def check_masking(fn: str, dims: dict, use_causal_mask, sliding_window,
                  bound_min, bound_max):
    """Check causal / sliding-window / packing-bound arguments.

    Returns ``(causal: bool, window: int | None)``.
    """
    causal = check_flag(fn, "use_causal_mask", use_causal_mask)
    sq, sk = dims["seqlen_q"], dims["seqlen_k"]
    if causal and sq != sk:
        fail(fn, "use_causal_mask", True,
             f"causal masking needs seqlen_q == seqlen_k, got seqlen_q = {sq}, seqlen_k = {sk}")
    window = None
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral):
            fail(fn, "sliding_window", repr(sliding_window), "must be an integer >= 1 or None")
        window = int(sliding_window)
        if window < 1:
            fail(fn, "sliding_window", window, "must be >= 1 (query i sees keys i-W+1 .. i)")
        if not causal:
            fail(fn, "sliding_window", window,
                 "a sliding window requires use_causal_mask=True")
    if (bound_min is None) != (bound_max is None):
        missing = "bound_max" if bound_max is None else "bound_min"
        given = "bound_min" if bound_max is None else "bound_max"
        fail(fn, missing, None, f"packing bounds come in pairs: {given} was given, {missing} is missing")
    if bound_min is not None:
        for name, b in (("bound_min", bound_min), ("bound_max", bound_max)):
            check_tensor(fn, name, b)
            if tuple(b.shape) != (sq,):
                fail(fn, f"{name}.shape", _shape(b),
                     f"must be 1-D of length seqlen_q = {sq}")
            if b.dtype != torch.float32:
                fail(fn, f"{name}.dtype", b.dtype, "packing bounds must be float32")
            if torch.isnan(b).any():
                fail(fn, name, "tensor with NaN", "packing bounds must not be NaN")
    return causal, window


def check_sinks(fn: str, name: str, sinks, dims: dict) -> int:
    """Check sinks (``[bs, nheads]`` or ``[bs, nheads, num_sinks]``); return num_sinks (0 if None)."""
    if sinks is None:
        return 0
    check_tensor(fn, name, sinks)
    bs, nheads = dims["bs"], dims["nheads"]
    if sinks.dtype not in _FLOAT_DTYPES:
        fail(fn, f"{name}.dtype", sinks.dtype, "sinks must be a floating tensor")
    ok = (sinks.dim() in (2, 3) and tuple(sinks.shape[:2]) == (bs, nheads)
          and (sinks.dim() == 2 or sinks.shape[2] >= 1))
    if not ok:
        fail(fn, f"{name}.shape", _shape(sinks),
             f"must be [bs, nheads] = [{bs}, {nheads}] or [bs, nheads, num_sinks] with num_sinks >= 1")
    return 1 if sinks.dim() == 2 else int(sinks.shape[2])


def check_same_as(fn: str, name: str, x, ref_name: str, ref: torch.Tensor):
    """Require ``x`` to have the shape and dtype of ``ref`` (used for o and dy vs q)."""
    check_tensor(fn, name, x)
    if tuple(x.shape) != tuple(ref.shape):
        fail(fn, f"{name}.shape", _shape(x), f"must equal {ref_name}.shape = {_shape(ref)}")
    if x.dtype != ref.dtype:
        fail(fn, f"{name}.dtype", x.dtype, f"must equal {ref_name}.dtype = {ref.dtype}")
