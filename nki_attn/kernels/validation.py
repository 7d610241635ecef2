"""Input validation shared by the attention kernels.

Runs at trace time, before any instruction is emitted, and raises ``ValueError`` naming the argument, its value
and the rule it breaks. Returns the shape facts the kernels need as an ``AttentionShape``.
"""
import math

from ..backend import nl

PMAX = 128
MAX_D_HEAD = 256
_DTYPES = ("float32", "bfloat16", "float16")


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
    return tuple(int(s) for s in t.shape)


def _check_rank4(name, t):
    if len(t.shape) != 4:
        raise ValueError(f"{name} must be 4-D [bs, heads, d_head, seqlen], got shape {_shape(t)}")


def validate_attention(q, k, v, o=None, dy=None, lse=None, sinks=None, bound_min=None, bound_max=None,
                       use_causal_mask=False, softmax_scale=None, sliding_window=None):
    """Check the arguments of attention_fwd / attention_bwd and return an ``AttentionShape``.

    Layouts: q, o, dy ``[bs, nheads, d_head, seqlen_q]``; k, v ``[bs, nheads_kv, d_head, seqlen_k]``;
    lse float32 ``[bs, nheads, 128, seqlen_q // 128]``; sinks ``[bs, nheads]`` or ``[bs, nheads, num_sinks]``;
    bound_min, bound_max float32 ``[seqlen_q]``.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_rank4(name, t)
    bs, nheads, d_head, seqlen_q = _shape(q)
    bs_k, nheads_kv, d_k, seqlen_k = _shape(k)
    if _shape(v) != _shape(k):
        raise ValueError(f"v shape {_shape(v)} must equal k shape {_shape(k)}")
    if bs_k != bs:
        raise ValueError(f"k batch {bs_k} must equal q batch {bs}")
    if d_k != d_head:
        raise ValueError(f"k d_head {d_k} must equal q d_head {d_head}")
    if nheads_kv < 1 or nheads % nheads_kv != 0:
        raise ValueError(f"nheads={nheads} (q) must be divisible by nheads_kv={nheads_kv} (k, v) for GQA/MQA")
    for name, n in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        if n <= 0 or n % PMAX != 0:
            raise ValueError(f"{name}={n} must be a positive multiple of {PMAX} (pad the sequence and mask the "
                             f"padding; the torch API does this for you)")
    if d_head > MAX_D_HEAD:
        raise ValueError(f"d_head={d_head} exceeds the supported maximum {MAX_D_HEAD}")
    d_tiles = -(-d_head // PMAX)
    if d_head % d_tiles != 0:
        raise ValueError(f"d_head={d_head} cannot be split into {d_tiles} equal partition tiles of at most {PMAX}")
    dt = str(q.dtype)
    if dt not in _DTYPES:
        raise ValueError(f"q dtype {dt} is not supported; use one of {_DTYPES}")
    for name, t in (("k", k), ("v", v), ("o", o), ("dy", dy)):
        if t is not None and str(t.dtype) != dt:
            raise ValueError(f"{name} dtype {t.dtype} must equal q dtype {dt}")
    for name, t in (("o", o), ("dy", dy)):
        if t is not None and _shape(t) != _shape(q):
            raise ValueError(f"{name} shape {_shape(t)} must equal q shape {_shape(q)}")
    if lse is not None:
        want = (bs, nheads, PMAX, seqlen_q // PMAX)
        if _shape(lse) != want:
            raise ValueError(f"lse shape {_shape(lse)} must be [bs, nheads, 128, seqlen_q // 128] = {want}")
        if str(lse.dtype) != "float32":
            raise ValueError(f"lse dtype {lse.dtype} must be float32")
    if use_causal_mask and seqlen_q != seqlen_k:
        raise ValueError(f"use_causal_mask=True needs seqlen_q == seqlen_k, got {seqlen_q} and {seqlen_k}")
    window = 0
    if sliding_window is not None:
        if not isinstance(sliding_window, int) or isinstance(sliding_window, bool) or sliding_window < 1:
            raise ValueError(f"sliding_window={sliding_window!r} must be None or an int >= 1")
        if not use_causal_mask:
            raise ValueError(f"sliding_window={sliding_window} is only supported with use_causal_mask=True")
        window = sliding_window
    if (bound_min is None) != (bound_max is None):
        given = "bound_min" if bound_min is not None else "bound_max"
        missing = "bound_max" if bound_min is not None else "bound_min"
        raise ValueError(f"{given} was given without {missing}; sequence packing needs both")
    packing = bound_min is not None
    if packing:
        for name, t in (("bound_min", bound_min), ("bound_max", bound_max)):
            if _shape(t) != (seqlen_q,):
                raise ValueError(f"{name} shape {_shape(t)} must be [seqlen_q] = ({seqlen_q},)")
            if str(t.dtype) != "float32":
                raise ValueError(f"{name} dtype {t.dtype} must be float32")
    num_sinks, sinks_3d = 0, False
    if sinks is not None:
        ss = _shape(sinks)
        if len(ss) == 2 and ss == (bs, nheads):
            num_sinks = 1
        elif len(ss) == 3 and ss[:2] == (bs, nheads) and ss[2] >= 1:
            num_sinks, sinks_3d = ss[2], True
        else:
            raise ValueError(f"sinks shape {ss} must be [bs, nheads] = {(bs, nheads)} or [bs, nheads, num_sinks]")
        if str(sinks.dtype) not in _DTYPES:
            raise ValueError(f"sinks dtype {sinks.dtype} is not supported; use one of {_DTYPES}")
    if softmax_scale is None:
        scale = 1.0 / math.sqrt(d_head)
    else:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) or not softmax_scale > 0:
            raise ValueError(f"softmax_scale={softmax_scale!r} must be None or a positive number")
        scale = float(softmax_scale)
    return AttentionShape(bs, nheads, nheads_kv, d_head, seqlen_q, seqlen_k, d_tiles, num_sinks, sinks_3d, scale,
                          bool(use_causal_mask), window, packing)
