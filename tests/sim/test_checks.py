"""Undefined behaviour the hardware does not forgive, memory capacity and strict mode, each caught by a small
deliberate kernel (and the legal variant not caught)."""
import numpy as np
import pytest
from simtools import tile

import nki_attn.sim as sim
from nki_attn.sim import NkiValidationError
from nki_attn.sim import isa as nisa
from nki_attn.sim import language as nl


@pytest.fixture(autouse=True)
def _default_modes(monkeypatch):
    # These tests set the modes explicitly; the environment of the test run must not change them.
    monkeypatch.delenv("NKI_ATTN_SIM_STRICT", raising=False)
    monkeypatch.delenv("NKI_ATTN_SIM_CAPACITY", raising=False)
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")


def _load(src, dtype=None):
    t = nl.ndarray(src.shape, dtype or src.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=src)
    return t


# ------------------------------------------------------------------ PSUM accumulation
@sim.jit
def _matmul_groups(a, b, accumulate_first, reuse_psum, init_with):
    """Two independent products a[g].T @ b[g] (g = 0, 1) into out[g]; the knobs reproduce common PSUM bugs."""
    out = nl.ndarray((2, a.shape[2], b.shape[2]), nl.float32, buffer=nl.shared_hbm)
    shared = nl.ndarray((a.shape[2], b.shape[2]), nl.float32, buffer=nl.psum, name="acc_shared")
    for g in range(2):
        acc = shared if reuse_psum else nl.ndarray((a.shape[2], b.shape[2]), nl.float32, buffer=nl.psum,
                                                   name=f"acc{g}")
        if init_with == "memset":
            nisa.memset(dst=acc, value=0.0)
        elif init_with == "copy":
            nisa.tensor_copy(dst=acc, src=_load(b[g, 0:a.shape[2], :]))
        nisa.nc_matmul(dst=acc, stationary=_load(a[g]), moving=_load(b[g]), accumulate=accumulate_first)
        nisa.nc_matmul(dst=acc, stationary=_load(a[g]), moving=_load(b[g]), accumulate=True)
        res = nl.ndarray(acc.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=res, src=acc)
        nisa.dma_copy(dst=out[g], src=res)
    return out


def _mm_inputs(rng):
    a = rng.standard_normal((2, 16, 8)).astype(np.float32)
    b = rng.standard_normal((2, 16, 32)).astype(np.float32)
    want = np.stack([2 * a[g].T.astype(np.float64) @ b[g] for g in range(2)])
    return a, b, want


def test_legal_psum_accumulation_is_not_flagged(rng):
    a, b, want = _mm_inputs(rng)
    with sim.checking(strict=True):
        out = _matmul_groups(a, b, None, False, None)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    with sim.checking(strict=True):  # accumulate=False restarts a reused tile: also legal
        out = _matmul_groups(a, b, False, True, None)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_accumulate_true_onto_unstarted_psum_names_the_region(rng):
    a, b, _ = _mm_inputs(rng)
    with pytest.raises(NkiValidationError, match=r"nc_matmul: accumulate: True onto PSUM acc0\[0:8, 0:32\] "
                                                 r"\(element \[0, 0\] of acc0\) that was never written"):
        _matmul_groups(a, b, True, False, None)


