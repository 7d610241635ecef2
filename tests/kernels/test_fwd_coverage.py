"""Forward-kernel cases where query rows see keys in several key blocks, for every feature, so the online
softmax's rescale (running max, sum and output carried from one key block to the next) is exercised everywhere:
causal, sliding window (incl. widths next to a multiple of 128), sinks, packing, GQA with group != nheads_kv,
seqlen_q != seqlen_k, 16-bit inputs.

Accuracy: the project's criterion (tests/kernels/conftest.py, derived in docs/validation.md) for o and the finite
entries of lse, with ``ref`` the golden on float64 copies of the inputs and ``golden`` the golden in the kernel's
dtype; rows that see no key must be +inf in lse exactly where the reference has them. Each case first asserts,
on its own dense visibility mask, that some query row really sees keys in two or more key blocks (so a case cannot
silently stop covering the rescale if shapes or the kernel's key block change).
"""

import pytest
import torch

from . import conftest as _compare  # its check_close

from golden import attention_fwd_torch_ref, packing_bounds  # noqa: E402
from golden.attention_fwd_torch import visibility_mask  # noqa: E402
from nki_attn.kernels import attention_fwd as kf  # noqa: E402
from nki_attn.kernels.attention_fwd import attention_fwd  # noqa: E402

# Keys per key block of the forward kernel (docs/kernel-fwd.md): within one the row max is taken over all its score
# tiles at once; the rescale of the running max, sum and output happens between key blocks.
KEY_TILE = kf.KB_TILES * kf.K_TILE
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def max_key_tiles_per_row(sq, sk, causal, window, bmin, bmax):
    """Largest number of distinct KEY_TILE-wide key blocks one query row sees (dense mask, no kernel involved)."""
    vis = visibility_mask(sq, sk, causal, window, bmin, bmax)
    tiles = torch.zeros(sq, dtype=torch.int64)
    for t0 in range(0, sk, KEY_TILE):
        tiles += vis[:, t0:t0 + KEY_TILE].any(dim=1).to(torch.int64)
    return int(tiles.max())


def check(name, out, gold, ref, dtype):
    assert not torch.isnan(out).any(), f"{name}: NaN in the kernel result"
    assert torch.equal(torch.isposinf(out), torch.isposinf(ref)), f"{name}: +inf pattern differs from the reference"
    fin = torch.isfinite(ref)
    _compare.check_close(name, out[fin], ref[fin], gold[fin], dtype)


def run_case(bs=1, h=1, hk=1, d=32, sq=2176, sk=None, dtype="float32", causal=False, window=None, sinks=0,
             cu=None, mixed=True, scale=None, k_ramp=False, seed=0):
    sk = sq if sk is None else sk
    tdt = DTYPES[dtype]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(bs, h, d, sq, generator=g)
    k = torch.randn(bs, hk, d, sk, generator=g)
    v = torch.randn(bs, hk, d, sk, generator=g)
    if k_ramp:
        # key norms grow along the sequence: each new key block raises the running max, so every step rescales
        k = k * torch.linspace(0.5, 3.0, sk)
    q, k, v = q.to(tdt), k.to(tdt), v.to(tdt)
    s = None
    if sinks:
        s = (torch.randn((bs, h) if sinks == 1 else (bs, h, sinks), generator=g) * 2.0).to(tdt)
    bmin = bmax = None
    if cu is not None:
        bmin, bmax = packing_bounds(cu, seqlen_q=sq)
    assert max_key_tiles_per_row(sq, sk, causal, window, bmin, bmax) >= 2, "case does not cross a key block"
    kw = dict(bound_min=bmin, bound_max=bmax, use_causal_mask=causal, softmax_scale=scale, sliding_window=window)
    o, lse = attention_fwd(q, k, v, sinks_ref=s, mixed_precision=mixed, **kw)
    o_ref, lse_ref = attention_fwd_torch_ref(q.double(), k.double(), v.double(),
                                             sinks_ref=None if s is None else s.double(), **kw)
    o_gold, lse_gold = attention_fwd_torch_ref(q, k, v, sinks_ref=s, mixed_precision=mixed, **kw)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.dtype == torch.float32
    check("o", o, o_gold, o_ref, tdt)
    check("lse", lse, lse_gold, lse_ref, torch.float32)
    return o, lse


# ----------------------------------------------------------------------------------------------- one feature each
def test_causal():
    run_case(causal=True, h=2, sq=2560)  # key blocks of 2048 and 512 keys


def test_causal_partial_last_key_tile():
    run_case(causal=True, sq=2176)  # key blocks of 2048 and 128 keys (a partial score tile)


def test_non_causal():
    run_case(sq=256, sk=2560, h=2, hk=1)


def test_seqlen_q_ne_seqlen_k_partial_tile():
    run_case(sq=384, sk=2176, h=4, hk=2)


def test_rising_scores_rescale_every_tile():
    run_case(sq=256, sk=3 * KEY_TILE, k_ramp=True, scale=0.5)


@pytest.mark.parametrize("window,sq", [(2, 2176), (127, 2176), (130, 2176), (255, 2304), (258, 2304), (513, 2560),
                                       (700, 2560)])
def test_window(window, sq):
    run_case(causal=True, window=window, sq=sq, seed=window)


@pytest.mark.parametrize("num_sinks", [1, 2])
def test_sinks(num_sinks):
    run_case(causal=True, sinks=num_sinks, h=2, seed=num_sinks)


def test_sinks_non_causal_unequal_lengths():
    run_case(sq=256, sk=2176, sinks=2, h=2, hk=1)


@pytest.mark.parametrize("causal", [False, True])
def test_packing(causal):
    # the middle sequence spans key blocks 0 and 1; the last one ends before the padding rows
    run_case(cu=[0, 300, 2100, 2150], causal=causal, h=2, hk=1)


def test_packing_window():
    run_case(cu=[0, 300, 2100, 2176], causal=True, window=258)


@pytest.mark.parametrize("h,hk", [(8, 2), (6, 2), (6, 3)])
def test_gqa_group_differs_from_kv_heads(h, hk):
    run_case(bs=2, h=h, hk=hk, sq=128, sk=2176, seed=h + hk)


@pytest.mark.parametrize("h,hk,sinks", [(8, 2, 1), (6, 2, 2)])
def test_gqa_sinks_causal(h, hk, sinks):
    run_case(bs=2, h=h, hk=hk, causal=True, sinks=sinks, seed=h)


# ----------------------------------------------------------------------------------------------- combinations
@pytest.mark.parametrize("dtype,mixed", [("bfloat16", True), ("bfloat16", False), ("float16", True)])
def test_low_precision(dtype, mixed):
    run_case(dtype=dtype, mixed=mixed, causal=True, window=130, h=2, hk=1, sinks=1)


def test_everything_at_once():
    # packing, causal, window 130, 2 sinks, GQA 6:2, bf16
    run_case(h=6, hk=2, causal=True, window=130, sinks=2, cu=[0, 450, 2100], dtype="bfloat16", seed=3)
