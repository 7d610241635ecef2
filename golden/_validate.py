"""Argument checks shared by the golden modules (private).

Every failure raises ``ValueError`` with a message of the form::

    <function>: <argument> = <value>: <rule>

so that a caller (or a test) can see at a glance which argument was wrong,
what was passed and which rule it broke.  Each golden module has exactly one
private validation entry point built from these helpers.  The score
modifications' checks are not here: each is declared with its steps, in its
``SCORE_STEPS`` row (``golden.attention_fwd_torch``).
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

    Layouts: q ``[bs, nheads, d_qk, seqlen_q]``; k ``[bs, nheads_kv, d_qk, seqlen_k]``;
    v ``[bs, nheads_kv, d_v, seqlen_k]``.  ``d_v`` may differ from ``d_qk``
    (e.g. DeepSeek's MLA, 192 / 128).  The returned dict has ``d_head`` =
    ``d_qk`` (the dimension the default softmax scale uses) and ``d_v``.
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
    # v shares k's batch, heads and keys; its head_dim (dim 2) is d_v, free.
    labels = ("batch size", "nheads_kv", None, "seqlen_k")
    for dim, label in enumerate(labels):
        if label is not None and v.shape[dim] != k.shape[dim]:
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
    return dict(bs=bs, nheads=nheads, nheads_kv=nheads_kv, d_head=d_head, d_v=v.shape[2],
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


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_masking(fn: str, dims: dict, use_causal_mask, sliding_window,
                  bound_min, bound_max, window_size=None):
    """Check causal / sliding-window / window_size / packing-bound arguments.

    Causal and windows are bottom-right aligned (offset ``seqlen_k - seqlen_q``),
    so any pair of lengths is accepted.  Returns ``(causal: bool,
    window: int | None, window_size: (left, right) | None)``.
    """
    causal = check_flag(fn, "use_causal_mask", use_causal_mask)
    sq = dims["seqlen_q"]
    window = None
    if sliding_window is not None:
        if not _is_int(sliding_window):
            fail(fn, "sliding_window", repr(sliding_window), "must be an integer >= 1 or None")
        window = int(sliding_window)
        if window < 1:
            fail(fn, "sliding_window", window, "must be >= 1 (query i sees keys i+off-W+1 .. i+off)")
        if not causal:
            fail(fn, "sliding_window", window,
                 "a sliding window requires use_causal_mask=True")
    pair = None
    if window_size is not None:
        if window is not None:
            fail(fn, "window_size", repr(window_size),
                 f"give either sliding_window (= {window}) or window_size, not both")
        ok = isinstance(window_size, (tuple, list)) and len(window_size) == 2
        if not ok or not all(_is_int(x) for x in window_size):
            fail(fn, "window_size", repr(window_size),
                 "must be a pair (left, right) of ints, -1 meaning unbounded, or None")
        pair = (int(window_size[0]), int(window_size[1]))
        if min(pair) < -1:
            fail(fn, "window_size", pair, "entries must be >= -1 (-1 means unbounded on that side)")
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
    return causal, window, pair


def check_dropout(fn: str, dropout_p, dropout_seed, dropout_mask, dims: dict) -> float:
    """Dropout: ``dropout_p`` in [0, 1); when > 0, exactly one of ``dropout_seed``
    (the keep mask comes from ``golden.dropout``) or ``dropout_mask`` (bool
    ``[bs, nheads, seqlen_q, seqlen_k]``, True = keep) must be given; when 0,
    neither.  Returns ``p``."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        fail(fn, "dropout_p", repr(dropout_p), "must be a real number in [0, 1)")
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        fail(fn, "dropout_p", p, "must be in [0, 1) (the kept probabilities are scaled by 1/(1-p))")
    if p == 0.0:
        if dropout_seed is not None:
            fail(fn, "dropout_seed", repr(dropout_seed), "must be None when dropout_p = 0")
        if dropout_mask is not None:
            fail(fn, "dropout_mask", "a tensor", "must be None when dropout_p = 0")
        return p
    if dropout_seed is None and dropout_mask is None:
        fail(fn, "dropout_seed", None, f"dropout_p = {p} needs dropout_seed (or, golden only, dropout_mask)")
    if dropout_seed is not None and dropout_mask is not None:
        fail(fn, "dropout_mask", "a tensor", "give dropout_seed or dropout_mask, not both")
    if dropout_mask is not None:
        check_tensor(fn, "dropout_mask", dropout_mask)
        full = (dims["bs"], dims["nheads"], dims["seqlen_q"], dims["seqlen_k"])
        if tuple(dropout_mask.shape) != full:
            fail(fn, "dropout_mask.shape", _shape(dropout_mask),
                 f"must be [bs, nheads, seqlen_q, seqlen_k] = {list(full)}")
        if dropout_mask.dtype != torch.bool:
            fail(fn, "dropout_mask.dtype", dropout_mask.dtype, "must be bool (True = keep)")
    return p


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


def check_same_as(fn: str, name: str, x, ref_name: str, ref: torch.Tensor, shape=None):
    """Require ``x`` to have the dtype of ``ref`` and the shape ``shape`` (default:
    ``ref``'s; o and dy are ``[bs, nheads, d_v, seqlen_q]``)."""
    check_tensor(fn, name, x)
    want = tuple(ref.shape) if shape is None else tuple(shape)
    if tuple(x.shape) != want:
        what = f"{ref_name}.shape = {_shape(ref)}" if shape is None else f"{ref_name} = {want}"
        fail(fn, f"{name}.shape", _shape(x), f"must equal {what}")
    if x.dtype != ref.dtype:
        fail(fn, f"{name}.dtype", x.dtype, f"must equal {ref_name}.dtype = {ref.dtype}")
