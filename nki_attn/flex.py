"""``flex_attention``: torch's FlexAttention signature on the NKI kernels, with block masks and built-in score mods.

    out = flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                         return_lse=False)

Layouts as torch: query ``[B, Hq, Sq, D]``, key ``[B, Hkv, Sk, D]``, value ``[B, Hkv, Sk, Dv]`` -> out
``[B, Hq, Sq, Dv]`` (and lse float32 ``[B, Hq, Sq]``, natural log, with ``return_lse``). Differentiable with
respect to query, key and value (the backward kernel; torch's own FlexAttention has no backward on CPU).

``block_mask``: a ``nki_attn.BlockMask`` (``nki_attn.create_block_mask``) of shape ``(1 or B, 1 or Hq, Sq,
Sk)``; None attends to every key. The kernels skip its SKIP tiles, run its FULL tiles without a mask and mask its
PARTIAL tiles with their bitmaps (docs/masks.md). A row that sees no key gives 0 and lse ``+inf`` (torch's
FlexAttention returns lse ``-inf`` there; both give a zero output).

``score_mod``: the kernels are fixed NKI code, so an arbitrary Python ``score_mod`` cannot run in them. The
built-in modifications, the rows of ``nki_attn.spec.SCORE_MODS``, are accepted as markers (one, or a list
applied in the kernels' order: logit scale, soft-cap, ALiBi, bias), each checked by its row as the same keyword
of ``flash_attn_func`` is: ``logit_scale(t)`` (``score *= t[h]`` or ``t[b, h]``, differentiable), ``softcap(c)`` (``score = c * tanh(score / c)``), ``alibi(slopes)`` (``score -= slopes[h] *
|q_idx + Sk - Sq - kv_idx|``, FlashAttention's bottom-right distance, which is ``|q_idx - kv_idx|`` when Sq ==
Sk) and ``bias(t)`` (``score += t[b, h, q_idx, kv_idx]``, differentiable: a block-sparse learned bias). Anything
else raises TypeError naming these.

It is a thin function over the one op pair ``torch.ops.nki_attn.attention_fwd`` / ``attention_bwd``
(``nki_attn.ops.attention``): it builds an ``AttentionSpec`` whose ``block_mask`` holds the mask's kernel
operands, so compile with ``fullgraph=True`` keeps one opaque node per direction and FakeTensor / ``meta`` inputs
get shapes only.
"""
import math
import numbers

import torch

from .block_mask import BLOCK, BlockMask, create_block_mask
from .ops import attention
from .spec import DTYPES, MAX_D_HEAD, MODS, SCORE_MODS, AttentionSpec, Dims, check_device, check_mods, resolve_scale

__all__ = ["flex_attention", "softcap", "alibi", "bias", "SoftCap", "ALiBi", "Bias", "Marker", "full_block_mask"]

_CONTIG = torch.contiguous_format
FN = "flex_attention"


def _fail(name, value, rule, exc=ValueError):
    raise exc(f"{FN}: {name}={value}: {rule}")


# ----------------------------------------------------------------------------------------------------- score mods
class SoftCap:
    """Score-mod marker: ``score = cap * tanh(score / cap)`` (Gemma-2's logit soft-capping), cap > 0."""

    def __init__(self, cap):
        if isinstance(cap, bool) or not isinstance(cap, numbers.Real) or not (math.isfinite(cap) and cap > 0):
            raise ValueError(f"softcap: cap={cap!r}: must be a finite real > 0")
        self.cap = float(cap)

    def __repr__(self):
        return f"softcap({self.cap})"


class ALiBi:
    """Score-mod marker: ``score -= slopes[h] * |q_idx + Sk - Sq - kv_idx|``; slopes float32 ``[Hq]`` or
    ``[B, Hq]``."""

    def __init__(self, slopes):
        if not isinstance(slopes, torch.Tensor) or slopes.dtype != torch.float32 or slopes.dim() not in (1, 2):
            raise TypeError(f"alibi: slopes={type(slopes).__name__}: must be a float32 tensor [Hq] or [B, Hq]")
        self.slopes = slopes

    def __repr__(self):
        return f"alibi(slopes {tuple(self.slopes.shape)})"


