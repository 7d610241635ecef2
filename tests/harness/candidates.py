"""Candidate kernels for the tests of ``nki-attn check --candidate-bwd / --candidate-fwd``, loaded by path
(``tests/harness/candidates.py:NAME``) as a user's file would be. Each wraps our kernels, with a planted bug, a
narrower signature, a crash, or another calling contract."""
import math

import torch

from nki_attn.kernels.attention_bwd import attention_bwd as _bwd
from nki_attn.kernels.attention_fwd import attention_fwd as _fwd


def bwd_dq_1_01(q, k, v, o, dy, lse, sinks=None, bound_min=None, bound_max=None, **kw):
    """Our backward with dQ scaled by 1.01 (a planted bug)."""
    res = list(_bwd(q, k, v, o, dy, lse, sinks, bound_min, bound_max, **kw))
    res[0] = res[0] * 1.01
    return tuple(res)


def bwd_dk_zero(q, k, v, o, dy, lse, sinks=None, bound_min=None, bound_max=None, **kw):
    """Our backward that forgets to write dK."""
    res = list(_bwd(q, k, v, o, dy, lse, sinks, bound_min, bound_max, **kw))
    res[1] = torch.zeros_like(res[1])
    return tuple(res)


def bwd_no_window(q, k, v, o, dy, lse, sinks=None, bound_min=None, bound_max=None, use_causal_mask=False,
                  mixed_precision=True, softmax_scale=None):
    """A backward without the sliding_window parameter: window rows cannot be passed to it."""
    return _bwd(q, k, v, o, dy, lse, sinks, bound_min, bound_max, use_causal_mask=use_causal_mask,
                mixed_precision=mixed_precision, softmax_scale=softmax_scale)


def bwd_minimal(q, k, v, o, dy, lse, use_causal_mask=False):
    """A backward with neither sinks, packing, scale, window nor mixed_precision parameters."""
    return _bwd(q, k, v, o, dy, lse, use_causal_mask=use_causal_mask, mixed_precision=True)


def bwd_crashes(q, k, v, o, dy, lse, *args, **kw):
    """A backward with a bug that raises something other than a refusal."""
    raise IndexError("tile index 7 out of range")


def bwd_drops_dsinks(q, k, v, o, dy, lse, sinks=None, *args, **kw):
    """A backward that returns three outputs even when sinks are given."""
    return tuple(_bwd(q, k, v, o, dy, lse, sinks, *args, **kw))[:3]


def bwd_refuses_everything(q, k, v, o, dy, lse, *args, **kw):
    """A backward whose validation rejects every input."""
    assert False, "nothing is supported"


def fwd_ours(q, k, v, sinks=None, bound_min=None, bound_max=None, use_causal_mask=False, mixed_precision=True,
             softmax_scale=None, sliding_window=None):
    """Our forward under the (o, lse) contract."""
    return _fwd(q, k, v, sinks, bound_min, bound_max, use_causal_mask=use_causal_mask,
                mixed_precision=mixed_precision, softmax_scale=softmax_scale, sliding_window=sliding_window)


def fwd_o_1_01(q, k, v, *args, **kw):
    """Our forward with O scaled by 1.01."""
    o, lse = _fwd(q, k, v, *args, **kw)
    return o * 1.01, lse


def cte_like(q, k, v, scale=1.0, causal_mask=True, sliding_window=None, tp_q=True, tp_k=False, tp_out=False,
             cache_softmax=False, sink=None, bound_min=None, bound_max=None):
    """attention_cte's calling contract (the NKI Library's forward) implemented with our forward: q ``[b * h, d,
    sq]`` (tp_q False), k ``[b * hk, d, sk]``, v ``[b * hk, sk, d]``, query batch i reading kv batch
    ``i // (b * h / (b * hk))``; sink ``[b * h, 1]``; bounds ``[sq, 1]``; returns o ``[b * h, d, sq]`` (tp_out)
    and, with cache_softmax, -max and 1/sum ``[b * h, 128, sq // 128]`` (max taken as lse - 1)."""
    assert not tp_q and not tp_k and tp_out and cache_softmax, "only the layouts the harness's adapter uses"
    assert not sliding_window or scale == 1.0, "SWA only supports scale=1.0"
    assert bound_min is None or scale == 1.0, "range_select path doesn't support scale != 1.0"
    nq, d, sq = q.shape
    nk, sk = k.shape[0], k.shape[2]
    group = nq // nk
    o, lse = _fwd(q.reshape(nk, group, d, sq), k.reshape(nk, 1, d, sk),
                  v.transpose(1, 2).reshape(nk, 1, d, sk), None if sink is None else sink.reshape(nk, group),
                  None if bound_min is None else bound_min.reshape(sq),
                  None if bound_max is None else bound_max.reshape(sq), use_causal_mask=causal_mask,
                  mixed_precision=True, softmax_scale=scale, sliding_window=sliding_window)
    lse = lse.reshape(nq, 128, sq // 128)
    return o.reshape(nq, d, sq), -(lse - 1.0), torch.full_like(lse, math.exp(-1.0))
