"""float32 / bfloat16 / float16 golden vs the float64 naive reference.

The inputs are the same (rounded) values on both sides, so every difference
is rounding inside the golden.  Tolerance, per output X with reference Xr:

    |X - Xr| <= M * ((8 + 2 * smax) * u  +  2 * sqrt(n) * u32)

where M = max|Xr|, u = eps(dtype) / 2 is the unit roundoff of the input
dtype, u32 = 2**-24 that of float32, smax the largest |logit| that gets a
non-zero probability, and n the longest contraction (max of d_head,
seqlen_k, group * seqlen_q).  Derivation:

* a value passes through at most ~8 roundings to the input dtype on its way
  to an output (matmul result, P or dS cast, and, without mixed precision,
  scale/shift/exp/sum/divide/log), each a relative error <= u of a quantity
  bounded by M (after normalising), hence 8 * u * M;
* a score S rounded with relative error u moves exp(S) by a relative
  ~|S| * u, and both the numerator and the normaliser of the softmax move,
  hence 2 * smax * u * M;
* torch's CPU matmul accumulates in float32; over n terms the rounding
  errors random-walk to ~sqrt(n) * u32 (a factor 2 of headroom).  For 16-bit
  inputs this term is negligible; for float32 it dominates.

Measured errors sit 2.5-10x below this bound; an indexing or masking bug gives
errors of order M, far above it (about 9 * eps for bf16 with smax ~ 5).
"""

import math

import pytest
import torch

import golden

LOW = [torch.float32, torch.bfloat16, torch.float16]

CASES = {
    "plain": dict(h=2, hk=2, d=128, s=256, causal=False, window=None, sinks=None, cu=None),
    "gqa_causal_sinks": dict(h=4, hk=1, d=64, s=256, causal=True, window=None, sinks=2, cu=None),
    "packing_window": dict(h=2, hk=2, d=96, s=256, causal=True, window=40, sinks=None,
                           cu=[0, 70, 150, 230]),
}


def _tol(dtype, smax, n):
    u = torch.finfo(dtype).eps / 2
    return (8 + 2 * smax) * u + 2 * math.sqrt(n) * 2.0 ** -24


def _assert_close_scaled(name, got, want, rel):
    got = got.to(torch.float64)
    finite = torch.isfinite(want)
    # inf entries (empty-row LSE) must match exactly.
    assert torch.equal(got[~finite], want[~finite]), name
    if finite.any():
        m = want[finite].abs().max().item()
        err = (got[finite] - want[finite]).abs().max().item()
        assert err <= rel * m, f"{name}: max err {err:.3g} > {rel:.3g} * max|ref| {m:.3g}"


def _sdt(dtype, mixed):
    if dtype in (torch.bfloat16, torch.float16) and not mixed:
        return dtype
    return torch.float32


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "pure"])
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_low_precision_against_float64(ref, name, dtype, mixed):
    c = CASES[name]
    q, k, v, dy = ref.make_inputs(1, c["h"], c["hk"], c["d"], c["s"], c["s"], dtype=dtype,
                                  seed=7)
    sinks = None
    if c["sinks"]:
        g = torch.Generator().manual_seed(8)
        sinks = torch.randn(1, c["h"], c["sinks"], generator=g, dtype=torch.float32)
    kw = dict(use_causal_mask=c["causal"], sliding_window=c["window"], mixed_precision=mixed)
    nkw = dict(causal=c["causal"], window=c["window"])
    if c["cu"] is not None:
        kw["bound_min"], kw["bound_max"] = golden.packing_bounds(torch.tensor(c["cu"]),
                                                                 seqlen_q=c["s"])
        nkw["cu_seqlens"] = (c["cu"], c["cu"])

    o, lse, probs = golden.compute_o_lse(q, k, v, sinks=sinks, **kw)
    got = golden.attention_bwd_torch_ref(q, k, v, o, dy, lse, sinks_ref=sinks, **kw)
    want = ref.run(q, k, v, dy, sinks=sinks, **nkw)

    # The documented dtypes.
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert probs.dtype == _sdt(dtype, mixed)
    for key in ("out_dq_ref", "out_dk_ref", "out_dv_ref"):
        assert got[key].dtype == dtype
    if sinks is not None:
        assert got["out_dsinks_ref"].dtype == torch.float32

    n = max(c["d"], c["s"], c["s"] * c["h"] // c["hk"])
    rel = _tol(dtype, want["smax"], n)
    _assert_close_scaled("o", o, want["o"], rel)
    _assert_close_scaled("lse", ref.lse_rows(lse), want["lse"], rel)
    _assert_close_scaled("dq", got["out_dq_ref"], want["dq"], rel)
    _assert_close_scaled("dk", got["out_dk_ref"], want["dk"], rel)
    _assert_close_scaled("dv", got["out_dv_ref"], want["dv"], rel)
    if sinks is not None:
        _assert_close_scaled("dsinks", got["out_dsinks_ref"], want["dsinks"], rel)


def test_mixed_precision_flag_changes_16bit_result(ref):
    """mixed_precision really switches the statistics dtype for 16-bit inputs."""
    q, k, v, _ = ref.make_inputs(1, 2, 2, 64, 128, 128, dtype=torch.bfloat16, seed=9)
    _, lse_mixed, p_mixed = golden.compute_o_lse(q, k, v, mixed_precision=True)
    _, lse_pure, p_pure = golden.compute_o_lse(q, k, v, mixed_precision=False)
    assert p_mixed.dtype == torch.float32 and p_pure.dtype == torch.bfloat16
    assert lse_mixed.dtype == lse_pure.dtype == torch.float32
    # Pure bf16 LSE values are bf16-representable; the mixed ones are not.
    assert torch.equal(lse_pure, lse_pure.to(torch.bfloat16).to(torch.float32))
    assert not torch.equal(lse_mixed, lse_mixed.to(torch.bfloat16).to(torch.float32))


def test_float32_mixed_flag_is_a_no_op(ref):
    q, k, v, dy = ref.make_inputs(1, 2, 2, 64, 128, 128, dtype=torch.float32, seed=10)
    a = golden.compute_o_lse(q, k, v, mixed_precision=True)
    b = golden.compute_o_lse(q, k, v, mixed_precision=False)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
