"""Hugging Face transformers: an attention implementation named ``nki_attn`` running the NKI kernels.

    import nki_attn.integrations.transformers as nki_hf
    nki_hf.register()                                   # once per process
    model = AutoModelForCausalLM.from_config(config, attn_implementation="nki_attn")
    # or model.set_attn_implementation("nki_attn") on a loaded model

``register()`` adds ``attention_forward`` to transformers' ``AttentionInterface`` and, under the same name, its
SDPA mask builder to ``AttentionMaskInterface``: models then hand the attention function either no mask (plain
causal or full attention) or a boolean ``[batch or 1, 1, seqlen_q, seqlen_k]`` mask that already combines
causality, padding, sliding windows and packed sequences. Each query row of such a mask is one contiguous run of
keys, which the kernels take as per-query key bounds (the varlen path: batch entries with different masks are
packed along the sequence). A mask row with gaps raises NotImplementedError; nothing is approximated.

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


def register(name=NAME):
    """Register ``attention_forward`` (and transformers' SDPA mask builder) as attention implementation
    ``name`` (default ``"nki_attn"``); returns the name, for ``attn_implementation=``. Idempotent."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("nki_attn.integrations.transformers needs Hugging Face transformers: "
                          "pip install 'nki-attn[hf]'") from e
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
