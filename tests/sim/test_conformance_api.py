"""API behaviours that running public NKI kernels on the simulator exposed as missing or wrong.

Each test pins the documented behaviour (aws-neuron-sdk nki/api docstrings, the NKI language guide) that a
public kernel relied on; docs/simulator.md ("Conformance with public kernels") says which kernel found it.
"""
import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest
from simtools import BF16, empty, tile, val

import nki_attn.sim as sim
from nki_attn.sim import NkiValidationError
from nki_attn.sim import isa as nisa
from nki_attn.sim import language as nl
from nki_attn.sim.tensor import NkiTensor


# ------------------------------------------------------------------ nisa.tensor_tensor_scan (fused_mamba)
def _scan_ref(a, b, init, op0, op1, rev0=False, rev1=False):
    out = np.empty_like(a)
    state = np.broadcast_to(np.asarray(init, np.float32), (a.shape[0],)).astype(np.float32)
    for i in range(a.shape[1]):
        t = op0(state, a[:, i]) if rev0 else op0(a[:, i], state)
        state = (op1(b[:, i], t) if rev1 else op1(t, b[:, i])).astype(np.float32)
        out[:, i] = state
    return out


def test_tensor_tensor_scan_is_the_mamba_recurrence(rng):
    a = rng.random((8, 40)).astype(np.float32)
    b = rng.standard_normal((8, 40)).astype(np.float32)
    dst = empty((8, 40))
    nisa.tensor_tensor_scan(dst=dst, data0=tile(a), data1=tile(b), initial=0.5, op0=nl.multiply, op1=nl.add)
    np.testing.assert_array_equal(val(dst), _scan_ref(a, b, 0.5, np.multiply, np.add))
    # the first element uses `initial`: r[0] = a[0] * 0.5 + b[0]
    np.testing.assert_allclose(val(dst)[:, 0], a[:, 0] * 0.5 + b[:, 0], rtol=1e-6)


def test_tensor_tensor_scan_reverse_flags_and_tile_initial(rng):
    a = rng.standard_normal((4, 6)).astype(np.float32)
    b = rng.standard_normal((4, 6)).astype(np.float32)
    init = rng.standard_normal((4, 1)).astype(np.float32)
    for rev0, rev1 in ((False, False), (True, False), (False, True), (True, True)):
        dst = empty((4, 6))
        nisa.tensor_tensor_scan(dst=dst, data0=tile(a), data1=tile(b), initial=tile(init), op0=nl.subtract,
                                op1=nl.subtract, reverse0=rev0, reverse1=rev1)
        np.testing.assert_array_equal(val(dst), _scan_ref(a, b, init[:, 0], np.subtract, np.subtract, rev0, rev1))


def test_tensor_tensor_scan_runs_over_flattened_free_dims_and_rejects_two_psum_inputs(rng):
    a = rng.random((4, 2, 5)).astype(np.float32)
    b = rng.random((4, 2, 5)).astype(np.float32)
    dst = empty((4, 10))
    nisa.tensor_tensor_scan(dst=dst, data0=tile(a), data1=tile(b), initial=0.0, op0=nl.multiply, op1=nl.add)
    np.testing.assert_array_equal(val(dst), _scan_ref(a.reshape(4, 10), b.reshape(4, 10), 0.0, np.multiply,
                                                      np.add))
    with pytest.raises(NkiValidationError, match="tensor_tensor_scan: data1: data0 and data1 are both in PSUM"):
        nisa.tensor_tensor_scan(dst=empty((4, 10)), data0=tile(a.reshape(4, 10), buffer=nl.psum),
                                data1=tile(b.reshape(4, 10), buffer=nl.psum), initial=0.0, op0=nl.multiply,
                                op1=nl.add)


# ------------------------------------------------------------------ nl.broadcast_to (fused_mamba)
def test_broadcast_to_partition_and_free_dims(rng):
    row = rng.standard_normal((1, 16)).astype(np.float32)
    out = nl.broadcast_to(tile(row), (128, 16))
    assert out.shape == (128, 16) and out.buffer is nl.sbuf
    np.testing.assert_array_equal(val(out), np.repeat(row, 128, axis=0))
    col = rng.standard_normal((8, 1)).astype(np.float32)
    out2 = nl.broadcast_to(tile(col), (8, 5), dtype=nl.bfloat16)
    assert out2.dtype == nl.bfloat16
    np.testing.assert_array_equal(val(out2), np.repeat(col.astype(BF16).astype(np.float64), 5, axis=1))


def test_broadcast_to_same_shape_returns_x_and_rejects_bad_shapes():
    x = tile(np.ones((4, 8), np.float32))
    assert nl.broadcast_to(x, (4, 8)) is x
    with pytest.raises(NkiValidationError, match="dim 1 of x has size 8"):
        nl.broadcast_to(x, (4, 16))
    with pytest.raises(NkiValidationError, match="rank"):
        nl.broadcast_to(x, (4, 8, 1))


