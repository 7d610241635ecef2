"""Cases that scripts/mutation_check.py found missing: each test kills a planted bug the other tests let through
(docs/validation.md, "Mutation testing", names the mutation)."""
import pytest
import torch

from . import conftest as taf  # its make_qkv / run_and_check helpers


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
