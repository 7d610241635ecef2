"""Tensors, views, limits, the NaN sentinel, launches (LNC2), install_as_nki and the backend switch."""
import importlib
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from simtools import BF16, empty, tile, val

import nki_attn.sim as sim
from nki_attn.sim import NkiValidationError
from nki_attn.sim import isa as nisa
from nki_attn.sim import language as nl


# ------------------------------------------------------------------ allocation and the sentinel
def test_new_tensors_hold_the_sentinel():
    assert np.isnan(val(nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf))).all()
    assert np.isnan(val(nl.ndarray((4, 8), nl.bfloat16, buffer=nl.psum))).all()
    assert (val(nl.ndarray((4, 8), nl.int32, buffer=nl.sbuf)) == 4).all()
    assert (val(nl.zeros((4, 8), nl.float32)) == 0).all()


def test_unwritten_memory_shows_up_as_nan_in_outputs():
    @sim.jit
    def forgets_half(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[:, 0:4], src=x[:, 0:4])
        nisa.dma_copy(dst=out, src=t)
        return out

    out = forgets_half(np.ones((8, 8), np.float32))
    assert (out[:, :4] == 1).all() and np.isnan(out[:, 4:]).all()


def test_buffers_must_be_objects_and_on_chip_2d():
    with pytest.raises(NkiValidationError, match="string buffer names are rejected"):
        nl.ndarray((4, 4), nl.float32, buffer="sbuf")
    with pytest.raises(NkiValidationError, match="at least 2-D"):
        nl.ndarray((4,), nl.float32, buffer=nl.sbuf)


# ------------------------------------------------------------------ indexing
def test_on_chip_integer_indexing_rules():
    t = nl.ndarray((64, 64, 64), nl.float32, buffer=nl.sbuf)
    assert t[0, 0, 10].shape == (1, 1)
    assert t[:, 0].shape == (64, 64)
    assert t[:, 0, 10].shape == (64, 1)
    assert t[0, ..., :].shape == (1, 64, 64)
    assert t[:, :, ::2].shape == (64, 64, 32)
    assert t[nl.ds(8, 16), 3].shape == (16, 64)


def test_hbm_integer_indexing_drops_dims():
    h = nl.ndarray((2, 3, 4), nl.float32, buffer=nl.shared_hbm)
    assert h[1].shape == (3, 4) and h[1, 2].shape == (4,) and h[1, 2, 3].shape == (1,)


def test_views_share_storage_and_offsets():
    t = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf)
    v = t[32:64, :]
    assert v.offset == 2048 and v.strides == (64, 1)
    v.np()[...] = 3.0
    assert (val(t)[32:64] == 3).all() and np.isnan(val(t)[:32]).all()


def test_out_of_range_slices_raise_not_clamp():
    t = nl.ndarray((128, 512), nl.float32, buffer=nl.sbuf)
    with pytest.raises(NkiValidationError, match="index out of bounds: slice 0:513 on dim 1"):
        t[:, 0:513]
    with pytest.raises(NkiValidationError, match="index out of bounds: 128 on dim 0"):
        t[128, :]
    with pytest.raises(NkiValidationError, match="partition slice .* step 1"):
        t[0:128:2, :]


def test_access_pattern_worked_example():
    x = nl.ndarray((128, 1024), nl.bfloat16, buffer=nl.sbuf)
    x.np()[...] = np.arange(128 * 1024, dtype=np.float32).reshape(128, 1024).astype(BF16)
    a = x.ap(pattern=[[1024, 64], [2, 128]], offset=257)
    assert a.shape == (64, 128)
    np.testing.assert_array_equal(val(a), val(x[0:64, 257:513:2]))
    with pytest.raises(NkiValidationError, match="partition stride"):
        x.ap(pattern=[[2048, 64], [1, 128]], offset=0)


def test_hbm_transposed_access_pattern():
    h = nl.ndarray((512, 128), nl.float32, buffer=nl.shared_hbm)
    h.np()[...] = np.arange(512 * 128, dtype=np.float32).reshape(512, 128)
    v = h.ap([[1, 128], [128, 512]])
    np.testing.assert_array_equal(val(v), val(h).T)


