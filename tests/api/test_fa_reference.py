"""scripts/fa_reference_check.py: FlashAttention's own reference (``attention_ref`` of its tests) against our
``flash_attn_func`` under FlashAttention's rule. The comparison needs a local checkout of the public
Dao-AILab/flash-attention repository named by FLASH_ATTENTION_REPO (and einops); without it only the argument
errors are tested."""
import importlib.util
import os
import pathlib

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "fa_reference_check.py"
REPO = os.environ.get("FLASH_ATTENTION_REPO")


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("fa_reference_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_without_a_checkout_it_is_a_usage_error(script, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("FLASH_ATTENTION_REPO", raising=False)
    with pytest.raises(SystemExit) as e:
        script.main(["--flash-attn", str(tmp_path)])
    assert e.value.code == 2 and "tests/test_flash_attn.py" in capsys.readouterr().err


@pytest.mark.skipif(not REPO, reason="set FLASH_ATTENTION_REPO to a Dao-AILab/flash-attention checkout")
def test_flashattention_reference_agrees(script, capsys):
    pytest.importorskip("einops")
    code = script.main(["--flash-attn", REPO, "--dtypes", "bf16",
                        "--variants", "softcap-causal", "alibi", "local", "causal-sq<sk"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "4/4 rows pass" in out
