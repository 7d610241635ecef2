"""``nki-attn profile --features / --set / --vs default``: a variant or a kernel knob costed against the default
path, on tiny shapes; bad names are usage errors (exit 2) naming what is valid."""
import json

import pytest

from nki_attn.cli import main

TINY = ["--heads", "2", "--kv-heads", "1", "--seqlen", "256", "--head-dim", "64"]


def run_cli(args, capsys):
    status = main(["profile"] + args)
    return status, capsys.readouterr()


def test_a_variant_against_the_default_path(tmp_path, capsys):
    out = tmp_path / "v.json"
    status, cap = run_cli(["--kernel", "fwd", "--causal", "--features", "softcap=30", "alibi", "--vs", "default",
                           "--json", str(out)] + TINY, capsys)
    assert status == 0, cap.err
    assert "softcap=30.0" in cap.out and "vs the default path" in cap.out
    d = json.loads(out.read_text())
    v = d["vs_default"]
    # soft-capping and ALiBi add engine work per score tile: the variant costs more than the default path
    assert v["time_us"] > v["default_time_us"] > 0
    assert v["ratio"] == pytest.approx(v["time_us"] / v["default_time_us"])
    # the comparison is on the profile's headline, the scheduled time; the perfect-overlap time rides along
    assert v["time_us"] == pytest.approx(d["time_ns"] / 1e3)
    assert v["overlap_us"] == pytest.approx(d["time_overlap_ns"] / 1e3)
    assert v["overlap_ratio"] == pytest.approx(v["overlap_us"] / v["default_overlap_us"])
    # same visible pairs and head dims: the ratio per useful FLOP equals the ratio
    assert v["ratio_per_useful_flop"] == pytest.approx(v["ratio"])
    assert d["useful_flops"] == 4 * 2 * 64 * (256 * 257 // 2)


def test_shape_features_change_the_useful_flops(tmp_path, capsys):
    out = tmp_path / "d.json"
    status, cap = run_cli(["--kernel", "fwd", "--features", "d_qk=96", "seqlen_k=384", "--json", str(out)]
                          + TINY, capsys)
    assert status == 0, cap.err
    # not causal: every (query, key) pair, 2 * (d_qk + d_v) FLOPs each per query head
    assert json.loads(out.read_text())["useful_flops"] == 2 * 2 * 256 * 384 * (96 + 64)


def test_a_knob_is_passed_to_the_kernel(tmp_path, capsys):
    out = tmp_path / "k.json"
    status, cap = run_cli(["--kernel", "bwd", "--causal", "--set", "k_section_len=128", "--vs", "default",
                           "--json", str(out)] + TINY, capsys)
    assert status == 0, cap.err
    v = json.loads(out.read_text())["vs_default"]
    # two K/V sections of 128 keys instead of one: a different instruction stream, a different modeled time
    assert v["time_us"] != pytest.approx(v["default_time_us"])


@pytest.mark.parametrize("args, words", [
    (["--kernel", "bwd", "--set", "NO_SUCH_KNOB=1"], ["NO_SUCH_KNOB", "valid:", "k_section_len"]),
    (["--kernel", "fwd", "--features", "nope"], ["unknown feature", "softcap"]),
    (["--kernel", "fwd", "--features", "window_size"], ["needs a value"]),
    (["--kernel", "fwd", "--features", "softcap=abc"], ["bad value"]),
    (["--kernel", "demo", "--features", "softcap"], ["not the demo"]),
    (["--kernel", "fwd", "--window", "64", "--features", "window_size=3,3"], ["not both"]),
])
def test_bad_variant_options_are_usage_errors(args, words, capsys):
    with pytest.raises(SystemExit) as e:
        main(["profile"] + args + TINY)
    err = capsys.readouterr().err
    assert e.value.code == 2 and all(w in err for w in words), err
