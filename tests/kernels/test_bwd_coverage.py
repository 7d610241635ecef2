"""Backward-kernel cases the feature tests miss: windows next to a multiple of 128, several K/V sections combined
with sinks / window / GQA / packing, and the mixed-precision dQ path pinned per section count.

Accuracy: each output against the golden run on float64 copies of the dtype-rounded inputs, with the project's
criterion (tests/kernels/conftest.py, derived in docs/validation.md) and its fixed absolute band. Inputs are
N(0, 1) q, k, v, dy rounded to the dtype; o and lse come from the float64 golden forward (o rounded to the dtype,
lse to float32), in the kernel layout. Sizes are small (d_head 32 or 64, seqlen <= 640): the cases are about
which tiles, sections and heads meet, not about length.

Two helpers hold this module's knowledge of kernel internals: ``run_bwd`` (the only way sections are forced) and
``hbm_round_trips`` (the only reading of the instruction trace).
"""
import numpy as np
import pytest

from nki_attn.kernels import attention_bwd as kb
from nki_attn.sim import trace

from .conftest import GRAD_NAMES as NAMES
from .conftest import Case as SharedCase


# ----------------------------------------------------------------------------------------------- kernel access
def run_bwd(args, kwargs, k_section_len=None, lnc=None):
    """attention_bwd(*args, **kwargs), with K/V sections of ``k_section_len`` keys (a multiple of 128) when given,
    launched on ``lnc`` cores when given. The only place this module forces sections."""
    kern = kb.attention_bwd if lnc is None else kb.attention_bwd[lnc]
    return kern(*args, k_section_len=k_section_len, **kwargs)


def hbm_round_trips(rec):
    """dtypes of the HBM tensors a launch writes and later reads back, from the instruction trace (DMA operands,
    matched by tensor name). Between K/V sections the backward parks each query tile's dQ partial sum in HBM;
    nothing else is written and re-read, so this is the set of dtypes the dQ partial sums pass through."""
    written, dtypes = set(), set()
    for r in rec.records:
        if r.instr not in trace.DMA_INSTRUCTIONS:
            continue
        for s in r.srcs:
            if s.buffer == "hbm" and s.name in written:
                dtypes.add(s.dtype)
        if r.dst is not None and r.dst.buffer == "hbm":
            written.add(r.dst.name)
    return dtypes


# ----------------------------------------------------------------------------------------------- cases
class Case(SharedCase):
    """The shared case builder (conftest.py) with this module's defaults; ``run`` goes through ``run_bwd``."""

    def __init__(self, d=32, sq=384, causal=True, **kw):
        super().__init__(d=d, sq=sq, causal=causal, **kw)

    def run(self, k_section_len=None, lnc=None):
        return run_bwd(self.bwd_refs()["args"], self.bwd_kwargs(), k_section_len, lnc)

    def check(self, out):
        self.check_bwd(out)


def run_case(k_section_len=None, **kw):
    c = Case(**kw)
    out = c.run(k_section_len)
    c.check(out)
    return c, out


# ----------------------------------------------------------------------------------------------- windows
# W = 127 mod 128 and W = 2 mod 128 are where an off-by-one in the tile decisions first changes the plan: the
# first / last key of a query tile's window sits exactly on a chunk boundary.
@pytest.mark.parametrize("window,sq", [(2, 384), (127, 384), (129, 384), (130, 384), (255, 384), (383, 384),
                                       (258, 640), (511, 640), (514, 640)])
def test_window_next_to_a_chunk_boundary(window, sq):
    run_case(sq=sq, window=window, seed=window)


@pytest.mark.parametrize("window", [127, 130])
@pytest.mark.parametrize("section", [128, 256])
def test_window_next_to_a_chunk_boundary_in_sections(window, section):
    run_case(k_section_len=section, sq=640, window=window, h=2, seed=window + section)


@pytest.mark.parametrize("window", [127, 130])
def test_window_next_to_a_chunk_boundary_bf16_packing(window):
    run_case(sq=640, window=window, cu=[0, 200, 520, 640], dtype="bfloat16", mixed=True, seed=window)


