"""Input validation shared by the attention kernels, in NKI's kernel subset.

``attention_problem`` runs at trace time, before any instruction is emitted, and returns the first problem as a
message naming the argument, its value and the rule it breaks (``None`` when the arguments are valid). Kernel code
cannot raise, so the kernels ``assert`` on it (as the NKI Library's ``kernel_assert`` does); host code raises the
same message as ``ValueError`` before launching (``nki_attn.kernel_api``). ``attention_shape`` returns the shape
facts the kernels need as an ``AttentionShape``.
"""
import math

from ..backend import nl

PMAX = 128
MAX_D_HEAD = 256
_DTYPES = ("float32", "bfloat16", "float16")  # for messages


class AttentionShape(nl.NKIObject):
    """Validated shape facts of one attention call.

    bs, nheads, nheads_kv, d_head, seqlen_q, seqlen_k: sizes from q ``[bs, nheads, d_head, seqlen_q]`` and
    k/v ``[bs, nheads_kv, d_head, seqlen_k]``; group = nheads // nheads_kv (query heads per kv head);
    d_tiles, d_tile: head_dim split into ``d_tiles`` equal partition tiles of ``d_tile`` <= 128 rows;
    num_sinks: sink logits per head (0 without sinks); sinks_3d: sinks given as ``[bs, nheads, num_sinks]``;
    scale: the softmax scale applied to q.k; window: sliding window (0 when none); packing: bounds given.
    """

    def __init__(self, bs, nheads, nheads_kv, d_head, seqlen_q, seqlen_k, d_tiles, num_sinks, sinks_3d, scale,
                 causal, window, packing):
        self.bs = bs
        self.nheads = nheads
        self.nheads_kv = nheads_kv
        self.group = nheads // nheads_kv
        self.d_head = d_head
        self.seqlen_q = seqlen_q
        self.seqlen_k = seqlen_k
        self.d_tiles = d_tiles
        self.d_tile = d_head // d_tiles
        self.num_sinks = num_sinks
        self.sinks_3d = sinks_3d
        self.scale = scale
        self.causal = causal
        self.window = window
        self.packing = packing


def _shape(t):
    return tuple(t.shape)


def sbuf_bytes_per_partition():
    """Usable SBUF bytes per partition of the target (``nl.tile_size.sbuf_fmax_bytes``; NKI before 0.4 only has
    the older name ``total_available_sbuf_size``). Which name exists is decided once, at import, by host
    Python: kernel code has no getattr/hasattr, and the branch not taken is never evaluated."""
    if _HAS_SBUF_FMAX:
        return nl.tile_size.sbuf_fmax_bytes
    return nl.tile_size.total_available_sbuf_size


_HAS_SBUF_FMAX = hasattr(type(nl.tile_size), "sbuf_fmax_bytes") or hasattr(nl.tile_size, "sbuf_fmax_bytes")


def supported_dtype(dtype):
    """True for the kernels' input dtypes: float32, bfloat16, float16 (compared by name, as NKI dtypes are)."""
    name = str(dtype)
    return name == str(nl.float32) or name == str(nl.bfloat16) or name == str(nl.float16)


def _rank4_problem(name, t):
    if len(t.shape) != 4:
        return f"{name} must be 4-D [bs, heads, d_head, seqlen], got shape {_shape(t)}"
    return None


