"""Every bad input raises ValueError naming the argument, the value and the rule."""

import inspect

import pytest
import torch

import golden
from golden.attention_fwd_torch import SCORE_STEPS

F64 = torch.float64


def t(*shape, dtype=F64):
    return torch.zeros(*shape, dtype=dtype)


# Good defaults: bs 1, nheads 4, nheads_kv 2, d_head 8, seqlen 128.
Q, K, V = t(1, 4, 8, 128), t(1, 2, 8, 128), t(1, 2, 8, 128)
LSE = t(1, 4, 128, 1, dtype=torch.float32)
B32 = t(128, dtype=torch.float32)


def fwd(**kw):
    args = dict(q=Q, k=K, v=V)
    args.update(kw)
    return golden.attention_fwd_torch_ref(**args)


def full(**kw):
    args = dict(q=Q, k=K, v=V, use_causal_mask=False)
    args.update(kw)
    return golden.compute_o_lse(**args)


def bwd(**kw):
    args = dict(q_ref=Q, k_ref=K, v_ref=V, o_ref=Q, dy_ref=Q, lse_ref=LSE)
    args.update(kw)
    return golden.attention_bwd_torch_ref(**args)


# (id, call, regex the message must match: the argument name, and where
# useful the value and the rule).
BAD = [
    ("heads_not_divisible", lambda: fwd(q=t(1, 3, 8, 128)),
     r"nheads_kv \(k\.shape\[1\]\) = 2: nheads .* = 3 must be divisible"),
    ("heads_not_divisible_bwd", lambda: bwd(q_ref=t(1, 3, 8, 128), o_ref=t(1, 3, 8, 128),
                                            dy_ref=t(1, 3, 8, 128)),
     r"nheads_kv \(k_ref\.shape\[1\]\) = 2"),
    ("q_rank", lambda: fwd(q=t(4, 8, 128)), r"q\.shape = \(4, 8, 128\): .*rank 4"),
    ("k_rank_bwd", lambda: bwd(k_ref=t(2, 8, 128)), r"k_ref\.shape = .*rank 4"),
    ("batch_mismatch", lambda: fwd(k=t(2, 2, 8, 128), v=t(2, 2, 8, 128)),
     r"k\.shape\[0\] = 2: batch size must equal q\.shape\[0\] = 1"),
    ("d_head_mismatch", lambda: fwd(k=t(1, 2, 16, 128), v=t(1, 2, 16, 128)),
     r"k\.shape\[2\] = 16: d_head must equal q\.shape\[2\] = 8"),
    ("v_seqlen_mismatch", lambda: fwd(v=t(1, 2, 8, 256)),
     r"v\.shape\[3\] = 256: seqlen_k must equal k\.shape\[3\] = 128"),
    ("v_heads_mismatch", lambda: fwd(v=t(1, 1, 8, 128)), r"v\.shape\[1\] = 1: nheads_kv"),
    # d_v may differ from d_qk; then o and dy must carry d_v.
    ("o_without_d_v_bwd", lambda: bwd(v_ref=t(1, 2, 4, 128)),
     r"o_ref\.shape = \(1, 4, 8, 128\): must equal \[bs, nheads, d_v, seqlen_q\] = \(1, 4, 4, 128\)"),
    ("dy_without_d_v_bwd", lambda: bwd(v_ref=t(1, 2, 4, 128), o_ref=t(1, 4, 4, 128)),
     r"dy_ref\.shape = \(1, 4, 8, 128\): must equal \[bs, nheads, d_v"),
    ("window_without_causal", lambda: fwd(sliding_window=4),
     r"sliding_window = 4: .*requires use_causal_mask=True"),
    ("window_zero", lambda: fwd(use_causal_mask=True, sliding_window=0),
     r"sliding_window = 0: must be >= 1"),
    ("window_negative", lambda: fwd(use_causal_mask=True, sliding_window=-3),
     r"sliding_window = -3"),
    ("window_not_int", lambda: fwd(use_causal_mask=True, sliding_window=2.5),
     r"sliding_window = 2\.5: must be an integer"),
    ("window_bool", lambda: fwd(use_causal_mask=True, sliding_window=True), r"sliding_window"),
    ("window_without_causal_bwd", lambda: bwd(sliding_window=4), r"sliding_window = 4"),
    ("seqlen_q_not_multiple", lambda: fwd(q=t(1, 4, 8, 100)),
     r"seqlen_q \(q\.shape\[3\]\) = 100: must be a positive multiple of 128"),
    ("seqlen_q_not_multiple_bwd", lambda: bwd(q_ref=t(1, 4, 8, 200)), r"seqlen_q \(q_ref"),
    ("only_bound_min", lambda: fwd(bound_min=B32),
     r"bound_max = None: .*bound_min was given, bound_max is missing"),
    ("only_bound_max", lambda: fwd(bound_max=B32), r"bound_min = None: .*bound_min is missing"),
    ("only_bound_max_bwd", lambda: bwd(bound_max=B32), r"bound_min = None"),
    ("bound_wrong_length", lambda: fwd(bound_min=t(64, dtype=torch.float32), bound_max=B32),
     r"bound_min\.shape = \(64,\): must be 1-D of length seqlen_q = 128"),
    ("bound_wrong_rank", lambda: fwd(bound_min=B32, bound_max=t(1, 128, dtype=torch.float32)),
     r"bound_max\.shape = \(1, 128\)"),
    ("bound_float64", lambda: fwd(bound_min=B32, bound_max=t(128)),
     r"bound_max\.dtype = torch\.float64: packing bounds must be float32"),
    ("bound_int", lambda: fwd(bound_min=t(128, dtype=torch.int32), bound_max=B32),
     r"bound_min\.dtype = torch\.int32"),
    ("bound_wrong_shape_bwd", lambda: bwd(bound_min=t(256, dtype=torch.float32),
                                          bound_max=t(256, dtype=torch.float32)),
     r"bound_min\.shape"),
    ("sinks_wrong_heads", lambda: fwd(sinks_ref=t(1, 3)),
     r"sinks_ref\.shape = \(1, 3\): must be \[bs, nheads\] = \[1, 4\]"),
    ("sinks_wrong_rank", lambda: fwd(sinks_ref=t(4)), r"sinks_ref\.shape = \(4,\)"),
    ("sinks_zero_sinks", lambda: fwd(sinks_ref=t(1, 4, 0)), r"sinks_ref\.shape = \(1, 4, 0\)"),
    ("sinks_rank4", lambda: full(sinks=t(1, 4, 2, 1)), r"sinks\.shape = \(1, 4, 2, 1\)"),
    ("sinks_wrong_batch_bwd", lambda: bwd(sinks_ref=t(2, 4, 1)), r"sinks_ref\.shape = \(2, 4, 1\)"),
    ("k_dtype", lambda: fwd(k=t(1, 2, 8, 128, dtype=torch.float32)),
     r"k\.dtype = torch\.float32: must equal q\.dtype = torch\.float64"),
    ("v_dtype", lambda: fwd(v=t(1, 2, 8, 128, dtype=torch.bfloat16)), r"v\.dtype = torch\.bfloat16"),
    ("o_dtype_bwd", lambda: bwd(o_ref=t(1, 4, 8, 128, dtype=torch.float32)),
     r"o_ref\.dtype = torch\.float32: must equal q_ref\.dtype"),
    ("dy_dtype_bwd", lambda: bwd(dy_ref=t(1, 4, 8, 128, dtype=torch.float16)), r"dy_ref\.dtype"),
    ("v_dtype_bwd", lambda: bwd(v_ref=t(1, 2, 8, 128, dtype=torch.float32)), r"v_ref\.dtype"),
    ("dy_shape_bwd", lambda: bwd(dy_ref=t(1, 4, 128, 8)),
     r"dy_ref\.shape = \(1, 4, 128, 8\): must equal q_ref\.shape = \(1, 4, 8, 128\)"),
    ("o_shape_bwd", lambda: bwd(o_ref=t(1, 2, 8, 128)), r"o_ref\.shape = \(1, 2, 8, 128\)"),
    ("lse_shape_bwd", lambda: bwd(lse_ref=t(1, 4, 128)),
     r"lse_ref\.shape = \(1, 4, 128\): must be \[bs, nheads, 128, seqlen_q // 128\] = \[1, 4, 128, 1\]"),
    ("lse_rows_layout_bwd", lambda: bwd(lse_ref=t(1, 4, 1, 128)), r"lse_ref\.shape = \(1, 4, 1, 128\)"),
    ("q_integer_dtype", lambda: fwd(q=t(1, 4, 8, 128, dtype=torch.int32)), r"q\.dtype = torch\.int32"),
    ("q_not_tensor", lambda: fwd(q=[[1.0]]), r"q = list: must be a torch\.Tensor"),
    ("lse_not_tensor", lambda: bwd(lse_ref=None), r"lse_ref = NoneType"),
    ("scale_not_number", lambda: fwd(softmax_scale="0.1"), r"softmax_scale = '0\.1'"),
    ("scale_nan", lambda: fwd(softmax_scale=float("nan")), r"softmax_scale = nan: must be finite"),
    ("causal_flag_not_bool", lambda: fwd(use_causal_mask=torch.ones(2)), r"use_causal_mask = .*must be a bool"),
    ("mixed_flag_not_bool_bwd", lambda: bwd(mixed_precision="yes"), r"mixed_precision = 'yes'"),
    ("bias_shape", lambda: full(logit_bias=t(1, 4, 64, 128)),
     r"logit_bias\.shape = \(1, 4, 64, 128\): must broadcast to"),
    ("bias_too_big", lambda: full(logit_bias=t(2, 4, 128, 128)), r"logit_bias\.shape = \(2, 4, 128, 128\)"),
    ("bias_shape_kernel_name", lambda: full(attn_bias=t(1, 4, 64, 128)),
     r"compute_o_lse: attn_bias\.shape = \(1, 4, 64, 128\): must broadcast to"),
    ("bias_both_names", lambda: full(attn_bias=t(1, 4, 128, 128), logit_bias=t(1, 4, 128, 128)),
     r"logit_bias = a tensor: is attn_bias under its older name; give one of the two"),
    ("dropout_shape", lambda: full(dropout_mask=t(1, 4, 128, 1)), r"dropout_mask\.shape = \(1, 4, 128, 1\)"),
    ("dropout_dtype", lambda: full(dropout_mask=t(1, 4, 128, 128, dtype=torch.int64)),
     r"dropout_mask\.dtype = torch\.int64"),
    ("cu_float", lambda: golden.packing_bounds(torch.tensor([0.0, 3.0])),
     r"packing_bounds: cu_seqlens_q\.dtype = torch\.float32"),
    ("cu_not_starting_at_0", lambda: golden.packing_bounds(torch.tensor([1, 3])),
     r"cu_seqlens_q\[0\] = 1: cu_seqlens must start at 0"),
    ("cu_decreasing", lambda: golden.packing_bounds(torch.tensor([0, 5, 3])),
     r"cu_seqlens_q = \[0, 5, 3\]: cu_seqlens must be non-decreasing"),
    ("cu_too_short", lambda: golden.packing_bounds(torch.tensor([0])), r"cu_seqlens_q\.shape = \(1,\)"),
    ("cu_k_length", lambda: golden.packing_bounds(torch.tensor([0, 3, 5]), torch.tensor([0, 4])),
     r"cu_seqlens_k\.shape = \(2,\)"),
    ("cu_k_decreasing", lambda: golden.packing_bounds([0, 3, 5], [0, 4, 2]), r"cu_seqlens_k = \[0, 4, 2\]"),
    ("packing_seqlen_q_short", lambda: golden.packing_bounds([0, 3, 5], seqlen_q=4),
     r"seqlen_q = 4: must be an int >= cu_seqlens_q\[-1\] = 5"),
]


