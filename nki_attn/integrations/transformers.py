"""Hugging Face transformers: an attention implementation named ``nki_attn`` running the NKI kernels.

    import nki_attn.integrations.transformers as nki_hf
    nki_hf.register()                                   # once per process
    model = AutoModelForCausalLM.from_config(config, attn_implementation="nki_attn")
    # or model.set_attn_implementation("nki_attn") on a loaded model

``register()`` adds ``attention_forward`` to transformers' ``AttentionInterface`` and, under the same name,
``block_mask_builder`` to ``AttentionMaskInterface``: the model's mask function (causality, padding, sliding
windows, packed sequences from ``position_ids``, prefix-LM / bidirectional-prefix patterns, chunked attention:
whatever transformers composes) becomes an ``nki_attn.BlockMask`` (``nki_attn.create_block_mask``, evaluated on
the host by broadcasting, as transformers' SDPA mask builder does), built once per forward pass and shared by
every layer, forward and backward. The kernels then skip the blocks nobody sees (``nki_attn.flex``). Where no
mask is needed (plain causal or full attention without padding) the builder returns None, as SDPA's does.

A dense boolean ``[batch or 1, 1, seqlen_q, seqlen_k]`` mask (a model or caller that builds its own, or the
block mask of a call with sinks or dropout, which the block-mask op does not take) goes the interval path: each
query row must be one contiguous run of keys, which the kernels take as per-query key bounds (batch entries with
different masks are packed along the sequence); a row with gaps raises NotImplementedError. Nothing is
approximated.

What is handled, per transformers argument:

- causal / bidirectional (``is_causal`` or ``module.is_causal``), padding (left or right), packed sequences
  (``position_ids``), sliding windows (Mistral, Qwen3, Gemma-2, GPT-OSS): through the mask as above. Without a
  mask, causal attention follows SDPA's convention (top-left; the static-cache prefill crop) and
  ``sliding_window`` W keeps the W most recent keys (FlashAttention window ``(W - 1, 0)``, or ``(W - 1, W - 1)``
  when bidirectional, as transformers' FlashAttention path).
- GQA / MQA: native (no repeat of K/V).
- sinks (GPT-OSS ``s_aux``, one learnable logit per head): the kernels' sinks, with gradient.
- ``scaling``: the kernels' softmax_scale.
- ``softcap`` (Gemma-2 ``attn_logit_softcapping``, 50.0): the kernels' logit soft-capping, on both paths (with
  Gemma-2's sliding window, which arrives inside the mask, or as ``sliding_window`` without one).
- ``dropout`` (``attention_dropout`` while training; transformers passes 0.0 in eval mode): the kernels' attention
  dropout, its seed drawn from torch's global generator (``torch.manual_seed`` makes a training step
  reproducible; the backward pass regenerates the same mask).
- head_dim_v != head_dim (DeepSeek's MLA): passed through.
- ``output_attentions``: attention weights are never returned (None), as with SDPA.
"""
import torch

from .. import ops
from ..attention import interval_attention, mask_intervals
from ..block_mask import BlockMask, create_block_mask
from ..flex import flex_attention, softcap as _softcap_mod
from ..spec import flash_spec

NAME = "nki_attn"
_FN = "nki_attn (transformers)"


