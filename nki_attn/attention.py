"""PyTorch API: FlashAttention-compatible and SDPA-compatible attention running the NKI kernels.

Entry points (all differentiable with respect to q, k, v and sinks):

- ``flash_attn_func``, ``flash_attn_qkvpacked_func``, ``flash_attn_kvpacked_func`` — FlashAttention's layout
  ``[batch, seqlen, heads, head_dim]``, signatures and conventions (flash_attn_interface.py);
- ``flash_attn_varlen_func``, ``flash_attn_varlen_qkvpacked_func``, ``flash_attn_varlen_kvpacked_func`` —
  packed ``[total_tokens, heads, head_dim]`` sequences described by cu_seqlens;
- ``scaled_dot_product_attention`` — torch's layout ``[..., heads, seqlen, head_dim]`` and argument names.

Each validates its arguments (plain Python on shapes and values, which ``torch.compile(fullgraph=True)`` traces
without a break) and calls one custom op per direction, ``nki_attn::flash_fwd`` / ``flash_bwd``, in
FlashAttention's layout. Those hold the layout work around the kernel ops of ``nki_attn.ops``: the kernels want
``[b, h, d, s]`` with s a multiple of 128, so the ops permute, zero-pad lengths that are not multiples of 128,
mask the padded keys and drop the padded query rows; callers never see padded values or gradients. Keeping that
work inside the ops leaves a compiled graph with one opaque node per direction.

Every mask is a per-query key interval. Equal lengths with causal order (with or without a sliding window) use
the kernels' native ``use_causal_mask`` / ``sliding_window``, which skip masked tiles at trace time; any other
interval — FlashAttention windows, bottom-right alignment for seqlen_q != seqlen_k, padded keys, packed
sequences, interval masks — goes through the kernels' per-query bounds ``[bound_min, bound_max)``.
"""
import math
import numbers
from typing import Optional

import torch

from . import ops
from .ops import PMAX, _fail

MAX_PROBS_ELEMENTS = 1 << 24  # return_attn_probs materialises S_dmask up to this many elements (64 MiB fp32)
MAX_EXACT_KEY = 1 << 24  # bounds are float32: key indices up to 2**24 are exact

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "scaled_dot_product_attention"]


# ----------------------------------------------------------------------------------------------------- arguments
@torch.compiler.assume_constant_result
def _supports(feature):
    """kernel_api.supports: whether both kernels implement a variant (imported late: it loads the kernels). A
    constant of the process, so ``torch.compile`` evaluates it once at trace time instead of tracing it."""
    from . import kernel_api  # noqa: PLC0415
    return kernel_api.supports(feature)


def _check_tensor(fn, name, t):
    if not isinstance(t, torch.Tensor):
        _fail(fn, name, type(t).__name__, "must be a torch.Tensor", TypeError)


def _check_bool(fn, name, x):
    if not isinstance(x, bool):
        _fail(fn, name, repr(x), "must be a bool (True or False)", TypeError)
    return x


def _is_int(x):
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_real(fn, name, x):
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        _fail(fn, name, repr(x), "must be a real number", TypeError)
    return float(x)


def _check_dropout(fn, dropout_p):
    """dropout_p as a float in [0, 1); NotImplementedError when > 0 and the kernels have no dropout step."""
    p = _check_real(fn, "dropout_p", dropout_p)
    if not 0.0 <= p < 1.0:
        _fail(fn, "dropout_p", p, "must be a probability in [0, 1) (kept probabilities are scaled by 1/(1-p))")
    if p != 0.0 and not _supports("dropout"):
        _fail(fn, "dropout_p", p, "dropout is not implemented by the NKI kernels of this build; only 0.0 is "
                                  "accepted", NotImplementedError)
    return p


def _check_softcap(fn, softcap):
    cap = _check_real(fn, "softcap", softcap)
    if not (math.isfinite(cap) and cap >= 0.0):
        _fail(fn, "softcap", cap, "must be finite and >= 0 (0.0 deactivates soft-capping)")
    if cap != 0.0 and not _supports("softcap"):
        _fail(fn, "softcap", cap, "logit soft-capping is not implemented by the NKI kernels of this build; only "
                                  "0.0 (deactivated) is accepted", NotImplementedError)
    return cap


def _check_alibi(fn, alibi_slopes, batch, hq, q):
    """FlashAttention's ALiBi slopes: float32 ``[nheads]`` or ``[batch, nheads]`` (None: no ALiBi)."""
    if alibi_slopes is None:
        return None
    _check_tensor(fn, "alibi_slopes", alibi_slopes)
    shape = tuple(alibi_slopes.shape)
    if shape != (hq,) and shape != (batch, hq):
        _fail(fn, "alibi_slopes.shape", shape, f"must be [nheads] = [{hq}] or [batch, nheads] = [{batch}, {hq}]")
    if alibi_slopes.dtype != torch.float32:
        _fail(fn, "alibi_slopes.dtype", alibi_slopes.dtype, "must be torch.float32 (as FlashAttention)")
    if alibi_slopes.device != q.device:
        _fail(fn, "alibi_slopes.device", alibi_slopes.device, f"must equal q.device {q.device}")
    if not _supports("alibi"):
        _fail(fn, "alibi_slopes", shape, "ALiBi is not implemented by the NKI kernels of this build; only None is "
                                         "accepted", NotImplementedError)
    return alibi_slopes


def _check_flags(fn, deterministic, return_attn_probs):
    _check_bool(fn, "deterministic", deterministic)  # always honoured: the kernels are deterministic
    _check_bool(fn, "return_attn_probs", return_attn_probs)


def _check_fa_extras(fn, softcap, alibi_slopes, deterministic, return_attn_probs):
    """For entry points that implement none of the variants (ring attention): soft-capping and ALiBi accepted at
    their neutral values (0.0 / None) only, NotImplementedError otherwise."""
    cap = _check_real(fn, "softcap", softcap)
    if cap != 0.0:
        _fail(fn, "softcap", cap, "logit soft-capping is not implemented here; only 0.0 (deactivated)",
              NotImplementedError)
    if alibi_slopes is not None:
        shape = tuple(alibi_slopes.shape) if isinstance(alibi_slopes, torch.Tensor) else type(alibi_slopes).__name__
        _fail(fn, "alibi_slopes", shape, "ALiBi is not implemented here; only None", NotImplementedError)
    _check_flags(fn, deterministic, return_attn_probs)


SEED_MAX = (1 << 32) - 1


def dropout_seed_tensor(seed, offset=0, device="cpu"):
    """The kernels' dropout seed for ints ``seed`` and ``offset`` in ``[0, 2**32)``: int32 ``[2]`` =
    ``(seed, offset)`` (``nki_attn.dropout.make_seed``; docs/semantics.md, "Dropout")."""
    from .dropout import make_seed  # noqa: PLC0415
    return make_seed(int(seed), int(offset)).to(device)


