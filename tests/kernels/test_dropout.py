"""The dropout tile step (nki_attn/kernels/dropout.py) on the simulator: bit-identical to golden.dropout for any
tiling, any seed dtype, across 65536-key blocks; the multiplier values; p = 0 and p close to 1; the
two-call form (row words once, then tiles) equal to the one-call form; the integer instructions it relies on."""
import numpy as np
import pytest
import torch

import nki_attn.sim as sim
from golden import dropout as gd
from nki_attn.backend import nisa, nki, nl
from nki_attn.dropout import dropout_mask, make_seed, seed_from_generator
from nki_attn.kernels import dropout as kd


@pytest.fixture(autouse=True)
def _trn2(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")


def _golden(seed, p, bs, nh, sq, sk, k_start=0):
    v = gd.hash_values(seed, bs, nh, sq, k_start + sk, k_range=range(k_start, k_start + sk))
    return v < gd.keep_threshold(p)


@pytest.mark.parametrize("p, tiles", [(0.1, (128, 512)), (0.5, (100, 333)), (0.3, (1, 7)), (0.9, (128, 1))])
def test_kernel_equals_golden_for_any_tiling(p, tiles):
    seed = make_seed(20260601, 5)
    bs, nh, sq, sk = 1, 2, 130, 520
    if tiles == (1, 7) or tiles == (128, 1):
        sq, sk = 9, 40  # tiny tiles: keep the number of launched instructions small
    got, scale = dropout_mask(seed, p, bs, nh, sq, sk, q_tile=tiles[0], k_tile=tiles[1], return_scale=True)
    assert torch.equal(got, _golden(seed, p, bs, nh, sq, sk))
    s = np.float32(1.0 / (1.0 - p))
    assert set(torch.unique(scale).tolist()) <= {0.0, float(s)}


def test_kernel_strict_checks_and_uint32_seed():
    seed = make_seed(-77, 2**31 + 3).to(torch.int64) & 0xFFFFFFFF
    seed_u = seed.numpy().astype(np.uint32)
    with sim.checking(strict=True, frontend="full"):
        out = kd.dropout_mask_kernel(seed_u, 0.25, 2, 1, 64, 96, q_tile=64, k_tile=96)
    assert sim.last_launch_stats().strict
    got = torch.from_numpy(np.asarray(out)) != 0
    assert torch.equal(got, _golden(torch.from_numpy(seed_u), 0.25, 2, 1, 64, 96))


def test_one_word_seed():
    one = np.array([-12345], dtype=np.int32)
    out = kd.dropout_mask_kernel(one, 0.4, 1, 1, 32, 64, q_tile=32, k_tile=64)
    assert torch.equal(torch.from_numpy(np.asarray(out)) != 0, _golden(make_seed(-12345, 0), 0.4, 1, 1, 32, 64))


def test_tile_straddling_a_key_block():
    # columns 65536 - 200 .. 65536 + 199: one 512-wide tile crosses the 65536 boundary (two sets of row words)
    seed = make_seed(3)
    got = dropout_mask(seed, 0.5, 1, 1, 16, 400, q_tile=16, k_tile=512, k_start=65536 - 200)
    assert torch.equal(got, _golden(seed, 0.5, 1, 1, 16, 400, k_start=65536 - 200))


def test_p_zero_and_p_close_to_one():
    seed = make_seed(11)
    keep, scale = dropout_mask(seed, 0.0, 1, 1, 32, 64, return_scale=True)
    assert keep.all() and torch.all(scale == 1.0)
    p = 0.999
    keep = dropout_mask(seed, p, 1, 2, 128, 512)
    assert torch.equal(keep, _golden(seed, p, 1, 2, 128, 512))
    # keep probability 66/65536: 131072 draws, mean 132, 5-sigma bound (tests/golden/test_dropout_golden.py)
    q = gd.keep_threshold(p) / 65536
    n = keep.numel()
    assert abs(int(keep.sum()) - n * q) <= 5 * (n * q * (1 - q)) ** 0.5


@nki.jit
def _two_forms(dropout_seed, dropout_p, b, h, q0, k0, rows, cols):
    out = nl.ndarray((2, rows, cols), dtype=nl.float32, buffer=nl.shared_hbm)
    seed_sb = kd.load_dropout_seed(dropout_seed)
    one = kd.dropout_scale_tile(seed_sb, dropout_p, b, h, q0, k0, rows, cols)
    keys = kd.dropout_row_keys(seed_sb, b, h, q0, rows, k0 >> 16)
    two = kd.dropout_scale_keys(keys, dropout_p, k0, rows, cols)
    nisa.dma_copy(dst=out[0], src=one)
    nisa.dma_copy(dst=out[1], src=two)
    return out


def test_row_keys_then_tiles_equals_one_call():
    seed = make_seed(5, 6)
    out = np.asarray(_two_forms(seed.numpy(), 0.2, 3, 5, 256, 1024, 128, 512))
    assert np.array_equal(out[0], out[1])
    keep = gd.hash_values(seed, 4, 6, 384, 1536, q_range=range(256, 384), k_range=range(1024, 1536))[3, 5] < \
        gd.keep_threshold(0.2)
    assert torch.equal(torch.from_numpy(out[0]) != 0, keep)


def test_host_function_rejects_bad_input():
    seed = make_seed(1)
    with pytest.raises(ValueError, match="dropout_p"):
        dropout_mask(seed, 1.0, 1, 1, 8, 8)
    with pytest.raises(ValueError, match="k_tile"):
        dropout_mask(seed, 0.1, 1, 1, 8, 8, k_tile=513)
    with pytest.raises(ValueError, match="dtype"):
        dropout_mask(torch.tensor([1, 2], dtype=torch.int64), 0.1, 1, 1, 8, 8)
    with pytest.raises(ValueError, match="elements"):
        dropout_mask(seed, 0.1, 64, 64, 4096, 4096)
    assert torch.equal(make_seed(1), gd.make_seed(1))
    g = torch.Generator().manual_seed(0)
    s = seed_from_generator(g)
    assert s.dtype == torch.int32 and s.shape == (2,)


# ------------------------------------------------------------------------------ the integer instructions used
@nki.jit
def _int_ops(a, b):
    out = nl.ndarray((4, 128, 8), dtype=nl.uint32, buffer=nl.shared_hbm)
    ta = nl.ndarray((128, 8), dtype=nl.uint32, buffer=nl.sbuf)
    tb = nl.ndarray((128, 8), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.dma_copy(dst=ta, src=a)
    nisa.dma_copy(dst=tb, src=b)
    r0 = nl.ndarray((128, 8), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=r0, data1=ta, data2=tb, op=nl.multiply, engine=nisa.engine.gpsimd)
    r1 = nl.ndarray((128, 8), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=r1, data1=ta, data2=tb, op=nl.bitwise_xor, engine=nisa.engine.vector)
    r2 = nl.ndarray((128, 8), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=r2, data=ta, op0=nl.right_shift, operand0=16, op1=nl.bitwise_or, operand1=1)
    r3 = nl.ndarray((128, 8), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=r3, data1=ta, data2=tb, op=nl.add, engine=nisa.engine.gpsimd)
    nisa.dma_copy(dst=out[0], src=r0)
    nisa.dma_copy(dst=out[1], src=r1)
    nisa.dma_copy(dst=out[2], src=r2)
    nisa.dma_copy(dst=out[3], src=r3)
    return out


def test_integer_instructions_are_exact():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 1 << 16, size=(128, 8), dtype=np.uint64)
    b = rng.integers(0, 1 << 16, size=(128, 8), dtype=np.uint64) + 1
    a[0, 0], b[0, 0] = 0xFFFF, 0x10000  # the largest product the hash forms: 0xFFFF0000 < 2**32
    out = np.asarray(_int_ops(a.astype(np.uint32), b.astype(np.uint32))).astype(np.uint64)
    assert np.array_equal(out[0], a * b)  # exact 32-bit products (float32 would round them)
    assert np.array_equal(out[1], a ^ b)
    assert np.array_equal(out[2], (a >> 16) | 1)
    assert np.array_equal(out[3], a + b)
    big = np.full((128, 8), 0xFFFFFFFF, dtype=np.uint32)
    # results beyond 32 bits are not specified by the docs; the simulator wraps (docs/simulator.md)
    wrapped = np.asarray(_int_ops(big, np.full((128, 8), 2, dtype=np.uint32))).astype(np.uint64)
    assert np.all(wrapped[0] == 0xFFFFFFFE) and np.all(wrapped[3] == 1)