@pytest.mark.parametrize("tgt", ["trn1", "trn2"])
@pytest.mark.parametrize("init_with", ["memset", "copy"])
def test_matmul_accumulating_onto_non_matmul_data_is_undefined_before_trn3(tgt, init_with, rng, monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", tgt)
    a, b, _ = _mm_inputs(rng)
    with pytest.raises(NkiValidationError, match=r"True onto PSUM acc0\[0:8, 0:32\] .*last written by a "
                                                 r"non-matmul instruction"):
        _matmul_groups(a, b, True, False, init_with)


@sim.jit
def _rescale_between_matmuls(a, b):
    """acc = a.T @ b; acc *= 0.5 in place (a Vector write); acc += a.T @ b with the default accumulate=None."""
    out = nl.ndarray((a.shape[1], b.shape[1]), nl.float32, buffer=nl.shared_hbm)
    acc = nl.ndarray((a.shape[1], b.shape[1]), nl.float32, buffer=nl.psum, name="acc")
    nisa.nc_matmul(dst=acc, stationary=_load(a), moving=_load(b))
    nisa.tensor_scalar(dst=acc, data=acc, op0=nl.multiply, operand0=0.5)
    nisa.nc_matmul(dst=acc, stationary=_load(a), moving=_load(b))
    res = nl.ndarray(acc.shape, nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=res, src=acc)
    nisa.dma_copy(dst=out, src=res)
    return out


def test_default_accumulation_onto_vector_written_psum(rng, monkeypatch):
    a = rng.standard_normal((16, 8)).astype(np.float32)
    b = rng.standard_normal((16, 32)).astype(np.float32)
    with pytest.raises(NkiValidationError, match=r"accumulating onto PSUM acc\[0:8, 0:32\] \(element \[0, 0\] of "
                                                 r"acc\), last written by a non-matmul instruction \(undefined on "
                                                 r"trn2\)"):
        _rescale_between_matmuls(a, b)
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")  # defined from NeuronCore v4 on
    np.testing.assert_allclose(_rescale_between_matmuls(a, b), 1.5 * (a.T.astype(np.float64) @ b), rtol=1e-5,
                               atol=1e-5)


def test_trn3_accumulates_onto_memset_psum(rng, monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    a, b, want = _mm_inputs(rng)
    np.testing.assert_allclose(_matmul_groups(a, b, True, False, "memset"), want, rtol=1e-5, atol=1e-5)


def test_reusing_one_psum_tile_for_two_accumulations_is_a_visible_bug(rng):
    # The classic bug: the PSUM tile is allocated once outside the loop and every group starts with the default
    # accumulate=None. The second group's first matmul finds elements a matmul already wrote, so it accumulates
    # onto the first group's result, as on hardware: out[1] comes out as out[0] + out[1].
    a, b, want = _mm_inputs(rng)
    out = _matmul_groups(a, b, None, True, None)
    np.testing.assert_allclose(out[0], want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[1], want[0] + want[1], rtol=1e-5, atol=1e-4)
    assert not np.allclose(out[1], want[1], atol=1e-3)


def test_dma_cannot_read_psum():
    @sim.jit
    def evict_by_dma(x):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        p = nl.ndarray(x.shape, nl.float32, buffer=nl.psum, name="ps")
        nisa.tensor_copy(dst=p, src=_load(x))
        nisa.dma_copy(dst=out, src=p)
        return out

    with pytest.raises(NkiValidationError, match="dma_copy: src: ps is in PSUM; DMA cannot access PSUM"):
        evict_by_dma(np.ones((4, 8), np.float32))


def test_range_select_on_false_value_must_be_fp32_min():
    @sim.jit
    def mask_with(x, fill):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        lo = nl.zeros((x.shape[0], 1), nl.float32)
        hi = nl.full((x.shape[0], 1), 3.0, nl.float32)
        res = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.range_select(dst=res, on_true_tile=_load(x), comp_op0=nl.greater_equal, comp_op1=nl.less, bound0=lo,
                          bound1=hi, on_false_value=fill)
        nisa.dma_copy(dst=out, src=res)
        return out

    x = np.ones((4, 8), np.float32)
    assert (mask_with(x, -3.4028235e38)[:, :3] == 1).all()
    with pytest.raises(NkiValidationError, match="range_select: on_false_value: -inf is not supported"):
        mask_with(x, float("-inf"))


# ------------------------------------------------------------------ LNC2 shared-HBM write ownership
@sim.jit
def _lnc_writer(x, mode):
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm, name="out")
    pid = nl.program_id(0)
    half = x.shape[0] // 2
    t = _load(x)
    if mode == "overlap":        # core 0 writes one row too many: row `half` is written by both cores
        lo, hi = (0, half + 1) if pid == 0 else (half, x.shape[0])
        nisa.dma_copy(dst=out[lo:hi, :], src=t[lo:hi, :])
    elif mode == "same":         # both cores write everything
        nisa.dma_copy(dst=out, src=t)
    else:                        # disjoint halves, and each core rewrites its own half
        nisa.dma_copy(dst=out[pid * half:(pid + 1) * half, :], src=t[pid * half:(pid + 1) * half, :])
        nisa.dma_copy(dst=out[pid * half:(pid + 1) * half, :], src=t[pid * half:(pid + 1) * half, :])
    return out


def test_lnc2_disjoint_writes_and_same_core_rewrites_are_fine():
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    np.testing.assert_array_equal(_lnc_writer[2](x, "disjoint"), x)


@pytest.mark.parametrize("mode,row", [("overlap", 4), ("same", 0)])
def test_lnc2_two_cores_writing_one_hbm_region_raise(mode, row):
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    with pytest.raises(NkiValidationError) as info:
        _lnc_writer[2](x, mode)
    msg = str(info.value)
    assert msg.startswith("dma_copy: dst: core ")
    assert "out[" in msg and f"element [{row}, 0] of out" in msg
    assert ("core 0 writes" in msg and "core 1 already wrote" in msg) or \
           ("core 1 writes" in msg and "core 0 already wrote" in msg)


def test_lnc2_race_on_a_kernel_argument_written_in_place():
    @sim.jit
    def both_zero(x):
        z = nl.zeros((x.shape[0], x.shape[1]), x.dtype)
        nisa.dma_copy(dst=x[0:2, :], src=z[0:2, :])
        return x

    with pytest.raises(NkiValidationError, match=r"already wrote element \[0, 0\] of arg0"):
        both_zero[2](np.ones((4, 4), np.float32))
    np.testing.assert_array_equal(both_zero[1](np.ones((4, 4), np.float32))[0:2], 0)  # one core: fine


def test_lnc2_shared_constants_are_not_core_writes():
    @sim.jit
    def add_const(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        c = nl.shared_constant(np.full(x.shape, 3.0, np.float32))  # both cores declare the same constant
        pid = nl.program_id(0)
        rows = slice(pid * 2, pid * 2 + 2)
        t, u = _load(x[rows, :]), _load(c[rows, :])
        nisa.tensor_tensor(dst=t, data1=t, data2=u, op=nl.add)
        nisa.dma_copy(dst=out[rows, :], src=t)
        return out

    with sim.checking(strict=True):
        np.testing.assert_array_equal(add_const[2](np.ones((4, 4), np.float32)), 4.0)


# ------------------------------------------------------------------ capacity
@sim.jit
def _alloc(free_bytes_list, buffer_name):
    """Holds one live fp32 tensor per entry (128 partitions x bytes per partition), touches each, returns a
    dummy."""
    out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
    buf = {"sbuf": nl.sbuf, "psum": nl.psum}[buffer_name]
    live = []
    for i in range(len(free_bytes_list)):  # (NKI has no enumerate, and loops bind one name)
        nbytes = free_bytes_list[i]
        t = nl.ndarray((128, nbytes // 4), nl.float32, buffer=buf, name=f"{buffer_name}{i}")
        nisa.memset(dst=t, value=0.0)
        live.append(t)
    one = nl.ones((1, 1), nl.float32)
    nisa.dma_copy(dst=out, src=one)
    return out


def test_sbuf_over_allocation_is_caught_and_names_the_tensor():
    cap = 212984  # trn2 sbuf_fmax_bytes
    _alloc((100000, 100000), "sbuf")
    stats = sim.last_launch_stats()
    assert stats.peak_sbuf_bytes == 200000 + 4  # plus the (1, 1) fp32 ones tile
    with pytest.raises(NkiValidationError) as info:
        _alloc((100000, 100000, 16000), "sbuf")
    msg = str(info.value)
    assert msg.startswith("nl.ndarray: sbuf2: SBUF capacity exceeded on core 0")
    assert f"216000 B per partition; trn2 has {cap} B" in msg and "sbuf0 (97.7 KiB)" in msg


def test_sbuf_capacity_depends_on_the_generation(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn1")
    with pytest.raises(NkiValidationError, match="trn1 has 180224 B"):
        _alloc((190000,), "sbuf")
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    _alloc((240000,), "sbuf")
    assert sim.last_launch_stats().sbuf_capacity_bytes == 245752


def test_psum_nine_banks_are_caught_eight_fit():
    _alloc((2048,) * 8, "psum")
    assert sim.last_launch_stats().peak_psum_banks == 8
    with pytest.raises(NkiValidationError, match=r"psum8: PSUM capacity exceeded on core 0: allocating 1 bank\(s\) "
                                                 r".* needs 9 of the 8 banks .* Live PSUM tensors: psum0 \(1 bank\), "):
        _alloc((2048,) * 9, "psum")
    # a (128, 1024) fp32 tile is 4 KiB per partition: two banks, even if its matmuls write one bank at a time
    with pytest.raises(NkiValidationError, match="needs 9 of the 8 banks"):
        _alloc((4096,) * 4 + (2048,), "psum")
    _alloc((100,) * 8, "psum")  # tiles smaller than a bank still take a whole bank each
    assert sim.last_launch_stats().peak_psum_banks == 8


def test_dead_tiles_are_released_and_capacity_is_per_core():
    @sim.jit
    def loop(n):
        out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
        for _ in range(n):
            t = nl.ndarray((128, 40000), nl.float32, buffer=nl.sbuf)   # 160000 B: only one fits
            p = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
            nisa.memset(dst=t, value=0.0)
            nisa.memset(dst=p, value=0.0)
            t = None  # release both before the next iteration allocates (NKI has no 'del')
            p = None
        if nl.program_id(0) == 0:  # one writer: both cores writing `out` would be a race
            nisa.dma_copy(dst=out, src=nl.ones((1, 1), nl.float32))
        return out

    loop(20)
    assert (sim.last_launch_stats().peak_sbuf_bytes, sim.last_launch_stats().peak_psum_banks) == (160000, 1)
    loop[2](20)  # each core has its own SBUF
    stats = sim.last_launch_stats()
    assert stats.lnc == 2 and stats.per_core == [(160000, 1), (160000, 1)]
    assert "core 1: SBUF peak 160000 B per partition" in stats.memory_report()


def test_placed_tensors_occupy_their_address_range():
    @sim.jit
    def placed(offset, n):
        out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
        keep = []
        for i in range(n):  # circular buffer: n logical tiles on two physical slots
            t = nl.ndarray((128, 4096), nl.float32, buffer=nl.sbuf, address=(0, offset + (i % 2) * 16384))
            keep.append(t)
        ps = []
        for i in range(n):
            ps.append(nl.ndarray((128, 512), nl.float32, buffer=nl.psum, address=(0, (i % 2) * 2048)))
        nisa.dma_copy(dst=out, src=nl.ones((1, 1), nl.float32))
        return out, len(ps)

    placed(0, 6)
    stats = sim.last_launch_stats()
    assert (stats.peak_sbuf_bytes, stats.peak_psum_banks) == (32768 + 4, 2)
    with pytest.raises(NkiValidationError, match=r"placed at SBUF bytes 196608\.\.212992 of each partition, beyond "
                                                 r"the 212984 B per partition usable on trn2"):
        placed(212992 - 16384, 2)


def test_capacity_check_can_be_turned_off_but_peaks_are_still_reported(monkeypatch):
    with sim.checking(capacity=False):
        _alloc((2048,) * 9, "psum")
    assert sim.last_launch_stats().peak_psum_banks == 9 and not sim.last_launch_stats().capacity_checked
    monkeypatch.setenv("NKI_ATTN_SIM_CAPACITY", "0")
    _alloc((2048,) * 9, "psum")
    with sim.checking(capacity=True), pytest.raises(NkiValidationError, match="needs 9 of the 8 banks"):
        _alloc((2048,) * 9, "psum")


# ------------------------------------------------------------------ strict mode: uninitialised reads
@sim.jit
def _half_written(x):
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf, name="tile")
    nisa.dma_copy(dst=t[:, 0:4], src=x[:, 0:4])
    doubled = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=doubled, data=t, op0=nl.multiply, operand0=2.0)
    nisa.dma_copy(dst=out, src=doubled)
    return out


def test_strict_mode_reports_the_first_uninitialised_read_at_its_instruction():
    x = np.ones((8, 8), np.float32)
    out = _half_written(x)  # off by default: the NaN sentinel shows up in the output instead
    assert (out[:, :4] == 2).all() and np.isnan(out[:, 4:]).all()
    with sim.checking(strict=True), pytest.raises(NkiValidationError) as info:
        _half_written(x)
    assert str(info.value) == ("tensor_scalar: data: reads tile[0:8, 0:8], but element [0, 4] of tile was never "
                               "written (uninitialised read; strict mode, NKI_ATTN_SIM_STRICT)")


def test_strict_mode_from_the_environment(monkeypatch):
    monkeypatch.setenv("NKI_ATTN_SIM_STRICT", "1")
    with pytest.raises(NkiValidationError, match="tensor_scalar: data: reads tile"):
        _half_written(np.ones((8, 8), np.float32))
    assert sim.last_launch_stats().strict
    with sim.checking(strict=False):  # the innermost setting wins over the environment
        _half_written(np.ones((8, 8), np.float32))


def test_strict_mode_dma_reads_operand_reads_and_outputs():
    @sim.jit
    def variant(x, which):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm, name="result")
        t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf, name="stage")
        if which == "dma":       # DMA of a tile nobody wrote
            nisa.dma_copy(dst=out, src=t)
        elif which == "bias":    # a (P, 1) operand that was never written
            bias = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.sbuf, name="bias")
            nisa.dma_copy(dst=t, src=x)
            nisa.activation(dst=t, op=nl.exp, data=t, bias=bias)
            nisa.dma_copy(dst=out, src=t)
        elif which == "output":  # the kernel forgets the last row of its output
            nisa.dma_copy(dst=t, src=x)
            nisa.dma_copy(dst=out[0:x.shape[0] - 1, :], src=t[0:x.shape[0] - 1, :])
        else:                    # arguments count as written; in-place updates are reads of written data
            nisa.dma_copy(dst=t, src=x)
            nisa.tensor_tensor(dst=t, data1=t, data2=t, op=nl.add)
            nisa.dma_copy(dst=out, src=t)
        return out

    x = np.ones((4, 8), np.float32)
    with sim.checking(strict=True):
        with pytest.raises(NkiValidationError, match=r"^dma_copy: src: reads stage\[0:4, 0:8\], but element "
                                                     r"\[0, 0\] of stage was never written"):
            variant(x, "dma")
        with pytest.raises(NkiValidationError, match=r"^activation: bias: reads bias\[0:4, 0:1\]"):
            variant(x, "bias")
        with pytest.raises(NkiValidationError, match=r"^kernel output result\[0:4, 0:8\]: element \[3, 0\] was "
                                                     r"never written"):
            variant(x, "output")
        np.testing.assert_array_equal(variant(x, "ok"), 2 * x)


