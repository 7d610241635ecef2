"""Input validation shared by the attention kernels, in NKI's kernel subset.

``attention_problem`` runs at trace time, before any instruction is emitted, and returns the first problem as a
message naming the argument, its value and the rule it breaks (``None`` when the arguments are valid). Kernel code
cannot raise, so the kernels ``assert`` on it (as the NKI Library's ``kernel_assert`` does); host code raises the
same message as ``ValueError`` before launching (``nki_attn.kernel_api``). ``attention_shape`` returns the facts
the kernels need as an ``AttentionShape`` (sizes, head-dim partition tiles, the mask band, the variant flags).
Both kernels implement every variant of docs/semantics.md, so there is one contract for both.
"""
import math

from ..backend import nl
from .band import attention_band
from .score_mods import active_mods, bias_problem, mod_row, mods_problem  # noqa: F401 (bias_problem: re-export)
from .steps import PMAX, head_dim_tiles, is_array, is_number, shape_of, supported_dtype

MAX_D_HEAD = 256
_DTYPES = ("float32", "bfloat16", "float16")  # for messages

# The variant names ``nki_attn.kernel_api.supports`` still takes (every kernel implements all of them; the
# host-side probing that reads this goes away with it).
FEATURES = ("causal_unequal", "head_dim_any", "d_v", "softcap", "alibi", "window_size", "dropout")
DROPOUT_SEED_SHAPE = (2,)  # (seed, offset); (1,) is (seed,) with offset 0: kernels/dropout.py, docs/semantics.md


class AttentionShape(nl.NKIObject):
    """Validated facts of one attention call (all Python values, fixed at trace time).

    Sizes: q ``[bs, nheads, d_qk, seqlen_q]``, k ``[bs, nheads_kv, d_qk, seqlen_k]``, v ``[bs, nheads_kv, d_v,
    seqlen_k]``; group = nheads // nheads_kv (query heads per kv head); ``d_head`` = d_qk (the older name).
    qk_tiles / v_tiles: partition tiles ``[(first row, rows), ...]`` of d_qk / d_v, 128 + remainder
    (``steps.head_dim_tiles``).
    num_sinks: sink logits per head (0 without sinks); sinks_3d: sinks given as ``[bs, nheads, num_sinks]``.
    scale: the softmax scale applied to q.k (default ``1/sqrt(d_qk)``).
    causal, window (sliding window, 0 when none), window_size (``(left, right)``, -1 = unbounded, or None),
    packing (bounds given). off = seqlen_k - seqlen_q; band ``(lo_rel, hi_rel)``: key j is visible to query i
    iff ``i + lo_rel <= j <= i + hi_rel`` (``band.attention_band``, before packing bounds); banded: the band
    masks something. dropout_p (0.0 = off), dropout (p > 0). ``mods`` (the score modifications' kernel arguments
    by keyword), ``active`` (their ``score_mods.SCORE_MODS`` rows applied, in table order); softcap (0.0 = off),
    alibi (slopes given), logit_scale (a per-head logit scale given) for the engine choices.
    """

    def __init__(self, bs, nheads, nheads_kv, d_head, seqlen_q, seqlen_k, num_sinks, sinks_3d, scale,
                 causal, window, packing, d_v, window_size, dropout_p, mods=None):
        self.bs = bs
        self.nheads = nheads
        self.nheads_kv = nheads_kv
        self.group = nheads // nheads_kv
        self.d_head = d_head
        self.d_qk = d_head
        self.d_v = d_v
        self.qk_tiles = head_dim_tiles(d_head)
        self.v_tiles = head_dim_tiles(d_v)
        self.seqlen_q = seqlen_q
        self.seqlen_k = seqlen_k
        self.num_sinks = num_sinks
        self.sinks_3d = sinks_3d
        self.scale = scale
        self.causal = causal
        self.window = window
        self.window_size = window_size
        self.packing = packing
        self.off = seqlen_k - seqlen_q
        band = attention_band(causal, window, window_size, seqlen_q, seqlen_k)
        self.lo_rel = band[0]
        self.hi_rel = band[1]
        self.band = band
        self.banded = not (band[0] <= 1 - seqlen_q and band[1] >= seqlen_k - 1)
        self.dropout_p = dropout_p
        self.dropout = dropout_p > 0.0
        # the score modifications (``score_mods``): the arguments by kernel keyword, the rows applied, and the
        # facts the kernels' engine choices read (the cap's scale, ALiBi's and the logit scale's presence)
        self.mods = mods
        if mods is None:
            self.mods = {}
        self.active = active_mods(mods)
        self.softcap = float(mod_row("softcap").value(mods))
        self.alibi = mod_row("alibi").is_on(mods)
        self.logit_scale = mod_row("logit_scale").is_on(mods)


