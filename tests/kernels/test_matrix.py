"""Both kernels on the simulator as one matrix: dtype x variant x shape x heads (GQA), against the float64 golden.

A row is four strings (vocabulary in conftest.py: ``case_kwargs``) and the kernels it runs: ``f`` the forward
(``attention_fwd`` on the inputs, o and lse checked), ``b`` the backward (``attention_bwd`` fed the float64 forward's
O and LSE, dq, dk, dv, dsinks and the score modifications' gradients checked). The accuracy criterion is conftest.py's (derived in docs/validation.md):
at most K = 2 times the golden's own error in the dtype (plus, backward, the error the kernel's formula gets from its
inputs) plus one rounding; a fixed absolute band for the backward; +inf LSE exactly where the reference has it, and
exact zeros for rows that see no key and keys no row sees.

``ROWS`` (the default run) puts every variant on at least one shape and dtype, in groups whose comments say what
they exercise (windows at tile edges, head dims with a remainder partition tile, several key blocks, K/V sections...).
``PRODUCT`` (marked ``slow``) is the full cross product of the core axes. ``test_chain`` feeds the forward kernel's
own O and LSE to the backward kernel.
"""
import itertools
import re

import numpy as np
import pytest

from nki_attn.kernels.attention_bwd import attention_bwd

from .conftest import (FLOAT32_GRADS, TEST_MODS, VARIANT_TOKENS, Case, as_t64, bwd_from_stats, case_kwargs,
                       check_close, empty_rows, max_err)

