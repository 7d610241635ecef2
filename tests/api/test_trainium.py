"""What docs/trainium.md says that can run without Trainium: which NKI the backend picks (NKI_ATTN_BACKEND and a
real `nki` package on the path), and which devices the PyTorch API refuses, with which message."""
import os
import pathlib
import subprocess
import sys
import types

import pytest
import torch

import nki_attn
from nki_attn import spec

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "trainium.md"


def _backend_in_subprocess(env_value, extra_path=None):
    """(exit code, stdout, stderr) of a fresh interpreter printing nki_attn.backend's choice."""
    env = {k: v for k, v in os.environ.items() if k != "NKI_ATTN_BACKEND"}
    if env_value is not None:
        env["NKI_ATTN_BACKEND"] = env_value
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, str(ROOT)) if p)
    code = "import nki_attn.backend as b; print(b.BACKEND, getattr(b.nki, '__file__', None))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    return r.returncode, r.stdout.strip(), r.stderr


@pytest.fixture
def fake_real_nki(tmp_path):
    """A package named nki (with nki.language and nki.isa), standing for the Neuron SDK's."""
    pkg = tmp_path / "nki"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("FAKE_REAL_NKI = True\n")
    (pkg / "language.py").write_text("")
    (pkg / "isa.py").write_text("")
    return str(tmp_path)


def test_the_docs_command_prints_the_backend():
    env = {**{k: v for k, v in os.environ.items() if k != "NKI_ATTN_BACKEND"}, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", "import nki_attn.backend as b; print(b.BACKEND)"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "sim"  # no real nki on this machine
    assert 'python -c "import nki_attn.backend as b; print(b.BACKEND)"' in DOC.read_text()


def test_the_real_nki_is_picked_when_importable(fake_real_nki):
    code, out, err = _backend_in_subprocess(None, fake_real_nki)
    assert code == 0, err
    name, path = out.split()
    assert name == "nki" and path.startswith(fake_real_nki)
    code, out, err = _backend_in_subprocess("nki", fake_real_nki)
    assert code == 0 and out.split()[0] == "nki", err


def test_another_package_named_nki_is_named_not_taken_for_the_real_one(tmp_path):
    (tmp_path / "nki").mkdir()
    (tmp_path / "nki" / "__init__.py").write_text("")  # no nki.language, no nki.isa
    code, _, err = _backend_in_subprocess(None, str(tmp_path))
    assert code != 0 and "is not the Neuron SDK's NKI" in err and "NKI_ATTN_BACKEND=sim" in err
    code, out, err = _backend_in_subprocess("sim", str(tmp_path))
    assert code == 0 and out.split()[0] == "sim", err


def test_pypis_placeholder_nki_counts_as_absent(tmp_path):
    """PyPI's `nki` 0.0.1 raises ImportError on import, pointing to the Neuron repository."""
    (tmp_path / "nki").mkdir()
    (tmp_path / "nki" / "__init__.py").write_text('raise ImportError("WRONG PACKAGE. Please install the package '
                                                   'from Neuron Repository")\n')
    code, out, err = _backend_in_subprocess(None, str(tmp_path))
    assert code == 0 and out.split()[0] == "sim", err
    code, _, err = _backend_in_subprocess("nki", str(tmp_path))
    assert code != 0 and "the real 'nki' package is not importable" in err


def test_sim_forces_the_simulator_even_with_the_real_nki(fake_real_nki):
    code, out, err = _backend_in_subprocess("sim", fake_real_nki)
    assert code == 0 and out.split()[0] == "sim", err


def test_nki_without_the_real_package_fails_naming_where_it_comes_from():
    code, out, err = _backend_in_subprocess("nki")
    assert code != 0
    assert "NKI_ATTN_BACKEND=nki but the real 'nki' package is not importable" in err
    assert "neuronx-cc" in err and "Neuron package repository" in err


def test_an_invalid_choice_is_refused():
    code, _, err = _backend_in_subprocess("cuda")
    assert code != 0 and "NKI_ATTN_BACKEND='cuda' is not valid" in err


def _on(device_type):
    """Something shaped like a tensor on ``device_type``: the device check reads only ``.device``."""
    return types.SimpleNamespace(device=torch.device(device_type))


def test_cpu_tensors_are_refused_when_the_real_nki_is_selected(monkeypatch):
    monkeypatch.setattr(spec, "BACKEND", "nki")
    with pytest.raises(RuntimeError, match="CPU tensors run on the simulator.*XLA"):
        spec.check_device(torch.zeros(1))
    q = torch.zeros(1, 128, 1, 64)
    with pytest.raises(RuntimeError, match="NKI_ATTN_BACKEND=sim"):  # the public API says the same, before work
        nki_attn.flash_attn_func(q, q, q)


@pytest.mark.parametrize("backend", ["sim", "nki"])
def test_xla_tensors_are_accepted_on_either_backend(monkeypatch, backend):
    """nki: the Trainium path; sim: torch-xla's CPU fallback hands the ops CPU copies (tests/xla, docs/xla.md)."""
    monkeypatch.setattr(spec, "BACKEND", backend)
    spec.check_device(_on("xla"))


@pytest.mark.parametrize("device", ["cuda", "mps", "privateuseone"])
def test_other_devices_are_refused_naming_the_device(device):
    with pytest.raises(ValueError, match=f"q is on {device}.*CPU \\(simulator\\), XLA \\(Trainium\\)"):
        spec.check_device(_on(device))


def test_meta_tensors_give_shapes_on_either_backend(monkeypatch):
    q = torch.empty(1, 200, 4, 64, device="meta")
    k = torch.empty(1, 200, 2, 64, device="meta")
    for backend in ("sim", "nki"):
        monkeypatch.setattr(spec, "BACKEND", backend)
        assert nki_attn.flash_attn_func(q, k, k, causal=True).shape == (1, 200, 4, 64)


def test_the_package_names_match_the_neuron_extra():
    text = DOC.read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    extra = pyproject.split("neuron = [", 1)[1].split("]", 1)[0]
    for name in ("neuronx-cc", "torch-neuronx"):
        assert f'"{name}"' in extra and f"`{name}`" in text
    assert "`nki`" in text and "Neuron pip repository" in text