# ------------------------------------------------------------------ nisa.nc_stream_shuffle (NKI Library attention_cte)
def test_stream_shuffle_broadcasts_partition_zero_per_quadrant(rng):
    src = rng.standard_normal((1, 6)).astype(np.float32)
    dst = tile(np.zeros((32, 6), np.float32))
    nisa.nc_stream_shuffle(dst=dst, src=tile(src), shuffle_mask=[0] * 32)
    np.testing.assert_array_equal(val(dst), np.repeat(src, 32, axis=0))


def test_stream_shuffle_mask_is_per_quadrant_and_255_keeps_dst(rng):
    x = rng.standard_normal((64, 3)).astype(np.float32)
    keep = np.full((64, 3), 7.0, np.float32)
    mask = [31 - i for i in range(32)]
    mask[5] = 255
    dst = tile(keep)
    nisa.nc_stream_shuffle(dst=dst, src=tile(x), shuffle_mask=mask)
    want = keep.copy()
    for p in range(64):
        if p % 32 != 5:
            want[p] = x[(p // 32) * 32 + mask[p % 32]]
    np.testing.assert_array_equal(val(dst), want)


def test_stream_shuffle_checks():
    x = tile(np.ones((32, 4), np.float32))
    with pytest.raises(NkiValidationError, match="nc_stream_shuffle: dst: dtype bfloat16 must equal src dtype"):
        nisa.nc_stream_shuffle(dst=empty((32, 4), nl.bfloat16), src=x, shuffle_mask=[0] * 32)
    with pytest.raises(NkiValidationError, match="32 entries"):
        nisa.nc_stream_shuffle(dst=empty((32, 4)), src=x, shuffle_mask=[0] * 16)
    with pytest.raises(NkiValidationError, match="src has 1 partitions"):
        nisa.nc_stream_shuffle(dst=empty((32, 4)), src=x[0:1, :], shuffle_mask=[1] * 32)
    big = tile(np.ones((128, 4), np.float32))
    # each operand alone is placed legally (64 partitions at 64, 1 partition at 32), but the shuffle has 64
    # active partitions, so both must start at 0 or 64
    with pytest.raises(NkiValidationError, match="src: with 64 active partitions the start partition must be one"):
        nisa.nc_stream_shuffle(dst=big[64:128, :], src=big[32:33, :], shuffle_mask=[0] * 32)


# ------------------------------------------------------------------ nl.NKIObject classes (NKI Library attention_cte)
@dataclasses.dataclass
class _Params(nl.NKIObject):
    idx = None          # a plain class attribute is a field too (NKI Library SectionParams does this)
    offset = 0
    size: int = 4


@dataclasses.dataclass(frozen=True)
class _Frozen(nl.NKIObject):
    a: int = 1
    b: int = 2


class _WithPost(nl.NKIObject):
    x: int
    y: bool = False

    def __post_init__(self):
        self.z = (self.x or 0) + 1


class _OwnInit(nl.NKIObject):
    def __init__(self, v):
        self.v = v * 2


def test_nkiobject_gets_the_compiler_initializer_even_under_dataclass():
    p = _Params(idx=3, offset=7)
    assert (p.idx, p.offset, p.size) == (3, 7, 4)
    assert _Params().idx is None and _Params(1, 2, 3).size == 3
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        _Params(bogus=1)


def test_nkiobject_frozen_post_init_and_user_init():
    f = _Frozen(b=5)
    assert (f.a, f.b) == (1, 5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.a = 3
    w = _WithPost(x=4)
    assert (w.x, w.y, w.z) == (4, False, 5)
    assert _WithPost().x is None  # fields without a default start as None (language guide)
    assert _OwnInit(3).v == 6


# ------------------------------------------------------------------ nki.typing and install_as_nki (tutorials)
def test_nki_typing_tensor_is_registered(monkeypatch):
    for name in ("nki", "nki.language", "nki.isa", "nki.typing"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert sim.install_as_nki()
    from nki.typing import tensor  # noqa: PLC0415 - the import under test
    assert tensor is NkiTensor


def test_a_directory_named_nki_is_not_the_real_package(tmp_path, monkeypatch):
    # Running the tutorials from a checkout of the NKI docs puts its nki/ folder (no __init__.py) on sys.path.
    (tmp_path / "nki").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "nki", raising=False)
    assert not sim.real_nki_available()
    env = dict(os.environ, NKI_ATTN_BACKEND="")
    code = ("import nki_attn.backend as b; import nki_attn.sim as s; print(b.BACKEND, s.install_as_nki()); "
            "import nki.language")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["sim", "True"]