S = pytest.mark.slow
# (kernels, dtype, variant, shape, heads)
ROWS = [
    # ---- plain, causal, sliding windows (1: the diagonal only, 128: one tile, 300: tiles skipped at trace time)
    ("fb", "fp32", "plain", "d64-s256", "h1k1"),
    ("f", "fp32", "causal", "d64-s512", "h1k1"),
    ("f", "fp32", "causal+swa1", "d64-s640", "h1k1"),
    ("f", "fp32", "causal+swa100+seed100", "d64-s640", "h1k1"),
    ("f", "fp32", "causal+swa128+seed128", "d64-s640", "h1k1"),
    ("f", "fp32", "causal+swa300+seed300", "d64-s640", "h1k1"),
    ("f", "fp32", "causal+swa10000", "d64-s256", "h1k1"),                    # wider than the sequence
    ("b", "fp32", "causal+swa100", "d64-s256", "h1k1"),
    ("b", "fp32", "causal+swa1", "d64-s128", "h1k1"),
    ("b", "fp32", "causal+swa300", "d64-s512", "h1k1"),
    ("f", "fp32", "causal+swa200", "d64-s384", "h4k1"),                      # 12 (head, tile) units: two blocks
    # ---- GQA / MQA
    ("f", "fp32", "causal", "d64-s256", "h8k2"),
    ("b", "fp32", "causal", "d64-s128", "h8k2"),
    ("f", "fp32", "plain", "d64-s256", "b2h3k1"),
    ("b", "fp32", "plain", "d64-s128", "b2h3k1"),
    # ---- packing (cu: sequence boundaries; rows past the last boundary see nothing)
    ("f", "fp32", "cu0-100-333-512", "d64-s512", "h2k1"),
    ("f", "fp32", "causal+cu0-100-333-512", "d64-s512", "h2k1"),
    ("f", "fp32", "causal+swa40+cu0-100-333-512", "d64-s512", "h1k1"),
    ("f", "bf16-nomix", "cu0-200-300", "d64-s384", "h1k1"),                  # rows 300.. empty, bf16 accumulator
    ("b", "fp32", "cu0-100-250-384", "d64-s384", "h1k1"),
    ("b", "fp32", "causal+cu0-100-250-384", "d64-s384", "h1k1"),
    ("b", "fp32", "causal+swa50+cu0-37-300-384", "d64-s384", "h1k1"),
    ("b", "fp32", "causal+cu0-90-200-250", "d64-s384", "h2k1"),              # rows 250.. see no key: zero grads
    # ---- sinks
    ("f", "fp32", "causal+sinks1+sinkmul3+seed1", "d64-s256", "h2k1"),
    ("f", "fp32", "causal+sinks2+sinkmul3+seed2", "d64-s256", "h2k1"),
    ("f", "fp32", "sinks1+sinkval30", "d64-s256", "h1k1"),                   # sinks dominate: P of keys tiny
    ("b", "fp32", "sinks1", "d64-s256", "h1k1"),
    ("b", "fp32", "causal+sinks2", "d64-s256", "h4k2"),
    ("b", "fp32", "causal+sinks1+cu0-100-250-384", "d64-s384", "h1k1"),
    # ---- softmax scale (> 1: scale * mask value would overflow if applied after masking), large logits
    ("f", "fp32", "causal+swa150+scale0.3+seed4", "d64-s384", "h1k1"),
    ("f", "fp32", "causal+swa150+scale1.0+seed4", "d64-s384", "h1k1"),
    ("f", "fp32", "causal+swa150+scale2.5+seed4", "d64-s384", "h1k1"),
    ("b", "fp32", "scale0.3", "d64-s256", "h1k1"),
    ("b", "fp32", "causal+scale1.0", "d64-s256", "h1k1"),
    ("f", "fp32", "causal+qmul64+seed5", "d64-s256", "h1k1"),                # scores of several hundred
    # ---- seqlen_q != seqlen_k (causal and windows bottom-right aligned)
    ("f", "fp32", "plain", "d64-s256x640", "h2k1"),
    ("f", "fp32", "plain", "d64-s640x256", "h2k1"),
    ("f", "fp32", "plain", "d64-s128x1152", "h2k1"),
    ("b", "fp32", "plain", "d64-s256x512", "h1k1"),
    ("b", "fp32", "plain", "d64-s384x128", "h1k1"),
    ("f", "fp32", "causal", "d64-s256x512", "h2k1"),
    ("f", "fp32", "causal", "d64-s512x256", "h2k1"),                         # first 256 rows see no key
    ("f", "fp32", "causal", "d64-s384x896", "h2k1"),
    ("b", "fp32", "causal", "d64-s256x512", "h1k1"),
    ("b", "fp32", "causal", "d64-s384x128", "h1k1"),                         # rows 0..255 see no key
    ("f", "fp32", "causal+swa100", "d64-s256x640", "h2k1"),
    ("b", "fp32", "causal+swa100", "d64-s384x256", "h1k1"),
    # ---- head dims (128 + remainder partition tiles, d_qk != d_v; d128 forward: the dtype rows below)
    ("f", "fp32", "causal+seed64", "d64-s256", "h1k1"),
    ("f", "fp32", "causal+seed96", "d96-s256", "h1k1"),
    ("f", "fp32", "causal+seed256", "d256-s256", "h1k1"),
    ("b", "fp32", "causal", "d64-s256", "h2k1"),                             # also the backward's plain causal
    ("b", "fp32", "causal", "d96-s256", "h2k1"),
    ("b", "fp32", "causal", "d128-s256", "h2k1"),
    ("b", "fp32", "causal", "d256-s256", "h2k1"),
    ("f", "bf16", "causal", "d192v128-s256", "h2k1"),
    ("f", "fp32", "causal", "d128v192-s256", "h2k1"),
    ("f", "fp32", "causal", "d199-s256", "h2k1"),
    ("f", "bf16", "causal", "d72-s256", "h2k1"),
    ("f", "fp32", "causal", "d1-s256", "h2k1"),
    ("f", "fp32", "causal", "d64v200-s256", "h2k1"),
    ("f", "fp32", "causal", "d256v32-s256", "h2k1"),
    ("f", "fp16-nomix", "seed14", "d199v72-s256", "h2k1"),
    ("b", "fp32", "causal", "d192v128-s256", "h2k1"),                        # DeepSeek MLA shape
    ("b", "bf16", "causal", "d192v128-s384", "h2k1"),
    ("b", "fp32", "plain", "d64v200-s256", "h1k1"),
    ("b", "fp32", "causal", "d199-s256", "h2k1"),
    ("b", "fp32", "causal", "d72-s256", "h1k1"),
    ("b", "fp32", "plain", "d1-s256", "h1k1"),
    ("b", "fp32", "sinks1", "d256v40-s256", "h1k1"),
    # ---- dtypes x mixed precision
    *[("f", dt, var, "d128-s256", "h2k1") for dt in ("fp32", "fp32-nomix", "bf16", "bf16-nomix", "fp16",
                                                     "fp16-nomix") for var in ("seed1", "causal+seed1")],
    *[("b", dt, "causal+sinks1", "d128-s256", "h2k1") for dt in ("bf16", "bf16-nomix", "fp16", "fp16-nomix")],
    ("f", "bf16", "causal+cu0-130-256+sinks1+sinkval0.5+seed7", "d256-s256", "h1k1"),
    ("f", "fp16", "causal+cu0-130-256+sinks1+sinkval0.5+seed7", "d256-s256", "h1k1"),
    ("b", "bf16-nomix", "causal", "d64-s256", "h1k1"),
    # ---- K/V sections in the backward (sec: k_section_len)
    ("b", "fp32", "causal+swa200+sec128", "d64-s512", "h1k1"),
    ("b", "bf16", "sec128", "d64-s512x768", "h2k1"),                         # fp32 dQ scratch in HBM
    ("b", "bf16-nomix", "causal+sinks2+sec128", "d64-s512", "h1k1"),          # dQ round trip in bf16
    ("b", "fp32", "causal+sec128", "d256-s384", "h1k1"),
    ("b", "bf16", "causal+swa200+cap3+sec128", "d256-s384", "h2k1"),         # Gemma-2 like
    ("b", "fp32", "alibi+win100:60+sec128", "d192v128-s512", "h2k1"),
    # the transposed dQ (d_qk != d_v, transposed_dq) across sections: fp32 HBM scratch, then the bf16 round trip
    ("b", "bf16", "causal+sec128", "d192v128-s512", "h2k1"),
    ("b", "bf16-nomix", "causal+sinks1+sec256", "d192v128-s512x768", "h1k1"),
    ("b", "fp32", "causal+sec128", "d64v200-s384", "h2k1"),
    ("b", "bf16", "causal+alibi+cap2+sinks1+sec128", "d64-s512x640", "h1k1"),
    ("b", "bf16", "causal+swa700+sinks1+sec1024", "d128-s2048", "h4k2", S),
    ("b", "fp32-nomix", "causal+swa700+sinks1+sec1024", "d128-s2048", "h4k2", S),
    # ---- soft-capping (q scaled so scores reach the cap's non-linear range; sinks are not capped)
    ("f", "fp32", "cap30+qmul6+seed1", "d64-s384", "h2k1"),
    ("f", "fp32", "causal+cap30+qmul6+seed1", "d64-s384", "h2k1"),
    ("f", "bf16", "causal+cap30+qmul6+seed1", "d64-s384", "h2k1"),
    ("f", "fp32", "causal+cap5+qmul5+sinks2+sinkmul2+seed2", "d64-s256", "h2k1"),   # scale 1/8: a power of two
    ("b", "fp32", "cap2", "d64-s256", "h1k1"),
    ("b", "fp32", "causal+cap2+scale0.5", "d64-s256", "h1k1"),
    ("b", "fp32", "causal+cap1.5+sinks2", "d64-s256", "h4k2"),
    ("b", "bf16", "causal+cap3", "d128-s256", "h2k1"),
    # ---- ALiBi (slopes per batch row and head)
    ("f", "fp32", "alibi", "d64-s256", "b2h4k2"),
    ("f", "fp32", "causal+alibi", "d64-s256", "b2h4k2"),
    ("f", "fp32", "alibi", "d64-s256x640", "b2h4k2"),
    ("f", "fp32", "causal+alibi", "d64-s256x640", "b2h4k2"),
    ("f", "fp32", "alibi", "d64-s384x256", "b2h4k2"),
    ("f", "bf16", "alibi+seed4", "d64-s256x2560", "h4k1"),                   # two key blocks
    ("f", "fp32", "alibi+cap20+win100:60+qmul4+seed5", "d64-s512", "h2k1"),
    ("b", "fp32", "causal+alibi", "d64-s256x384", "h2k1"),
    ("b", "fp32", "causal+alibi", "d64-s384x256", "h2k2"),
    ("b", "fp32", "alibi", "d64-s384x256", "h4k1"),
    ("b", "bf16", "alibi", "d64-s256", "b2h2k1"),
    ("b", "fp32", "causal+alibi+cap2", "d64-s256", "h2k1"),
    # ---- two-sided window_size (-1 = unbounded side)
    ("f", "fp32", "win64:64+seed71", "d64-s512", "h2k1"),
    ("f", "fp32", "win0:0+seed7", "d64-s512", "h2k1"),
    ("f", "fp32", "win200:-1+seed207", "d64-s512", "h2k1"),
    ("f", "fp32", "win-1:100+seed6", "d64-s512", "h2k1"),
    ("f", "fp32", "causal+win130:7+seed137", "d64-s512", "h2k1"),
    ("f", "fp32", "causal+win3:300+seed10", "d64-s512", "h2k1"),
    ("f", "fp32", "win50:20", "d64-s256x768", "h2k1"),                       # band starts late
    ("f", "fp32", "win50:20", "d64-s768x256", "h2k1"),                       # whole query tiles see no key
    ("f", "fp32", "win0:0", "d64-s640x128", "h2k1"),
    ("f", "fp32", "win40:40+cu0-100-300-480+sinks1+sinkmul2+seed9", "d64-s512", "h2k1"),
    ("b", "fp32", "win64:64", "d64-s512", "h1k1"),
    ("b", "fp32", "win30:70", "d64-s384x256", "h1k1"),
    ("b", "fp32", "win-1:50", "d64-s256x384", "h1k1"),
    ("b", "fp32", "causal+win100:-1", "d64-s256x512", "h1k1"),
    ("b", "fp32", "causal+win200:5", "d64-s384", "h1k1"),                    # causal wins over right > 0
    # ---- combinations and model-like rows
    ("b", "fp32", "causal+alibi+cap2", "d64-s256", "h8k2"),
    ("b", "fp32", "alibi+win40:40", "d64-s384", "h4k1"),
    ("b", "fp32", "causal+alibi+cap2+cu0-100-250-384", "d64-s384", "h1k1"),
    ("b", "fp32", "win50:20+cu0-37-300-384", "d64-s384", "h1k1"),
    ("f", "bf16", "causal+swa200+cap50+qmul4+seed15", "d256-s512", "h2k1"),    # Gemma-2
    ("f", "bf16", "causal+seed16", "d192v128-s256", "h4k4"),                 # DeepSeek MLA
    ("f", "bf16", "win64:64+seed17", "d64-s512", "b2h2k2"),                  # ModernBERT
    ("f", "bf16", "causal+alibi+seed18", "d64-s384", "h4k4"),                # BLOOM
    # ---- dropout (the golden regenerates the kernel's keep mask from the same seed)
    ("f", "fp32", "drop0.1+seed19", "d64-s256x640", "b2h2k1"),
    ("f", "bf16", "causal+drop0.1+seed19", "d64-s256x640", "b2h2k1"),
    ("f", "fp32", "causal+drop0.5+seed19", "d64-s256x640", "b2h2k1"),
    ("f", "bf16", "alibi+win700:100+drop0.2+seed21", "d64-s256x2560", "h4k2"),
    ("f", "fp32", "win300:0+drop0.25+seed23", "d8-s128x65792", "h1k1"),      # hash row words past key 65536
    ("f", "bf16", "drop0.1+seed22", "d64-s256", "b2h2k2"),                   # BERT-like
    ("b", "fp32", "drop0.1", "d64-s256", "h2k1"),
    ("b", "fp32", "causal+drop0.3+sinks1", "d64-s384x512", "h2k2"),
    ("b", "bf16", "alibi+cap2+win100:30+drop0.2", "d64-s256", "h1k1"),
    # ---- per-head logit scale (lscale: ``conftest.logit_scales``, different per head and batch row; the backward
    # returns its gradient last); with ALiBi in bf16 causal the forward leaves the ALiBi matmul for the exact step
    ("fb", "fp32", "lscale1", "d64-s256", "b2h2k1"),
    ("f", "bf16", "causal+alibi+lscale1", "d64-s256", "h2k1"),
    ("b", "bf16", "causal+cap2+alibi+sinks1+lscale1.5", "d64-s256", "h4k2"),
    ("b", "fp32", "causal+drop0.2+lscale1+sec128", "d64-s384", "h2k1", S),
    ("fb", "bf16", "causal+cap2+biash+lscale1", "d64-s256", "b2h2k1"),       # with the bias and its gradient
    # ---- additive bias (attn_bias; backward with its gradient, summed over the broadcast dims)
    ("fb", "fp32", "causal+biash", "d64-s256x384", "b2h4k2"),
    ("fb", "bf16", "win100:40+cap3+biasb", "d64-s384", "b2h2k1"),
    ("b", "fp16", "causal+alibi+sinks1+bias1+sec128", "d64-s512", "h2k1"),
    ("f", "bf16", "causal+alibi+biaskeys+seed3", "d64-s256", "b2h2k2"),         # with the ALiBi matmul path
    ("b", "fp32", "drop0.2+biasfull+cu0-100-250-384", "d64-s384", "b2h2k1", S),
]