def _visible(mask, dtype):
    """transformers' mask (bool, True = attend; or additive float, 0 = attend) as a bool tensor."""
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        raise TypeError(f"{_FN}: attention_mask dtype {mask.dtype} must be bool or floating")
    visible = mask == 0
    blocked = mask <= torch.finfo(mask.dtype).min / 2
    if not bool((visible | blocked).all()):
        raise NotImplementedError(f"{_FN}: attention_mask carries an additive bias (values other than 0 and the "
                                  f"dtype's minimum); the kernels take masks, not biases")
    return visible


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                      softcap=None, is_causal=None, s_aux=None, **kwargs):
    """transformers attention function: query ``[batch, heads, seqlen_q, head_dim]``, key ``[batch, heads_kv,
    seqlen_k, head_dim]``, value ``[batch, heads_kv, seqlen_k, head_dim_v]`` -> ``(out [batch, seqlen_q, heads,
    head_dim_v], None)``. ``dropout`` (a probability) and ``softcap`` (None or a float >= 0) as transformers
    passes them.

    ``attention_mask`` is None or a bool/additive mask ``[batch or 1, 1, seqlen_q, seqlen_k]`` (see the module
    docstring). ``s_aux`` are GPT-OSS's per-head sink logits ``[heads]``.
    """
    cap = 0.0 if softcap is None else softcap
    is_causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    if isinstance(attention_mask, BlockMask):
        if s_aux is None and not dropout:
            out = flex_attention(query, key, value, score_mod=_softcap_mod(cap) if cap else None,
                                 block_mask=attention_mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
            return out.transpose(1, 2), None
        attention_mask = attention_mask.to_dense()  # sinks / dropout: the interval path below takes them
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    sq, sk = q.shape[1], k.shape[1]
    if attention_mask is None:
        causal = is_causal and sq > 1  # one query attends to the whole cache, as SDPA
        if causal and sk > sq:
            k, v = k[:, :sq], v[:, :sq]  # SDPA's top-left causal on a static-cache prefill: keys past sq are unused
        window = (-1, -1)
        if sliding_window is not None and sliding_window > 0:
            window = (sliding_window - 1, 0 if causal else sliding_window - 1)
        spec = flash_spec(_FN, q, k, v, dropout, scaling, causal, window, cap, sinks=s_aux)
        return ops.attention(spec, q, k, v)[0], None
    spec = flash_spec(_FN, q, k, v, dropout, scaling, softcap=cap, sinks=s_aux)
    m = _visible(attention_mask, query.dtype)
    if m.dim() != 4 or m.shape[-2:] != (sq, sk) or m.shape[0] not in (1, q.shape[0]):
        raise ValueError(f"{_FN}: attention_mask shape {tuple(m.shape)} must be [batch or 1, 1, seqlen_q, "
                         f"seqlen_k] = [{q.shape[0]}, 1, {sq}, {sk}]")
    if m.shape[1] != 1:
        if not bool((m == m[:, :1]).all()):
            raise NotImplementedError(f"{_FN}: per-head attention masks are not supported")
        m = m[:, :1]
    lo, hi = mask_intervals(m.reshape(m.shape[0], sq, sk), _FN)
    if lo.shape[0] == 1:
        lo, hi = lo[0], hi[0]  # one mask for the whole batch: one batched launch
    out, _ = interval_attention(q, k, v, lo, hi, spec=spec)
    return out, None


def block_mask_builder(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                       attention_mask=None, local_size=None, allow_is_causal_skip=True,
                       allow_is_bidirectional_skip=False, use_vmap=False, device="cpu", **kwargs):
    """transformers' mask-builder interface (``AttentionMaskInterface``, the arguments of its ``sdpa_mask``) ->
    an ``nki_attn.BlockMask`` ``(batch_size, 1, q_length, kv_length)`` of ``mask_function`` (and the 2-D padding
    ``attention_mask``), or None where SDPA's builder skips the mask. Mask functions that need ``use_vmap``
    (not index-based) get transformers' dense SDPA mask instead."""
    from transformers import masking_utils as mu
    if mask_function is None:
        mask_function = mu.causal_mask_function
    if use_vmap:
        return mu.sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                            local_size, allow_is_causal_skip, allow_is_bidirectional_skip, use_vmap, device, **kwargs)
    padding_mask = mu.prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if allow_is_causal_skip and mu._ignore_causal_mask_sdpa(padding_mask, q_length, kv_length, q_offset, kv_offset,
                                                            local_size):
        return None
    if allow_is_bidirectional_skip and mu._ignore_bidirectional_mask_sdpa(padding_mask, kv_length, local_size):
        return None
    if padding_mask is not None:
        mask_function = mu.and_masks(mask_function, mu.padding_mask_function(padding_mask.cpu().bool()))

    def offset_mask(b, h, q_idx, kv_idx):
        return mask_function(b, h, q_idx + q_offset, kv_idx + kv_offset)
    return create_block_mask(offset_mask, batch_size, None, q_length, kv_length)


def register(name=NAME):
    """Register ``attention_forward`` and ``block_mask_builder`` as attention implementation ``name`` (default
    ``"nki_attn"``); returns the name, for ``attn_implementation=``. Idempotent."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("nki_attn.integrations.transformers needs Hugging Face transformers: "
                          "pip install 'nki-attn[hf]'") from e
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, block_mask_builder)
    return name
