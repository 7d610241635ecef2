"""The backward's streamed keys (``attention_bwd.streamed_keys``, keyword ``stream_keys``) and transposed dQ / dK
of the partial Q/K head-dim tile (``attention_bwd.transposed_qk_grads``, keyword ``qk_transposed``): the rules
stream the keys of every launch and transpose the partial tile where it streams fewer TensorE columns and a query
tile's band spans more than two 128-key chunks; both move work and change no gradient bit (the transposes are
exact and every PSUM element sums the same products in the same matmul order), on one section and across
sections (the dQ partial sums reloaded transposed), on every target, under the simulator's SBUF / PSUM capacity
check; and the transposed tile saves the TensorE columns the rule counts on."""
import ml_dtypes
import numpy as np
import pytest

from nki_attn.kernels import attention_bwd as kb
from nki_attn.kernels.steps import head_dim_tiles
from nki_attn.sim import trace

from .conftest import to_np


@pytest.mark.parametrize("d_qk, d_v, expected", [(192, 128, True), (64, 200, True), (40, 256, True),
                                                 (199, 72, True), (256, 40, False), (128, 64, False),
                                                 (64, 64, True), (96, 96, True), (128, 128, False),
                                                 (192, 192, True), (256, 256, False)])
def test_rule(d_qk, d_v, expected):
    # columns per 128-key chunk, transposed (each Q/K tile's rows, at least 64) against untransposed (128 per
    # tile): 192 : 256, 64 : 128, 64 : 128 (40 rows cost 64), 199 : 256, 256 : 256, 128 : 128, 96 : 128; d_v
    # plays no part
    assert kb.transposed_qk_grads(d_qk, d_v, head_dim_tiles(d_qk)) == expected


@pytest.mark.parametrize("tile_keys, expected", [(None, True), (4096, True), (257, True), (256, False),
                                                 (255, False), (128, False)])
def test_rule_needs_more_than_two_chunks_per_query_tile(tile_keys, expected):
    # a sliding window of 128 spans 255 keys per 128-query tile (two chunks, three where misaligned): too few saved
    # columns per member for its dQ transposes; a window of 256 spans 383
    assert kb.transposed_qk_grads(64, 64, head_dim_tiles(64), tile_keys) == expected
    assert kb.transposed_qk_grads(192, 128, head_dim_tiles(192), tile_keys) == expected


def test_narrow_window_keeps_the_untransposed_products_and_streams(target):
    import types

    def t(*shape):
        return types.SimpleNamespace(shape=shape, dtype="bfloat16")

    target("trn2")
    q, k, lse = t(1, 8, 64, 2048), t(1, 1, 64, 2048), t(1, 8, 2048, 1)
    for window, trans in ((128, False), (129, False), (256, True)):
        c = kb._configure(q, k, None, None, True, True, None, window, None)
        assert c.stream and c.qk_trans == trans and c.qk_t == [trans]
    c = kb._configure(q, k, None, None, True, True, None, None, None, stream_keys=False)
    assert not c.stream and not c.qk_trans
    c = kb._configure(q, k, None, None, True, True, None, None, None, qk_transposed=False)
    assert c.stream and not c.qk_trans


def _inputs(dtype, h, hkv, d_qk, d_v, sq, sk, seed=5):
    import torch
    g = torch.Generator().manual_seed(seed)
    tdt = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    q = torch.randn(1, h, d_qk, sq, generator=g).to(tdt)
    k = torch.randn(1, hkv, d_qk, sk, generator=g).to(tdt)
    v = torch.randn(1, hkv, d_v, sk, generator=g).to(tdt)
    dy = torch.randn(1, h, d_v, sq, generator=g).to(tdt)
    return q, k, v, dy


def _run(x, fkw, **kw):
    from golden.attention_fwd_torch import attention_fwd_torch_ref
    q, k, v, dy = x
    o, lse = attention_fwd_torch_ref(q, k, v, **fkw)
    with trace.recording() as rec:
        out = kb.attention_bwd(to_np(q), to_np(k), to_np(v), to_np(o), to_np(dy), to_np(lse.float()), **fkw, **kw)
    return [np.asarray(t) for t in out], rec.records


