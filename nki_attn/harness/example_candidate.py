"""A candidate for ``nki-attn check --candidate-bwd nki_attn/harness/example_candidate.py:my_bwd``."""
from nki_attn.kernels.attention_bwd import attention_bwd  # put your NKI backward kernel here


def my_bwd(q, k, v, o, dy, lse, sinks=None, bound_min=None, bound_max=None, use_causal_mask=False,
           mixed_precision=True, softmax_scale=None, sliding_window=None):
    """q, o, dy [b, h, d, sq]; k, v [b, hk, d, sk]; lse [b, h, 128, sq // 128] -> (dq, dk, dv[, dsinks])."""
    assert sinks is None or len(sinks.shape) == 2, "one sink per head only"  # a refusal: row "unsupported"
    return attention_bwd(q, k, v, o, dy, lse, sinks, bound_min, bound_max, use_causal_mask=use_causal_mask,
                         mixed_precision=mixed_precision, softmax_scale=softmax_scale, sliding_window=sliding_window)
