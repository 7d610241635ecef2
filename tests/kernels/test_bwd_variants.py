"""The attention variants of issue #14 in the backward kernel (nki_attn/kernels/attention_bwd.py), on the simulator.

Soft-capping, ALiBi, two-sided ``window_size``, causal and windows with seqlen_q != seqlen_k (bottom-right),
d_qk != d_v, any head dim 1..256 (128 + remainder partition tiles), and their combinations, each against the
float64 golden (``golden.attention_bwd_torch.attention_bwd_torch_ref``) with the rule of docs/tolerances.md
(``_compare.check_close``: K * (golden error in the dtype + error of the kernel's formula from its own inputs) +
one rounding) plus the fixed absolute band; then the argument checks of the new keywords and what each variant
adds to the instruction trace. Sizes stay small: the simulator is slow and the machine is shared.
"""
import math
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import _compare  # noqa: E402
from test_attention_bwd import TORCH_DT, to_np  # noqa: E402

from golden.attention_bwd_torch import attention_bwd_torch_ref  # noqa: E402
from golden import dropout as gdrop  # noqa: E402
from golden.attention_fwd_torch import alibi_bias, compute_o_lse, packing_bounds, visibility_mask  # noqa: E402
from nki_attn import kernel_api  # noqa: E402
from nki_attn.kernels import attention_bwd as kb  # noqa: E402
from nki_attn.sim import trace  # noqa: E402

NAMES = ("dq", "dk", "dv", "dsinks")


def alibi_slopes(bs, h):
    """FlashAttention-style geometric slopes 2^(-8 (i + 1) / h), a little different per batch entry."""
    base = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], dtype=torch.float32)
    return torch.stack([base * (1.0 + 0.25 * b) for b in range(bs)])


def bwd_from_stats(q, k, v, o, dy, lse, opts, sinks=None, drop=None, compute_dtype=torch.float32):
    """The backward kernel's formula with every variant, evaluated by torch in ``compute_dtype`` from exactly the
    inputs the kernel gets (O in the input dtype, LSE in float32): the ``err_inputs`` baseline of
    docs/tolerances.md. logits = cap * tanh(scale S / cap) + ALiBi, masked by the band and packing bounds;
    P = exp(logits - LSE); D = rowsum(O * dO); dS = P (dP - D) (1 - tanh^2); dV = P^T dO; dK = scale dS^T Q;
    dQ = scale dS K (dropout: dP and the dV operand times M / (1 - p)); dsinks = -sum_rows exp(sink - LSE) D."""
    f = lambda x: torch.as_tensor(x, dtype=torch.float64).to(compute_dtype)  # noqa: E731
    q, k, v, o, dy, lse = (f(x) for x in (q, k, v, o, dy, lse))
    bs, h, d, sq = q.shape
    hk, sk = k.shape[1], k.shape[3]
    g = h // hk
    scale = 1.0 / math.sqrt(d) if opts.get("softmax_scale") is None else opts["softmax_scale"]
    qt, ot, dot = (x.transpose(-1, -2) for x in (q, o, dy))
    kt = k.transpose(-1, -2).repeat_interleave(g, dim=1)
    vt = v.transpose(-1, -2).repeat_interleave(g, dim=1)
    rows = lse.transpose(-1, -2).reshape(bs, h, sq)
    s = torch.matmul(qt, kt.transpose(-1, -2)) * scale
    cap = opts.get("softcap", 0.0)
    th = None
    if cap > 0.0:
        th = torch.tanh(s / cap)
        s = cap * th
    if opts.get("alibi_slopes") is not None:
        s = s + alibi_bias(opts["alibi_slopes"], sq, sk, torch.float32).to(compute_dtype)
    vis = visibility_mask(sq, sk, opts["use_causal_mask"], opts.get("sliding_window"), opts.get("bound_min"),
                          opts.get("bound_max"), opts.get("window_size"))
    s = s.masked_fill(~vis, float("-inf"))
    p = torch.exp(s - rows[..., None])
    dd = (ot * dot).sum(-1)
    dp = torch.matmul(dot, vt.transpose(-1, -2))
    pv = p
    if drop is not None:
        dp = dp * drop.to(compute_dtype)
        pv = p * drop.to(compute_dtype)
    ds = torch.nan_to_num(p * (dp - dd[..., None]), nan=0.0)
    if th is not None:
        ds = ds * (1.0 - th * th)
    dq = torch.matmul(ds, kt) * scale
    dk = (torch.matmul(ds.transpose(-1, -2), qt) * scale).reshape(bs, hk, g, sk, -1).sum(2)
    dv = torch.matmul(pv.transpose(-1, -2), dot).reshape(bs, hk, g, sk, -1).sum(2)
    out = {"dq": dq.transpose(-1, -2), "dk": dk.transpose(-1, -2), "dv": dv.transpose(-1, -2)}
    if sinks is not None:
        sk_ = f(sinks).reshape(bs, h, -1)
        psink = torch.exp(sk_[:, :, None, :] - rows[..., None])
        out["dsinks"] = (-(psink * dd[..., None]).sum(2)).reshape(sinks.shape)
    return {n: x.to(torch.float64).numpy() for n, x in out.items()}