def test_strict_mode_follows_bit_cast_views():
    @sim.jit
    def cast_read(x, full):
        out = nl.ndarray((x.shape[0], 2 * x.shape[1]), nl.bfloat16, buffer=nl.shared_hbm)
        t = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t if full else t[:, 0:1], src=x if full else x[:, 0:1])
        as_bf16 = t.view(nl.bfloat16)
        res = nl.ndarray(as_bf16.shape, nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_copy(dst=res, src=as_bf16)
        nisa.dma_copy(dst=out, src=res)
        return out

    x = np.ones((4, 2), np.float32)
    with sim.checking(strict=True):
        cast_read(x, True)
        with pytest.raises(NkiValidationError, match=r"tensor_copy: src: .*element \[0, 2\] of t\d+ was never"):
            cast_read(x, False)


def test_checks_cost_nothing_when_off():
    @sim.jit
    def probe(x):
        t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        return t.storage.written, t.storage.writer, x.storage.written

    assert probe(np.ones((2, 2), np.float32)) == (None, None, None)
    assert probe[2](np.ones((2, 2), np.float32))[0:2] == (None, None)  # on-chip storage never has a writer map
    t = tile(np.ones((2, 2), np.float32))  # instructions outside a kernel are never checked
    with sim.checking(strict=True):
        assert t.storage.written is None and t.storage.acct is None
