"""Cases that scripts/mutation_check.py found missing: each test kills a planted bug the other tests let through
(docs/validation.md, "Mutation testing", names the mutation)."""
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import test_attention_fwd as taf  # noqa: E402  (its make_qkv / run_and_check helpers)

from nki_attn import kernel_api  # noqa: E402
from nki_attn.kernels import attention_bwd as kb  # noqa: E402
from nki_attn.kernels import attention_fwd as kf  # noqa: E402
from nki_attn.sim import trace  # noqa: E402


def _fwd_args(sq, sk):
    z = lambda *s: np.zeros(s, np.float32)  # noqa: E731
    return dict(q_ref=z(1, 1, 64, sq), k_ref=z(1, 1, 64, sk), v_ref=z(1, 1, 64, sk), use_causal_mask=True)


def _bwd_args(sq, sk):
    args = _fwd_args(sq, sk)
    args.update(o_ref=np.zeros((1, 1, 64, sq), np.float32), dy_ref=np.zeros((1, 1, 64, sq), np.float32),
                lse_ref=np.zeros((1, 1, 128, sq // 128), np.float32))
    return args


# Mutation v_causal_lengths_one_sided: the kernels' native causal mask is top-left and needs equal lengths; the
# existing validation cases only had seqlen_k > seqlen_q, so a check refusing that direction alone passed them.
@pytest.mark.parametrize("sq,sk", [(256, 128), (128, 256)], ids=["q_longer", "k_longer"])
@pytest.mark.parametrize("which", ["fwd", "bwd"])
def test_causal_refuses_unequal_lengths_both_ways(which, sq, sk):
    host = kernel_api.attention_fwd if which == "fwd" else kernel_api.attention_bwd
    kern = kf.attention_fwd if which == "fwd" else kb.attention_bwd
    args = _fwd_args(sq, sk) if which == "fwd" else _bwd_args(sq, sk)
    with pytest.raises(ValueError, match=f"needs seqlen_q == seqlen_k, got {sq} and {sk}"):
        host(**args)
    with trace.recording() as rec, pytest.raises(AssertionError, match="needs seqlen_q == seqlen_k"):
        kern(**args)
    assert rec.count() == 0


# Mutation f_trn1_window_affine: on trn1 the forward masks causal / window tiles with affine_select ("affine"
# mask); the trn1 window tests all used packing bounds (the "predicate" mask), so the affine window mask was
# never run. Windows 130 and 700 put the window's edge inside partially visible 128-key chunks; the result must
# pass the accuracy criterion and equal trn2's range_select path bit for bit (both write FP32_MIN).
@pytest.mark.parametrize("window", [130, 700])
def test_trn1_affine_window_mask(monkeypatch, window):
    q, k, v = taf.make_qkv(nheads=2, nheads_kv=1, d=64, sq=1024, seed=window)
    out = {}
    for target in ("trn1", "trn2"):
        monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", target)
        o, lse, _, _ = taf.run_and_check(q, k, v, causal=True, window=window)
        out[target] = (o, lse)
    assert torch.equal(out["trn1"][0], out["trn2"][0]) and torch.equal(out["trn1"][1], out["trn2"][1])