class Bias:
    """Score-mod marker: ``score += bias[b, h, q_idx, kv_idx]``, an additive bias broadcastable to ``[B, Hq, Sq,
    Sk]`` (each dim 1 or the call's size; float32, bfloat16 or float16), with its gradient when it requires one
    (reduced over the broadcast dims). Added after soft-capping and ALiBi; hidden keys stay hidden."""

    def __init__(self, bias):
        if not isinstance(bias, torch.Tensor) or bias.dim() != 4 or bias.dtype not in DTYPES:
            raise TypeError(f"bias: bias={type(bias).__name__}: must be a 4-D float32 / bfloat16 / float16 tensor "
                            f"broadcastable to [B, Hq, Sq, Sk]")
        self.bias = bias

    def __repr__(self):
        return f"bias({tuple(self.bias.shape)})"


def bias(t):
    """The additive-bias score mod (a marker the kernels run natively, with its gradient):
    ``score += t[b, h, q_idx, kv_idx]``."""
    return Bias(t)


def softcap(cap):
    """The soft-capping score mod (a marker the kernels run natively): ``score = cap * tanh(score / cap)``."""
    return SoftCap(cap)


def alibi(slopes):
    """The ALiBi score mod (a marker the kernels run natively): ``score -= slopes[h] * distance``."""
    return ALiBi(slopes)


class Marker:
    """Score-mod marker of any row of ``nki_attn.spec.SCORE_MODS`` without a class of its own (e.g.
    ``logit_scale(t)``: ``score *= t[b, h]`` before the other modifications, with its gradient); its value is
    checked by the row, as the same keyword of ``flash_attn_func`` is."""

    def __init__(self, name, value):
        self.name = name
        self.value = value

    def __repr__(self):
        v = self.value
        return f"{self.name}({tuple(v.shape) if isinstance(v, torch.Tensor) else v})"


SoftCap.name, ALiBi.name, Bias.name = "softcap", "alibi", "bias"
SoftCap.value = property(lambda self: self.cap)
ALiBi.value = property(lambda self: self.slopes)
Bias.value = property(lambda self: self.bias)


def _marker_fn(name):
    def make(value):
        return Marker(name, value)
    make.__name__ = make.__qualname__ = name
    make.__doc__ = f"The ``{name}`` score mod (a marker the kernels run natively; ``nki_attn.spec.SCORE_MODS``)."
    return make


# every other row of the table gets its marker function here, under the row's name
for _m in SCORE_MODS:
    if _m.name not in globals():
        globals()[_m.name] = _marker_fn(_m.name)
        __all__.append(_m.name)

_SUPPORTED = ("score_mod must be None, " + ", ".join(f"nki_attn.flex.{m.name}(...)" for m in SCORE_MODS) +
              " or a list of them: the NKI kernels are fixed code and cannot run an arbitrary Python score_mod "
              "(express a mask as a mask_mod in nki_attn.create_block_mask instead)")


def _score_mods(score_mod, dims):
    """``{spec field: value}`` of the markers, each checked by its ``SCORE_MODS`` row."""
    mods = [] if score_mod is None else list(score_mod) if isinstance(score_mod, (list, tuple)) else [score_mod]
    given = {}
    for m in mods:
        row = MODS.get(getattr(m, "name", None)) if isinstance(m, (Marker, SoftCap, ALiBi, Bias)) else None
        if row is None or row.keyword in given:
            name = getattr(m, "__name__", type(m).__name__)
            _fail("score_mod", name, _SUPPORTED + " (each marker at most once)", TypeError)
        given[row.keyword] = m.value
    return check_mods(FN, given, dims)


# ----------------------------------------------------------------------------------------------------- masks
_FULL = {}


def full_block_mask(q_len, kv_len):
    """The block mask that hides nothing but the padding (what ``block_mask=None`` means); cached per lengths."""
    key = (q_len, kv_len)
    if key not in _FULL:
        _FULL[key] = create_block_mask(_all_visible, None, None, q_len, kv_len)
    return _FULL[key]


def _all_visible(b, h, q_idx, kv_idx):
    return torch.ones((), dtype=torch.bool).expand(1, 1, 1, 1)