def sbuf_bytes_per_partition():
    """Usable SBUF bytes per partition of the target (``nl.tile_size.sbuf_fmax_bytes``; NKI before 0.4 only has
    the older name ``total_available_sbuf_size``). Which name exists is decided once, at import, by host
    Python: kernel code has no getattr/hasattr, and the branch not taken is never evaluated."""
    if _HAS_SBUF_FMAX:
        return nl.tile_size.sbuf_fmax_bytes
    return nl.tile_size.total_available_sbuf_size


_HAS_SBUF_FMAX = hasattr(type(nl.tile_size), "sbuf_fmax_bytes") or hasattr(nl.tile_size, "sbuf_fmax_bytes")


def _is_int(x):
    # (NKI's isinstance(True, int) is False, Python's True: the bool test keeps both readings equal)
    return isinstance(x, int) and not isinstance(x, bool)


_shape = shape_of
_is_number = is_number
_is_array = is_array


def _rank4_problem(name, t):
    if len(t.shape) != 4:
        return f"{name} must be 4-D [bs, heads, d_head, seqlen], got shape {_shape(t)}"
    return None


def _shape_problem(q, k, v, o, dy, lse):
    """Ranks, sizes, head dims and dtypes of the tensors (first problem or None)."""
    for item in (("q", q), ("k", k), ("v", v)):
        name, t = item
        problem = _rank4_problem(name, t)
        if problem is not None:
            return problem
    bs, nheads, d_qk, seqlen_q = _shape(q)
    bs_k, nheads_kv, d_k, seqlen_k = _shape(k)
    d_v = _shape(v)[2]
    want_v = (bs_k, nheads_kv, d_v, seqlen_k)
    if _shape(v) != want_v:
        return (f"v shape {_shape(v)} must be [bs, nheads_kv, d_v, seqlen_k] with k's bs, nheads_kv and "
                f"seqlen_k: {want_v}")
    if bs_k != bs:
        return f"k batch {bs_k} must equal q batch {bs}"
    if d_k != d_qk:
        return f"k d_head {d_k} must equal q d_head {d_qk}"
    if nheads_kv < 1 or nheads % nheads_kv != 0:
        return f"nheads={nheads} (q) must be divisible by nheads_kv={nheads_kv} (k, v) for GQA/MQA"
    for item in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        name, n = item
        if n <= 0 or n % PMAX != 0:
            return (f"{name}={n} must be a positive multiple of {PMAX} (pad the sequence and mask the padding; "
                    f"the torch API does this for you)")
    for item in (("d_head", d_qk), ("d_v", d_v)):
        name, d = item
        if d < 1:
            return f"{name}={d} must be >= 1"
        if d > MAX_D_HEAD:
            return f"{name}={d} exceeds the supported maximum {MAX_D_HEAD}"
    dt = str(q.dtype)
    if not supported_dtype(q.dtype):
        return f"q dtype {dt} is not supported; use one of {_DTYPES}"
    for item in (("k", k), ("v", v), ("o", o), ("dy", dy)):
        name, t = item
        if t is not None and str(t.dtype) != dt:
            return f"{name} dtype {t.dtype} must equal q dtype {dt}"
    want_o = (bs, nheads, d_v, seqlen_q)
    for item in (("o", o), ("dy", dy)):
        name, t = item
        if t is not None and _shape(t) != want_o:
            if want_o == _shape(q):
                return f"{name} shape {_shape(t)} must equal q shape {_shape(q)}"
            return f"{name} shape {_shape(t)} must be [bs, nheads, d_v, seqlen_q] = {want_o}"
    if lse is not None:
        want = (bs, nheads, PMAX, seqlen_q // PMAX)
        if _shape(lse) != want:
            return f"lse shape {_shape(lse)} must be [bs, nheads, 128, seqlen_q // 128] = {want}"
        if str(lse.dtype) != str(nl.float32):
            return f"lse dtype {lse.dtype} must be float32"
    return None


def _mask_problem(seqlen_q, seqlen_k, use_causal_mask, sliding_window, window_size, bound_min, bound_max):
    """Causal, sliding window, window_size and packing bounds (first problem or None)."""
    if sliding_window is not None:
        if not _is_int(sliding_window) or sliding_window < 1:
            return f"sliding_window={sliding_window!r} must be None or an int >= 1"
        if not use_causal_mask:
            return f"sliding_window={sliding_window} is only supported with use_causal_mask=True"
    if window_size is not None:
        pair = isinstance(window_size, tuple) or isinstance(window_size, list)
        if not pair or len(window_size) != 2 or not _is_int(window_size[0]) or not _is_int(window_size[1]):
            return f"window_size={window_size!r} must be None or a pair (left, right) of ints, -1 = unbounded"
        if window_size[0] < -1 or window_size[1] < -1:
            return f"window_size={window_size!r}: each side must be >= 0, or -1 for unbounded"
        if sliding_window is not None:
            return (f"window_size={window_size!r} and sliding_window={sliding_window} were both given; use one "
                    f"(sliding_window=W is window_size=(W - 1, 0) with use_causal_mask=True)")
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
    return None


def _dropout_problem(dropout_p, dropout_seed):
    """dropout_p and dropout_seed (first problem or None)."""
    if not _is_number(dropout_p) or not (dropout_p >= 0.0 and dropout_p < 1.0):
        return f"dropout_p={dropout_p!r} must be a number in [0, 1) (the kept probabilities are scaled by 1/(1-p))"
    if dropout_p > 0.0:
        if dropout_seed is None:
            return f"dropout_p={dropout_p} needs dropout_seed (an int32 or uint32 HBM tensor), got None"
        if not _is_array(dropout_seed):
            return f"dropout_seed={dropout_seed!r} must be an int32 or uint32 HBM tensor, not a Python value"
        name = str(dropout_seed.dtype)
        if name != str(nl.int32) and name != str(nl.uint32):
            return f"dropout_seed dtype {dropout_seed.dtype} must be int32 or uint32"
        if _shape(dropout_seed) != DROPOUT_SEED_SHAPE and _shape(dropout_seed) != (1,):
            return (f"dropout_seed shape {_shape(dropout_seed)} must be {DROPOUT_SEED_SHAPE}: (seed, offset), or "
                    f"(1,): (seed,) with offset 0")
    elif dropout_seed is not None:
        return "dropout_seed was given with dropout_p=0.0; pass dropout_seed only when dropout_p > 0"
    return None


def attention_problem(q, k, v, o=None, dy=None, lse=None, sinks=None, bound_min=None, bound_max=None,
                      use_causal_mask=False, softmax_scale=None, sliding_window=None, window_size=None,
                      dropout_p=0.0, dropout_seed=None, mods=None, kernel="this kernel"):
    """Check the arguments of attention_fwd / attention_bwd: ``None`` when they are valid, else the first
    problem as a message naming the argument, its value and the rule. The kernels ``assert`` on it (kernel
    code cannot raise); the host-side entry points (``nki_attn.kernel_api``, the torch API) raise it as
    ``ValueError`` before launching.

    Layouts: q ``[bs, nheads, d_qk, seqlen_q]``; k ``[bs, nheads_kv, d_qk, seqlen_k]``; v ``[bs, nheads_kv, d_v,
    seqlen_k]``; o, dy ``[bs, nheads, d_v, seqlen_q]``; lse float32 ``[bs, nheads, 128, seqlen_q // 128]``;
    sinks ``[bs, nheads]`` or ``[bs, nheads, num_sinks]``; bound_min, bound_max float32 ``[seqlen_q]``;
    dropout_seed an int32 / uint32 tensor ``[2]`` = (seed, offset) (or ``[1]``, offset 0) (docs/semantics.md,
    "Dropout"). Scalars: window_size None or ``(left, right)`` ints >= -1 (-1 = unbounded), not with
    sliding_window; dropout_p in [0, 1) with dropout_seed given iff dropout_p > 0. ``mods``: the score
    modifications' arguments by kernel keyword (``{"softcap": 50.0, "alibi_slopes": t, "attn_bias": t,
    "bias_grad": True, "logit_scale": t}``, a keyword not given is off), each checked by its ``SCORE_MODS``
    row's rule. ``kernel`` is accepted and ignored.
    """
    problem = _shape_problem(q, k, v, o, dy, lse)
    if problem is not None:
        return problem
    bs, nheads, _, seqlen_q = _shape(q)
    seqlen_k = _shape(k)[3]
    problem = _mask_problem(seqlen_q, seqlen_k, use_causal_mask, sliding_window, window_size, bound_min,
                            bound_max)
    if problem is not None:
        return problem
    if sinks is not None:
        ss = _shape(sinks)
        ok = (len(ss) == 2 and ss == (bs, nheads)) or (len(ss) == 3 and ss[0] == bs and ss[1] == nheads
                                                       and ss[2] >= 1)
        if not ok:
            return f"sinks shape {ss} must be [bs, nheads] = {(bs, nheads)} or [bs, nheads, num_sinks]"
        if not supported_dtype(sinks.dtype):
            return f"sinks dtype {sinks.dtype} is not supported; use one of {_DTYPES}"
    if softmax_scale is not None:
        if not _is_number(softmax_scale) or not softmax_scale > 0:
            return f"softmax_scale={softmax_scale!r} must be None or a positive number"
    problem = mods_problem(mods, bs, nheads, seqlen_q, seqlen_k)
    if problem is not None:
        return problem
    return _dropout_problem(dropout_p, dropout_seed)


def attention_shape(q, k, sinks=None, bound_min=None, use_causal_mask=False, softmax_scale=None,
                    sliding_window=None, v=None, window_size=None, dropout_p=0.0, mods=None):
    """The ``AttentionShape`` of arguments that ``attention_problem`` accepted (``v`` gives d_v; without it
    d_v = d_qk; ``mods`` the score modifications' arguments by kernel keyword)."""
    bs, nheads, d_head, seqlen_q = _shape(q)
    nheads_kv = _shape(k)[1]
    seqlen_k = _shape(k)[3]
    d_v = d_head
    if v is not None:
        d_v = _shape(v)[2]
    num_sinks = 0
    sinks_3d = False
    if sinks is not None:
        sinks_3d = len(sinks.shape) == 3
        num_sinks = sinks.shape[2] if sinks_3d else 1
    scale = 1.0 / math.sqrt(d_head) if softmax_scale is None else float(softmax_scale)
    window = 0 if sliding_window is None else sliding_window
    pair = None
    if window_size is not None:
        pair = (window_size[0], window_size[1])
    return AttentionShape(bs, nheads, nheads_kv, d_head, seqlen_q, seqlen_k, num_sinks, sinks_3d, scale,
                          bool(use_causal_mask), window, bound_min is not None, d_v, pair, float(dropout_p), mods)