class VCase:
    """Inputs of one backward call with variants, the float64 reference, the golden in the dtype, the inputs
    baseline and the kernel arguments."""

    def __init__(self, bs=1, h=1, hk=1, d=64, dv=None, sq=256, sk=None, dtype="float32", causal=False, window=None,
                 window_size=None, softcap=0.0, alibi=False, sinks=0, cu=None, scale=None, mixed=False, seed=0,
                 dropout_p=0.0, dropout_seed=(1234, 7)):
        sk = sq if sk is None else sk
        dv = d if dv is None else dv
        self.dtype = dtype
        tdt = TORCH_DT[dtype]
        gen = torch.Generator().manual_seed(seed)

        def rnd(*shape):
            return torch.randn(*shape, generator=gen, dtype=torch.float64).to(tdt).to(torch.float64)

        q, k, v, dy = rnd(bs, h, d, sq), rnd(bs, hk, d, sk), rnd(bs, hk, dv, sk), rnd(bs, h, dv, sq)
        sk_t = None
        if sinks:
            sk_t = rnd(bs, h) if sinks == 1 else rnd(bs, h, sinks)
        bmin = bmax = None
        if cu is not None:
            bmin, bmax = packing_bounds(cu, seqlen_q=sq)
        slopes = alibi_slopes(bs, h) if alibi else None
        self.opts = dict(use_causal_mask=causal, softmax_scale=scale, sliding_window=window, bound_min=bmin,
                         bound_max=bmax, softcap=softcap, alibi_slopes=slopes, window_size=window_size)
        drop = None
        bopts = dict(self.opts)
        if dropout_p > 0.0:
            seed_t = gdrop.make_seed(*dropout_seed)
            keep = gdrop.keep_mask(seed_t, dropout_p, bs, h, sq, sk)
            drop = keep.to(torch.float64) / (1.0 - dropout_p)
            bopts.update(dropout_p=dropout_p, dropout_seed=seed_t)
        o, lse, _ = compute_o_lse(q, k, v, sinks=sk_t, mixed_precision=False, dropout_mask=drop, **self.opts)
        self.opts = bopts
        self.ref = attention_bwd_torch_ref(q, k, v, o, dy, lse, sinks_ref=sk_t, **self.opts)
        low = [x.to(tdt) for x in (q, k, v, o, dy)]
        lse32 = lse.to(torch.float32)
        sk_low = None if sk_t is None else sk_t.to(tdt)
        self.golden = attention_bwd_torch_ref(*low, lse32, sinks_ref=sk_low, mixed_precision=mixed, **self.opts)
        self.fs32 = bwd_from_stats(*low, lse32, self.opts, sinks=sk_low, drop=drop)
        self.lse = lse
        self.args = [to_np(x) for x in low] + [to_np(lse32)]
        self.kwargs = dict(use_causal_mask=causal, softmax_scale=scale, sliding_window=window,
                           mixed_precision=mixed, softcap=softcap, window_size=window_size)
        if slopes is not None:
            self.kwargs["alibi_slopes"] = slopes.numpy()
        if dropout_p > 0.0:
            self.kwargs["dropout_p"] = dropout_p
            self.kwargs["dropout_seed"] = bopts["dropout_seed"].numpy()
        if sk_low is not None:
            self.kwargs["sinks_ref"] = to_np(sk_low)
        if bmin is not None:
            self.kwargs["bound_min"] = to_np(bmin)
            self.kwargs["bound_max"] = to_np(bmax)

    def run(self, **extra):
        return kernel_api.attention_bwd(*self.args, **self.kwargs, **extra)

    def check(self, out):
        assert len(out) == (4 if "sinks_ref" in self.kwargs else 3)
        for name, got in zip(NAMES, out):
            key = f"out_{name}_ref"
            _compare.check_close(name, got, self.ref[key], self.golden[key], self.dtype,
                                 inputs_err=self.fs32[name])
            _compare.absolute_band(name, got, self.ref[key], self.dtype)


