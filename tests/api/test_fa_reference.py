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


def test_the_validation_note_keeps_the_flashattention_section(tmp_path):
    """docs/validation.md is regenerated from the harness reports; the measured FlashAttention-reference section
    after the marker survives the regeneration."""
    spec = importlib.util.spec_from_file_location("make_validation_note", SCRIPT.parent / "make_validation_note.py")
    note = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(note)
    doc = tmp_path / "validation.md"
    doc.write_text("# generated\n\nold numbers\n\n" + note.KEEP_MARK + "\n\n## FlashAttention's reference\n\nkept\n")
    kept = note._kept_sections(str(doc))
    assert kept.lstrip().startswith(note.KEEP_MARK) and "kept" in kept and "old numbers" not in kept
    assert note._kept_sections(str(tmp_path / "missing.md")) == ""
    assert note.KEEP_MARK in (SCRIPT.parents[1] / "docs" / "validation.md").read_text()
