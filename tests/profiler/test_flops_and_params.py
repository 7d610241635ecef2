"""Attention FLOP counts against a brute-force mask count, and the parameter table against its documentation."""
import pathlib

import numpy as np
import pytest

from nki_attn.profiler import GENERATIONS
from nki_attn.profiler.flops import fa_convention_flops, useful_attention_flops, visible_pairs
from nki_attn.profiler.params import render_table


@pytest.mark.parametrize("s, causal, window", [(256, False, None), (256, True, None), (384, True, 1),
                                              (384, True, 100), (384, True, 384), (384, True, 1000)])
def test_visible_pairs_match_the_mask(s, causal, window):
    i = np.arange(s)[:, None]
    j = np.arange(s)[None, :]
    vis = np.ones((s, s), bool)
    if causal:
        vis &= j <= i
    if window:
        vis &= j >= i - window + 1
    assert visible_pairs(s, s, causal, window) == int(vis.sum())


def test_flops_follow_the_flash_attention_convention():
    b, h, s, d = 2, 4, 1024, 128
    assert useful_attention_flops(b, h, s, s, d) == fa_convention_flops(b, h, s, d) == 4 * b * s * s * h * d
    # causal: S(S+1)/2 pairs instead of S^2/2, i.e. the FA number plus the diagonal
    assert useful_attention_flops(b, h, s, s, d, causal=True) == fa_convention_flops(b, h, s, d, causal=True) \
        + 4 * b * h * d * s // 2
    assert useful_attention_flops(b, h, s, s, d, backward=True) == 10 * b * s * s * h * d


def test_derived_peak_matches_documented_peak():
    for g in GENERATIONS.values():
        assert g.peak_tflops == pytest.approx(g.peak_tflops_documented, rel=0.01)
        # per-core DMA bandwidth (all queues) never exceeds the per-core share of HBM bandwidth
        assert g.dma_queues * g.dma_queue_bytes_per_ns <= g.hbm_bytes_per_ns


def test_docs_hold_the_current_parameter_table():
    doc = pathlib.Path(__file__).resolve().parents[2] / "docs" / "performance.md"
    text = doc.read_text()
    start = text.index("<!-- params-table:start -->") + len("<!-- params-table:start -->")
    end = text.index("<!-- params-table:end -->")
    assert text[start:end].strip() == render_table().strip(), \
        "docs/performance.md is stale: paste `python -m nki_attn.profiler` between the params-table markers"