def run_case(k_section_len=None, **kw):
    c = VCase(**kw)
    out = c.run(k_section_len=k_section_len)
    c.check(out)
    return c, out


def _ids(kw):
    return ",".join(f"{k}={v}" for k, v in kw.items())


# --------------------------------------------------------------------------------------------- variants
@pytest.mark.parametrize("kw", [
    dict(softcap=2.0),                                                  # capping active: |S| ~ 1..4
    dict(softcap=2.0, causal=True, scale=0.5),
    dict(softcap=1.5, sinks=2, h=4, hk=2, causal=True),                 # sinks are not capped
    dict(softcap=3.0, dtype="bfloat16", mixed=True, causal=True, h=2, hk=1, d=128),
], ids=_ids)
def test_softcap(kw):
    run_case(**kw)


@pytest.mark.parametrize("kw", [
    dict(alibi=True, causal=True, sq=256, sk=384, h=2, hk=1),           # bottom-right, seqlen_q < seqlen_k
    dict(alibi=True, causal=True, sq=384, sk=256, h=2, hk=2),           # seqlen_q > seqlen_k: empty rows
    dict(alibi=True, sq=384, sk=256, h=4, hk=1),                        # non-causal: tiles across the diagonal
    dict(alibi=True, sq=256, bs=2, h=2, hk=1, dtype="bfloat16", mixed=True),
    dict(alibi=True, softcap=2.0, causal=True, sq=256, h=2, hk=1),      # bias after the cap
], ids=_ids)
def test_alibi(kw):
    run_case(**kw)


@pytest.mark.parametrize("kw", [
    dict(window_size=(64, 64), sq=512, d=64),                           # ModernBERT-like local attention
    dict(window_size=(30, 70), sq=384, sk=256),
    dict(window_size=(-1, 50), sq=256, sk=384),
    dict(window_size=(100, -1), causal=True, sq=256, sk=512),           # causal: right side is 0
    dict(window_size=(200, 5), causal=True, sq=384),                    # right > 0 with causal: causal wins
    dict(causal=True, sq=256, sk=512),                                  # plain causal, bottom-right
    dict(causal=True, window=100, sq=384, sk=256),                      # sliding window, seqlen_q > seqlen_k
], ids=_ids)
def test_windows_and_unequal_lengths(kw):
    run_case(**kw)


def test_causal_more_queries_than_keys_gives_zero_rows():
    # seqlen_q 384 > seqlen_k 128, causal bottom-right: query rows 0..255 see no key (lse = +inf)
    c, out = run_case(causal=True, sq=384, sk=128)
    assert np.all(np.asarray(out[0])[..., :256] == 0.0)


@pytest.mark.parametrize("kw", [
    dict(d=192, dv=128, causal=True, h=2, hk=1),                        # DeepSeek MLA shape
    dict(d=192, dv=128, causal=True, h=2, hk=1, dtype="bfloat16", mixed=True, sq=384),
    dict(d=64, dv=200, sq=256),
    dict(d=199, causal=True, h=2, hk=1),                                # 128 + 71
    dict(d=72, causal=True),
    dict(d=1, sq=256),
    dict(d=256, dv=40, sinks=1),
], ids=_ids)
def test_head_dims(kw):
    run_case(**kw)


@pytest.mark.parametrize("kw", [
    dict(d=256, softcap=3.0, causal=True, window=200, sq=384, h=2, hk=1, dtype="bfloat16", mixed=True),  # Gemma-2
    dict(d=192, dv=128, alibi=True, window_size=(100, 60), sq=512, h=2, hk=1),
    dict(alibi=True, softcap=2.0, causal=True, sq=512, sk=640, dtype="bfloat16", mixed=True, sinks=1),
], ids=["gemma2-like", "mla-alibi-window", "alibi-softcap-sinks"])
def test_several_sections(kw):
    run_case(k_section_len=128, **kw)


@pytest.mark.parametrize("kw", [
    dict(h=8, hk=2, softcap=2.0, alibi=True, causal=True, sq=256),
    dict(h=4, hk=1, window_size=(40, 40), sq=384, alibi=True),
    dict(cu=[0, 100, 250, 384], sq=384, causal=True, alibi=True, softcap=2.0),   # packing + variants
    dict(cu=[0, 37, 300, 384], sq=384, window_size=(50, 20)),                    # packing + two-sided window
], ids=["gqa-cap-alibi", "gqa-window-alibi", "packing-alibi-cap", "packing-window"])
def test_combinations(kw):
    run_case(**kw)