def test_reshape_permute_broadcast_view():
    t = tile(np.arange(4 * 12, dtype=np.float32).reshape(4, 12))
    r = t.reshape((4, 3, 4))
    np.testing.assert_array_equal(val(r), val(t).reshape(4, 3, 4))
    np.testing.assert_array_equal(val(r.permute((0, 2, 1))), val(t).reshape(4, 3, 4).transpose(0, 2, 1))
    with pytest.raises(NkiValidationError, match="must keep dim 0 first"):
        r.permute((1, 0, 2))
    with pytest.raises(NkiValidationError, match="must keep the partition dim"):
        t.reshape((2, 24))
    col = tile(np.arange(4, dtype=np.float32).reshape(4, 1))
    b = col.broadcast(1, 5)
    np.testing.assert_array_equal(val(b), np.repeat(np.arange(4)[:, None], 5, 1))
    i = tile(np.zeros((4, 4), np.float32)).view(nl.int32)
    assert i.dtype == nl.int32 and (val(i) == 0).all()
    h = tile(np.zeros((4, 4), np.float32)).view(nl.bfloat16)
    assert h.shape == (4, 8)


# ------------------------------------------------------------------ limits that every compute instruction checks
def test_partition_limit_and_hbm_operands():
    big = nl.ndarray((256, 4), nl.float32, buffer=nl.sbuf)
    with pytest.raises(NkiValidationError, match="tensor_copy: src: partition dimension 256 exceeds maximum 128"):
        nisa.tensor_copy(dst=empty((128, 4)), src=big)
    h = nl.ndarray((4, 4), nl.float32, buffer=nl.shared_hbm)
    with pytest.raises(NkiValidationError, match="compute instructions cannot read or write HBM"):
        nisa.activation(dst=empty((4, 4)), op=nl.exp, data=h)


def test_start_partition_rule():
    t = nl.ndarray((128, 8), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=t[64:128, :], value=0.0)
    nisa.memset(dst=t[96:128, :], value=0.0)
    with pytest.raises(NkiValidationError, match="must start at partition"):
        nisa.memset(dst=t[16:80, :], value=0.0)


def test_dma_copy_rules():
    s = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
    p = nl.ndarray((4, 8), nl.float32, buffer=nl.psum)
    h = nl.ndarray((32,), nl.bfloat16, buffer=nl.shared_hbm)
    with pytest.raises(NkiValidationError, match="dma_copy: src: .*DMA cannot access PSUM"):
        nisa.dma_copy(dst=s, src=p)
    with pytest.raises(NkiValidationError, match="has 16 elements"):
        nisa.dma_copy(dst=s, src=h[0:16])
    s.np()[...] = 1.0 + 2.0 ** -9
    nisa.dma_copy(dst=h, src=s)  # row-major pairing, fp32 -> bf16 cast on the way
    assert (val(h) == 1.0).all()


def test_dma_transpose(target):
    target("trn2")
    h = nl.ndarray((64, 128), nl.bfloat16, buffer=nl.shared_hbm)
    h.np()[...] = np.arange(64 * 128, dtype=np.float32).reshape(64, 128).astype(BF16)
    d = nl.ndarray((128, 64), nl.bfloat16, buffer=nl.sbuf)
    nisa.dma_transpose(dst=d, src=h)
    np.testing.assert_array_equal(val(d), val(h).T)
    with pytest.raises(NkiValidationError, match="not a 2-byte type"):
        nisa.dma_transpose(dst=nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf),
                           src=nl.ndarray((64, 128), nl.float32, buffer=nl.shared_hbm))
    target("trn1")
    with pytest.raises(NkiValidationError, match="requires NeuronCore v3"):
        nisa.dma_transpose(dst=d, src=h)


def test_psum_allocation_address_must_be_bank_aligned():
    with pytest.raises(NkiValidationError, match="bank aligned"):
        nl.ndarray((128, 512), nl.float32, buffer=nl.psum, address=(0, 100))


# ------------------------------------------------------------------ launches
@sim.jit
def _whoami(x):
    out = nl.ndarray((2, 4), nl.float32, buffer=nl.shared_hbm)
    pid = nl.program_id(0)
    row = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=row, value=float(pid * 100 + nl.num_programs() * 10 + nl.program_ndim()))
    if nl.num_programs() == 1:
        for r in range(2):
            nisa.dma_copy(dst=out[r:r + 1, :], src=row)
    else:
        nisa.dma_copy(dst=out[pid:pid + 1, :], src=row)
    return out


def test_lnc_launch_program_ids(target):
    target("trn2")
    x = np.zeros((1,), np.float32)
    np.testing.assert_array_equal(_whoami(x)[:, 0], [10, 10])        # no brackets: one core, ndim 0
    np.testing.assert_array_equal(_whoami[1](x)[:, 0], [11, 11])     # kernel[1]: ndim 1
    np.testing.assert_array_equal(_whoami[2](x)[:, 0], [21, 121])    # two cores share the output
    np.testing.assert_array_equal(sim.simulate(_whoami[2])(x)[:, 0], [21, 121])


