"""Attention FLOP counts, for "useful TFLOPS".

The FlashAttention benchmark convention (anchors §3): forward = ``4 * B * S^2 * H * d`` (halved when causal),
backward = 2.5 x forward: two matmuls of ``2 * S^2 * d`` FLOPs per head forward (Q.K^T and P.V), five backward.
``useful_attention_flops`` generalises it to sliding windows by counting the (query, key) pairs the mask leaves
visible; for plain causal attention it gives ``S(S+1)/2`` pairs instead of ``S^2/2`` (0.05% more at S = 2048).
"""


def visible_pairs(seqlen_q, seqlen_k, causal=False, window=None):
    """Number of (query i, key j) pairs attention computes: all ``seqlen_q * seqlen_k``; causal ``j <= i``; a
    window W additionally keeps ``j >= i - W + 1`` (only with causal, as in docs/semantics.md)."""
    if not causal:
        return seqlen_q * seqlen_k
    w = window if window else seqlen_k
    total = 0
    # Row i sees keys max(0, i - w + 1) .. min(i, seqlen_k - 1).
    full_rows = min(seqlen_q, w)
    # rows 0 .. full_rows-1 see i + 1 keys (capped at seqlen_k); rows after see w keys (capped likewise)
    for i in range(full_rows):
        total += min(i + 1, seqlen_k)
    if seqlen_q > full_rows:
        total += (seqlen_q - full_rows) * min(w, seqlen_k)
    return total


def useful_attention_flops(batch, heads, seqlen_q, seqlen_k, d_head, causal=False, window=None, backward=False):
    """``4 * B * H * d * visible_pairs`` for the forward, 2.5x that for the backward (``heads`` = query heads)."""
    fwd = 4 * batch * heads * d_head * visible_pairs(seqlen_q, seqlen_k, causal, window)
    return fwd * 5 // 2 if backward else fwd


def fa_convention_flops(batch, heads, seqlen, d_head, causal=False, backward=False):
    """The FlashAttention benchmark formula exactly: ``4 * B * S^2 * H * d`` (/2 causal), x2.5 backward."""
    fwd = 4 * batch * seqlen * seqlen * heads * d_head
    if causal:
        fwd //= 2
    return fwd * 5 // 2 if backward else fwd
