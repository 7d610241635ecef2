"""The kernels' argument checks: every refused argument of the forward and the backward, in one table.

Kernel code cannot raise, so each kernel checks its arguments with ``assert`` before it emits any instruction, and
``nki_attn.kernel_api`` runs the same check on the host and raises ``ValueError`` with the same message. For each
row: the host raises ValueError matching the row's text; called directly, the kernel fails its assert with exactly
the host's message and records no instruction.
"""
import inspect

import numpy as np
import pytest
import torch

from nki_attn import kernel_api
from nki_attn.kernels.attention_bwd import attention_bwd
from nki_attn.kernels.attention_fwd import attention_fwd
from nki_attn.sim.trace import recording


def fwd_args(d=64, dv=None, sq=256, sk=256, **over):
    """Forward arguments: q [1, 2, d, sq], k [1, 1, d, sk], v [1, 1, dv, sk] (GQA 2:1), overridden by ``over``."""
    dv = d if dv is None else dv
    args = dict(q_ref=torch.randn(1, 2, d, sq), k_ref=torch.randn(1, 1, d, sk), v_ref=torch.randn(1, 1, dv, sk))
    args.update(over)
    return args


def bwd_args(d=64, dv=None, sq=128, sk=None, h=1, dtype=np.float32, **over):
    """Backward arguments, zeros: q [1, h, d, sq], k [1, 1, d, sk], v [1, 1, dv, sk], o and dy [1, h, dv, sq],
    lse [1, h, 128, sq / 128] float32, overridden by ``over``."""
    sk = sq if sk is None else sk
    dv = d if dv is None else dv
    z = lambda *s: np.zeros(s, dtype=dtype)  # noqa: E731
    args = dict(q_ref=z(1, h, d, sq), k_ref=z(1, 1, d, sk), v_ref=z(1, 1, dv, sk), o_ref=z(1, h, dv, sq),
                dy_ref=z(1, h, dv, sq), lse_ref=np.zeros((1, h, 128, sq // 128), np.float32))
    args.update(over)
    return args


def f32(*shape):
    return np.zeros(shape, np.float32)


# (kernel, id, arguments, message regex)
ERRORS = [
    # ---- forward: shapes, dtypes
    ("fwd", "q_rank", lambda: fwd_args(q_ref=torch.randn(2, 64, 256)), "q must be 4-D"),
    ("fwd", "v_shape", lambda: fwd_args(v_ref=torch.randn(1, 1, 64, 384)), "v shape"),
    ("fwd", "k_batch", lambda: fwd_args(k_ref=torch.randn(2, 1, 64, 256), v_ref=torch.randn(2, 1, 64, 256)),
     "k batch"),
    ("fwd", "k_d_head", lambda: fwd_args(k_ref=torch.randn(1, 1, 32, 256), v_ref=torch.randn(1, 1, 32, 256)),
     "d_head"),
    ("fwd", "gqa_ratio", lambda: fwd_args(q_ref=torch.randn(1, 3, 64, 256), k_ref=torch.randn(1, 2, 64, 256),
                                          v_ref=torch.randn(1, 2, 64, 256)), "divisible"),
    ("fwd", "seqlen_q", lambda: fwd_args(q_ref=torch.randn(1, 2, 64, 200)), "seqlen_q=200"),
    ("fwd", "seqlen_k", lambda: fwd_args(sk=300), "seqlen_k=300"),
    ("fwd", "d_head_too_big", lambda: fwd_args(d=264), "exceeds"),
    ("fwd", "d_v_too_big", lambda: fwd_args(dv=300), "d_v=300 exceeds"),
    ("fwd", "d_head_zero", lambda: fwd_args(d=0, dv=64), "d_head"),
    ("fwd", "dtype_int32", lambda: fwd_args(q_ref=torch.ones(1, 2, 64, 256, dtype=torch.int32),
                                            k_ref=torch.ones(1, 1, 64, 256, dtype=torch.int32),
                                            v_ref=torch.ones(1, 1, 64, 256, dtype=torch.int32)), "not supported"),
    ("fwd", "dtype_mismatch", lambda: fwd_args(k_ref=torch.randn(1, 1, 64, 256, dtype=torch.bfloat16)), "k dtype"),
    # ---- forward: masks, packing, sinks, scale
    ("fwd", "window_no_causal", lambda: fwd_args(sliding_window=64), "only supported with use_causal_mask"),
    ("fwd", "window_zero", lambda: fwd_args(sliding_window=0, use_causal_mask=True), "sliding_window"),
    ("fwd", "window_float", lambda: fwd_args(sliding_window=64.0, use_causal_mask=True), "sliding_window"),
    ("fwd", "bound_min_only", lambda: fwd_args(bound_min=torch.zeros(256)), "without bound_max"),
    ("fwd", "bound_max_only", lambda: fwd_args(bound_max=torch.zeros(256)), "without bound_min"),
    ("fwd", "bound_shape", lambda: fwd_args(bound_min=torch.zeros(128), bound_max=torch.zeros(128)),
     "bound_min shape"),
    ("fwd", "bound_dtype", lambda: fwd_args(bound_min=torch.zeros(256, dtype=torch.int32),
                                            bound_max=torch.zeros(256, dtype=torch.int32)), "float32"),
    ("fwd", "sinks_shape", lambda: fwd_args(sinks_ref=torch.zeros(1, 3)), "sinks shape"),
    ("fwd", "sinks_dtype", lambda: fwd_args(sinks_ref=torch.zeros(1, 2, dtype=torch.int32)), "sinks dtype"),
    ("fwd", "scale_negative", lambda: fwd_args(softmax_scale=-1.0), "softmax_scale"),
    ("fwd", "scale_bool", lambda: fwd_args(softmax_scale=True), "softmax_scale"),
    ("fwd", "mixed_precision", lambda: fwd_args(mixed_precision="yes"), "mixed_precision"),
    # ---- forward: variants
    ("fwd", "softcap_negative", lambda: fwd_args(softcap=-1.0), "softcap"),
    ("fwd", "alibi_shape", lambda: fwd_args(alibi_slopes=torch.ones(2)), "alibi_slopes shape"),
    ("fwd", "alibi_dtype", lambda: fwd_args(alibi_slopes=torch.ones(1, 2, dtype=torch.float16)),
     "alibi_slopes dtype"),
    ("fwd", "window_and_sliding", lambda: fwd_args(window_size=(4, 4), sliding_window=4, use_causal_mask=True),
     "both"),
    ("fwd", "window_bad", lambda: fwd_args(window_size=(-2, 3)), "window_size"),
    ("fwd", "window_size_float", lambda: fwd_args(window_size=(2.0, 3)), "window_size"),
    ("fwd", "dropout_no_seed", lambda: fwd_args(dropout_p=0.1), "dropout"),
    ("fwd", "dropout_seed_without_p", lambda: fwd_args(dropout_seed=torch.zeros(2, dtype=torch.int32)),
     "dropout_seed"),
    ("fwd", "dropout_seed_dtype", lambda: fwd_args(dropout_p=0.1, dropout_seed=torch.zeros(2)),
     "dropout_seed dtype"),
    ("fwd", "dropout_p_one", lambda: fwd_args(dropout_p=1.0), "dropout_p"),
    # ---- backward: shapes, dtypes
    ("bwd", "q_rank", lambda: bwd_args(q_ref=f32(1, 64, 128)), "q must be 4-D"),
    ("bwd", "v_shape", lambda: bwd_args(v_ref=f32(1, 1, 64, 256)), "v shape"),
    ("bwd", "k_batch", lambda: bwd_args(k_ref=f32(2, 1, 64, 128), v_ref=f32(2, 1, 64, 128)), "batch"),
    ("bwd", "k_d_head", lambda: bwd_args(k_ref=f32(1, 1, 32, 128), v_ref=f32(1, 1, 32, 128)), "d_head"),
    ("bwd", "gqa_ratio", lambda: bwd_args(k_ref=f32(1, 2, 64, 128), v_ref=f32(1, 2, 64, 128)),
     "divisible by nheads_kv"),
    ("bwd", "seqlen_k", lambda: bwd_args(sk=200), "seqlen_k=200 must be a positive multiple of 128"),
    ("bwd", "o_shape", lambda: bwd_args(o_ref=f32(1, 1, 64, 256)), "o shape"),
    ("bwd", "o_shape_dv", lambda: bwd_args(o_ref=f32(1, 1, 32, 128)), "o shape"),
    ("bwd", "dy_dtype", lambda: bwd_args(dy_ref=np.zeros((1, 1, 64, 128), np.float16)), "dy dtype"),
    ("bwd", "lse_shape", lambda: bwd_args(lse_ref=f32(1, 1, 128, 2)), "lse shape"),
    ("bwd", "lse_dtype", lambda: bwd_args(lse_ref=np.zeros((1, 1, 128, 1), np.float16)), "lse dtype"),
    ("bwd", "lse_missing", lambda: bwd_args(lse_ref=None), "lse_ref are required"),
    ("bwd", "d_head_too_big", lambda: bwd_args(d=260), "d_head=260 exceeds the supported maximum 256"),
    ("bwd", "d_head_300", lambda: bwd_args(d=300), "d_head=300 exceeds"),
    ("bwd", "d_v_too_big", lambda: bwd_args(dv=257), "d_v=257 exceeds the supported maximum 256"),
    ("bwd", "seqlen_q", lambda: bwd_args(sq=200), "seqlen_q=200 must be a positive multiple of 128"),
    ("bwd", "dtype_int32", lambda: bwd_args(dtype=np.int32), "q dtype int32 is not supported"),
    # ---- backward: masks, packing, sinks, scale
    ("bwd", "window_no_causal", lambda: bwd_args(sliding_window=64), "only supported with use_causal_mask=True"),
    ("bwd", "window_zero", lambda: bwd_args(sliding_window=0, use_causal_mask=True),
     "must be None or an int >= 1"),
    ("bwd", "bound_min_only", lambda: bwd_args(bound_min=f32(128)), "bound_min was given without bound_max"),
    ("bwd", "bound_dtype", lambda: bwd_args(bound_min=np.zeros(128, np.int32), bound_max=np.zeros(128, np.int32)),
     "bound_min dtype"),
    ("bwd", "bound_shape", lambda: bwd_args(bound_min=f32(64), bound_max=f32(64)), "bound_min shape"),
    ("bwd", "sinks_shape", lambda: bwd_args(sinks_ref=f32(1, 2)), "sinks shape"),
    ("bwd", "scale_negative", lambda: bwd_args(softmax_scale=-1.0),
     "softmax_scale=-1.0 must be None or a positive number"),
    ("bwd", "mixed_precision", lambda: bwd_args(mixed_precision=1), "mixed_precision=1 must be a bool"),
    ("bwd", "section_len", lambda: bwd_args(sq=384, k_section_len=200),
     "k_section_len=200 must be a positive multiple of 128"),
    # ---- backward: variants
    ("bwd", "softcap_negative", lambda: bwd_args(softcap=-1.0), "softcap=-1.0 must be a finite number >= 0"),
    ("bwd", "alibi_shape", lambda: bwd_args(alibi_slopes=f32(1, 2)), "alibi_slopes shape"),
    ("bwd", "alibi_dtype", lambda: bwd_args(alibi_slopes=np.zeros((1, 1), np.float16)), "alibi_slopes dtype"),
    ("bwd", "window_bad", lambda: bwd_args(window_size=(-2, 0)), "window_size"),
    ("bwd", "window_and_sliding", lambda: bwd_args(window_size=(4, 4), sliding_window=4, use_causal_mask=True),
     "both given"),
    ("bwd", "dropout_p_big", lambda: bwd_args(dropout_p=1.5), "dropout_p=1.5 must be a number in"),
    ("bwd", "dropout_no_seed", lambda: bwd_args(dropout_p=0.1), "needs dropout_seed"),
    ("bwd", "dropout_seed_dtype", lambda: bwd_args(dropout_p=0.1, dropout_seed=f32(2)), "dropout_seed dtype"),
]
KERNELS = {"fwd": (kernel_api.attention_fwd, attention_fwd), "bwd": (kernel_api.attention_bwd, attention_bwd)}


@pytest.mark.parametrize("row", ERRORS, ids=[f"{r[0]}-{r[1]}" for r in ERRORS])
def test_validation_errors(row):
    kernel, _, make, match = row
    host_fn, kernel_fn = KERNELS[kernel]
    args = make()
    with pytest.raises(ValueError, match=match) as host:
        host_fn(**args)
    with recording() as rec, pytest.raises(AssertionError) as direct:
        kernel_fn(**args)
    assert str(direct.value) == str(host.value)
    assert rec.count() == 0


def test_kernel_api_checks_the_kernel_signature():
    q, k, v = (fwd_args()[n] for n in ("q_ref", "k_ref", "v_ref"))
    with pytest.raises(TypeError):
        kernel_api.attention_fwd(q, k, v, no_such_argument=1)  # the kernel's own signature, checked on the host


def test_bwd_keyword_order():
    # the variant keywords follow the seed's in the kernel's signature, then k_section_len (tuning knobs after it)
    names = list(inspect.signature(attention_bwd.fn).parameters)
    i = names.index("sliding_window") + 1
    assert names[i:i + 6] == ["softcap", "alibi_slopes", "window_size", "dropout_p", "dropout_seed", "k_section_len"]
