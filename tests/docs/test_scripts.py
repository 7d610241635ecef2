"""The scripts under scripts/ as a maintainer runs them: every subcommand parses its options, the comparison with
FlashAttention's reference (``compare.py flash-attention``, gated on a local checkout of the public
Dao-AILab/flash-attention repository named by FLASH_ATTENTION_REPO, and einops), and the validation note's kept
sections. The scripts' figures themselves come from running them, not from these tests."""
import ast
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
REPO = os.environ.get("FLASH_ATTENTION_REPO")


def _load(name):
    sys.path.insert(0, str(SCRIPTS))  # figures.py shares bench.py's helpers, as when run from scripts/
    try:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(SCRIPTS))
    return mod


@pytest.fixture(scope="module")
def compare():
    return _load("compare")


@pytest.mark.parametrize("script, commands", [
    ("bench", ["compile", "frontend-overhead", "sim-overhead", "modeled-util", "dropout-cost", "dropout-stats",
               "blas-orders", "planted-bugs", "sim-speed", "block-mask-cost"]),
    ("figures", ["fwd", "bwd", "bwd-tolerances", "ring", "validation-note", "readme", "accuracy",
                 "accuracy-steps", "masks", "variants"]),
    ("compare", ["flash-attention"]),
])
def test_every_subcommand_is_listed_and_parses(script, commands, capsys):
    mod = _load(script)
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0
    listed = capsys.readouterr().out
    assert all(c in listed for c in commands), listed
    for c in commands:
        with pytest.raises(SystemExit) as e:
            mod.main([c, "--help"])
        assert e.value.code == 0, c
    with pytest.raises(SystemExit) as e:
        mod.main(["no-such-command"])
    assert e.value.code == 2


def test_no_script_imports_tests_or_patches_kernel_modules():
    for path in SCRIPTS.glob("*.py"):
        tree = ast.parse(path.read_text())
        kernel_names = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                assert not any(m and (m.split(".")[0] in ("tests", "conftest") or m.split(".")[-1].startswith(
                    ("test_", "_cases", "_compare"))) for m in mods), f"{path.name} imports tests: {mods}"
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nki_attn.kernels"):
                    kernel_names |= {a.asname or a.name for a in node.names}
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "insert" and node.args[1:]:
                assert "tests" not in ast.unparse(node.args[1]), f"{path.name} puts tests/ on sys.path"
        for node in ast.walk(tree):  # no kernel module's constants switched from outside
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and node.args:
                assert ast.unparse(node.args[0]) not in kernel_names, f"{path.name} patches {ast.unparse(node)}"