# The cross product of the core axes (slow): every variant on every dtype, shape and head layout, both kernels.
PRODUCT_DTYPES = ["fp32", "bf16", "fp16-nomix"]
PRODUCT_VARIANTS = ["plain", "causal", "causal+swa100", "win64:32", "cap2+qmul2", "alibi", "causal+sinks2",
                    "cu0-100-250", "drop0.2", "causal+alibi+cap2+sinks1+drop0.1", "causal+lscale1"]
PRODUCT_SHAPES = ["d64-s256", "d128v96-s384x256"]
PRODUCT_HEADS = ["h2k2", "b2h4k1"]
PRODUCT = [(k, dt, var, shape, heads, S) for k, dt, var, shape, heads in itertools.product(
    "fb", PRODUCT_DTYPES, PRODUCT_VARIANTS, PRODUCT_SHAPES, PRODUCT_HEADS)]


def _params(kernel):
    out = []
    for row in ROWS + PRODUCT:
        kernels, dt, var, shape, heads = row[:5]
        if kernel in kernels:
            out.append(pytest.param(dt, var, shape, heads, marks=row[5:], id=f"{dt}-{var}-{shape}-{heads}"))
    return out


def _unique(params):
    seen, out = set(), []
    for p in params:  # a product row equal to a default row runs once, unmarked
        if p.id not in seen:
            seen.add(p.id)
            out.append(p)
    return out