def _ops(rec):
    return [(r.engine, r.instr) for r in rec]


def _narrow_tensor_matmuls(rec, rn=64):
    # the transposed dK / dQ matmuls of an rn-row Q/K tile write [128, rn]; the untransposed ones write [rn, N]
    return sum(1 for r in rec if r.instr == "nc_matmul" and r.dst.shape == (128, rn))


CASES = [
    # (target, dtype, heads, kv heads, d_qk, d_v, seqlen_q, seqlen_k, forward keywords, kernel keywords)
    ("trn2", "bfloat16", 2, 1, 192, 128, 512, 512, dict(use_causal_mask=True), dict(mixed_precision=True)),
    ("trn2", "bfloat16", 2, 1, 192, 128, 512, 512, dict(use_causal_mask=True),
     dict(mixed_precision=True, k_section_len=128)),                     # fp32 dQ scratch, reloaded transposed
    ("trn3", "bfloat16", 1, 1, 192, 128, 384, 640, dict(use_causal_mask=True), dict(k_section_len=256)),
    ("trn1", "float32", 2, 1, 192, 128, 512, 512, dict(window_size=(100, 60)), dict(k_section_len=128)),
    ("trn2", "float32", 1, 1, 64, 200, 384, 384, dict(), dict()),
    # keys 0..703 seen by no query (zero dK / dV, 704 keys: more than one zero tile's 512)
    # (a band this narrow keeps the untransposed products by the rule: forced on)
    ("trn2", "bfloat16", 1, 1, 192, 128, 256, 1024, dict(window_size=(64, 0)),
     dict(mixed_precision=True, qk_transposed=True)),
    ("trn2", "bfloat16", 2, 1, 64, 64, 512, 512, dict(use_causal_mask=True), dict(mixed_precision=True)),
    ("trn1", "float32", 2, 1, 96, 96, 384, 384, dict(), dict(k_section_len=128)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-d{c[4]}v{c[5]}-{len(c[9])}kw")
def test_transposed_is_bit_identical_to_untransposed(case, target):
    tgt, dtype, h, hkv, d_qk, d_v, sq, sk, fkw, kw = case
    target(tgt)
    x = _inputs(dtype, h, hkv, d_qk, d_v, sq, sk)
    got, rec1 = _run(x, fkw, **kw)                         # the rules: streamed keys, transposed partial tile
    base, rec0 = _run(x, fkw, **dict(kw, qk_transposed=False))
    old, rec2 = _run(x, fkw, **dict(kw, qk_transposed=False, stream_keys=False))
    assert len(got) == len(base) == len(old) == 3
    for a, b, o in zip(got, base, old):
        assert a.dtype == b.dtype == o.dtype
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
        assert np.array_equal(a.view(np.uint8), o.view(np.uint8))
    assert len(rec1) != len(rec0) and _ops(rec0) != _ops(rec2)
    if fkw.get("window_size") == (64, 0):
        assert not np.any(got[1][..., :704].astype(np.float32)) and np.any(got[1][..., 704:].astype(np.float32))
    rn = d_qk % 128
    assert _narrow_tensor_matmuls(rec1, rn) > 0 and _narrow_tensor_matmuls(rec0, rn) == 0


@pytest.mark.parametrize("d", [64, 128, 256])
def test_streamed_keys_are_bit_identical_to_the_section_loads(d, target):
    # the streamed keys (on by the rule) against K / V loaded per section and dK / dV stored at its end: the same
    # gradients; d 64 also transposes its partial tile, d 128 and 256 have none (they stream 128 columns either
    # way), so only the order of their instructions changes
    target("trn2")
    x = _inputs("bfloat16", 2, 1, d, d, 512, 512, seed=9)
    got, rec1 = _run(x, dict(use_causal_mask=True), mixed_precision=True)
    base, rec0 = _run(x, dict(use_causal_mask=True), mixed_precision=True, stream_keys=False)
    for a, b in zip(got, base):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    assert _ops(rec1) != _ops(rec0)
    assert (_narrow_tensor_matmuls(rec1) > 0) == (d == 64)


def test_transposed_saves_the_columns_the_rule_counts(target):
    # MLA 192 / 128, causal, one head, 1024 tokens: 36 visible (query tile, 128-key chunk) pairs. Per pair the
    # dK and dQ matmuls stream 128 + 64 columns transposed instead of 2 x 128: 2 x 64 x 36 fewer matmul columns
    target("trn2")
    x = _inputs("bfloat16", 1, 1, 192, 128, 1024, 1024)
    _, rec1 = _run(x, dict(use_causal_mask=True), mixed_precision=True)
    _, rec0 = _run(x, dict(use_causal_mask=True), mixed_precision=True, qk_transposed=False)

    def matmul_columns(rec):
        return sum(r.dst.shape[1] for r in rec if r.instr == "nc_matmul")

    assert matmul_columns(rec0) - matmul_columns(rec1) == 2 * 64 * 36
    # the price: one transpose of the 64-row tile per member for dQ (8 members) and per 128-key chunk for dK (8
    # chunks); the full 128-row tile is not transposed (no columns to save), and K^T is formed by key tile
    # instead of per section, the same transposes
    transposes = [sum(1 for r in rec if r.instr == "nc_transpose") for rec in (rec0, rec1)]
    assert transposes[1] - transposes[0] == 8 + 8


def test_keyword_is_checked():
    q = np.zeros((1, 1, 192, 128), dtype=ml_dtypes.bfloat16)
    k = np.zeros((1, 1, 192, 128), dtype=ml_dtypes.bfloat16)
    v = np.zeros((1, 1, 128, 128), dtype=ml_dtypes.bfloat16)
    lse = np.zeros((1, 1, 128, 1), dtype=np.float32)
    with pytest.raises(AssertionError, match=r"qk_transposed=1 must be None \(the default\), True or False"):
        kb.attention_bwd(q, k, v, v, v, lse, qk_transposed=1)
    with pytest.raises(AssertionError, match=r"stream_keys=0 must be None \(the default\), True or False"):
        kb.attention_bwd(q, k, v, v, v, lse, stream_keys=0)
    with pytest.raises(AssertionError, match=r"qk_transposed=True needs the streamed keys"):
        kb.attention_bwd(q, k, v, v, v, lse, qk_transposed=True, stream_keys=False)


def test_rule_falls_back_where_its_buffers_do_not_fit(target):
    # the transposed path adds SBUF (the dQ copies and dK staging tiles in flight) and saves some (its dK
    # accumulator); the rule takes it only where the budget check passes with it, so it never refuses a launch
    # the untransposed path takes: float32 MLA with 16 query heads per kv head at 16384 tokens on trn1 falls back
    import types

    def t(*shape, dt="float32"):
        return types.SimpleNamespace(shape=shape, dtype=dt)

    def shapes(h, s, dt):
        return t(1, h, 192, s, dt=dt), t(1, 1, 192, s, dt=dt), t(1, 1, 128, s, dt=dt), t(1, h, 128, s, dt=dt), \
            t(1, h, 128, s // 128)

    target("trn1")
    q, k, v, o, lse = shapes(16, 16384, "float32")
    assert kb.bwd_problem(q, k, v, o, o, lse, use_causal_mask=True) is None
    c = kb._configure(q, k, None, None, True, False, None, None, None, v)
    assert c.stream and not c.qk_trans    # (the streamed keys add no SBUF: they stay)
    assert "SBUF bytes per partition" in kb.bwd_problem(q, k, v, o, o, lse, use_causal_mask=True, qk_transposed=True)
    q, k, v, o, lse = shapes(1, 4096, "float32")
    assert kb._configure(q, k, None, None, True, False, None, None, None, v).qk_trans
    target("trn2")
    q, k, v, o, lse = shapes(16, 16384, "bfloat16")
    assert kb.bwd_problem(q, k, v, o, o, lse, use_causal_mask=True, mixed_precision=True) is None
    assert kb._configure(q, k, None, None, True, True, None, None, None, v).qk_trans