def test_a_small_real_run(tmp_path):
    """dropout-stats on one seed: a healthy hash stays within a few standard deviations."""
    p = subprocess.run([sys.executable, str(SCRIPTS / "bench.py"), "dropout-stats", "--seeds", "1"],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr
    worst = float(p.stdout.split("largest |z| over all:")[1].split()[0])
    assert worst < 6, p.stdout


def test_without_a_checkout_it_is_a_usage_error(compare, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("FLASH_ATTENTION_REPO", raising=False)
    with pytest.raises(SystemExit) as e:
        compare.main(["flash-attention", "--flash-attn", str(tmp_path)])
    assert e.value.code == 2 and "tests/test_flash_attn.py" in capsys.readouterr().err


@pytest.mark.skipif(not REPO, reason="set FLASH_ATTENTION_REPO to a Dao-AILab/flash-attention checkout")
def test_flashattention_reference_agrees(compare, capsys):
    pytest.importorskip("einops")
    code = compare.main(["flash-attention", "--flash-attn", REPO, "--dtypes", "bf16",
                         "--variants", "softcap-causal", "alibi", "local", "causal-sq<sk"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "4/4 rows pass" in out


def test_the_validation_note_keeps_its_hand_written_sections(tmp_path):
    """docs/validation.md is regenerated from the harness reports; what follows the marker (the tolerance
    derivations, the FlashAttention-reference check, mutation testing) survives the regeneration."""
    note = _load("figures")
    doc = tmp_path / "validation.md"
    doc.write_text("# generated\n\nold numbers\n\n" + note.KEEP_MARK + "\n\n## FlashAttention's reference\n\nkept\n")
    kept = note._kept_sections(str(doc))
    assert kept.lstrip().startswith(note.KEEP_MARK) and "kept" in kept and "old numbers" not in kept
    assert note._kept_sections(str(tmp_path / "missing.md")) == ""
    text = (ROOT / "docs" / "validation.md").read_text()
    assert note.KEEP_MARK in text
    # the tables the scripts write live after the marker, so a regeneration keeps them
    tail = text.split(note.KEEP_MARK, 1)[1]
    for name in ("harness-tolerances", "blas-orders", "planted-bugs", "bwd-tolerances", "accuracy-steps"):
        assert f"<!-- {name}:begin -->" in tail and f"<!-- {name}:end -->" in tail, name


def test_reports_live_in_reports(tmp_path):
    """Generated JSON reports are under reports/, not docs/, and the docs cite them there."""
    assert not list((ROOT / "docs").rglob("*.json"))
    for name in ("full", "models", "nki_library", "nki_library_cte"):
        assert (ROOT / "reports" / f"harness_report_{name}.json").is_file()
    assert "reports/harness_report_full.json" in (ROOT / "docs" / "validation.md").read_text()


def test_modeled_figures_lead_with_the_scheduled_time(monkeypatch, tmp_path, capsys):
    """modeled-util and variants report cost model v2's scheduled time first and keep the perfect-overlap bound
    beside it; the schedule never beats that bound, and a variant's ratio is against its own default. A small
    shape (256 tokens, d 64) keeps the runs to seconds; the figures of the docs come from the full commands."""
    bench = _load("bench")
    r = bench._util_row("fwd", (1, 1, 1, 256, 64, True, None, 0), "trn2")
    assert r["time_us"] >= r["time_overlap_us"] > 0 and r["time_serial_us"] >= r["time_overlap_us"]
    # utilisation and the bound multiple are taken on the scheduled time, not on the bound
    assert r["floor_ratio"] == pytest.approx(r["floor_ratio_overlap"] * r["time_us"] / r["time_overlap_us"])
    assert r["useful_util"] == pytest.approx(1 / r["floor_ratio"])
    line = bench._util_table([("tiny", r)]).splitlines()[-1]
    assert f"**{r['time_us']:.0f}** ({r['time_overlap_us']:.0f} / {r['time_serial_us']:.0f})" in line

    # --reuse takes earlier rows only when they were made from the same kernel source and model
    import argparse
    import json
    from nki_attn.profiler.params import MODEL
    path = tmp_path / "util.json"
    rows = [dict(r, case="causal-2048", kernel=k) for k in ("fwd", "bwd")]
    run = argparse.Namespace(target="trn2", only=["causal-2048"], kernels=[], json=None, plot=None, write=False,
                             reuse=str(path))
    package = {"fwd": bench.kernel_package_sha(["attention_bwd.py"]),
               "bwd": bench.kernel_package_sha(["attention_fwd.py"])}
    for sha, model, pkg in ((bench.kernel_versions(), MODEL, package),
                            ({"attention_fwd.py": "0" * 12}, MODEL, package),
                            (bench.kernel_versions(), "cost model v1", package),
                            (bench.kernel_versions(), MODEL, dict(package, bwd="0" * 12))):
        path.write_text(json.dumps({"target": "trn2", "model": model, "kernel_sha256_12": sha,
                                    "kernel_package_sha256_12": pkg, "rows": rows}))
        if model == MODEL and sha == bench.kernel_versions() and pkg == package:
            assert bench.run_modeled_util(run) == 0
            assert capsys.readouterr().out.count(f"| causal-2048 | ") == 2
        else:
            with pytest.raises(SystemExit, match="run them again"):
                bench.run_modeled_util(run)

    figures = _load("figures")
    monkeypatch.setattr(figures, "VARIANT_BASE", ["--heads", "2", "--kv-heads", "1", "--seqlen", "256",
                                                  "--head-dim", "64", "--mixed-precision", "true"])
    monkeypatch.setitem(figures.VARIANT_ROWS, "fwd", [("default (causal)", [], True),
                                                      ("softcap 50", ["--features", "softcap=50"], True),
                                                      ("default (non-causal)", [], False)])
    rows = figures.variant_rows("fwd")
    causal, softcap, full = rows
    assert all(x["time_us"] >= x["overlap_us"] > 0 for x in rows)
    assert causal["rel"] == 1.0 and softcap["rel"] == pytest.approx(softcap["time_us"] / causal["time_us"])
    assert full["rel"] == pytest.approx(full["time_us"] / causal["time_us"])
    # soft-capping adds a tanh per score tile: more instructions than the default path, the same useful FLOPs
    assert softcap["instructions"] > causal["instructions"]
    assert softcap["rel_per_flop"] == pytest.approx(softcap["rel"])
    table = figures.variant_table(rows)
    assert f"| softcap 50 | **{softcap['time_us']:.1f}** |" in table and "`--causal --features softcap=50`" in table