def attention_problem(q, k, v, o=None, dy=None, lse=None, sinks=None, bound_min=None, bound_max=None,
                      use_causal_mask=False, softmax_scale=None, sliding_window=None):
    """Check the arguments of attention_fwd / attention_bwd: ``None`` when they are valid, else the first
    problem as a message naming the argument, its value and the rule. The kernels ``assert`` on it (kernel
    code cannot raise); the host-side entry points (``nki_attn.kernel_api``, the torch API) raise it as
    ``ValueError`` before launching.

    Layouts: q, o, dy ``[bs, nheads, d_head, seqlen_q]``; k, v ``[bs, nheads_kv, d_head, seqlen_k]``;
    lse float32 ``[bs, nheads, 128, seqlen_q // 128]``; sinks ``[bs, nheads]`` or ``[bs, nheads, num_sinks]``;
    bound_min, bound_max float32 ``[seqlen_q]``.
    """
    for item in (("q", q), ("k", k), ("v", v)):
        name, t = item
        problem = _rank4_problem(name, t)
        if problem is not None:
            return problem
    bs, nheads, d_head, seqlen_q = _shape(q)
    bs_k, nheads_kv, d_k, seqlen_k = _shape(k)
    if _shape(v) != _shape(k):
        return f"v shape {_shape(v)} must equal k shape {_shape(k)}"
    if bs_k != bs:
        return f"k batch {bs_k} must equal q batch {bs}"
    if d_k != d_head:
        return f"k d_head {d_k} must equal q d_head {d_head}"
    if nheads_kv < 1 or nheads % nheads_kv != 0:
        return f"nheads={nheads} (q) must be divisible by nheads_kv={nheads_kv} (k, v) for GQA/MQA"
    for item in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        name, n = item
        if n <= 0 or n % PMAX != 0:
            return (f"{name}={n} must be a positive multiple of {PMAX} (pad the sequence and mask the padding; "
                    f"the torch API does this for you)")
    if d_head > MAX_D_HEAD:
        return f"d_head={d_head} exceeds the supported maximum {MAX_D_HEAD}"
    d_tiles = -(-d_head // PMAX)
    if d_head % d_tiles != 0:
        return f"d_head={d_head} cannot be split into {d_tiles} equal partition tiles of at most {PMAX}"
    dt = str(q.dtype)
    if not supported_dtype(q.dtype):
        return f"q dtype {dt} is not supported; use one of {_DTYPES}"
    for item in (("k", k), ("v", v), ("o", o), ("dy", dy)):
        name, t = item
        if t is not None and str(t.dtype) != dt:
            return f"{name} dtype {t.dtype} must equal q dtype {dt}"
    for item in (("o", o), ("dy", dy)):
        name, t = item
        if t is not None and _shape(t) != _shape(q):
            return f"{name} shape {_shape(t)} must equal q shape {_shape(q)}"
    if lse is not None:
        want = (bs, nheads, PMAX, seqlen_q // PMAX)
        if _shape(lse) != want:
            return f"lse shape {_shape(lse)} must be [bs, nheads, 128, seqlen_q // 128] = {want}"
        if str(lse.dtype) != str(nl.float32):
            return f"lse dtype {lse.dtype} must be float32"
    if use_causal_mask and seqlen_q != seqlen_k:
        return f"use_causal_mask=True needs seqlen_q == seqlen_k, got {seqlen_q} and {seqlen_k}"
    if sliding_window is not None:
        # (NKI's isinstance(True, int) is False, Python's True: the bool test keeps both readings equal)
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            return f"sliding_window={sliding_window!r} must be None or an int >= 1"
        if not use_causal_mask:
            return f"sliding_window={sliding_window} is only supported with use_causal_mask=True"
    if (bound_min is None) != (bound_max is None):
        if bound_min is not None:
            return "bound_min was given without bound_max; sequence packing needs both"
        return "bound_max was given without bound_min; sequence packing needs both"
    if bound_min is not None:
        for item in (("bound_min", bound_min), ("bound_max", bound_max)):
            name, t = item
            if _shape(t) != (seqlen_q,):
                return f"{name} shape {_shape(t)} must be [seqlen_q] = ({seqlen_q},)"
            if str(t.dtype) != str(nl.float32):
                return f"{name} dtype {t.dtype} must be float32"
    if sinks is not None:
        ss = _shape(sinks)
        ok = (len(ss) == 2 and ss == (bs, nheads)) or (len(ss) == 3 and ss[0] == bs and ss[1] == nheads
                                                       and ss[2] >= 1)
        if not ok:
            return f"sinks shape {ss} must be [bs, nheads] = {(bs, nheads)} or [bs, nheads, num_sinks]"
        if not supported_dtype(sinks.dtype):
            return f"sinks dtype {sinks.dtype} is not supported; use one of {_DTYPES}"
    if softmax_scale is not None:
        number = isinstance(softmax_scale, int) or isinstance(softmax_scale, float)
        if isinstance(softmax_scale, bool) or not number or not softmax_scale > 0:
            return f"softmax_scale={softmax_scale!r} must be None or a positive number"
    return None


def attention_shape(q, k, sinks=None, bound_min=None, use_causal_mask=False, softmax_scale=None,
                    sliding_window=None):
    """The ``AttentionShape`` of arguments that ``attention_problem`` accepted."""
    bs, nheads, d_head, seqlen_q = _shape(q)
    nheads_kv = _shape(k)[1]
    seqlen_k = _shape(k)[3]
    d_tiles = -(-d_head // PMAX)
    num_sinks = 0
    sinks_3d = False
    if sinks is not None:
        sinks_3d = len(sinks.shape) == 3
        num_sinks = sinks.shape[2] if sinks_3d else 1
    scale = 1.0 / math.sqrt(d_head) if softmax_scale is None else float(softmax_scale)
    window = 0 if sliding_window is None else sliding_window
    return AttentionShape(bs, nheads, nheads_kv, d_head, seqlen_q, seqlen_k, d_tiles, num_sinks, sinks_3d, scale,
                          bool(use_causal_mask), window, bound_min is not None)


def validate_attention(q, k, v, o=None, dy=None, lse=None, sinks=None, bound_min=None, bound_max=None,
                       use_causal_mask=False, softmax_scale=None, sliding_window=None):
    """Kernel-side check of the arguments of attention_fwd / attention_bwd (assert on ``attention_problem``)
    and their ``AttentionShape``."""
    problem = attention_problem(q, k, v, o, dy, lse, sinks, bound_min, bound_max, use_causal_mask, softmax_scale,
                                sliding_window)
    assert problem is None, problem
    return attention_shape(q, k, sinks, bound_min, use_causal_mask, softmax_scale, sliding_window)
