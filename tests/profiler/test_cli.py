"""``nki-attn profile`` end to end on tiny shapes: table, JSON, PNG (or the message when matplotlib is absent)."""
import json
import sys

import pytest

from nki_attn.cli import main

TINY = ["--heads", "2", "--kv-heads", "1", "--seqlen", "256", "--head-dim", "64"]


def run_cli(args, capsys):
    status = main(["profile"] + args)
    return status, capsys.readouterr()


def test_forward_profile_writes_json(tmp_path, capsys):
    out = tmp_path / "fwd.json"
    status, cap = run_cli(["--kernel", "fwd", "--causal", "--json", str(out)] + TINY, capsys)
    assert status == 0
    assert "MODELED" in cap.out and "TensorE" in cap.out and "perfect overlap" in cap.out
    d = json.loads(out.read_text())
    assert d["modeled"] is True and d["target"] == "trn2" and d["cores"] == 1
    assert d["engines"]["TensorE"]["instructions"] > 0 and d["engines"]["DMA"]["instructions"] > 0
    busy = [e["busy_ns"] for e in d["engines"].values()]
    assert d["time_overlap_ns"] == pytest.approx(max(busy))
    assert d["time_serial_ns"] == pytest.approx(sum(busy))
    # causal S=256: 256*257/2 visible pairs, 4 FLOPs per pair and head-dim element, 2 query heads
    assert d["useful_flops"] == 4 * 2 * 64 * (256 * 257 // 2)
    assert 0 < d["tensor_utilisation_overlap"] <= 1
    assert d["hbm_bytes"] >= 2 * (2 + 1 + 1) * 64 * 256  # q, k, v read and o written at least once (bf16)


def test_backward_profile_lnc2_with_sinks_and_window(tmp_path, capsys):
    out = tmp_path / "bwd.json"
    shape = ["--heads", "2", "--kv-heads", "2", "--seqlen", "256", "--head-dim", "64"]
    status, _ = run_cli(["--kernel", "bwd", "--window", "128", "--sinks", "1", "--lnc", "2", "--target", "trn3",
                         "--json", str(out)] + shape, capsys)
    assert status == 0
    d = json.loads(out.read_text())
    assert d["target"] == "trn3" and d["args"]["causal"] is True  # --window implies --causal
    assert d["cores"] == 2 and d["active_cores"] == [0, 1]
    assert d["useful_flops"] > 0 and d["matmul_flops"] > 0


def test_plot_written_when_matplotlib_is_present(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "demo.png"
    status, cap = run_cli(["--kernel", "demo", "--seqlen", "512", "--plot", str(png)], capsys)
    assert status == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_degrades_with_a_message_without_matplotlib(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    png = tmp_path / "demo.png"
    status, cap = run_cli(["--kernel", "demo", "--seqlen", "512", "--plot", str(png)], capsys)
    assert status == 0 and not png.exists()
    assert "matplotlib is not installed" in cap.err and "nki-attn[plot]" in cap.err
    assert "modeled time" in cap.out  # the profile itself still printed


def test_bad_shape_is_reported_without_a_traceback(capsys):
    status, cap = run_cli(["--kernel", "fwd", "--seqlen", "200"], capsys)
    assert status == 2
    assert "nki-attn profile:" in cap.err and "200" in cap.err


@pytest.mark.parametrize("argv,flag", [
    (["--plot", "/nonexistent-dir-of-nki-attn/x.png"], "--plot"),
    (["--json", "/nonexistent-dir-of-nki-attn/x.json"], "--json"),
    (["--lnc", "2", "--target", "trn1"], "--lnc"),
    (["--kernel", "demo", "--lnc", "2"], "--lnc"),
    (["--dtype", "int8"], "--dtype"),
    (["--seqlen", "0"], "--seqlen"),
    (["--heads", "3", "--kv-heads", "2"], "--heads"),
])
def test_usage_errors_exit_2_before_the_kernel_runs(argv, flag, capsys, monkeypatch):
    from nki_attn.profiler import cli as prof_cli

    def boom(*a, **k):
        raise AssertionError("the kernel ran before the usage error was reported")
    monkeypatch.setattr(prof_cli, "run_kernel", boom)
    with pytest.raises(SystemExit) as exc:
        main(["profile"] + argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and flag in err and "Traceback" not in err


def test_long_dtype_spelling_runs(tmp_path, capsys):
    out = tmp_path / "p.json"
    status, cap = run_cli(["--kernel", "fwd", "--dtype", "bfloat16", "--json", str(out)] + TINY, capsys)
    assert status == 0 and " bf16" in cap.out
    assert json.loads(out.read_text())["args"]["dtype"] == "bf16"