def _dropout_seed(fn, p, dropout_seed, generator, device):
    """The seed tensor of a call with dropout ``p`` (None when p == 0): from ``dropout_seed`` (an int, or an
    int32/uint32 ``[2]`` (seed, offset) tensor), else drawn from ``generator`` (default: torch's global generator,
    so ``torch.manual_seed`` makes the call reproducible, as FlashAttention's CUDA generator state does)."""
    if generator is not None and not isinstance(generator, torch.Generator):
        _fail(fn, "generator", type(generator).__name__, "must be a torch.Generator or None", TypeError)
    if dropout_seed is not None and generator is not None:
        _fail(fn, "dropout_seed", repr(dropout_seed), "give dropout_seed or generator, not both")
    if isinstance(dropout_seed, torch.Tensor):
        if tuple(dropout_seed.shape) not in ((2,), (1,)) or dropout_seed.dtype not in (torch.int32, torch.uint32):
            _fail(fn, "dropout_seed", f"{dropout_seed.dtype} {tuple(dropout_seed.shape)}",
                  "a seed tensor must be int32 or uint32 [2] = (seed, offset) or [1] = (seed,) (or pass an int)")
        seed = dropout_seed.to(device)
    elif dropout_seed is not None:
        if not _is_int(dropout_seed) or not 0 <= dropout_seed <= SEED_MAX:
            _fail(fn, "dropout_seed", repr(dropout_seed), f"must be an int in [0, {SEED_MAX}], a seed tensor or None")
        seed = dropout_seed_tensor(dropout_seed, 0, device)
    elif p == 0.0:
        seed = None
    else:
        from .dropout import seed_from_generator  # noqa: PLC0415
        seed = seed_from_generator(torch.default_generator if generator is None else generator).to(device)
    return seed if p != 0.0 else None


def _window(fn, window_size, causal):
    """FlashAttention's window_size=(left, right) -> (left, right), -1 = unbounded; causal forces right = 0."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        _fail(fn, "window_size", repr(window_size), "must be a pair (left, right) of ints, -1 meaning unbounded",
              TypeError)
    for x in window_size:
        if not _is_int(x):
            _fail(fn, "window_size", repr(tuple(window_size)), "entries must be ints (-1 means unbounded)",
                  TypeError)
    left, right = int(window_size[0]), int(window_size[1])
    if left < -1 or right < -1:
        _fail(fn, "window_size", (left, right), "entries must be >= -1 (-1 means unbounded)")
    if causal:
        right = 0  # FlashAttention: causal attention sees nothing to the right, whatever the window says
    return left, right


def _check_qkv(fn, q, k, v, rank, names=("q", "k", "v")):
    for name, t in zip(names, (q, k, v)):
        _check_tensor(fn, name, t)
        if t.dim() != rank:
            _fail(fn, f"{name}.shape", tuple(t.shape), f"must be {rank}-D")
    for name, t in zip(names[1:], (k, v)):
        if t.dtype != q.dtype:
            _fail(fn, f"{name}.dtype", t.dtype, f"must equal {names[0]}.dtype {q.dtype}")
        if t.device != q.device:
            _fail(fn, f"{name}.device", t.device, f"must equal {names[0]}.device {q.device}")
    if q.dtype not in ops.DTYPES:
        _fail(fn, f"{names[0]}.dtype", q.dtype, "must be float32, bfloat16 or float16")
    if k.shape[:-1] != v.shape[:-1]:
        _fail(fn, f"{names[2]}.shape", tuple(v.shape), f"must equal {names[1]}.shape {tuple(k.shape)} except in "
                                                       f"the last dim (head_dim_v may differ from head_dim)")
    ops.check_device(q, names[0])


def _check_heads(fn, hq, hk, name):
    if hk == 0 and hq == 0:
        return
    if hk < 1 or hq % hk != 0:
        _fail(fn, name, hk, f"the number of key/value heads must be >= 1 and divide the {hq} query heads")


def _check_head_dim(fn, d, name):
    if d > ops.MAX_D_HEAD:
        _fail(fn, name, d, f"head_dim must be at most {ops.MAX_D_HEAD}")  # 0 is fine: empty output, as torch


def _check_sinks(fn, sinks, hq, q):
    if sinks is None:
        return
    _check_tensor(fn, "sinks", sinks)
    if sinks.dim() not in (1, 2) or sinks.shape[0] != hq or (sinks.dim() == 2 and sinks.shape[1] < 1):
        _fail(fn, "sinks.shape", tuple(sinks.shape), f"must be [heads] = [{hq}] or [heads, num_sinks]")
    if not sinks.is_floating_point():
        _fail(fn, "sinks.dtype", sinks.dtype, "must be a floating dtype")
    if sinks.device != q.device:
        _fail(fn, "sinks.device", sinks.device, f"must equal q.device {q.device}")


# ----------------------------------------------------------------------------------------------------- masks
def _round_up(n):
    return max(PMAX, -(-n // PMAX) * PMAX)


def window_intervals(sq, sk, left, right, shift, device=None):
    """Key interval ``[lo, hi)`` of each query i < sq (int64 [sq] each): keys ``i + shift - left ..
    i + shift + right`` (a side of -1 is unbounded) within ``[0, sk)``; ``hi == lo`` when none is visible."""
    i = torch.arange(sq, dtype=torch.int64, device=device)
    lo = (i + shift - left).clamp(0, sk) if left >= 0 else torch.zeros_like(i)
    hi = (i + shift + right + 1).clamp(0, sk) if right >= 0 else torch.full_like(i, sk)
    return lo, torch.maximum(hi, lo)


def _bounds(lo, hi, pad_to, front=0):
    """float32 [pad_to] kernel bounds from int64 [n] intervals placed at rows ``front .. front + n``; padded
    query rows see no key."""
    n = lo.shape[0]
    f = lo.new_zeros(front)
    z = lo.new_zeros(pad_to - n - front)
    return torch.cat([f, lo, z]).to(torch.float32), torch.cat([f, hi, z]).to(torch.float32)


class _Plan:
    """How one call reaches the kernels: the kernel lengths, the front padding of the query rows, the kernels'
    mask arguments and the padded head dims.

    q row i becomes kernel row ``front + i`` (front > 0 only to keep the bottom-right alignment, see
    ``_Mask.plan``); key j stays key j; rows and keys past the real ones are zero padding (padded keys are masked
    by bounds, padded rows are dropped)."""

    __slots__ = ("front", "sq_k", "sk_k", "causal", "window", "window_size", "bmin", "bmax")

    def __init__(self, front, sq_k, sk_k, causal=False, window=None, window_size=None, bmin=None, bmax=None):
        self.front, self.sq_k, self.sk_k = front, sq_k, sk_k
        self.causal, self.window, self.window_size = causal, window, window_size
        self.bmin, self.bmax = bmin, bmax


class _Mask:
    """A call's mask: a window description (query i sees keys ``i + shift - left .. i + shift + right``, -1 =
    unbounded) or explicit per-query intervals ``[lo, hi)`` (packed sequences, boolean masks)."""

    def __init__(self, sq, sk, left=-1, right=-1, shift=0, lo=None, hi=None):
        self.sq, self.sk, self.left, self.right, self.shift = sq, sk, left, right, shift
        self.lo, self.hi = lo, hi  # explicit intervals (int64 [sq]) override the window description

    def intervals(self, device):
        if self.lo is not None:
            return self.lo, self.hi
        return window_intervals(self.sq, self.sk, self.left, self.right, self.shift, device)

    def _native(self, sq_k, sk_k):
        """(causal, sliding_window, window_size) giving the window as the kernels' band on a layout where the
        kernel's offset ``sk_k - sq_k`` (after the front padding) equals ``shift``, or None when the kernels
        cannot take it (kernel_api.supports)."""
        left, right = self.left, self.right
        unequal_ok = sq_k == sk_k or _supports("causal_unequal")
        if left == -1 and right == -1:
            return False, None, None
        if right == 0 and unequal_ok:
            return True, (left + 1 if left >= 0 else None), None
        if unequal_ok and _supports("window_size"):
            return False, None, (left, right)
        return None

    def plan(self, device, aligned=False):
        """The ``_Plan`` of this mask. ``aligned``: the kernels must see every (query, key) pair at the same
        distance as the call (ALiBi, or a native band): query rows are padded at the front so that the kernel's
        bottom-right offset equals ``shift``. Otherwise both lengths are padded at the end and the mask goes
        through per-query bounds whenever it is not the kernels' plain causal or full mask."""
        sq, sk = self.sq, self.sk
        native = None
        if self.lo is None:
            # kernel lengths with sk_k - (front + sq + back) + front == shift: back = sk_k - shift - sq >= 0
            sk_k = _round_up(max(sk, sq + self.shift))
            back = sk_k - self.shift - sq
            front = (-(sq + back)) % PMAX
            sq_k = front + sq + back
            native = self._native(sq_k, sk_k)
            if native is not None and (aligned or native != (False, None, None)):
                causal, window, wsize = native
                # padded keys j >= sk are visible to a real row unless the band's right side hides them
                hidden = self.right >= 0 and sq - 1 + self.shift + self.right <= sk - 1
                bmin = bmax = None
                if sk_k > sk and not hidden:
                    lo = torch.zeros(sq, dtype=torch.int64, device=device)
                    bmin, bmax = _bounds(lo, lo + sk, sq_k, front)
                return _Plan(front, sq_k, sk_k, causal, window, wsize, bmin, bmax)
            if aligned:
                bmin, bmax = _bounds(*self.intervals(device), sq_k, front)
                return _Plan(front, sq_k, sk_k, bmin=bmin, bmax=bmax)
        sq_k, sk_k = _round_up(sq), _round_up(sk)
        if self.lo is None and self.left == -1 and self.right == -1 and sk == sk_k:
            return _Plan(0, sq_k, sk_k)
        bmin, bmax = _bounds(*self.intervals(device), sq_k)
        return _Plan(0, sq_k, sk_k, bmin=bmin, bmax=bmax)