@pytest.mark.parametrize("kw", [
    dict(dropout_p=0.1, d=64, sq=256, h=2, hk=1),                       # BERT-like
    dict(dropout_p=0.3, causal=True, sq=384, sk=512, h=2, hk=2, sinks=1),
    dict(dropout_p=0.2, softcap=2.0, alibi=True, window_size=(100, 30), sq=256, dtype="bfloat16", mixed=True),
], ids=_ids)
def test_dropout(kw):
    run_case(**kw)


def test_dropout_sections_and_seed():
    c = VCase(dropout_p=0.25, causal=True, sq=384, h=2, hk=1)
    out = c.run(k_section_len=128)
    c.check(out)
    # another seed gives other gradients (the mask is really applied)
    other = VCase(dropout_p=0.25, causal=True, sq=384, h=2, hk=1, dropout_seed=(99, 0))
    assert not np.array_equal(np.asarray(other.run()[2]), np.asarray(out[2]))


@pytest.mark.parametrize("kw", [
    dict(alibi=True, causal=True, h=2, hk=1, dtype="bfloat16", mixed=True),   # the forward's ALiBi matmul path
    dict(softcap=2.0, causal=True, window_size=(100, 0), dtype="bfloat16", mixed=True),
    dict(alibi=True, window_size=(60, 60), sq=384, h=2, hk=1),
    dict(d=192, dv=128, causal=True, sq=256, sk=384),
], ids=_ids)
def test_after_the_forward_kernel(kw):
    """attention_fwd's own O and LSE (same variants) into attention_bwd: the backward recomputes
    the forward's P from its LSE, so a forward and backward that form the logits differently would show here.
    The inputs baseline is the kernel formula from exactly these O and LSE."""
    c = VCase(**kw)
    fkw = {k: v for k, v in c.kwargs.items() if k != "mixed_precision"}
    o, lse = kernel_api.attention_fwd(*c.args[:3], mixed_precision=bool(kw.get("mixed", False)), **fkw)
    c.args[3] = o
    c.args[5] = lse
    c.fs32 = bwd_from_stats(*[_compare.as_t64(x) for x in c.args[:5]], _compare.as_t64(lse), c.opts,
                            sinks=c.kwargs.get("sinks_ref"))
    c.check(c.run())


# --------------------------------------------------------------------------------------------- trace
def _instrs(rec):
    out = {}
    for r in rec.records:
        out[r.instr] = out.get(r.instr, 0) + 1
    return out


def test_variants_add_their_steps_only():
    base = VCase(causal=True, sq=256, h=2, hk=1)
    with trace.recording() as rec0:
        base.run()
    cap = VCase(causal=True, sq=256, h=2, hk=1, softcap=2.0)
    with trace.recording() as rec1:
        cap.run()
    ali = VCase(causal=True, sq=256, h=2, hk=1, alibi=True)
    with trace.recording() as rec2:
        ali.run()
    i0, i1, i2 = _instrs(rec0), _instrs(rec1), _instrs(rec2)
    # one exp per visit: the only activations with a tensor bias (-LSE)
    visits = sum(1 for r in rec0.records if r.instr == "activation" and len(r.srcs) == 2)
    assert visits > 0 and "iota" not in i0
    # soft-capping: one tanh activation per visit, one t^2 (GpSimdE) and one VectorE op per visit
    assert i1["activation"] == i0["activation"] + visits
    assert i1["tensor_tensor"] == i0.get("tensor_tensor", 0) + visits
    assert i1["scalar_tensor_tensor"] == i0["scalar_tensor_tensor"] + visits
    # ALiBi: one iota and one VectorE op per visit (causal: no tile needs |x|), two ops per work item
    assert i2["iota"] == visits
    assert i2["scalar_tensor_tensor"] == i0["scalar_tensor_tensor"] + visits
    assert i2["nc_matmul"] == i0["nc_matmul"]