@pytest.mark.parametrize("dtype,variant,shape,heads", _unique(_params("f")))
def test_fwd(dtype, variant, shape, heads):
    kw, sec = case_kwargs(dtype, variant, shape, heads)
    assert sec is None, "K/V sections are the backward's"
    c = Case(**kw)
    c.check_fwd(*c.fwd())


@pytest.mark.parametrize("dtype,variant,shape,heads", _unique(_params("b")))
def test_bwd(dtype, variant, shape, heads):
    kw, sec = case_kwargs(dtype, variant, shape, heads)
    c = Case(**kw)
    c.check_bwd(c.bwd(sec))


# ----------------------------------------------------------------------------------------------- fwd -> bwd
# (dtype, variant, shape, heads, exact): exact rows also run the backward on the exact forward (first bound below)
CHAIN = [
    ("fp32", "plain", "d64-s384", "h2k1", True),
    ("fp32", "causal+swa150", "d64-s384", "h2k1", True),
    ("fp32", "causal", "d64-s384", "h4k2", True),
    ("fp32", "causal+cu0-100-250-330", "d64-s384", "h2k1", True),            # rows 330.. see no key
    ("fp32", "causal+sinks2+sinkmul2", "d64-s384", "h2k1", True),
    ("bf16", "causal", "d64-s384", "h2k1", True),
    ("bf16", "causal+alibi", "d64-s256", "h2k1", False),                     # the forward's ALiBi matmul path
    ("bf16", "causal+cap2+win100:0", "d64-s256", "h1k1", False),
    ("fp32", "alibi+win60:60", "d64-s384", "h2k1", False),
    ("fp32", "causal", "d192v128-s256x384", "h1k1", False),
]


