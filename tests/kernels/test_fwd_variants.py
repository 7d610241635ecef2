"""Forward kernel: the variants of issue #14 (docs/semantics.md) against the golden, alone and combined.

soft-capping, ALiBi (causal and not, seqlen_q != seqlen_k), two-sided ``window_size`` (causal or not, bottom-right
aligned, incl. query tiles that see no key), causal with seqlen_q != seqlen_k, d_qk != d_v, head dims that are not
multiples of 128 (1, 72, 199), dropout with the golden's keep mask from the same seed; the model-like combinations
(Gemma-2: softcap + window + d 256; DeepSeek MLA: d_qk 192 / d_v 128; ModernBERT: window (64, 64) non-causal d 64;
BLOOM: ALiBi); the trace-time facts (tile skipping follows the band, a bounded window costs linear in S, the
default launch emits no variant instruction); and the clear errors for what stays unsupported.

Accuracy: the project's criterion (tests/kernels/_compare.py, derived in docs/tolerances.md "Forward") for o and
the finite entries of lse, ``ref`` = the golden on float64 copies of the inputs, ``golden`` = the golden in the
kernel's dtype; rows that see no key must be +inf in lse exactly where the reference has them (and o = 0 there).
Sizes are small: the simulator is slow and the machine shared.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import _compare  # noqa: E402

from golden import attention_fwd_torch_ref, packing_bounds  # noqa: E402
from nki_attn.kernels import attention_fwd as kf  # noqa: E402
from nki_attn.kernels.attention_fwd import attention_fwd  # noqa: E402
from nki_attn.sim.trace import recording  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _check(name, out, gold, ref, dtype):
    assert not torch.isnan(out).any(), f"{name}: NaN in the kernel result"
    assert torch.equal(torch.isposinf(out), torch.isposinf(ref)), f"{name}: +inf pattern differs from the reference"
    fin = torch.isfinite(ref)
    return _compare.check_close(name, out[fin], ref[fin], gold[fin], dtype)


def make_inputs(bs=1, h=2, hk=1, d=64, dv=None, sq=256, sk=None, dtype="float32", alibi=False, sinks=0, seed=0,
                q_mul=1.0):
    sk = sq if sk is None else sk
    dv = d if dv is None else dv
    g = torch.Generator().manual_seed(seed)
    tdt = DTYPES[dtype]
    q = (torch.randn(bs, h, d, sq, generator=g) * q_mul).to(tdt)
    k = torch.randn(bs, hk, d, sk, generator=g).to(tdt)
    v = torch.randn(bs, hk, dv, sk, generator=g).to(tdt)
    kw = {}
    if alibi:
        # BLOOM-like geometric slopes per head, different per batch row
        base = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)])
        kw["alibi_slopes"] = torch.stack([base * (1.0 + 0.25 * b) for b in range(bs)]).to(torch.float32)
    if sinks:
        kw["sinks_ref"] = (torch.randn((bs, h) if sinks == 1 else (bs, h, sinks), generator=g) * 2.0).to(tdt)
    return q, k, v, kw


def run_case(dtype="float32", mixed=True, inputs=None, **kw):
    """Kernel vs golden: returns (o, lse) of the kernel after checking both."""
    q, k, v, extra = inputs
    kw = dict(kw, **extra)
    o, lse = attention_fwd(q, k, v, mixed_precision=mixed, **kw)
    dbl = {key: (val.double() if isinstance(val, torch.Tensor) and val.is_floating_point()
                 and key in ("sinks_ref",) else val) for key, val in kw.items()}
    o_ref, lse_ref = attention_fwd_torch_ref(q.double(), k.double(), v.double(), **dbl)
    o_gold, lse_gold = attention_fwd_torch_ref(q, k, v, mixed_precision=mixed, **kw)
    assert o.shape == (q.shape[0], q.shape[1], v.shape[2], q.shape[3]) and o.dtype == q.dtype
    assert lse.dtype == torch.float32
    tdt = q.dtype
    _check("o", o, o_gold, o_ref, tdt)
    _check("lse", lse, lse_gold, lse_ref, torch.float32)
    # rows without a visible key (and no sink): o is exactly 0
    empty = torch.isposinf(lse_ref).permute(0, 1, 3, 2).reshape(q.shape[0], q.shape[1], -1)  # [b, h, sq]
    if empty.any():
        assert torch.all(o.permute(0, 1, 3, 2)[empty] == 0)
    return o, lse


# ----------------------------------------------------------------------------------------------------- soft-capping
@pytest.mark.parametrize("dtype,causal", [("float32", False), ("float32", True), ("bfloat16", True)])
def test_softcap(dtype, causal):
    # q scaled up so that scores reach the cap's non-linear range (|s q.k| ~ 10 .. 60 for cap 30)
    run_case(dtype=dtype, inputs=make_inputs(dtype=dtype, sq=384, q_mul=6.0, seed=1), softcap=30.0,
             use_causal_mask=causal)


def test_softcap_power_of_two_scale_and_sinks():
    # d 64: scale 1/8 is applied by the exponent (tanh takes s/c), sinks stay uncapped
    run_case(inputs=make_inputs(d=64, sinks=2, q_mul=5.0, seed=2), softcap=5.0, use_causal_mask=True)


def test_softcap_changes_the_result():
    inputs = make_inputs(q_mul=6.0, seed=3)
    o1, _ = attention_fwd(*inputs[:3], softcap=2.0)
    o0, _ = attention_fwd(*inputs[:3])
    assert (o1 - o0).abs().max() > 1e-2


# ----------------------------------------------------------------------------------------------------- ALiBi
@pytest.mark.parametrize("causal,sq,sk", [(False, 256, 256), (True, 256, 256), (False, 256, 640), (True, 256, 640),
                                          (False, 384, 256)])
def test_alibi(causal, sq, sk):
    run_case(inputs=make_inputs(bs=2, h=4, hk=2, sq=sq, sk=sk, alibi=True, seed=sq + sk), use_causal_mask=causal)


def test_alibi_bf16_gqa_several_key_blocks():
    # keys in two key blocks: the bias spans score tiles on both sides of the diagonal and the online rescale
    run_case(dtype="bfloat16", inputs=make_inputs(h=4, hk=1, sq=256, sk=2560, alibi=True, dtype="bfloat16", seed=4))


@pytest.mark.parametrize("sq,sk,window,h,hk", [(256, 2560, None, 4, 1), (384, 384, 100, 2, 2),
                                                (256, 640, None, 16, 1)])
def test_alibi_causal_bf16_by_tensor_engine(sq, sk, window, h, hk):
    # causal bf16 takes _alibi_matmul (the bias's key part in PSUM, the row part folded into the LSE): one more
    # matmul per computed score tile; across key blocks, with a window, and with a group of 16 heads (two
    # blocks per query tile)
    inputs = make_inputs(h=h, hk=hk, sq=sq, sk=sk, alibi=True, dtype="bfloat16", seed=sq + h)
    kw = dict(use_causal_mask=True, sliding_window=window)
    with recording() as rec:
        run_case(dtype="bfloat16", inputs=inputs, **kw)
    q, k, v, _ = inputs
    with recording() as base:
        attention_fwd(q, k, v, **kw)
    # one score tile = one eviction (tensor_scalar_reduce when fully visible, range_select otherwise, trn2)
    n_score = base.count("tensor_scalar_reduce") + base.count("range_select")
    assert rec.count("nc_matmul") - base.count("nc_matmul") == n_score
    assert rec.count("tensor_scalar_reduce") == base.count("tensor_scalar_reduce")  # no extra VectorE pass


def test_alibi_with_softcap_and_window():
    run_case(inputs=make_inputs(h=2, sq=512, alibi=True, q_mul=4.0, seed=5), softcap=20.0, window_size=(100, 60))


# ----------------------------------------------------------------------------------------------------- bands
@pytest.mark.parametrize("sq,sk", [(256, 512), (512, 256), (384, 896)])
def test_causal_unequal_lengths(sq, sk):
    # sq > sk: the first sq - sk query rows see no key (o = 0, lse = +inf)
    run_case(inputs=make_inputs(h=2, sq=sq, sk=sk, seed=sq), use_causal_mask=True)


@pytest.mark.parametrize("window,causal", [((64, 64), False), ((0, 0), False), ((200, -1), False),
                                           ((-1, 100), False), ((130, 7), True), ((3, 300), True)])
def test_window_size(window, causal):
    run_case(inputs=make_inputs(h=2, sq=512, seed=window[0] + 7), window_size=window, use_causal_mask=causal)


@pytest.mark.parametrize("window,sq,sk", [((50, 20), 256, 768), ((50, 20), 768, 256), ((0, 0), 640, 128)])
def test_window_size_unequal_lengths(window, sq, sk):
    # bottom-right: with sq > sk whole query tiles see no key; with sq < sk the band starts late
    run_case(inputs=make_inputs(h=2, sq=sq, sk=sk, seed=sq), window_size=window)


def test_window_size_with_packing_and_sinks():
    bmin, bmax = packing_bounds([0, 100, 300, 480], seqlen_q=512)
    run_case(inputs=make_inputs(h=2, sq=512, sinks=1, seed=9), window_size=(40, 40), bound_min=bmin,
             bound_max=bmax)


def test_sliding_window_causal_unequal():
    run_case(inputs=make_inputs(h=2, sq=256, sk=640, seed=10), use_causal_mask=True, sliding_window=100)


@pytest.mark.parametrize("target", ["trn1", "trn3"])
def test_bands_on_other_generations(target, monkeypatch):
    # trn1 masks by affine_select (no range_select); trn3 like trn2
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", target)
    run_case(inputs=make_inputs(h=2, sq=512, sk=384, seed=11), window_size=(60, 30))
    run_case(inputs=make_inputs(h=2, sq=256, sk=512, alibi=True, seed=12), use_causal_mask=True, softcap=10.0)


def _matmuls(fn):
    with recording() as rec:
        fn()
    return rec.count("nc_matmul")


def test_window_tile_skipping_is_linear_in_seqlen():
    # a bounded two-sided window computes only the band's tiles: every 1024 more tokens add the same number of
    # matmuls (the edges are constant), and the non-causal window costs far less than full attention
    def run(s, window):
        q, k, v, _ = make_inputs(h=1, d=32, sq=s, seed=13)
        return _matmuls(lambda: attention_fwd(q, k, v, window_size=window))
    a = run(1024, (64, 64))
    b = run(2048, (64, 64))
    c = run(3072, (64, 64))
    assert c - b == b - a
    assert b < 0.35 * run(2048, None)


# ----------------------------------------------------------------------------------------------------- head dims
@pytest.mark.parametrize("d,dv,dtype", [(192, 128, "bfloat16"), (128, 192, "float32"), (199, 199, "float32"),
                                        (72, 72, "bfloat16"), (1, 1, "float32"), (64, 200, "float32"),
                                        (256, 32, "float32")])
def test_head_dims(d, dv, dtype):
    run_case(dtype=dtype, inputs=make_inputs(h=2, d=d, dv=dv, sq=256, dtype=dtype, seed=d + dv),
             use_causal_mask=True)


def test_uneven_head_dim_unmixed_16bit():
    run_case(dtype="float16", mixed=False, inputs=make_inputs(h=2, d=199, dv=72, sq=256, dtype="float16", seed=14))


# ----------------------------------------------------------------------------------------------------- combinations
def test_gemma2_like():
    # softcap 50 + sliding window + d 256, GQA 2:1, bf16
    run_case(dtype="bfloat16", inputs=make_inputs(h=2, hk=1, d=256, sq=512, dtype="bfloat16", q_mul=4.0, seed=15),
             softcap=50.0, use_causal_mask=True, sliding_window=200)


def test_deepseek_mla_like():
    run_case(dtype="bfloat16", inputs=make_inputs(h=4, hk=4, d=192, dv=128, sq=256, dtype="bfloat16", seed=16),
             use_causal_mask=True)


def test_modernbert_like():
    run_case(dtype="bfloat16", inputs=make_inputs(bs=2, h=2, hk=2, d=64, sq=512, dtype="bfloat16", seed=17),
             window_size=(64, 64))


def test_bloom_like():
    run_case(dtype="bfloat16", inputs=make_inputs(h=4, hk=4, d=64, sq=384, alibi=True, dtype="bfloat16", seed=18),
             use_causal_mask=True)


# ----------------------------------------------------------------------------------------------------- dropout
def _seed(seed=1234, offset=7):
    from golden.dropout import make_seed
    return make_seed(seed, offset)


@pytest.mark.parametrize("dtype,p,causal", [("float32", 0.1, False), ("bfloat16", 0.1, True),
                                            ("float32", 0.5, True)])
def test_dropout_matches_golden_same_seed(dtype, p, causal):
    run_case(dtype=dtype, inputs=make_inputs(bs=2, h=2, hk=1, sq=256, sk=640, dtype=dtype, seed=19),
             use_causal_mask=causal, dropout_p=p, dropout_seed=_seed())


def test_dropout_lse_is_pre_dropout_and_mask_matters():
    q, k, v, _ = make_inputs(h=2, sq=256, seed=20)
    o0, lse0 = attention_fwd(q, k, v, use_causal_mask=True)
    o1, lse1 = attention_fwd(q, k, v, use_causal_mask=True, dropout_p=0.3, dropout_seed=_seed())
    o2, _ = attention_fwd(q, k, v, use_causal_mask=True, dropout_p=0.3, dropout_seed=_seed(offset=8))
    assert torch.equal(lse0, lse1)  # the LSE is the pre-dropout one, bit for bit
    assert (o1 - o0).abs().max() > 1e-2 and (o1 - o2).abs().max() > 1e-2  # the mask, and the seed, matter
    o3, _ = attention_fwd(q, k, v, use_causal_mask=True, dropout_p=0.3, dropout_seed=_seed())
    assert torch.equal(o1, o3)  # deterministic given the seed


def test_dropout_with_window_gqa_alibi_and_several_key_blocks():
    run_case(dtype="bfloat16", inputs=make_inputs(h=4, hk=2, sq=256, sk=2560, alibi=True, dtype="bfloat16",
                                                  seed=21),
             window_size=(700, 100), dropout_p=0.2, dropout_seed=_seed(99, 0))


def test_dropout_beyond_the_first_65536_keys():
    # the hash's row words depend on j >> 16: a window at the end of 65792 keys crosses key 65536, so some score
    # tiles recompute their row words (the others use the section's)
    run_case(inputs=make_inputs(h=1, d=8, sq=128, sk=65536 + 256, seed=23), window_size=(300, 0),
             dropout_p=0.25, dropout_seed=_seed(3, 4))


def test_bert_like_dropout():
    # BERT-base: dropout 0.1, d 64, non-causal
    run_case(dtype="bfloat16", inputs=make_inputs(bs=2, h=2, hk=2, d=64, sq=256, dtype="bfloat16", seed=22),
             dropout_p=0.1, dropout_seed=_seed(5, 1))


# ----------------------------------------------------------------------------------------------------- trace facts
def test_default_launch_has_no_variant_steps():
    cfg_steps = []
    q, k, v, _ = make_inputs(h=2, sq=256)
    with recording() as rec:
        attention_fwd(q, k, v, use_causal_mask=True)
    assert rec.count("iota") <= 1  # the causal key bounds only
    assert rec.count("activation") == rec.count("activation")  # (trace recorded)
    with recording() as rec2:
        attention_fwd(q, k, v, use_causal_mask=True, softcap=0.0, alibi_slopes=None, window_size=None)
    assert rec2.count() == rec.count()
    assert cfg_steps == []


def test_softcap_adds_one_activation_per_score_tile():
    q, k, v, _ = make_inputs(h=1, sq=512)
    with recording() as r0:
        attention_fwd(q, k, v)
    with recording() as r1:
        attention_fwd(q, k, v, softcap=10.0)
    def tanh_like(rec):  # ScalarE activations from the PSUM scores into float32 SBUF: only the soft-cap's
        return sum(1 for r in rec.records if r.instr == "activation" and r.srcs[0].buffer == "psum"
                   and r.dst.dtype == "float32" and r.dst.free_elems == 512)
    n_tiles = 512 // 128  # one 512-key score tile per query tile
    assert tanh_like(r0) == 0 and tanh_like(r1) == n_tiles
    assert r1.count("nc_matmul") == r0.count("nc_matmul")
    # the tanh makes ScalarE the busiest engine: the Q scaling and O finishing moved to VectorE
    assert r1.counts_by_engine()["ScalarE"] < r0.counts_by_engine()["ScalarE"] + n_tiles


# ----------------------------------------------------------------------------------------------------- errors
def _qkv(d=64, dv=64, sq=256, sk=256):
    return torch.randn(1, 2, d, sq), torch.randn(1, 1, d, sk), torch.randn(1, 1, dv, sk)


BAD = {
    "softcap_negative": (lambda: dict(softcap=-1.0), "softcap"),
    "alibi_shape": (lambda: dict(alibi_slopes=torch.ones(2)), "alibi_slopes shape"),
    "alibi_dtype": (lambda: dict(alibi_slopes=torch.ones(1, 2, dtype=torch.float16)), "alibi_slopes dtype"),
    "window_and_sliding": (lambda: dict(window_size=(4, 4), sliding_window=4, use_causal_mask=True), "both"),
    "window_bad": (lambda: dict(window_size=(-2, 3)), "window_size"),
    "window_float": (lambda: dict(window_size=(2.0, 3)), "window_size"),
    "dropout_no_seed": (lambda: dict(dropout_p=0.1), "dropout"),
    "dropout_seed_without_p": (lambda: dict(dropout_seed=torch.zeros(2, dtype=torch.int32)), "dropout_seed"),
    "dropout_seed_dtype": (lambda: dict(dropout_p=0.1, dropout_seed=torch.zeros(2)), "dropout_seed dtype"),
    "dropout_p_one": (lambda: dict(dropout_p=1.0), "dropout_p"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_variant_errors(case):
    from nki_attn import kernel_api
    make, match = BAD[case]
    q, k, v = _qkv()
    args = make()
    with pytest.raises(ValueError, match=match) as host:
        kernel_api.attention_fwd(q, k, v, **args)
    with recording() as rec, pytest.raises(AssertionError) as kernel:
        attention_fwd(q, k, v, **args)
    assert str(kernel.value) == str(host.value)
    assert rec.count() == 0


@pytest.mark.parametrize("shapes,match", [((264, 264), "exceeds"), ((64, 300), "d_v=300 exceeds"),
                                          ((0, 64), "d_head")])
def test_head_dim_errors(shapes, match):
    from nki_attn import kernel_api
    d, dv = shapes
    q, k, v = _qkv(d=max(d, 1) if d else 0, dv=dv)
    with pytest.raises(ValueError, match=match):
        kernel_api.attention_fwd(q, k, v)