def _visibility(mask, device):
    """bool [sq, sk], True where query i sees key j."""
    lo, hi = mask.intervals(device)
    j = torch.arange(mask.sk, device=device)
    return (j[None, :] >= lo[:, None]) & (j[None, :] < hi[:, None])


# ----------------------------------------------------------------------------------------------------- core
def _kernel_head_dims(d_qk, d_v):
    """Head dims the kernels get: the real ones where the kernels implement them (kernel_api.supports), else
    zero-padded (exact: a zero column adds nothing to q.k, and a zero V column is dropped from the output)."""
    def even(d):
        if d <= PMAX or d % 2 == 0 or _supports("head_dim_any"):
            return d
        return d + 1  # 129..255 odd -> two equal tiles
    dq, dv = even(d_qk), even(d_v)
    if dq != dv and not _supports("d_v"):
        dq = dv = max(dq, dv)
    return dq, dv


def _to_kernel(x, pad_to, front=0, d_to=None):
    """[b, s, h, d] -> [b, h, d_to, pad_to] contiguous: ``front`` zero rows before the sequence, zeros after it
    and after the head dim."""
    x = x.permute(0, 2, 3, 1)
    s, d = x.shape[-1], x.shape[-2]
    d_to = d if d_to is None else d_to
    if pad_to > s or d_to > d:
        x = torch.nn.functional.pad(x, (front, pad_to - s - front, 0, d_to - d))
    return x.contiguous()


def _kernel_sinks(sinks, b):
    if sinks is None:
        return None
    s = sinks.to(torch.float32)
    return s.unsqueeze(0).expand(b, *s.shape).contiguous()


def _kernel_alibi(alibi_slopes, b, hq):
    """FlashAttention's ``[nheads]`` or ``[batch, nheads]`` slopes -> the kernels' float32 ``[batch, nheads]``."""
    if alibi_slopes is None:
        return None
    return alibi_slopes.to(torch.float32).expand(b, hq).contiguous()


def _empty_attention(q, k, v, mask, sinks):
    """Some size is 0: torch's result (zeros when no key exists, else an empty output), with gradients."""
    b, sq, hq, d = q.shape
    hk = k.shape[2]
    kk, vv = k, v
    if hq and hk and hq != hk:
        kk, vv = k.repeat_interleave(hq // hk, dim=2), v.repeat_interleave(hq // hk, dim=2)
    # with no key or an empty head_dim the scores are an empty sum (exact zeros), so this is exact
    s = torch.matmul(q.transpose(1, 2), kk.permute(0, 2, 3, 1))
    out = torch.matmul(s, vv.transpose(1, 2)).transpose(1, 2).contiguous()
    lo, hi = mask.intervals(q.device)
    n = (hi - lo).to(torch.float32)  # zero scores: lse = log(#visible keys)
    lse = torch.log(n).expand(b, hq, sq)
    if sinks is not None:
        s = sinks.detach().float()
        s = s if s.dim() == 2 else s[:, None]
        lse = torch.logaddexp(lse, torch.logsumexp(s, -1)[None, :, None])
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse)
    return out, lse.contiguous(), None


class _Variants:
    """The variant arguments of one call, checked: softcap (0.0 = off), alibi_slopes (float32 [b, h] or None),
    dropout_p and the kernels' dropout seed tensor (None without dropout)."""

    __slots__ = ("softcap", "alibi", "dropout_p", "seed")

    def __init__(self, softcap=0.0, alibi=None, dropout_p=0.0, seed=None):
        self.softcap, self.alibi, self.dropout_p, self.seed = softcap, alibi, dropout_p, seed


_NO_VARIANTS = _Variants()


def _attention(fn, q, k, v, mask, scale, sinks, want_probs, scale_name="softmax_scale", variants=_NO_VARIANTS):
    """q [b, sq, h, d_qk], k [b, sk, hk, d_qk], v [b, sk, hk, d_v] -> (out [b, sq, h, d_v] contiguous,
    lse float32 [b, h, sq], probs or None)."""
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    scale = ops.resolve_scale(fn, scale, max(d, 1), scale_name)
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        out, lse, _ = _empty_attention(q, k, v, mask, sinks)
        probs = q.new_zeros((b, hq, sq, sk), dtype=torch.float32) if want_probs else None
        return out, lse, probs
    if _round_up(max(sk, sq + mask.shift)) > MAX_EXACT_KEY:
        _fail(fn, "seqlen_k", sk, f"must be at most {MAX_EXACT_KEY} (the kernels' key bounds are float32)")
    alibi = _kernel_alibi(variants.alibi, b, hq)
    out, lse = _flash_fwd(q, k, v, sinks, mask.lo, mask.hi, mask.left, mask.right, mask.shift, scale,
                          variants.softcap, alibi, variants.dropout_p, variants.seed)
    probs = _probs(q, k, mask, scale, sinks, variants, alibi) if want_probs else None
    return out, lse, probs