def test_lnc2_needs_trn2_and_degree_is_checked(target):
    target("trn1")
    with pytest.raises(NkiValidationError, match="LNC2 exists on trn2/trn3 only"):
        _whoami[2](np.zeros((1,), np.float32))
    with pytest.raises(NkiValidationError, match="must be 1 or 2"):
        _whoami[3]
    with pytest.raises(NkiValidationError, match="multi-axis"):
        _whoami[2, 2]


def test_deprecated_range_aliases_are_range():
    assert list(nl.affine_range(3)) == [0, 1, 2]
    assert list(nl.sequential_range(1, 7, 2)) == [1, 3, 5]
    assert list(nl.static_range(2)) == [0, 1]


def test_outputs_must_be_shared_hbm():
    @sim.jit
    def bad(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.hbm)
        nisa.dma_copy(dst=out, src=x)
        return out

    with pytest.raises(NkiValidationError, match="must be allocated with buffer=nl.shared_hbm"):
        bad(np.ones((4,), np.float32))


def test_torch_in_torch_out_and_inputs_written_in_place():
    @sim.jit
    def double_into(x, out):
        t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)
        nisa.dma_copy(dst=out, src=t)
        return out

    x = torch.randn(4, 8, dtype=torch.bfloat16)
    out = torch.zeros(4, 8, dtype=torch.bfloat16)
    res = double_into(x, out)
    assert isinstance(res, torch.Tensor) and res.dtype == torch.bfloat16
    assert torch.equal(res, x * 2) and torch.equal(out, x * 2)


def test_jit_rejects_platform_target():
    with pytest.raises(NkiValidationError, match="NEURON_PLATFORM_TARGET_OVERRIDE"):
        sim.jit(platform_target="trn2")


# ------------------------------------------------------------------ install_as_nki and the backend switch
QUICKSTART = textwrap.dedent('''
    import numpy as np
    import nki_attn.sim
    nki_attn.sim.install_as_nki()
    import nki
    import nki.isa as nisa
    import nki.language as nl

    @nki.jit
    def nki_tensor_add_kernel(a_input, b_input):
        assert a_input.shape == b_input.shape
        assert a_input.shape[0] <= nl.tile_size.pmax
        a_tile = nl.ndarray(shape=a_input.shape, dtype=a_input.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=a_tile, src=a_input)
        b_tile = nl.ndarray(shape=b_input.shape, dtype=b_input.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=b_tile, src=b_input)
        c_tile = nl.ndarray(shape=a_input.shape, dtype=a_input.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=c_tile, data1=a_tile, data2=b_tile, op=nl.add)
        c_output = nl.ndarray(shape=a_input.shape, dtype=a_input.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=c_output, src=c_tile)
        return c_output

    @nki.jit
    def load_store_add(a, b):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        nl.store(out, value=nl.add(nl.load(a), nl.load(b)))
        return out

    a = np.random.rand(128, 512).astype(np.float32)
    b = np.random.rand(128, 512).astype(np.float32)
    assert np.array_equal(nki.simulate(nki_tensor_add_kernel)(a, b), a + b)
    assert np.array_equal(nki.simulate(load_store_add)(a, b), a + b)
    assert np.array_equal(nki.simulate_kernel(load_store_add, a, b), a + b)
    print("quickstart ok")
''')


def _run(code, **env):
    e = dict(os.environ)
    e.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=120)


def test_install_as_nki_runs_the_docs_quickstart_unmodified():
    r = _run(QUICKSTART)
    assert r.returncode == 0, r.stderr
    assert "quickstart ok" in r.stdout


def _fresh_backend(monkeypatch, choice):
    """Import nki_attn.backend anew under NKI_ATTN_BACKEND=choice (the original module is restored after the
    test). In-process: a child interpreter would pay the package's torch import for every case."""
    import nki_attn
    monkeypatch.setenv("NKI_ATTN_BACKEND", choice)
    monkeypatch.delitem(sys.modules, "nki_attn.backend", raising=False)
    monkeypatch.setattr(nki_attn, "backend", nki_attn.backend)  # the import below rebinds the attribute
    try:
        return importlib.import_module("nki_attn.backend")
    finally:
        sys.modules.pop("nki_attn.backend", None)


def test_backend_env_switch(monkeypatch):
    import nki_attn.backend  # noqa: F401 - make sure there is an original module to restore
    assert _fresh_backend(monkeypatch, "sim").BACKEND == "sim"
    assert _fresh_backend(monkeypatch, "").BACKEND == "sim"  # no real nki on this machine: falls back
    with pytest.raises(ImportError, match="real 'nki' package is not importable"):
        _fresh_backend(monkeypatch, "nki")
    with pytest.raises(ImportError, match="NKI_ATTN_BACKEND='cuda' is not valid"):
        _fresh_backend(monkeypatch, "cuda")