# ----------------------------------------------------------------------------------------------------- public
def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                   return_lse=False):
    """``torch.nn.attention.flex_attention.flex_attention`` on the NKI kernels (module docstring).

    Args:
        query: ``[B, Hq, Sq, D]``; key: ``[B, Hkv, Sk, D]``; value: ``[B, Hkv, Sk, Dv]``; float32, bfloat16 or
            float16, one dtype and device; D, Dv <= 256; Hq == Hkv unless ``enable_gqa`` (then Hq % Hkv == 0).
        score_mod: None or built-in markers (``softcap``, ``alibi``; module docstring); else TypeError.
        block_mask: None or a ``BlockMask`` with ``seq_lengths == (Sq, Sk)`` and batch / head extents 1 or
            B / Hq (ValueError otherwise, before any kernel runs).
        scale: the score scale, default ``1 / sqrt(D)``.
        enable_gqa: bool, as torch.
        return_lse: also return lse float32 ``[B, Hq, Sq]`` (not differentiable; +inf for rows with no key).
    Returns:
        out ``[B, Hq, Sq, Dv]`` in query's dtype, or ``(out, lse)``.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            _fail(name, type(t).__name__, "must be a torch.Tensor", TypeError)
        if t.dim() != 4:
            _fail(f"{name}.shape", tuple(t.shape), "must be 4-D [B, H, S, D]")
    if not isinstance(enable_gqa, bool):
        _fail("enable_gqa", repr(enable_gqa), "must be a bool", TypeError)
    if not isinstance(return_lse, bool):
        _fail("return_lse", repr(return_lse), "must be a bool", TypeError)
    if query.dtype not in DTYPES:
        _fail("query.dtype", query.dtype, "must be float32, bfloat16 or float16")
    for name, t in (("key", key), ("value", value)):
        if t.dtype != query.dtype:
            _fail(f"{name}.dtype", t.dtype, f"must equal query.dtype {query.dtype}")
        if t.device != query.device:
            _fail(f"{name}.device", t.device, f"must equal query.device {query.device}")
    check_device(query, "query")
    b, hq, sq, d = (int(x) for x in query.shape)
    hk, sk = int(key.shape[1]), int(key.shape[2])
    dv = int(value.shape[3])
    if tuple(key.shape[:1]) != (b,) or int(key.shape[3]) != d:
        _fail("key.shape", tuple(key.shape), f"must be [B, Hkv, Sk, D] with B = {b}, D = {d}")
    if tuple(value.shape[:3]) != tuple(key.shape[:3]):
        _fail("value.shape", tuple(value.shape), f"must be [B, Hkv, Sk, Dv] matching key {tuple(key.shape)}")
    if d > MAX_D_HEAD or dv > MAX_D_HEAD or min(b, hq, hk, sq, sk, d, dv) < 1:
        _fail("shapes", (tuple(query.shape), tuple(value.shape)), f"sizes must be >= 1 and D, Dv <= {MAX_D_HEAD}")
    if hq != hk and not enable_gqa:
        _fail("key.shape[1]", hk, f"differs from query's {hq} heads: pass enable_gqa=True for GQA / MQA")
    if hq % hk != 0:
        _fail("key.shape[1]", hk, f"the {hk} key/value heads must divide the {hq} query heads")
    scale = resolve_scale(FN, scale, d, "scale")
    mods = _score_mods(score_mod, Dims(b, hq, sq, sk, query.device))
    if mods.get("alibi") is not None and (sk - sq) % BLOCK != 0:
        _fail("score_mod", "alibi", f"needs Sk - Sq a multiple of {BLOCK} (got Sq={sq}, Sk={sk}): the kernels "
              f"measure the bottom-right distance on tile-padded lengths", NotImplementedError)
    if block_mask is None:
        block_mask = full_block_mask(sq, sk)
    if not isinstance(block_mask, BlockMask):
        _fail("block_mask", type(block_mask).__name__, "must be None or an nki_attn.BlockMask (from "
              "nki_attn.create_block_mask; torch's own BlockMask is not accepted: build ours from the same "
              "mask_mod)", TypeError)
    if block_mask.seq_lengths != (sq, sk):
        _fail("block_mask", f"a mask for (Q_LEN, KV_LEN) = {block_mask.seq_lengths}",
              f"must match the call's (Sq, Sk) = {(sq, sk)}")
    n_b, n_h = block_mask.shape[:2]
    if n_b not in (1, b) or n_h not in (1, hq):
        _fail("block_mask", f"a mask of shape {block_mask.shape}", f"its B and H must be 1 (broadcast) or the "
              f"call's B = {b} and Hq = {hq}")
    (n_b, n_h, _), store = block_mask.kernel_operands()
    spec = AttentionSpec(FN, b, sq, sk, hq, hk, d, dv, query.dtype, scale, block_mask=(block_mask.union_rows(),
                         store, n_b, n_h), **mods)
    out, lse = attention(spec, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2))
    out = out.transpose(1, 2)
    return (out, lse) if return_lse else out