# The API's own pair of ops, in FlashAttention's layout: the permutes, the padding to 128 and the sinks' batch
# expansion happen inside them, so a compiled graph holds one opaque node per direction instead of a dozen small
# generated layout kernels (each a parallel region: measurable per-call overhead next to the simulator).
@torch.library.custom_op("nki_attn::flash_fwd", mutates_args=())
def _flash_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: Optional[torch.Tensor],
               key_lo: Optional[torch.Tensor], key_hi: Optional[torch.Tensor], left: int, right: int, shift: int,
               scale: float, softcap: float = 0.0, alibi: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
               dropout_seed: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [b, sq, h, d_qk], k [b, sk, hk, d_qk], v [b, sk, hk, d_v], sinks [h(, n)], key_lo/key_hi int64 [sq] (or
    the window description left/right/shift), alibi float32 [b, h], dropout_seed the kernels' seed tensor
    -> (out [b, sq, h, d_v], lse float32 [b, h, sq])."""
    b, sq, hq, d_qk = q.shape
    d_v = v.shape[3]
    sk = k.shape[1]
    pl = _Mask(sq, sk, left, right, shift, key_lo, key_hi).plan(q.device, aligned=alibi is not None)
    dq_k, dv_k = _kernel_head_dims(d_qk, d_v)
    o, lse = ops._fwd_op(_to_kernel(q, pl.sq_k, pl.front, dq_k), _to_kernel(k, pl.sk_k, 0, dq_k),
                         _to_kernel(v, pl.sk_k, 0, dv_k), _kernel_sinks(sinks, b), pl.bmin, pl.bmax, pl.causal,
                         scale, pl.window, True, softcap, alibi, _wlist(pl.window_size), dropout_p, dropout_seed)
    out = o[:, :, :d_v, pl.front:pl.front + sq].permute(0, 3, 1, 2).contiguous()
    lse = lse.permute(0, 1, 3, 2).reshape(b, hq, pl.sq_k)[..., pl.front:pl.front + sq].contiguous()
    return out, lse


def _wlist(window_size):
    return None if window_size is None else [int(window_size[0]), int(window_size[1])]


@_flash_fwd.register_fake
def _flash_fwd_fake(q, k, v, sinks, key_lo, key_hi, left, right, shift, scale, softcap=0.0, alibi=None,
                    dropout_p=0.0, dropout_seed=None):
    b, sq, hq, _ = q.shape
    return q.new_empty((b, sq, hq, v.shape[3])), q.new_empty((b, hq, sq), dtype=torch.float32)


@torch.library.custom_op("nki_attn::flash_bwd", mutates_args=())
def _flash_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
               lse: torch.Tensor, sinks: Optional[torch.Tensor], key_lo: Optional[torch.Tensor],
               key_hi: Optional[torch.Tensor], left: int, right: int, shift: int, scale: float,
               dlse: Optional[torch.Tensor], softcap: float = 0.0, alibi: Optional[torch.Tensor] = None,
               dropout_p: float = 0.0, dropout_seed: Optional[torch.Tensor] = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``_flash_fwd``: (dq, dk, dv like q, k, v; dsinks like sinks, or an empty [0] tensor)."""
    b, sq, hq, d_qk = q.shape
    sk, d_v = k.shape[1], v.shape[3]
    pl = _Mask(sq, sk, left, right, shift, key_lo, key_hi).plan(q.device, aligned=alibi is not None)
    dq_k, dv_k = _kernel_head_dims(d_qk, d_v)
    # Padded query rows get dout = 0 (so D = 0 and dS = 0) and lse = +inf (so P = exp(S - lse) = 0): they add
    # nothing to dk, dv, dsinks, whatever o holds there.
    lse_k = torch.nn.functional.pad(lse, (pl.front, pl.sq_k - sq - pl.front), value=math.inf)
    lse_k = lse_k.reshape(b, hq, pl.sq_k // PMAX, PMAX).transpose(-1, -2).contiguous()
    ks = _kernel_sinks(sinks, b)
    dq, dk, dv, dsinks = ops._bwd_op(
        _to_kernel(q, pl.sq_k, pl.front, dq_k), _to_kernel(k, pl.sk_k, 0, dq_k), _to_kernel(v, pl.sk_k, 0, dv_k),
        _to_kernel(out, pl.sq_k, pl.front, dv_k), _to_kernel(dout, pl.sq_k, pl.front, dv_k), lse_k, ks, pl.bmin,
        pl.bmax, pl.causal, scale, pl.window, True, dlse, softcap, alibi, _wlist(pl.window_size), dropout_p,
        dropout_seed)
    back = [dq[:, :, :d_qk, pl.front:pl.front + sq], dk[:, :, :d_qk, :sk], dv[:, :, :d_v, :sk]]
    back = [t.permute(0, 3, 1, 2).contiguous() for t in back]
    dsinks = dsinks.sum(0).to(sinks.dtype) if sinks is not None else dsinks
    return back[0], back[1], back[2], dsinks


@_flash_bwd.register_fake
def _flash_bwd_fake(q, k, v, out, dout, lse, sinks, key_lo, key_hi, left, right, shift, scale, dlse, softcap=0.0,
                    alibi=None, dropout_p=0.0, dropout_seed=None):
    c = torch.contiguous_format
    dsinks = torch.empty_like(sinks, memory_format=c) if sinks is not None else q.new_empty((0,), dtype=torch.float32)
    return (torch.empty_like(q, memory_format=c), torch.empty_like(k, memory_format=c),
            torch.empty_like(v, memory_format=c), dsinks)


def _flash_setup_context(ctx, inputs, output):
    inputs = list(inputs) + [0.0, None, 0.0, None][len(inputs) - 10:]
    q, k, v, sinks, key_lo, key_hi, left, right, shift, scale, softcap, alibi, dropout_p, seed = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], sinks, key_lo, key_hi, alibi, seed)
    ctx.flags = (left, right, shift, scale)
    ctx.variants = (softcap, dropout_p)


def _flash_backward(ctx, dout, dlse):
    q, k, v, out, lse, sinks, key_lo, key_hi, alibi, seed = ctx.saved_tensors
    softcap, dropout_p = ctx.variants
    dq, dk, dv, dsinks = _flash_bwd(q, k, v, out, dout, lse, sinks, key_lo, key_hi, *ctx.flags, dlse, softcap,
                                    alibi, dropout_p, seed)
    return (dq, dk, dv, (dsinks if sinks is not None else None), None, None, None, None, None, None, None, None,
            None, None)


_flash_fwd.register_autograd(_flash_backward, setup_context=_flash_setup_context)
_flash_bwd.register_autograd(ops._bwd_backward, setup_context=ops._bwd_setup_context)


def _probs(q, k, mask, scale, sinks=None, variants=_NO_VARIANTS, alibi=None):
    """S_dmask: softmax probabilities [b, h, sq, sk] (float32) recomputed from q, k (soft-cap and ALiBi included)
    and normalised by their own float32 log-sum-exp over the visible keys and the sinks [h(, n)], zero where
    masked; with dropout, FlashAttention's encoding: negative where the element was dropped (None when the keep
    mask cannot be regenerated, golden.dropout missing). None above MAX_PROBS_ELEMENTS. Not differentiable.

    Normalised here rather than by the kernel's lse: in 16-bit dtypes that lse comes from differently rounded
    scores, so exp(score - lse) rows would sum to 1 only within the dtype's rounding (0.97-1.02 measured);
    normalised, a row's |S_dmask| plus its sinks' share sums to 1 within float32 rounding."""
    b, sq, hq, _ = q.shape
    sk, hk = k.shape[1], k.shape[2]
    if b * hq * sq * sk > MAX_PROBS_ELEMENTS:
        return None
    with torch.no_grad():
        kk = k.repeat_interleave(hq // hk, dim=2) if hk != hq else k
        s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kk.float()) * scale
        if variants.softcap > 0.0:
            s = variants.softcap * torch.tanh(s / variants.softcap)
        pl = mask.plan(q.device, aligned=alibi is not None)
        if alibi is not None:
            i = torch.arange(sq, device=q.device)[:, None] + pl.front
            j = torch.arange(sk, device=q.device)[None, :]
            dist = (i + (pl.sk_k - pl.sq_k) - j).abs().to(torch.float32)
            s = s - alibi[:, :, None, None] * dist
        vis = _visibility(mask, q.device)
        s = s.masked_fill(~vis, float("-inf"))
        terms = s
        if sinks is not None:
            sink = sinks.detach().float().reshape(hq, -1)                                   # [h, n]
            terms = torch.cat([s, sink[None, :, None, :].expand(b, hq, sq, sink.shape[1])], dim=-1)
        row_lse = torch.logsumexp(terms, dim=-1, keepdim=True)  # -inf for a row with no key and no sink
        p = torch.exp(s - row_lse)
        p = torch.where(vis, p, torch.zeros_like(p))  # also the NaN of -inf - (-inf) in empty rows
        if variants.dropout_p > 0.0:
            keep = _keep_mask(variants, b, hq, pl, sq, sk)
            if keep is None:
                return None
            p = torch.where(keep, p, -p)
        return p