# ----------------------------------------------------------------------------------------------- dQ between sections
# With mixed precision and 16-bit inputs, a query tile's dQ partial sum must cross K/V sections in float32: from 2
# sections on, not only from 3. Pinned on the trace, which needs no error bound: the bound alone cannot see it
# (the error grows by ~50% at 2 sections and stays inside).
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("n_sections", [1, 2, 3])
def test_mixed_precision_dq_crosses_sections_in_fp32(n_sections, dtype):
    c = Case(sq=384, causal=False, d=64, dtype=dtype, mixed=True, seed=n_sections)
    with trace.recording() as rec:
        out = c.run(k_section_len={1: 384, 2: 256, 3: 128}[n_sections])
    c.check(out)
    if n_sections == 1:
        assert hbm_round_trips(rec) == set(), "one section: nothing needs to be parked in HBM"
    else:
        assert hbm_round_trips(rec) == {"float32"}, \
            f"{n_sections} sections: dQ partial sums went through HBM as {hbm_round_trips(rec)}, not float32 only"


def test_mixed_precision_dq_sections_on_key_tile_boundaries_are_exact():
    # Sections that coincide with the 512-key tiles change nothing but where the running dQ waits between
    # tiles: with a float32 wait the result is bit-identical to one section (a 16-bit wait rounds it). Assumes
    # a query tile's dQ is summed over key tiles in key order whatever the sectioning (true of the kernel's
    # FlashAttention-2 loop); drop this test if a rewrite changes that order on purpose.
    c = Case(sq=1024, causal=True, dtype="bfloat16", mixed=True, h=2, hk=1, seed=5)
    one = c.run(k_section_len=1024)
    two = c.run(k_section_len=512)
    c.check(two)
    for name, a, b in zip(NAMES, one, two):
        assert np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16)), name


def test_lnc2_with_dq_parked_between_sections(monkeypatch):
    # two cores, 3 work items, each parking dQ partial sums in float32 HBM between 3 sections: each core's
    # parked sums are its own (bit-identical to one core)
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    c = Case(bs=3, h=4, hk=1, sq=384, window=130, sinks=1, dtype="bfloat16", mixed=True, seed=7)
    one = c.run(k_section_len=128)
    c.check(one)
    two = c.run(k_section_len=128, lnc=2)
    for name, a, b in zip(NAMES, one, two):
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)), name


# ----------------------------------------------------------------------------------------------- sinks, sections, GQA
# sq = 640, W = 130, sections of 128: query tile 4 (rows 512..639) first sees a key in section 2, tile 3 in
# section 1, so D (needed by dsinks after section 0) must not wait for a tile's first visible section.
@pytest.mark.parametrize("kw", [
    dict(sinks=1, h=2, hk=1),
    dict(sinks=2, h=6, hk=2),
    dict(sinks=2, h=2, hk=1, dtype="bfloat16", mixed=True),
    dict(sinks=1, h=2, hk=1, dtype="bfloat16", mixed=False),
], ids=["1sink", "2sinks-gqa6:2", "bf16-mixed", "bf16"])
def test_sinks_window_several_sections(kw):
    run_case(k_section_len=128, sq=640, window=130, seed=3, **kw)


@pytest.mark.parametrize("h,hk,sinks", [(8, 2, 1), (6, 2, 2), (6, 3, 1), (4, 1, 3)])
def test_sinks_gqa_group_differs_from_kv_heads(h, hk, sinks):
    # group = h / hk != hk, and bs = 2: a swap of group and kv-head count (or of batch stride) in the head index
    # of the sink logits or of dsinks lands on another head's values
    run_case(bs=2, h=h, hk=hk, sq=256, sinks=sinks, seed=h * 10 + hk)


@pytest.mark.parametrize("h,hk", [(8, 2), (6, 2)])
def test_gqa_window_sections(h, hk):
    run_case(k_section_len=128, bs=2, h=h, hk=hk, sq=384, window=200, seed=h)


def test_everything_at_once():
    # packing (3 sequences), causal, window 130, 2 sinks, GQA 6:2, 3 sections, bf16 mixed precision
    run_case(k_section_len=256, h=6, hk=2, sq=640, window=130, sinks=2, cu=[0, 150, 500, 640], dtype="bfloat16",
             mixed=True, seed=9)


def test_unequal_lengths_several_sections():
    # non-causal seqlen_q != seqlen_k, with the last section shorter than the others
    run_case(k_section_len=256, h=4, hk=2, sq=256, sk=640, causal=False, sinks=1, seed=11)


@pytest.mark.parametrize("sinks", [1, 2])
def test_causal_queries_longer_sinks(sinks):
    # bottom-right causal with seqlen_q - seqlen_k = 256: query tiles 0 and 1 see no key at all (their O is 0, D
    # must be 0); dsinks sums D over every query row, so it reads the rows no section ever visits
    run_case(h=2, hk=1, sq=512, sk=256, causal=True, sinks=sinks, seed=13)
