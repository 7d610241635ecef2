"""The quick preset, exactly as the README's main job runs it, passes (in process, one job)."""
import json

from nki_attn.cli import main


def test_quick_preset_passes(tmp_path, capsys):
    out = tmp_path / "report.json"
    code = main(["check", "--preset", "quick", "--out", str(out)])
    rep = json.loads(out.read_text())
    assert code == 0, capsys.readouterr().out
    assert rep["summary"]["pass"] and rep["summary"]["rows"] >= 19
    assert "OVERALL: PASS" in capsys.readouterr().out