def _keep_mask(variants, b, hq, pl, sq, sk):
    """The kernels' keep mask of the call's elements, bool [b, h, sq, sk] (golden.dropout at kernel positions),
    or None when golden.dropout is not installed."""
    try:
        from golden import dropout as gdrop  # noqa: PLC0415 - debug path only
    except ImportError:
        return None
    seed = variants.seed.to("cpu")
    full = gdrop.keep_mask(seed, variants.dropout_p, b, hq, pl.sq_k, pl.sk_k)
    return full[:, :, pl.front:pl.front + sq, :sk].to(variants.seed.device)


def _results(out, lse, probs, return_attn_probs, return_lse):
    if return_attn_probs:
        return out, lse, probs
    if return_lse:
        return out, lse
    return out


# ----------------------------------------------------------------------------------------------------- flash_attn
def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, sinks=None,
                    return_lse=False, dropout_seed=None, generator=None):
    """Attention in FlashAttention's layout, with FlashAttention's signature and conventions.

    Args:
        q: ``[batch, seqlen_q, nheads, head_dim]``, float32 / bfloat16 / float16 (CPU: simulator; XLA: Trainium;
            meta: shapes only); head_dim 1..256.
        k: ``[batch, seqlen_k, nheads_k, head_dim]``; v: ``[batch, seqlen_k, nheads_k, head_dim_v]`` (head_dim_v
            1..256, may differ from head_dim, e.g. 192 / 128 for DeepSeek's MLA); ``nheads % nheads_k == 0``
            (GQA / MQA: query head h reads kv head ``h // (nheads // nheads_k)``).
        dropout_p: probability in [0, 1) of dropping each attention probability (the kept ones are scaled by
            ``1/(1 - dropout_p)``); the keep mask is a pure function of the seed and the element (docs/semantics.md).
            FlashAttention applies it whenever it is > 0: pass 0.0 for evaluation.
        softmax_scale: scale of q·k, a finite number > 0; default ``1/sqrt(head_dim)``.
        causal: bool; key j masked for query i when ``j > i + seqlen_k - seqlen_q`` (bottom-right aligned).
        window_size: ``(left, right)`` ints, -1 = unbounded: query i sees keys
            ``i + seqlen_k - seqlen_q - left .. i + seqlen_k - seqlen_q + right``. ``causal`` forces right = 0.
        softcap: > 0 soft-caps the scaled scores, ``S = softcap * tanh(S / softcap)`` (Gemma-2: 50.0); 0.0 = off.
        alibi_slopes: float32 ``[nheads]`` or ``[batch, nheads]``: adds ``-slope * |i + seqlen_k - seqlen_q - j|``
            to the (capped) scores, causal or not. The gradient equals FlashAttention's; the returned lse differs
            from FlashAttention's under causal by a per-row constant (docs/api.md, "ALiBi and the LSE").
        deterministic: bool, accepted; the kernels are always deterministic (bit-identical reruns).
        return_attn_probs: also return the log-sum-exp and S_dmask (see Returns).
        sinks: keyword only; optional ``[nheads]`` or ``[nheads, num_sinks]`` learnable logits that join the
            softmax denominator (not scaled, capped, biased or dropped; no value; -inf means no sink); shared by
            the batch; get a gradient.
        return_lse: keyword only; return ``(out, lse)``.
        dropout_seed: keyword only; an int in ``[0, 2**32 - 1]`` (= seed tensor ``(seed, 0)``) or an int32 /
            uint32 tensor ``[2]`` = ``(seed, offset)`` (``nki_attn.dropout.make_seed``; step the offset for a new
            mask per training step): the dropout mask is a pure function of it. generator: keyword only; a
            ``torch.Generator`` the seed is drawn from instead. With neither, the seed is drawn from torch's
            global generator (``torch.manual_seed`` makes runs reproducible). The backward pass regenerates the
            same mask from the same seed.

    Returns:
        out ``[batch, seqlen_q, nheads, head_dim_v]`` contiguous, in q's dtype. With ``return_attn_probs``:
        ``(out, softmax_lse, S_dmask)``: softmax_lse float32 ``[batch, nheads, seqlen_q]`` (+inf for a row that
        sees no key and has no sink), S_dmask float32 ``[batch, nheads, seqlen_q, seqlen_k]``, the attention
        probabilities over the keys (sinks excluded; zero where masked; with dropout, negative where dropped, as
        FlashAttention encodes it) recomputed from q, k and normalised in float32, or None when it would exceed
        ``MAX_PROBS_ELEMENTS``. With ``return_lse``: ``(out, lse)``. lse takes no gradient (a non-zero one
        raises NotImplementedError).
    """
    fn = "flash_attn_func"
    p = _check_dropout(fn, dropout_p)
    cap = _check_softcap(fn, softcap)
    _check_flags(fn, deterministic, return_attn_probs)
    _check_bool(fn, "return_lse", return_lse)
    causal = _check_bool(fn, "causal", causal)
    _check_qkv(fn, q, k, v, 4)
    b, sq, hq, d = q.shape
    bk, sk, hk, dk = k.shape
    if bk != b:
        _fail(fn, "k.shape[0]", bk, f"batch must equal q.shape[0] = {b}")
    if dk != d:
        _fail(fn, "k.shape[3]", dk, f"head_dim must equal q.shape[3] = {d}")
    _check_heads(fn, hq, hk, "k.shape[2]")
    _check_head_dim(fn, d, "q.shape[3]")
    _check_head_dim(fn, v.shape[3], "v.shape[3]")
    _check_sinks(fn, sinks, hq, q)
    alibi = _check_alibi(fn, alibi_slopes, b, hq, q)
    left, right = _window(fn, window_size, causal)
    variants = _Variants(cap, alibi, p, _dropout_seed(fn, p, dropout_seed, generator, q.device))
    mask = _Mask(sq, sk, left, right, shift=sk - sq)
    out, lse, probs = _attention(fn, q, k, v, mask, softmax_scale, sinks, return_attn_probs, variants=variants)
    return _results(out, lse, probs, return_attn_probs, return_lse)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                              sinks=None, return_lse=False, dropout_seed=None, generator=None):
    """``flash_attn_func`` on ``qkv [batch, seqlen, 3, nheads, head_dim]`` (q, k, v stacked on dim 2)."""
    _check_tensor("flash_attn_qkvpacked_func", "qkv", qkv)
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        _fail("flash_attn_qkvpacked_func", "qkv.shape", tuple(qkv.shape), "must be [batch, seqlen, 3, nheads, "
                                                                          "head_dim]")
    q, k, v = qkv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, sinks=sinks, return_lse=return_lse,
                           dropout_seed=dropout_seed, generator=generator)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                             sinks=None, return_lse=False, dropout_seed=None, generator=None):
    """``flash_attn_func`` on q and ``kv [batch, seqlen_k, 2, nheads_k, head_dim]`` (k, v stacked on dim 2)."""
    _check_tensor("flash_attn_kvpacked_func", "kv", kv)
    if kv.dim() != 5 or kv.shape[2] != 2:
        _fail("flash_attn_kvpacked_func", "kv.shape", tuple(kv.shape), "must be [batch, seqlen_k, 2, nheads_k, "
                                                                      "head_dim]")
    k, v = kv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, sinks=sinks, return_lse=return_lse,
                           dropout_seed=dropout_seed, generator=generator)