@pytest.mark.parametrize("dtype,variant,shape,heads,exact", CHAIN, ids=["-".join(r[:4]) for r in CHAIN])
def test_chain(dtype, variant, shape, heads, exact):
    """attention_fwd's own O and LSE (same variants) into attention_bwd: the backward recomputes the forward's P
    from its LSE, so kernels that form the logits differently, or a forward whose O and LSE cost the backward
    accuracy, show here. Two bounds:

    * (``exact`` rows) the chain may be at most K = 2 times the worse of the golden in the dtype and the backward
      KERNEL fed the exact forward (float64 O and LSE rounded to the kernel's dtypes), plus one rounding (the
      forward's outputs must cost the backward nothing beyond what its own arithmetic costs);
    * (every row) the usual backward criterion and band with the inputs baseline taken from exactly these O and
      LSE.
    """
    kw, _ = case_kwargs(dtype, variant, shape, heads)
    c = Case(**kw)
    o, lse = c.fwd()
    r = c.bwd_refs()
    args = list(r["args"])
    args[3], args[5] = o, lse
    grads = attention_bwd(*args, **c.bwd_kwargs())
    if exact:
        for name, got, base in zip(c.grad_names(), grads, c.bwd()):
            ref, gold = r["ref"][f"out_{name}_ref"], r["golden"][f"out_{name}_ref"]
            baseline = gold if max_err(gold, ref) >= max_err(base, ref) else base
            check_close(name, got, ref, baseline, "float32" if name in FLOAT32_GRADS else c.dtype)
    inputs = bwd_from_stats(*[as_t64(x) for x in args[:5]], as_t64(lse), c.opts, sinks=c.sinks, drop=r["drop"])
    c.check_bwd(grads, inputs=inputs)
    empty = empty_rows(lse)
    if "cu" in kw:
        assert empty.any()
        dq = np.asarray(grads[0]).astype(np.float64)
        assert np.all(dq.transpose(0, 1, 3, 2)[empty.numpy()] == 0.0)


