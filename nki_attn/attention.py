"""PyTorch API: attention functions with autograd, running the NKI kernels.

Three entry points, each a thin layout adapter over one ``torch.autograd.Function`` (``NkiAttentionFunction``)
whose forward runs ``attention_fwd`` and saves (q, k, v, o, lse), and whose backward runs ``attention_bwd``:

- ``flash_attn_func`` — FlashAttention's layout ``[batch, seqlen, heads, head_dim]`` and conventions;
- ``flash_attn_varlen_func`` — packed ``[total_tokens, heads, head_dim]`` sequences described by cu_seqlens;
- ``scaled_dot_product_attention`` — torch's layout ``[batch, heads, seqlen, head_dim]`` and argument names.

The kernels want ``[b, h, d, s]`` with s a multiple of 128. The adapters permute once on the way in and once on
the way out, with differentiable torch ops, so autograd converts the gradients back by itself. Lengths that are
not multiples of 128 are zero-padded; padded keys are masked (causal order or per-query key bounds) and padded
query rows are dropped, so callers never see padded values or gradients.

Masks the kernels support natively are passed as flags (causal, sliding window, with trace-time tile skipping);
everything else expressible as a per-query key interval ``[bound_min, bound_max)`` — padding, bottom-right
causal alignment when seqlen_q != seqlen_k, packed sequences — goes through the kernels' packing bounds.

CPU tensors run on the built-in simulator; XLA tensors run on the real NKI when ``nki_attn.backend`` found it.
``NKI_ATTN_LNC=2`` launches the kernels on two NeuronCores (trn2/trn3); results are bit-identical to one core.
"""
import math
import os

import torch

from .backend import BACKEND

_TILE = 128
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------------------------------- kernel calls
def _launcher(kernel):
    lnc = os.environ.get("NKI_ATTN_LNC", "1").strip()
    if lnc not in ("1", "2"):
        raise ValueError(f"NKI_ATTN_LNC={lnc!r} must be 1 or 2")
    return kernel[2] if lnc == "2" else kernel


def _check_device(t):
    if t.device.type == "cpu":
        if BACKEND != "sim":
            raise RuntimeError("CPU tensors run on the simulator; set NKI_ATTN_BACKEND=sim to use it alongside the "
                               "real nki, or move the tensors to the XLA (Neuron) device")
    elif t.device.type == "xla":
        if BACKEND != "nki":
            raise RuntimeError("XLA tensors need the real nki package (torch-neuronx / neuronx-cc); it is not "
                               "importable here")
    else:
        raise RuntimeError(f"tensors on {t.device} are not supported: use CPU (simulator) or XLA (Trainium)")


def _kernels():
    from .kernels.attention_bwd import attention_bwd
    from .kernels.attention_fwd import attention_fwd
    return attention_fwd, attention_bwd


class NkiAttentionFunction(torch.autograd.Function):
    """Autograd function over the kernels, in the kernels' layout.

    forward(q [b, h, d, sq], k [b, hk, d, sk], v [b, hk, d, sk], sinks [b, h(, n)] or None,
            bound_min [sq] or None, bound_max [sq] or None, causal, window, scale) -> (o [b, h, d, sq],
            lse float32 [b, h, 128, sq // 128]); sq, sk multiples of 128. lse is not differentiable.
    """

    @staticmethod
    def forward(ctx, q, k, v, sinks, bound_min, bound_max, causal, window, scale):
        attention_fwd, _ = _kernels()
        o, lse = _launcher(attention_fwd)(q, k, v, sinks, bound_min, bound_max, use_causal_mask=causal,
                                         mixed_precision=True, softmax_scale=scale, sliding_window=window)
        ctx.save_for_backward(q, k, v, o, lse, sinks, bound_min, bound_max)
        ctx.causal, ctx.window, ctx.scale = causal, window, scale
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        _, attention_bwd = _kernels()
        q, k, v, o, lse, sinks, bound_min, bound_max = ctx.saved_tensors
        outs = _launcher(attention_bwd)(q, k, v, o, do.contiguous(), lse, sinks, bound_min, bound_max,
                                        use_causal_mask=ctx.causal, mixed_precision=True,
                                        softmax_scale=ctx.scale, sliding_window=ctx.window)
        dq, dk, dv = outs[:3]
        dsinks = outs[3].to(sinks.dtype) if sinks is not None else None
        return dq, dk, dv, dsinks, None, None, None, None, None