@pytest.mark.parametrize("kw", [
    dict(sq=1024, window_size=(64, 64)),
    dict(sq=640, sk=1152, window_size=(300, 100), section=256),
    dict(sq=1152, sk=640, causal=True, window_size=(200, -1)),
    dict(sq=768, sk=512, causal=True, window=130, section=384),
    dict(sq=512, sk=896, window_size=(-1, 0)),
    dict(sq=384, sk=128, causal=True),                                   # query tiles that see no key
], ids=_ids)
def test_plan_follows_the_band(kw):
    """The trace-time plan visits exactly the 128-key chunks holding a visible (query, key) pair of the golden's
    visibility matrix, and flags an element mask exactly where a visited chunk run holds an invisible pair on
    that side of the band (brute force, no error bound)."""
    sq, sk = kw["sq"], kw.get("sk", kw["sq"])
    cfg = kb._configure(np.zeros((1, 1, 64, sq), np.float32), np.zeros((1, 1, 64, sk), np.float32), None, None,
                        kw.get("causal", False), False, None, kw.get("window"), kw.get("section"),
                        window_size=kw.get("window_size"))
    vis = visibility_mask(sq, sk, kw.get("causal", False), kw.get("window"), None, None,
                          kw.get("window_size")).numpy()
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    above = j > i + cfg.hi_rel   # invisible by the band's upper side
    below = j < i + cfg.lo_rel   # invisible by its lower side
    assert np.array_equal(vis, ~(above | below))
    for s, (k_lo, k_len) in enumerate(cfg.sections):
        for qt in range(cfg.nq):
            rows = slice(qt * 128, (qt + 1) * 128)
            want = [c for c in range(k_lo, k_lo + k_len, 128) if vis[rows, c:c + 128].any()]
            got = [c for tile in cfg.tiles[s][qt] for c in range(tile[0], tile[0] + tile[1], 128)]
            assert got == want, (s, qt)
            for k0, kw_, cmask, wmask in cfg.tiles[s][qt]:
                assert cmask == bool(above[rows, k0:k0 + kw_].any())
                assert wmask == bool(below[rows, k0:k0 + kw_].any())
    for qt in range(cfg.nq):
        sees = bool(vis[qt * 128:(qt + 1) * 128].any())
        assert (qt in cfg.no_key_tiles) == (not sees)


def test_window_cost_is_linear_in_seqlen():
    counts = []
    for sq in (1024, 2048):
        c = kb._configure(np.zeros((1, 1, 64, sq), np.float32), np.zeros((1, 1, 64, sq), np.float32), None, None,
                          False, False, None, None, None, window_size=(64, 64))
        counts.append(sum(len(t) for row in c.tiles for t in row))
        chunks = sum(tile[1] // 128 for row in c.tiles for t in row for tile in t)
        # every visible 128-key chunk of a (64, 64) window: at most 3 per query tile
        assert chunks <= 3 * (sq // 128)
    assert counts[1] <= 2 * counts[0] + 2


# --------------------------------------------------------------------------------------------- validation
def _arrays(d=64, dv=None, sq=128, sk=None, h=1):
    sk = sq if sk is None else sk
    dv = d if dv is None else dv
    z = lambda *s: np.zeros(s, dtype=np.float32)  # noqa: E731
    return dict(q_ref=z(1, h, d, sq), k_ref=z(1, 1, d, sk), v_ref=z(1, 1, dv, sk), o_ref=z(1, h, dv, sq),
                dy_ref=z(1, h, dv, sq), lse_ref=np.zeros((1, h, 128, sq // 128), np.float32))


@pytest.mark.parametrize("change,match", [
    (dict(softcap=-1.0), "softcap=-1.0 must be a finite number >= 0"),
    (dict(alibi_slopes=np.zeros((1, 2), np.float32)), "alibi_slopes shape"),
    (dict(alibi_slopes=np.zeros((1, 1), np.float16)), "alibi_slopes dtype"),
    (dict(window_size=(-2, 0)), "window_size"),
    (dict(window_size=(4, 4), sliding_window=4, use_causal_mask=True), "both given"),
    (dict(v_ref=np.zeros((1, 1, 64, 256), np.float32)), "v shape"),
    (dict(o_ref=np.zeros((1, 1, 32, 128), np.float32)), "o shape"),
    (dict(dropout_p=1.5), "dropout_p=1.5 must be a number in"),
    (dict(dropout_p=0.1), "needs dropout_seed"),
    (dict(dropout_p=0.1, dropout_seed=np.zeros(2, np.float32)), "dropout_seed dtype"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_validation_errors(change, match):
    args = _arrays()
    args.update(change)
    with pytest.raises(ValueError, match=match) as host:
        kernel_api.attention_bwd(**args)
    with trace.recording() as rec, pytest.raises(AssertionError) as kernel:
        kb.attention_bwd(**args)
    assert str(kernel.value) == str(host.value)
    assert rec.count() == 0


def test_head_dim_limits():
    with pytest.raises(ValueError, match="d_v=257 exceeds the supported maximum 256"):
        kernel_api.attention_bwd(**_arrays(dv=257))
    with pytest.raises(ValueError, match="d_head=300 exceeds"):
        kernel_api.attention_bwd(**_arrays(d=300))


def test_new_keywords_before_k_section_len():
    import inspect
    names = list(inspect.signature(kb.attention_bwd.fn).parameters)
    assert names[-6:] == ["softcap", "alibi_slopes", "window_size", "dropout_p", "dropout_seed", "k_section_len"]