@pytest.mark.parametrize("call, pattern", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_raises_value_error(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()


def test_messages_name_the_calling_function():
    with pytest.raises(ValueError, match=r"^attention_fwd_torch_ref: "):
        fwd(sliding_window=3)
    with pytest.raises(ValueError, match=r"^compute_o_lse: "):
        full(sliding_window=3)
    with pytest.raises(ValueError, match=r"^attention_bwd_torch_ref: "):
        bwd(sliding_window=3)


def test_good_defaults_are_accepted():
    """Guard for the table above: without the bad argument every call succeeds."""
    fwd()
    full()
    bwd()
    golden.packing_bounds([0, 3, 5], seqlen_q=8)


ENTRY_POINTS = [("attention_fwd_torch_ref", fwd, golden.attention_fwd_torch_ref),
                ("compute_o_lse", full, golden.compute_o_lse),
                ("attention_bwd_torch_ref", bwd, golden.attention_bwd_torch_ref)]


@pytest.mark.parametrize("row", SCORE_STEPS, ids=[r.keyword for r in SCORE_STEPS])
@pytest.mark.parametrize("name, call, fn", ENTRY_POINTS, ids=[e[0] for e in ENTRY_POINTS])
def test_every_score_step_is_a_checked_keyword_of_every_entry_point(name, call, fn, row):
    """Each SCORE_STEPS row's keyword is a parameter of each entry point (the kernels' keyword, defaulting to the
    row's "off" value), and the entry point runs the row's check on it: a value of the wrong kind (a string) is
    refused naming the function and the keyword."""
    param = inspect.signature(fn).parameters[row.keyword]
    assert param.default == row.off
    with pytest.raises(ValueError, match=rf"^{name}: {row.keyword}( |\.)"):
        call(**{row.keyword: "bad"})


def test_compute_o_lse_takes_the_bias_under_either_name():
    """``attn_bias`` (the kernels' name) and ``logit_bias`` (the older one) are the same argument."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(*x.shape, generator=g, dtype=F64) for x in (Q, K, V))
    bias = torch.randn(1, 4, 128, 1, generator=g, dtype=F64)
    new = golden.compute_o_lse(q, k, v, attn_bias=bias)
    old = golden.compute_o_lse(q, k, v, logit_bias=bias)
    plain = golden.compute_o_lse(q, k, v)
    for a, b, c in zip(new, old, plain):
        assert torch.equal(a, b)
        assert not torch.equal(a, c)