# every score modification of conftest's TEST_MODS too: a new one needs default rows of both kernels
VARIANTS = {"causal", "swa", "win", "sinks", "cu", "scale", "drop"} | {m.token for m in TEST_MODS}


def test_default_rows_cover_every_variant_and_dtype_in_both_kernels():
    """Each variant of the vocabulary and each dtype appear in a default (not slow) row of each kernel, so trimming
    ROWS cannot silently drop one from the default run."""
    for kernel in "fb":
        rows = [r for r in ROWS if len(r) == 5 and kernel in r[0]]
        tokens = {next(n for n, pat in VARIANT_TOKENS.items() if re.fullmatch(pat, t))
                  for r in rows for t in r[2].split("+") if t != "plain"}
        assert VARIANTS <= tokens, (kernel, VARIANTS - tokens)
        assert {r[1].split("-")[0] for r in rows} == {"fp32", "bf16", "fp16"}
    assert set(VARIANT_TOKENS) == {t for r in ROWS for t in VARIANT_TOKENS
                                   if any(re.fullmatch(VARIANT_TOKENS[t], x) for x in r[2].split("+"))}


def test_every_score_modification_has_one_test_row():
    """conftest's TEST_MODS names the kernels' and the host's score modifications in their order (the order of the
    backward's gradient outputs), each row's keyword is a kernel keyword and a golden SCORE_STEPS row, and a row
    has a gradient name exactly when the kernel declares a gradient output."""
    from golden.attention_fwd_torch import SCORE_STEPS
    from nki_attn import spec
    from nki_attn.kernels import score_mods

    names = [m.name for m in TEST_MODS]
    assert names == [m.name for m in score_mods.SCORE_MODS] == [m.name for m in spec.SCORE_MODS]
    assert sorted(m.keyword for m in TEST_MODS) == sorted(row[0] for row in SCORE_STEPS)
    for m, km in zip(TEST_MODS, score_mods.SCORE_MODS):
        assert m.keyword == km.keywords[0]
        assert (m.grad is None) == (km.grad_out is None), m.name
        assert m.host.grad_flag is None or m.host.grad_flag in km.keywords, m.name
