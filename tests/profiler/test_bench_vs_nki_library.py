"""scripts/bench_vs_nki_library.py without the NKI Library: its tile-pair count, limits, and argument errors.
(The comparison itself needs a local checkout of the library and runs by hand, docs/performance.md.)"""
import importlib.util
import pathlib
from types import SimpleNamespace

import numpy as np
import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "bench_vs_nki_library.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_vs_nki_library", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_visible_tile_pairs_of_the_issue_shapes(bench):
    # (a) causal S 2048: query tile t (of 16) sees key tiles 0 .. t // 4, i.e. 1+2+3+4 tiles per 4 query tiles
    assert bench.visible_tile_pairs(bench.SHAPES["a"]) == 4 * 4 * (1 + 2 + 3 + 4)
    assert bench.visible_tile_pairs(bench.SHAPES["b"]) == 32 * 8  # non-causal S 4096: every tile
    assert bench.visible_tile_pairs(bench.SHAPES["d"]) == bench.visible_tile_pairs(bench.SHAPES["a"])
    # (c) window 128: a query tile touches its own key tile, and the previous one when its window reaches back
    c = bench.SHAPES["c"]
    per_head = sum(1 + (t % 4 == 0 and t > 0) for t in range(16))
    assert bench.visible_tile_pairs(c) == 8 * per_head


def _fig(time_us, floor_ratio=1.0):
    return {"time_us": time_us, "floor_ratio": floor_ratio}


def test_limits_flag_each_ratio_past_its_limit(bench):
    results = {
        "a": {"bwd": {"ours_fig": _fig(300, 2.7), "lib_fig": _fig(400), "mismatch": {"dq": 1e-3}},
              "fwd": {"ours_fig": _fig(90), "lib_fig": _fig(100), "mismatch": {"o": 1e-3}}},
        "b": {"bwd": {"ours_fig": _fig(69), "lib_fig": _fig(100), "mismatch": {"dq": 0.2}}},
    }
    args = SimpleNamespace(max_bwd_ratio=0.70, max_fwd_ratio=0.80, max_bwd_floor_ratio=2.5, max_mismatch=0.05)
    fails = bench.check_limits(results, args)
    assert any("(a) bwd: ratio 0.75" in f for f in fails)
    assert any("(a) fwd: ratio 0.90" in f for f in fails)
    assert any("2.70x the useful-FLOP bound" in f for f in fails)
    assert any("(b) bwd: output dq" in f for f in fails)
    assert not any("(b) bwd: ratio" in f for f in fails)  # 0.69 is within 0.70
    none = SimpleNamespace(max_bwd_ratio=None, max_fwd_ratio=None, max_bwd_floor_ratio=None, max_mismatch=0.5)
    assert bench.check_limits(results, none) == []


def test_bad_arguments_and_paths_are_reported(bench, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--nkilib", str(tmp_path), "--shapes", "a,z"])
    assert e.value.code == 2 and "'z'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--nkilib", str(tmp_path), "--max-bwd-ratio", "0"])
    assert "--max-bwd-ratio must be > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="no src/nkilib_src/nkilib/core/attention/attention_bwd.py"):
        bench.load_library(tmp_path)


def test_inputs_are_identical_bf16_for_both_kernels(bench):
    sh = bench.SHAPES["c"]
    x = bench.make_inputs(sh, seed=3)
    y = bench.make_inputs(sh, seed=3)
    assert x["q"].shape == (1, 8, 64, 2048) and x["k"].shape == (1, 1, 64, 2048)
    assert str(x["q"].dtype) == "bfloat16" and x["sinks"].shape == (1, 8)
    assert all(np.array_equal(np.asarray(x[n], np.float32), np.asarray(y[n], np.float32)) for n in x)


def test_worst_case_and_model_shape_limits(bench):
    # with --sensitivity the ratio limit applies to the worst case as well as the plain ratio
    sens = {"combined": 0.72}
    results = {"a": {"bwd": {"ours_fig": _fig(60), "lib_fig": _fig(100), "mismatch": {"dq": 1e-3}, "sens": sens}}}
    args = SimpleNamespace(max_bwd_ratio=0.70, max_fwd_ratio=None, max_bwd_floor_ratio=None, max_mismatch=0.05,
                           max_model_bwd_floor_ratio=1.5, max_model_fwd_floor_ratio=None, sensitivity=True)
    fails = bench.check_limits(results, args)
    assert fails == ["(a) bwd: worst-case ratio 0.72 > --max-bwd-ratio 0.7"]
    sens["combined"] = 0.69
    assert bench.check_limits(results, args) == []

    # the model-shape FLOP-bound limit: d128 / d256 shapes at >= 4096 tokens only
    def figs(bwd_floor):
        return {"bwd": {"floor_ratio": bwd_floor, "worst_ratio": None, "ratio": None},
                "fwd": {"floor_ratio": 9.0, "worst_ratio": None, "ratio": None}}
    rows = [("llama3-8b", 4096, figs(1.6)), ("llama3-8b", 2048, figs(1.6)), ("gpt-oss-20b", 4096, figs(9.0)),
            ("gemma2-9b", 8192, figs(1.4))]
    fails = bench.check_limits({}, args, rows)
    assert fails == ["llama3-8b S=4096 bwd: 1.60x the useful-FLOP bound > --max-model-bwd-floor-ratio 1.5"]


def test_model_shapes_and_their_arguments(bench, tmp_path, capsys):
    ms = bench.MODEL_SHAPES["deepseek-mla"]
    x = bench.model_inputs(ms, 512, seed=1)
    assert x["q"].shape == (1, 1, 192, 512) and x["v"].shape == (1, 1, 128, 512) and x["sinks"] is None
    assert bench.lib_unsupported(ms) == "d_qk != d_v"
    assert bench.lib_unsupported(bench.MODEL_SHAPES["llama3-8b"]) is None
    # d_qk = d_v: the FlashAttention convention (forward 4 d pairs, backward 2.5x)
    ll = bench.MODEL_SHAPES["llama3-70b-tp8"]
    fwd = bench.useful_attention_flops(1, 8, 4096, 4096, 128, causal=True)
    assert bench.model_flops(ll, 4096, False) == fwd
    assert bench.model_flops(ll, 4096, True) == fwd * 5 // 2
    for bad in (["--models", "llama3-8b,nope"], ["--model-seqlens", "1000"], ["--model-seqlens", "x"]):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(["--nkilib", str(tmp_path), *bad])
        assert e.value.code == 2
    capsys.readouterr()