# ----------------------------------------------------------------------------------------------------- varlen
def _as_max_seqlen(fn, name, x):
    if isinstance(x, torch.Tensor) and x.dim() == 0 and not x.is_floating_point() and x.dtype != torch.bool:
        x = int(x)
    if not _is_int(x) or x < 0:
        _fail(fn, name, repr(x), "must be an int >= 0 (the longest sequence)", TypeError if not _is_int(x)
              else ValueError)
    return int(x)


def _check_cu(fn, name, cu):
    _check_tensor(fn, name, cu)
    if cu.is_floating_point() or cu.is_complex() or cu.dtype == torch.bool:
        _fail(fn, f"{name}.dtype", cu.dtype, "cu_seqlens must be an integer tensor (FlashAttention: int32)",
              TypeError)
    if cu.dim() != 1 or cu.shape[0] < 2:
        _fail(fn, f"{name}.shape", tuple(cu.shape), "must be 1-D [num_seqs + 1] with at least 2 entries")


@torch.library.custom_op("nki_attn::varlen_intervals", mutates_args=())
def _varlen_intervals(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int, total_k: int,
                      max_seqlen_q: int, max_seqlen_k: int, left: int, right: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-query key intervals (int64 [total_q] each) of packed sequences, after checking cu_seqlens' values
    (the one step that reads them: an op of its own so that compiled graphs keep the check without a break)."""
    fn = "flash_attn_varlen_func"
    cq = cu_seqlens_q.detach().to("cpu", torch.int64)
    ck = cu_seqlens_k.detach().to("cpu", torch.int64)
    for name, c, total, mx, mx_name in (("cu_seqlens_q", cq, total_q, max_seqlen_q, "max_seqlen_q"),
                                        ("cu_seqlens_k", ck, total_k, max_seqlen_k, "max_seqlen_k")):
        if int(c[0]) != 0 or bool((c[1:] < c[:-1]).any()):
            _fail(fn, name, c.tolist(), "must start at 0 and be non-decreasing")
        if int(c[-1]) != total:
            _fail(fn, f"{name}[-1]", int(c[-1]), f"must equal the number of packed tokens {total}")
        longest = int((c[1:] - c[:-1]).max())
        if longest > mx:
            _fail(fn, mx_name, mx, f"is smaller than the longest sequence in {name} ({longest})")
    seq = torch.repeat_interleave(torch.arange(cq.shape[0] - 1), cq[1:] - cq[:-1], output_size=total_q)
    pos = torch.arange(total_q) - cq[seq]
    len_q, len_k, start_k = (cq[1:] - cq[:-1])[seq], (ck[1:] - ck[:-1])[seq], ck[seq]
    rel = pos + (len_k - len_q)  # bottom-right alignment within each sequence
    lo = (rel - left).clamp(min=0) if left >= 0 else torch.zeros_like(pos)
    hi = torch.minimum(rel + right + 1, len_k).clamp(min=0) if right >= 0 else len_k
    lo = torch.minimum(lo, len_k)
    hi = torch.maximum(hi, lo)
    return (start_k + lo).to(cu_seqlens_q.device), (start_k + hi).to(cu_seqlens_q.device)


@_varlen_intervals.register_fake
def _varlen_intervals_fake(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k, left, right):
    return (cu_seqlens_q.new_empty((total_q,), dtype=torch.int64),
            cu_seqlens_q.new_empty((total_q,), dtype=torch.int64))


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, sinks=None,
                           return_lse=False, dropout_seed=None, generator=None):
    """Attention over packed variable-length sequences, FlashAttention's varlen signature and layout.

    Args:
        q: ``[total_q, nheads, head_dim]``; k: ``[total_k, nheads_k, head_dim]``; v: ``[total_k, nheads_k,
            head_dim_v]``.
        cu_seqlens_q, cu_seqlens_k: integer ``[num_seqs + 1]``, cumulative lengths from 0, non-decreasing, last
            entry = total tokens; sequence s owns query rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` and key rows
            ``cu_seqlens_k[s]:cu_seqlens_k[s+1]``. Both list the same number of sequences.
        max_seqlen_q, max_seqlen_k: int >= the longest sequence (checked).
        alibi_slopes: float32 ``[nheads]`` or ``[num_seqs, nheads]``; positions and the bottom-right offset are
            those within each sequence.
        block_table: must be None (paged KV cache: NotImplementedError).
        Others: as ``flash_attn_func``, applied within each sequence (causal, windows and ALiBi bottom-right
            aligned per sequence). With dropout, element (h, i, j) of the packed call is kept or dropped by a
            pure function of the seed and its packed position.
    Returns:
        out ``[total_q, nheads, head_dim_v]``; with ``return_attn_probs`` ``(out, softmax_lse [nheads, total_q],
        S_dmask [num_seqs, nheads, max_seqlen_q, max_seqlen_k] or None)``; with ``return_lse`` ``(out, lse)``.

    The sequences run as one packed kernel call (per-query key bounds). ALiBi needs each sequence's own offset:
    when the sequences' query and key lengths differ (cu_seqlens_q != cu_seqlens_k) or the slopes differ per
    sequence, each sequence runs as its own call instead.
    """
    fn = "flash_attn_varlen_func"
    p = _check_dropout(fn, dropout_p)
    cap = _check_softcap(fn, softcap)
    _check_flags(fn, deterministic, return_attn_probs)
    _check_bool(fn, "return_lse", return_lse)
    if block_table is not None:
        _fail(fn, "block_table", type(block_table).__name__, "a paged KV cache is not supported; only None",
              NotImplementedError)
    causal = _check_bool(fn, "causal", causal)
    _check_qkv(fn, q, k, v, 3)
    tq, hq, d = q.shape
    tk, hk, dk = k.shape
    if dk != d:
        _fail(fn, "k.shape[2]", dk, f"head_dim must equal q.shape[2] = {d}")
    _check_heads(fn, hq, hk, "k.shape[1]")
    _check_head_dim(fn, d, "q.shape[2]")
    _check_head_dim(fn, v.shape[2], "v.shape[2]")
    _check_sinks(fn, sinks, hq, q)
    _check_cu(fn, "cu_seqlens_q", cu_seqlens_q)
    _check_cu(fn, "cu_seqlens_k", cu_seqlens_k)
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        _fail(fn, "cu_seqlens_k.shape", tuple(cu_seqlens_k.shape), f"must list as many sequences as cu_seqlens_q "
                                                                   f"{tuple(cu_seqlens_q.shape)}")
    n_seqs = cu_seqlens_q.shape[0] - 1
    alibi = _check_alibi(fn, alibi_slopes, n_seqs, hq, q)
    mq = _as_max_seqlen(fn, "max_seqlen_q", max_seqlen_q)
    mk = _as_max_seqlen(fn, "max_seqlen_k", max_seqlen_k)
    left, right = _window(fn, window_size, causal)
    lo, hi = _varlen_intervals(cu_seqlens_q, cu_seqlens_k, tq, tk, mq, mk, left, right)
    seed = _dropout_seed(fn, p, dropout_seed, generator, q.device)
    if alibi is not None and not _alibi_packs(alibi, cu_seqlens_q, cu_seqlens_k):
        out, lse, probs = _varlen_per_sequence(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, left, right, softmax_scale,
                                               sinks, return_attn_probs, _Variants(cap, alibi, p, seed), mq, mk)
        return _results(out, lse, probs, return_attn_probs, return_lse)
    if alibi is not None:
        alibi = alibi if alibi.dim() == 1 else alibi[0]
    lo, hi = lo.to(q.device), hi.to(q.device)
    mask = _Mask(tq, tk, lo=lo, hi=hi)
    out, lse, probs = _attention(fn, q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), mask, softmax_scale, sinks,
                                 return_attn_probs, variants=_Variants(cap, alibi, p, seed))
    out, lse = out.squeeze(0), lse.squeeze(0)
    if return_attn_probs:
        probs = _varlen_probs(probs, cu_seqlens_q, cu_seqlens_k, mq, mk)
    return _results(out, lse, probs, return_attn_probs, return_lse)


def _alibi_packs(alibi, cu_q, cu_k):
    """True when one packed call gives every sequence its own ALiBi distances: equal query and key lengths per
    sequence (so the packed offset 0 is each sequence's offset) and one set of slopes."""
    if not torch.equal(cu_q.detach().to("cpu", torch.int64), cu_k.detach().to("cpu", torch.int64)):
        return False
    return alibi.dim() == 1 or bool((alibi == alibi[:1]).all())


def _varlen_per_sequence(fn, q, k, v, cu_q, cu_k, left, right, scale, sinks, want_probs, variants, mq, mk):
    """Varlen as one call per sequence (the ALiBi case ``_alibi_packs`` refuses): -> (out, lse, probs)."""
    cq = cu_q.detach().to("cpu", torch.int64).tolist()
    ck = cu_k.detach().to("cpu", torch.int64).tolist()
    n = len(cq) - 1
    hq = q.shape[1]
    outs, lses, probs = [], [], []
    for s in range(n):
        qs, ks, vs = q[cq[s]:cq[s + 1]], k[ck[s]:ck[s + 1]], v[ck[s]:ck[s + 1]]
        sq, sk = qs.shape[0], ks.shape[0]
        slopes = variants.alibi if variants.alibi.dim() == 1 else variants.alibi[s]
        seed = None
        if variants.seed is not None:  # one mask per sequence: offset word + s, still determined by the seed
            seed = variants.seed.clone()
            seed[1] += s
        mask = _Mask(sq, sk, left, right, shift=sk - sq)
        o, lse, pr = _attention(fn, qs.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0), mask, scale, sinks,
                                want_probs, variants=_Variants(variants.softcap, slopes, variants.dropout_p, seed))
        outs.append(o.squeeze(0))
        lses.append(lse.squeeze(0))
        probs.append(pr)
    out = torch.cat(outs, 0) if outs else q.new_zeros((0, hq, v.shape[2]))
    lse = torch.cat(lses, -1) if lses else q.new_zeros((hq, 0), dtype=torch.float32)
    dmask = None
    if want_probs and all(pr is not None for pr in probs) and n * hq * mq * mk <= MAX_PROBS_ELEMENTS:
        dmask = q.new_zeros((n, hq, mq, mk), dtype=torch.float32)
        for s in range(n):
            dmask[s, :, :cq[s + 1] - cq[s], :ck[s + 1] - ck[s]] = probs[s][0]
    return out, lse, dmask


def _varlen_probs(probs, cu_q, cu_k, mq, mk):
    """Packed probabilities [1, h, total_q, total_k] -> FlashAttention's [num_seqs, h, max_seqlen_q, max_seqlen_k]."""
    n = cu_q.shape[0] - 1
    if probs is None or n * probs.shape[1] * mq * mk > MAX_PROBS_ELEMENTS:
        return None
    out = probs.new_zeros((n, probs.shape[1], mq, mk))
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for s in range(n):
        out[s, :, :cq[s + 1] - cq[s], :ck[s + 1] - ck[s]] = probs[0, :, cq[s]:cq[s + 1], ck[s]:ck[s + 1]]
    return out


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, sinks=None, return_lse=False, dropout_seed=None,
                                     generator=None):
    """``flash_attn_varlen_func`` on ``qkv [total, 3, nheads, head_dim]`` with one ``cu_seqlens`` / ``max_seqlen``."""
    _check_tensor("flash_attn_varlen_qkvpacked_func", "qkv", qkv)
    if qkv.dim() != 4 or qkv.shape[1] != 3:
        _fail("flash_attn_varlen_qkvpacked_func", "qkv.shape", tuple(qkv.shape), "must be [total, 3, nheads, "
                                                                                 "head_dim]")
    q, k, v = qkv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, sinks=sinks, return_lse=return_lse, dropout_seed=dropout_seed,
                                  generator=generator)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, sinks=None,
                                    return_lse=False, dropout_seed=None, generator=None):
    """``flash_attn_varlen_func`` on q and ``kv [total_k, 2, nheads_k, head_dim]``."""
    _check_tensor("flash_attn_varlen_kvpacked_func", "kv", kv)
    if kv.dim() != 4 or kv.shape[1] != 2:
        _fail("flash_attn_varlen_kvpacked_func", "kv.shape", tuple(kv.shape), "must be [total_k, 2, nheads_k, "
                                                                             "head_dim]")
    k, v = kv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, sinks=sinks, return_lse=return_lse, dropout_seed=dropout_seed,
                                  generator=generator)


# ----------------------------------------------------------------------------------------------------- masks → bounds
@torch.library.custom_op("nki_attn::mask_intervals", mutates_args=())
def _mask_intervals(mask: torch.Tensor, fn: str) -> tuple[torch.Tensor, torch.Tensor]:
    """bool ``[n, sq, sk]`` -> key intervals (int64 ``[n, sq]`` each) of every row, after checking that each
    row's visible keys are one contiguous run (NotImplementedError otherwise). Rows with no key get lo == hi."""
    n, sq, sk = mask.shape
    m = mask.detach()
    j = torch.arange(sk, device=m.device)
    any_ = m.any(-1)
    lo = torch.where(m, j, sk).amin(-1) if sk else torch.zeros((n, sq), dtype=torch.int64, device=m.device)
    hi = torch.where(m, j + 1, 0).amax(-1) if sk else torch.zeros((n, sq), dtype=torch.int64, device=m.device)
    lo = torch.where(any_, lo, 0)
    hi = torch.where(any_, hi, 0)
    if bool((m.sum(-1) != hi - lo).any()):
        raise NotImplementedError(f"{fn}: attn_mask: every query's visible keys must be one contiguous run (causal, "
                                  "sliding-window, padding and packed-sequence masks are); this mask has a row "
                                  "with gaps, which the kernels' per-query key bounds cannot express")
    return lo.to(torch.int64), hi.to(torch.int64)


@_mask_intervals.register_fake
def _mask_intervals_fake(mask, fn):
    n, sq, _ = mask.shape
    return mask.new_empty((n, sq), dtype=torch.int64), mask.new_empty((n, sq), dtype=torch.int64)


def interval_attention(q, k, v, lo, hi, softmax_scale=None, sinks=None, softcap=0.0, dropout_p=0.0,
                       dropout_seed=None, variants=None):
    """Attention where query i of batch entry n sees keys ``lo[n, i] <= j < hi[n, i]``.

    Args:
        q: ``[batch, seqlen_q, nheads, head_dim]``; k: ``[batch, seqlen_k, nheads_k, head_dim]``; v: ``[batch,
            seqlen_k, nheads_k, head_dim_v]``.
        lo, hi: int64 ``[batch, seqlen_q]`` (or ``[seqlen_q]``, shared by the batch).
        softcap, dropout_p, dropout_seed: as in ``flash_attn_func`` (the seed is drawn from torch's global
            generator when dropout_p > 0 and no seed is given). variants: internal (already checked variants).
    Returns:
        (out ``[batch, seqlen_q, nheads, head_dim_v]``, lse float32 ``[batch, nheads, seqlen_q]``).

    Intervals shared by the whole batch run as one batched launch; otherwise the batch entries are packed along
    the sequence (entry n's keys offset by n * seqlen_k), as varlen packs its sequences.
    """
    fn = "nki_attn"
    if variants is None:
        p = _check_dropout(fn, dropout_p)
        variants = _Variants(_check_softcap(fn, softcap), None, p, _dropout_seed(fn, p, dropout_seed, None,
                                                                                 q.device))
    b, sq, hq, d = q.shape
    sk, dv = k.shape[1], v.shape[-1]
    if lo.dim() == 2 and b <= 1:
        lo, hi = (lo[0], hi[0]) if b == 1 else (lo.new_zeros(sq), hi.new_zeros(sq))
    if lo.dim() == 1:
        out, lse, _ = _attention(fn, q, k, v, _Mask(sq, sk, lo=lo, hi=hi), softmax_scale, sinks, False,
                                 variants=variants)
        return out, lse
    off = (torch.arange(b, device=lo.device) * sk)[:, None]
    mask = _Mask(b * sq, b * sk, lo=(lo + off).reshape(-1), hi=(hi + off).reshape(-1))
    out, lse, _ = _attention(fn, q.reshape(1, b * sq, hq, d), k.reshape(1, b * sk, *k.shape[2:]),
                             v.reshape(1, b * sk, *v.shape[2:]), mask, softmax_scale, sinks, False,
                             variants=variants)
    return out.reshape(b, sq, hq, dv), lse.reshape(hq, b, sq).transpose(0, 1)


# ----------------------------------------------------------------------------------------------------- SDPA
def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention`` on the NKI kernels.

    Args:
        query: ``[..., heads, seqlen_q, head_dim]`` (2-D and up, as torch); key, value:
            ``[..., heads_kv, seqlen_k, head_dim]`` with the same leading dims and one head_dim.
        attn_mask: None, or a bool mask broadcastable to ``[..., 1, seqlen_q, seqlen_k]`` (True = attend; one
            mask for all heads) whose visible keys form one contiguous run per query (causal, sliding-window,
            padding, packed-sequence masks); other masks (gaps, per-head, additive float) raise
            NotImplementedError.
        dropout_p: float in [0, 1), as in ``flash_attn_func`` (applied whenever > 0, as torch does: pass 0.0 for
            evaluation); the keep mask's seed is drawn from torch's global generator (``torch.manual_seed`` makes
            it reproducible) and the backward regenerates the same mask.
        is_causal: bool, top-left aligned as torch (key j masked for query i when j > i); not with attn_mask.
        scale: scale of q·k, finite > 0; default ``1/sqrt(head_dim)``.
        enable_gqa: bool; must be True when heads_kv < heads (heads % heads_kv == 0), as torch.
    Returns:
        ``[..., heads, seqlen_q, head_dim_v]`` in query's dtype. A query row that the mask leaves without any
        visible key gives 0 (and passes no gradient), as torch's SDPA does since PyTorch 2.5; earlier versions
        return NaN there.
    """
    fn = "scaled_dot_product_attention"
    p = _check_dropout(fn, dropout_p)
    is_causal = _check_bool(fn, "is_causal", is_causal)
    _check_bool(fn, "enable_gqa", enable_gqa)
    names = ("query", "key", "value")
    for name, t in zip(names, (query, key, value)):
        _check_tensor(fn, name, t)
        if t.dim() < 2:
            _fail(fn, f"{name}.shape", tuple(t.shape), "must have at least 2 dims [..., seqlen, head_dim]")
    if query.dim() != key.dim() or key.dim() != value.dim():
        _fail(fn, "key.dim()/value.dim()", (key.dim(), value.dim()), f"must equal query.dim() {query.dim()}")
    lead = tuple(query.shape[:-3])
    if tuple(key.shape[:-3]) != lead:
        _fail(fn, "key.shape", tuple(key.shape), f"leading (batch) dims must equal query's {lead}")
    nb = math.prod(lead)
    q4, k4, v4 = (t.reshape(nb, *t.shape[-3:]) if t.dim() >= 4 else t.reshape(*([1] * (4 - t.dim())), *t.shape)
                  for t in (query, key, value))
    _check_qkv(fn, q4, k4, v4, 4, names)
    b, hq, sq, d = q4.shape
    _, hk, sk, dk = k4.shape
    if dk != d:
        _fail(fn, "key.shape[-1]", dk, f"head_dim must equal query.shape[-1] = {d}")
    if hk != hq and not enable_gqa:
        _fail(fn, "key.shape[-3]", hk, f"differs from query's {hq} heads: pass enable_gqa=True for grouped-query "
                                       f"attention")
    _check_heads(fn, hq, hk, "key.shape[-3]")
    _check_head_dim(fn, d, "query.shape[-1]")
    _check_head_dim(fn, v4.shape[-1], "value.shape[-1]")
    variants = _Variants(dropout_p=p, seed=_dropout_seed(fn, p, None, None, q4.device))
    qf, kf, vf = (t.transpose(1, 2) for t in (q4, k4, v4))
    if attn_mask is None:
        mask = _Mask(sq, sk, -1, 0 if is_causal else -1, shift=0)
        out, _, _ = _attention(fn, qf, kf, vf, mask, scale, None, False, "scale", variants)
    else:
        if is_causal:
            _fail(fn, "attn_mask", "a tensor", "must be None when is_causal=True (as torch)")
        scale = ops.resolve_scale(fn, scale, max(d, 1), "scale")
        lo, hi = _sdpa_mask_intervals(fn, attn_mask, lead, b, sq, sk, q4.device)
        out, _ = interval_attention(qf, kf, vf, lo, hi, scale, variants=variants)
    return out.transpose(1, 2).reshape(*query.shape[:-1], v4.shape[-1])


def _sdpa_mask_intervals(fn, attn_mask, lead, b, sq, sk, device):
    _check_tensor(fn, "attn_mask", attn_mask)
    if attn_mask.dtype != torch.bool:
        _fail(fn, "attn_mask.dtype", attn_mask.dtype, "only bool masks are supported (additive float masks are "
                                                      "arbitrary biases the kernels do not take)",
              NotImplementedError)
    if attn_mask.device != device:
        _fail(fn, "attn_mask.device", attn_mask.device, f"must equal query.device {device}")
    full = (*lead, 1, sq, sk)
    try:
        m = attn_mask.expand(full) if attn_mask.dim() <= len(full) else None
    except RuntimeError:
        m = None
    if m is None:
        _fail(fn, "attn_mask.shape", tuple(attn_mask.shape), f"must broadcast to [..., 1, seqlen_q, seqlen_k] = "
                                                             f"{list(full)} (one mask shared by all heads)",
              NotImplementedError if attn_mask.dim() >= 3 and attn_mask.shape[-3] > 1 else ValueError)
    if all(n == 1 for n in attn_mask.shape[:-2]):  # one mask for the whole batch: shared bounds, one launch
        mm = attn_mask.reshape(attn_mask.shape[-2:]) if attn_mask.dim() > 2 else attn_mask
        lo, hi = _mask_intervals(mm.expand(sq, sk).reshape(1, sq, sk), fn)
        return lo[0], hi[0]
    return _mask_intervals(m.reshape(b, sq, sk), fn)
