"""Independent float64 reference for the golden tests.

The golden modules are checked against an attention written the naive way,
here, sharing no code with ``golden``: layout ``[b, h, s, d]``, plain matmul,
a mask built row by row from intervals, ``masked_fill(-inf)``, ``softmax``
with the sinks concatenated as extra columns (then dropped), and rows with
no visible key handled explicitly.  Gradients come from ``torch.autograd``.

The helpers are handed to tests through the ``ref`` fixture (rather than
imported) so they work whatever import mode pytest runs in.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch


def allowed_matrix(sq, sk, causal=False, window=None, bound_min=None, bound_max=None,
                   cu_seqlens=None):
    """Bool [sq, sk]: row i allows the key interval [lo, hi) computed per rule.

    Written as intervals (not broadcast comparisons) on purpose: a different
    formulation from the golden's.  ``cu_seqlens=(cu_q, cu_k)`` gives the
    block-diagonal packing mask straight from the sequence boundaries,
    bypassing ``golden.packing_bounds``.
    """
    allowed = torch.zeros(sq, sk, dtype=torch.bool)
    for i in range(sq):
        lo, hi = 0, sk
        if causal:
            hi = min(hi, i + 1)
        if window is not None:
            lo = max(lo, i - window + 1)
        if bound_min is not None:
            # integer j >= x  <=>  j >= ceil(x);  j < x  <=>  j < ceil(x)
            lo = max(lo, math.ceil(float(bound_min[i])))
            hi = min(hi, math.ceil(float(bound_max[i])))
        if cu_seqlens is not None:
            cu_q, cu_k = (list(map(int, c)) for c in cu_seqlens)
            seq = [s for s in range(len(cu_q) - 1) if cu_q[s] <= i < cu_q[s + 1]]
            if not seq:
                continue  # padding row: sees nothing
            lo = max(lo, cu_k[seq[0]])
            hi = min(hi, cu_k[seq[0] + 1])
        if lo < hi:
            allowed[i, lo:hi] = True
    return allowed


def naive_attention(q, k, v, *, causal=False, window=None, bound_min=None, bound_max=None,
                    cu_seqlens=None, scale=None, sinks=None, bias=None, dropout_mask=None):
    """float64 attention, q [b, h, sq, d], k/v [b, hk, sk, d].

    Returns (o [b, h, sq, d], lse [b, h, sq], probs [b, h, sq, sk + num_sinks]).
    """
    b, h, sq, d = q.shape
    sk = k.shape[2]
    group = h // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias
    allowed = allowed_matrix(sq, sk, causal, window, bound_min, bound_max, cu_seqlens)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        cols = sinks.reshape(b, h, 1, -1).expand(b, h, sq, -1)
        scores = torch.cat([scores, cols], dim=-1)
        empty = torch.zeros(sq, dtype=torch.bool)  # sinks always visible
    else:
        empty = ~allowed.any(dim=1)
    # Softmax of an all -inf row is NaN and would poison autograd even
    # through a where(); give empty rows finite dummy scores, then zero them.
    scores = torch.where(empty[:, None], torch.zeros_like(scores), scores)
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(empty[:, None], torch.zeros_like(probs), probs)
    lse = torch.logsumexp(scores, dim=-1)
    lse = torch.where(empty, torch.full_like(lse, float("inf")), lse)
    p_keys = probs[..., :sk]
    if dropout_mask is not None:
        p_keys = p_keys * dropout_mask
    return torch.matmul(p_keys, v), lse, probs


def to_naive(x):
    """Kernel layout [b, h, d, s] (any dtype) -> float64 leaf [b, h, s, d] with grad."""
    return x.detach().to(torch.float64).transpose(-1, -2).contiguous().requires_grad_(True)


def to_kernel(x):
    """[b, h, s, d] -> [b, h, d, s], detached."""
    return x.detach().transpose(-1, -2)


def run_reference(q, k, v, dy=None, *, sinks=None, **kw):
    """Naive forward (+ autograd backward if dy is given) on kernel-layout inputs.

    Returns a dict in kernel layout: o, lse (rows, [b, h, sq]), probs, and
    dq, dk, dv, dsinks when dy is given; plus smax, the largest finite
    |logit| (scores and sinks), used by the low-precision tolerances.
    """
    Q, K, V = to_naive(q), to_naive(k), to_naive(v)
    S = None if sinks is None else sinks.detach().to(torch.float64).requires_grad_(True)
    o, lse, probs = naive_attention(Q, K, V, sinks=S, **kw)
    finite = probs.detach() > 0
    # Recover |logit| of the visible columns from probs and lse: log p + lse.
    logits = torch.where(finite, torch.log(probs.detach()) + lse.detach()[..., None],
                         torch.zeros_like(probs))
    out = dict(o=to_kernel(o), lse=lse.detach(), probs=probs.detach(),
               smax=float(logits.abs().max()))
    if dy is not None:
        o.backward(to_naive(dy).detach())
        out.update(dq=to_kernel(Q.grad), dk=to_kernel(K.grad), dv=to_kernel(V.grad),
                   dsinks=None if S is None else S.grad.detach())
    return out


def lse_rows(lse_tiles):
    """[b, h, 128, T] -> [b, h, T * 128] with row r = t * 128 + p."""
    b, h, p, t = lse_tiles.shape
    return lse_tiles.transpose(-1, -2).reshape(b, h, t * p)


def make_inputs(bs, nheads, nheads_kv, d_head, seqlen_q, seqlen_k, dtype=torch.float64,
                seed=0):
    """Random q, k, v, dy in kernel layout (standard normal, then cast)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    return (rnd(bs, nheads, d_head, seqlen_q), rnd(bs, nheads_kv, d_head, seqlen_k),
            rnd(bs, nheads_kv, d_head, seqlen_k), rnd(bs, nheads, d_head, seqlen_q))


@pytest.fixture
def ref():
    """Namespace of the independent reference helpers."""
    return SimpleNamespace(allowed_matrix=allowed_matrix, attention=naive_attention,
                           run=run_reference, lse_rows=lse_rows, make_inputs=make_inputs,
                           to_naive=to_naive, to_kernel=to_kernel)