# ----------------------------------------------------------------------------------------------------- core
def _round_up(n):
    return max(_TILE, -(-n // _TILE) * _TILE)


def _to_kernel_layout(x, seq_dim, pad_to):
    """[b, s, h, d] (seq_dim=1) or [b, h, s, d] (seq_dim=2) -> [b, h, d, s_padded], one permute + pad."""
    x = x.permute(0, 2, 3, 1) if seq_dim == 1 else x.permute(0, 1, 3, 2)
    s = x.shape[-1]
    if pad_to > s:
        x = torch.nn.functional.pad(x, (0, pad_to - s))
    return x.contiguous()


def _bounds(sq, sk, sq_pad, key_lo, key_hi):
    """float32 [sq_pad] bounds from per-query int64 tensors key_lo/key_hi [sq]; padded rows see no key."""
    bmin = torch.zeros(sq_pad, dtype=torch.float32)
    bmax = torch.zeros(sq_pad, dtype=torch.float32)
    lo = key_lo.clamp(0, sk)
    hi = key_hi.clamp(0, sk)
    hi = torch.maximum(hi, lo)
    bmin[:sq] = lo.to(torch.float32)
    bmax[:sq] = hi.to(torch.float32)
    return bmin, bmax


def _attention(q, k, v, seq_dim, causal, left, scale, sinks, align, key_lo=None, key_hi=None):
    """Shared body: q [b, s, h, d] (seq_dim 1) or [b, h, s, d] (seq_dim 2); returns (o in q's layout, lse [b, h, sq]).

    ``causal`` with ``left`` (keys i-left..i visible, -1 = unbounded) describes the mask; ``align`` is
    "top_left" or "bottom_right" for causal masks when sq != sk. ``key_lo``/``key_hi`` (int64 [sq]) override
    the mask with explicit per-query key intervals (varlen).
    """
    b = q.shape[0]
    hq = q.shape[2] if seq_dim == 1 else q.shape[1]
    sq = q.shape[seq_dim]
    sk = k.shape[seq_dim]
    d = q.shape[-1]
    sq_pad, sk_pad = _round_up(sq), _round_up(sk)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)

    native_causal = key_lo is None and causal and sq == sk
    window = None
    if native_causal and left >= 0:
        window = left + 1
    need_bounds = key_lo is not None or (sk_pad != sk and not native_causal) or (causal and not native_causal)
    bmin = bmax = None
    if need_bounds:
        i = torch.arange(sq, dtype=torch.int64)
        if key_lo is None:
            if causal:
                shift = (sk - sq) if align == "bottom_right" else 0
                key_hi = i + shift + 1
                key_lo = (key_hi - 1 - left) if left >= 0 else torch.zeros_like(i)
            else:
                key_lo, key_hi = torch.zeros_like(i), torch.full_like(i, sk)
        bmin, bmax = _bounds(sq, sk, sq_pad, key_lo, key_hi)
    qk = _to_kernel_layout(q, seq_dim, sq_pad)
    kk = _to_kernel_layout(k, seq_dim, sk_pad)
    vk = _to_kernel_layout(v, seq_dim, sk_pad)
    sk_sinks = None
    if sinks is not None:
        s = sinks.to(torch.float32)
        sk_sinks = s.unsqueeze(0).expand(b, *s.shape).contiguous()
    o, lse = NkiAttentionFunction.apply(qk, kk, vk, sk_sinks, bmin, bmax, native_causal, window, scale)
    o = o[..., :sq]
    o = o.permute(0, 3, 1, 2) if seq_dim == 1 else o.permute(0, 1, 3, 2)
    lse = lse.permute(0, 1, 3, 2).reshape(b, hq, sq_pad)[..., :sq]
    return o, lse


# ----------------------------------------------------------------------------------------------------- validation
def _check_qkv(q, k, v, layout, rank=4, names=("q", "k", "v")):
    for name, t in zip(names, (q, k, v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D {layout}, got shape {tuple(t.shape)}")
    for name, t in zip(names[1:], (k, v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} dtype {t.dtype} must equal {names[0]} dtype {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but {names[0]} is on {q.device}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"{names[0]} dtype {q.dtype} is not supported; use float32, bfloat16 or float16")
    if k.shape != v.shape:
        raise ValueError(f"{names[1]} shape {tuple(k.shape)} must equal {names[2]} shape {tuple(v.shape)}")
    _check_device(q)


def _check_heads(hq, hk, what):
    if hk < 1 or hq % hk != 0:
        raise ValueError(f"number of query heads {hq} must be divisible by the number of key/value heads {hk} "
                         f"({what})")


def _check_sinks(sinks, hq, q):
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor) or sinks.dim() not in (1, 2) or sinks.shape[0] != hq:
        raise ValueError(f"sinks must be a tensor of shape [heads] = [{hq}] or [heads, num_sinks], got "
                         f"{tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__}")
    if sinks.device != q.device:
        raise ValueError(f"sinks is on {sinks.device} but q is on {q.device}")


def _window(window_size, causal):
    """FlashAttention window_size=(left, right) -> (causal, left) with left=-1 meaning unbounded."""
    try:
        left, right = (int(x) for x in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"window_size={window_size!r}: entries must be >= -1 (-1 means unbounded)")
    if causal and right == -1:
        right = 0  # causal implies nothing to the right, as in FlashAttention
    if right == 0:
        return True, left
    if (left, right) == (-1, -1):
        return False, -1
    raise NotImplementedError(f"window_size={tuple(window_size)} with causal={causal}: the kernels support "
                              f"windows (left >= 0, right = 0) with causal masking, or no window (-1, -1)")


def _check_dropout(dropout_p):
    if dropout_p != 0.0:
        raise NotImplementedError(f"dropout_p={dropout_p}: dropout is not implemented by the NKI kernels yet")


# ----------------------------------------------------------------------------------------------------- public API
def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), sinks=None,
                    deterministic=True, return_lse=False):
    """Attention in FlashAttention's layout, differentiable with respect to q, k, v and sinks.

    Args:
        q: ``[batch, seqlen_q, nheads, head_dim]``, float32/bfloat16/float16 (CPU: simulator; XLA: Trainium).
        k, v: ``[batch, seqlen_k, nheads_k, head_dim]``; nheads % nheads_k == 0 (GQA/MQA).
        dropout_p: must be 0.0 (NotImplementedError otherwise).
        softmax_scale: scale of q·k; default 1/sqrt(head_dim).
        causal: mask key j for query i when j > i + seqlen_k - seqlen_q (bottom-right aligned, as FlashAttention).
        window_size: (left, right); -1 is unbounded. Supported: (-1, -1), and (left >= 0, 0) which with causal
            order keeps keys i-left..i. Anything else raises NotImplementedError.
        sinks: optional ``[nheads]`` (or ``[nheads, num_sinks]``) learnable logits that join the softmax
            denominator (not scaled, no value); shared by the batch.
        deterministic: accepted for compatibility; the kernels are always deterministic (bit-identical runs).
        return_lse: also return the log-sum-exp ``[batch, nheads, seqlen_q]`` float32 (+inf for rows that see
            no key).
    Returns:
        out ``[batch, seqlen_q, nheads, head_dim]`` in q's dtype (and lse when return_lse).
    """
    _check_dropout(dropout_p)
    _check_qkv(q, k, v, "[batch, seqlen, heads, head_dim]")
    b, sq, hq, d = q.shape
    bk, sk, hk, dk = k.shape
    if bk != b or dk != d:
        raise ValueError(f"k shape {tuple(k.shape)} must match q shape {tuple(q.shape)} in batch and head_dim")
    _check_heads(hq, hk, "q.shape[2] and k.shape[2]")
    _check_sinks(sinks, hq, q)
    is_causal, left = _window(window_size, causal)
    o, lse = _attention(q, k, v, 1, is_causal, left, softmax_scale, sinks, "bottom_right")
    return (o, lse) if return_lse else o


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), sinks=None, deterministic=True,
                           return_lse=False):
    """Attention over packed variable-length sequences, FlashAttention's varlen layout.

    Args:
        q: ``[total_q, nheads, head_dim]``; k, v: ``[total_k, nheads_k, head_dim]``.
        cu_seqlens_q, cu_seqlens_k: int ``[num_seqs + 1]``, cumulative lengths starting at 0; sequence s owns
            query rows cu_seqlens_q[s]:cu_seqlens_q[s+1] and key rows cu_seqlens_k[s]:cu_seqlens_k[s+1].
        max_seqlen_q, max_seqlen_k: longest sequence (checked against cu_seqlens).
        causal, window_size, softmax_scale, sinks, dropout_p, deterministic, return_lse: as flash_attn_func,
            applied within each sequence (causal bottom-right aligned per sequence).
    Returns:
        out ``[total_q, nheads, head_dim]`` (and lse ``[nheads, total_q]`` float32 when return_lse).
    """
    _check_dropout(dropout_p)
    _check_qkv(q, k, v, "[total_tokens, heads, head_dim]", rank=3)
    tq, hq, d = q.shape
    tk, hk, dk = k.shape
    if dk != d:
        raise ValueError(f"k head_dim {dk} must equal q head_dim {d}")
    _check_heads(hq, hk, "q.shape[1] and k.shape[1]")
    _check_sinks(sinks, hq, q)
    cq = torch.as_tensor(cu_seqlens_q).to(device="cpu", dtype=torch.int64)
    ck = torch.as_tensor(cu_seqlens_k).to(device="cpu", dtype=torch.int64)
    for name, c, total, mx in (("cu_seqlens_q", cq, tq, max_seqlen_q), ("cu_seqlens_k", ck, tk, max_seqlen_k)):
        if c.dim() != 1 or c.numel() < 2 or int(c[0]) != 0 or bool((c[1:] < c[:-1]).any()):
            raise ValueError(f"{name} must be a non-decreasing 1-D int tensor starting at 0, got {c.tolist()}")
        if int(c[-1]) != total:
            raise ValueError(f"{name}[-1]={int(c[-1])} must equal the number of packed tokens {total}")
        if int((c[1:] - c[:-1]).max()) > int(mx):
            raise ValueError(f"max_seqlen {mx} is smaller than the longest sequence in {name}")
    if cq.numel() != ck.numel():
        raise ValueError(f"cu_seqlens_q has {cq.numel() - 1} sequences but cu_seqlens_k has {ck.numel() - 1}")
    is_causal, left = _window(window_size, causal)
    seq = torch.repeat_interleave(torch.arange(cq.numel() - 1), cq[1:] - cq[:-1])
    pos = torch.arange(tq) - cq[seq]
    len_q, len_k = (cq[1:] - cq[:-1])[seq], (ck[1:] - ck[:-1])[seq]
    start_k = ck[seq]
    if is_causal:
        hi = start_k + torch.clamp(pos + (len_k - len_q) + 1, max=len_k)
        lo = torch.maximum(start_k, hi - 1 - left) if left >= 0 else start_k
    else:
        lo, hi = start_k, start_k + len_k
    o, lse = _attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), 1, False, -1, softmax_scale, sinks,
                        "top_left", key_lo=lo, key_hi=torch.maximum(hi, lo))
    o = o.squeeze(0)
    return (o, lse.squeeze(0)) if return_lse else o


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention`` on the NKI kernels.

    Args:
        query: ``[batch, heads, seqlen_q, head_dim]``; key, value: ``[batch, heads_kv, seqlen_k, head_dim]``.
        attn_mask: must be None (arbitrary masks are not supported by the kernels: NotImplementedError).
        dropout_p: must be 0.0.
        is_causal: top-left aligned causal mask, as torch (key j masked for query i when j > i).
        scale: scale of q·k; default 1/sqrt(head_dim).
        enable_gqa: allow heads_kv < heads (heads % heads_kv == 0), as torch.
    Returns:
        ``[batch, heads, seqlen_q, head_dim]`` in query's dtype.
    """
    if attn_mask is not None:
        raise NotImplementedError("attn_mask is not supported by the NKI kernels; use is_causal, or "
                                  "flash_attn_func's window_size / flash_attn_varlen_func's cu_seqlens")
    _check_dropout(dropout_p)
    _check_qkv(query, key, value, "[batch, heads, seqlen, head_dim]", names=("query", "key", "value"))
    b, hq, sq, d = query.shape
    bk, hk, sk, dk = key.shape
    if bk != b or dk != d:
        raise ValueError(f"key shape {tuple(key.shape)} must match query shape {tuple(query.shape)} in batch "
                         f"and head_dim")
    if hk != hq and not enable_gqa:
        raise ValueError(f"query has {hq} heads and key {hk}: pass enable_gqa=True for grouped-query attention")
    _check_heads(hq, hk, "query.shape[1] and key.shape[1]")
    o, _ = _attention(query, key, value, 2, bool(is_causal), -1, scale, None, "top_left")
    return o
