"""``flex_attention`` with block masks: forward and backward against the float64 definition with the dense mask
(the harness's two rules, ``_reference.judge``), the forward against torch's own FlexAttention on CPU (same
mask_mod, same inputs), score-mod markers, GQA, empty rows, compile / FakeTensor, and bad input."""
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import nki_attn
from nki_attn import flex, masks, ops
from nki_attn.block_mask import create_block_mask

from ._reference import dense_attention, from_stats, judge, run
from .test_block_mask import _dense, _random_blocks

torch.set_num_threads(1)

def _ids(n):
    """Document ids of n tokens: 4 documents of unequal length (cuts at 30 %, 73 %, 85 %)."""
    i = torch.arange(n)
    return (i >= n * 30 // 100).long() + (i >= n * 73 // 100).long() + (i >= n * 85 // 100).long()


def _mask_cases(sq, sk):
    """name -> (mask_mod, B extent (None: broadcast), H extent)."""
    n = max(sq, sk)
    ids = _ids(n)
    ids2 = torch.stack([ids, (torch.arange(n) >= n // 2).long()])
    return {
        "causal": (masks.causal_mask, None, None),
        "sliding_window": (masks.sliding_window(100), None, None),
        "document": (masks.and_masks(masks.causal_mask, masks.document(ids2)), 2, None),
        "prefix_lm": (masks.prefix_lm(torch.tensor([37, 150])), 2, None),
        "chunked_local": (masks.chunked_local(64), None, None),
        "dilated": (masks.dilated(3, window=40), None, None),
        "or_masks": (masks.or_masks(masks.sliding_window(20), masks.document(ids)), None, None),
        "random": (_random_blocks(5, 0.5, sq, sk, 2, 4), 2, 4),
        "empty_rows": (lambda b, h, q, kv: (q >= 140) & (kv <= q - 140), None, None),
        # broadcast random blocks: the union classes are the blocks' own, so key tiles hold FULL, SKIP and
        # element-level PARTIAL chunks side by side (the mask steps' segments; SKIP chunks inside a tile's run)
        "random_mixed": (_broadcast(_random_blocks(11, 0.6, sq, sk)), None, None),
        # every 512-key tile: PARTIAL (one pattern), SKIP, PARTIAL (another pattern), FULL chunks; the backward
        # splits the tile at the SKIP chunk, so its second visit starts inside the tile and must read the second
        # PARTIAL chunk's bitmap slot, not the first's
        "partial_gap_partial": (_partial_gap_partial, None, None),
        # every 512-key tile with SKIP chunks between visible ones, each chunk class at each position of a
        # split tile (``_split_runs``): the forward computes only the runs, the backward visits each run
        "split_runs": (_split_runs, None, None),
        # FlexAttention's benchmark pattern: 50 % of the blocks FULL, the rest SKIP, no bitmap anywhere
        "random_full_skip": (_full_skip_blocks(7, 0.5, sq, sk), None, None),
        "sliding_window_two_sided": (masks.sliding_window(150, causal=False), None, None),
        "chunked_local_bidirectional": (masks.chunked_local(200, causal=False), None, None),
        "dilated_two_sided": (masks.dilated(4, window=60, causal=False), None, None),
        # Llama 4's chunked local attention (causal within chunks) with per-batch documents on top
        "chunked_local_documents": (masks.and_masks(masks.chunked_local(256), masks.document(ids2)), 2, None),
    }


def _partial_gap_partial(b, h, q, kv):
    """Chunk classes PARTIAL, SKIP, PARTIAL, FULL in every 512-key tile, the two PARTIAL chunks with different
    element patterns."""
    c = (kv // 128) % 4
    first = (q + kv) % 3 != 0
    third = (q * 7 + kv) % 5 < 2
    return ((c == 0) & first) | ((c == 2) & third) | (c == 3)


def _split_patterns():
    """Every class pattern of a 512-key tile (4 chunks: 0 SKIP, 1 PARTIAL, 2 FULL) whose non-SKIP chunks form two
    runs or more: 28 patterns, so each of PARTIAL and FULL sits at each position of a split tile, first and
    second run, beside SKIP chunks on either side."""
    out = []
    for code in range(81):
        p = [(code // 3 ** i) % 3 for i in range(4)]
        on = [c != 0 for c in p]
        runs = sum(1 for i in range(4) if on[i] and (i == 0 or not on[i - 1]))
        if runs >= 2:
            out.append(p)
    return out


def _split_runs(b, h, q, kv):
    """Query tile t, key tile j (of 7) gets pattern ``7 t + j`` of ``_split_patterns`` (4 query tiles x 7 key
    tiles: sq = 512, sk = 3584). A PARTIAL chunk's element pattern depends on the chunk (a period of 2 to 4 keys,
    shifted by the row), so reading another PARTIAL chunk's bitmap slot changes the result."""
    pats = torch.tensor(_split_patterns())  # [28, 4]
    t = q // 128
    c = kv // 128
    cls = pats[t * 7 + c // 4, c % 4]
    period = c % 3 + 2
    elem = (q * (c % 5 + 1) + kv) % period != 0
    return (cls == 2) | ((cls == 1) & elem)


def _broadcast(mm):
    """``mm`` (defined for b = h = 0) for every batch element and head: torch's FlexAttention evaluates a
    broadcast mask_mod at the call's own b and h."""
    def broadcast_mask(b, h, q, kv):
        return mm(b * 0, h * 0, q, kv)
    return broadcast_mask


def _full_skip_blocks(seed, density, sq, sk):
    """A random mask_mod whose 128 x 128 blocks are all visible (probability ``density``) or all hidden."""
    g = torch.Generator().manual_seed(seed)
    on = torch.rand(-(-sq // 128), -(-sk // 128), generator=g) < density

    def full_skip_mask(b, h, q, kv):
        return on[q // 128, kv // 128]
    return full_skip_mask


def _has_segments(bm, kinds):
    """True when some key tile's run (kernels' 512-key tiles) holds chunks of every union class in ``kinds``."""
    from nki_attn.kernels import band
    (_, _, rows), _ = bm.kernel_operands()
    n = len(rows[0]) * 128
    for r in rows:
        for t0 in range(0, n, 512):
            kt = band.block_key_tile(r, t0, min(t0 + 512, n))
            if kt.kind == band.PARTIAL and kinds <= {r[c] for c in range(kt.k0 // 128, kt.k1 // 128)}:
                return True
    return False


def _qkv(b, hq, hk, sq, sk, d, dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=g).to(dtype)
    k = torch.randn(b, hk, sk, d, generator=g).to(dtype)
    v = torch.randn(b, hk, sk, dv, generator=g).to(dtype)
    return q, k, v


def check_fwd_bwd(name, dtype, sq=300, sk=300, hq=4, hk=2, d=32, dv=24, score_mod=None, cap=0.0, slopes=None):
    mm, nb, nh = _mask_cases(sq, sk)[name]
    b = 2
    bm = create_block_mask(mm, nb, nh, sq, sk)
    dense = _dense(mm, nb or 1, nh or 1, sq, sk)
    q, k, v = _qkv(b, hq, hk, sq, sk, d, dv, dtype, seed=len(name))
    dout = torch.randn(b, hq, sq, dv, generator=torch.Generator().manual_seed(9)).to(dtype)
    scale = 1.0 / math.sqrt(d)

    def ours(q, k, v):
        return flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=hq != hk, return_lse=True)

    def ref(q, k, v):
        return dense_attention(q, k, v, dense, scale, cap, slopes)

    got = run(ours, q, k, v, dout)
    truth = run(ref, q.double(), k.double(), v.double(), dout.double())
    base = run(ref, q, k, v, dout)
    inputs = from_stats(q, k, v, got[0], got[1], dout, dense, scale, cap, slopes)
    grp = hq // hk
    for i, (what, n) in enumerate((("out", sk), ("lse", sk), ("dq", sk), ("dk", sq * grp), ("dv", sq * grp))):
        judge(what, got[i], truth[i], base[i], dtype, n, inputs=inputs[i - 2] if i >= 2 else None,
              vec_axis=None if what == "lse" else 3)
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["document", "random", "empty_rows"])
def test_fwd_bwd_match_the_dense_golden(name, dtype):
    got = check_fwd_bwd(name, dtype)
    if name == "empty_rows":
        assert torch.isinf(got[1][:, :, :140]).all() and bool((got[0][:, :, :140] == 0).all())
        assert bool((got[2][:, :, :140] == 0).all())


@pytest.mark.slow
def test_fwd_bwd_full_and_skip_chunks_inside_key_tiles():
    """FlexAttention's benchmark pattern (FULL / SKIP blocks only): key tiles whose runs hold SKIP chunks, masked
    without any bitmap (the kernels get no store), forward and backward."""
    sq, sk = 256, 768
    mm, nb, nh = _mask_cases(sq, sk)["random_full_skip"]
    bm = create_block_mask(mm, nb, nh, sq, sk)
    assert _has_segments(bm, {0, 2}) and bm.kernel_operands()[1] is None
    check_fwd_bwd("random_full_skip", torch.float32, sq=sq, sk=sk)


def test_forward_mixed_chunk_classes_inside_key_tiles():
    """Key tiles whose runs mix FULL, SKIP and PARTIAL chunks (each masked by its own class): the forward
    against the dense definition and against torch's own flex_attention."""
    sq, sk = 384, 1024
    mm, nb, nh = _mask_cases(sq, sk)["random_mixed"]
    assert _has_segments(create_block_mask(mm, nb, nh, sq, sk), {0, 1, 2})
    check_vs_torch("random_mixed", sq=sq, sk=sk)


def test_fwd_bwd_mixed_chunk_classes_inside_key_tiles():
    """The same mask forward and backward: a group of the backward whose members' key runs leave a chunk of
    their 512-key tile between them that none of its matmuls writes (chunk 2 of this layout) evicts only the
    chunks it wrote."""
    check_fwd_bwd("random_mixed", torch.float32, sq=384, sk=1024)


def test_fwd_bwd_tile_split_at_a_skip_chunk_reads_its_own_bits():
    """A key tile whose chunks are PARTIAL, SKIP, PARTIAL, FULL: the backward visits it as two runs, and the
    second run's PARTIAL chunk is masked by its own bits (its slot counted from the key tile's first chunk)."""
    from nki_attn.kernels import band
    mm, nb, nh = _mask_cases(256, 512)["partial_gap_partial"]
    (_, _, rows), _ = create_block_mask(mm, nb, nh, 256, 512).kernel_operands()
    assert [list(r) for r in rows] == [[band.BLOCK_PARTIAL, band.BLOCK_SKIP, band.BLOCK_PARTIAL, band.BLOCK_FULL]] * 2
    check_fwd_bwd("partial_gap_partial", torch.float32, sq=256, sk=512)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fwd_bwd_split_key_tiles_visit_only_their_runs(dtype):
    """Key tiles split at SKIP chunks, every PARTIAL / FULL chunk at every position of the split tile (first or
    second run, next to a SKIP chunk on either side): forward and backward against the float64 definition.
    A forward that computed a SKIP chunk unmasked, dropped a run, or read a PARTIAL chunk's bits from another
    chunk's slot (counted from the run instead of the key tile's first chunk) gives other outputs."""
    from nki_attn.kernels import band
    sq, sk = 512, 3584
    mm, nb, nh = _mask_cases(sq, sk)["split_runs"]
    (_, _, rows), bits = create_block_mask(mm, nb, nh, sq, sk).kernel_operands()
    pats = _split_patterns()
    assert len(pats) == 28 and bits is not None
    seen = set()
    for t in range(4):
        for j in range(7):
            assert list(rows[t][4 * j:4 * j + 4]) == pats[7 * t + j]
            kt = band.block_key_tile(rows[t], 512 * j, 512 * j + 512)
            assert kt.runs is not None and len(kt.runs) >= 2
            for c in range(4):
                seen.add((c, pats[7 * t + j][c]))
    assert seen == {(c, k) for c in range(4) for k in range(3)}
    # its visits average at most half a key tile: the backward runs its deeper pipeline (stages B and D later)
    from nki_attn.kernels import attention_bwd as bwd
    assert bwd._narrow_visit_lags(rows) == (2 * bwd.PIPE_LAG_B, 2 * bwd.PIPE_LAG_D)
    check_fwd_bwd("split_runs", dtype, sq=sq, sk=sk, hq=2, hk=1)


def test_narrow_visit_lags_only_for_narrow_visits():
    """The backward's deeper pipeline is for masks whose visits average at most two chunks: whole key tiles and
    3-chunk runs keep the defaults, as does a mask with no visible key."""
    from nki_attn.kernels import attention_bwd as bwd
    deep = (2 * bwd.PIPE_LAG_B, 2 * bwd.PIPE_LAG_D)
    assert bwd._narrow_visit_lags([[2, 2, 2, 2, 0, 0, 0, 0]]) is None
    assert bwd._narrow_visit_lags([[2, 2, 2, 0, 1, 2, 1, 0]]) is None      # runs of 3 chunks
    assert bwd._narrow_visit_lags([[2, 2, 0, 0, 0, 1, 2, 0]]) == deep      # runs of 2 chunks
    assert bwd._narrow_visit_lags([[2, 0, 2, 0, 2, 2, 2, 2]]) == deep      # 6 chunks in 3 visits
    assert bwd._narrow_visit_lags([[2, 0, 2, 2, 2, 2, 2, 2]]) is None      # 7 chunks in 3 visits
    assert bwd._narrow_visit_lags([[0, 0, 0, 0]]) is None


def test_split_key_tiles_with_score_mods():
    """The same split tiles with soft-capping and ALiBi: each run goes through the score steps as its own tile
    (the ALiBi distances are the run's keys, not the columns of the runs back to back), forward and backward."""
    slopes = torch.tensor([0.5, 0.25])
    check_fwd_bwd("split_runs", torch.float32, sq=512, sk=3584, hq=2, hk=1,
                  score_mod=[flex.softcap(3.0), flex.alibi(slopes)], cap=3.0, slopes=slopes)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["causal", "sliding_window", "prefix_lm", "chunked_local", "dilated", "or_masks",
                                  "random_full_skip", "sliding_window_two_sided", "chunked_local_bidirectional",
                                  "dilated_two_sided", "chunked_local_documents"])
def test_fwd_bwd_every_prebuilt_mask(name, dtype):
    check_fwd_bwd(name, dtype, sq=384, sk=640)


def test_score_mod_markers_compose_with_the_block_mask():
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    check_fwd_bwd("document", torch.float32, score_mod=[flex.softcap(3.0), flex.alibi(slopes)], cap=3.0,
                  slopes=slopes)


def _torch_flex(mm, nb, nh, q, k, v, enable_gqa):
    from torch.nn.attention.flex_attention import create_block_mask as t_cbm
    from torch.nn.attention.flex_attention import flex_attention as t_flex
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tb = t_cbm(mm, nb, nh, q.shape[2], k.shape[2], device="cpu")
        return t_flex(q, k, v, block_mask=tb, enable_gqa=enable_gqa, return_lse=True)


def check_vs_torch(name, sq=300, sk=300, dtype=torch.float32):
    """Ours against torch's own flex_attention on CPU, same mask_mod and inputs (GQA 4 / 2): judged with
    torch's result as the baseline of the harness's rule (the float64 dense definition the truth)."""
    mm, nb, nh = _mask_cases(sq, sk)[name]
    q, k, v = _qkv(2, 4, 2, sq, sk, 32, 32, dtype, seed=3)
    bm = create_block_mask(mm, nb, nh, sq, sk)
    out, lse = flex.flex_attention(q, k, v, block_mask=bm, enable_gqa=True, return_lse=True)
    t_out, t_lse = _torch_flex(mm, nb, nh, q, k, v, True)
    dense = _dense(mm, nb or 1, nh or 1, sq, sk)
    truth, t_lse64 = dense_attention(q.double(), k.double(), v.double(), dense, 1 / math.sqrt(32))
    judge("out", out, truth, t_out, dtype, sk)
    # torch's lse is -inf for a row without keys, ours +inf (both give a zero output)
    t_lse = torch.where(torch.isneginf(t_lse), torch.full_like(t_lse, math.inf), t_lse)
    judge("lse", lse, t_lse64, t_lse.float(), dtype, sk, vec_axis=None)


@pytest.mark.parametrize("name", ["document", "prefix_lm", "random"])
def test_forward_matches_torch_flex_attention(name):
    check_vs_torch(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["causal", "sliding_window", "chunked_local", "dilated", "or_masks", "empty_rows",
                                  "random_full_skip", "sliding_window_two_sided", "chunked_local_bidirectional",
                                  "dilated_two_sided", "chunked_local_documents"])
def test_forward_matches_torch_flex_attention_every_mask(name):
    check_vs_torch(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["causal", "sliding_window", "document", "prefix_lm", "chunked_local", "dilated",
                                  "or_masks", "random", "random_mixed", "random_full_skip", "empty_rows",
                                  "chunked_local_documents"])
def test_forward_matches_torch_flex_attention_bf16(name):
    check_vs_torch(name, dtype=torch.bfloat16)


def test_no_block_mask_and_mqa():
    q, k, v = _qkv(1, 4, 1, 200, 130, 16, 16, torch.float32)
    out = flex.flex_attention(q, k, v, enable_gqa=True)
    ref, _ = dense_attention(q.double(), k.double(), v.double(), torch.ones(200, 130, dtype=torch.bool), 0.25)
    base, _ = dense_attention(q, k, v, torch.ones(200, 130, dtype=torch.bool), 0.25)
    judge("out", out, ref, base, torch.float32, 130)


def test_compile_fullgraph_and_fake_tensors():
    bm = create_block_mask(masks.causal_mask, None, None, 256, 256)
    q, k, v = _qkv(1, 2, 2, 256, 256, 16, 16, torch.float32)

    def f(q, k, v):
        return flex.flex_attention(q, k, v, score_mod=flex.softcap(5.0), block_mask=bm)

    assert torch.equal(torch.compile(f, fullgraph=True)(q, k, v), f(q, k, v))
    for mode in ("meta", "fake"):
        def shapes():
            mk = (lambda *s: torch.empty(*s, device="meta")) if mode == "meta" else torch.empty
            qq = mk(1, 2, 256, 16).requires_grad_(True)
            kk, vv = mk(1, 2, 256, 16).requires_grad_(True), mk(1, 2, 256, 8)
            out, lse = flex.flex_attention(qq, kk, vv, block_mask=bm, return_lse=True)
            assert out.shape == (1, 2, 256, 8) and lse.shape == (1, 2, 256)
            out.sum().backward()
            assert qq.grad.shape == qq.shape
        if mode == "meta":
            shapes()
        else:
            with FakeTensorMode(allow_non_fake_inputs=True):
                shapes()


def _no_kernel(*a, **kw):
    raise AssertionError("a kernel ran for a call that should have been refused")


@pytest.mark.parametrize("kw, exc, match", [
    (dict(block_mask="Q"), ValueError, r"must match the call's \(Sq, Sk\)"),
    (dict(block_mask="B"), ValueError, "its B and H must be 1"),
    (dict(block_mask="torch"), TypeError, "must be None or an nki_attn.BlockMask"),
    (dict(score_mod=lambda s, b, h, q, kv: s * 2), TypeError, "arbitrary Python score_mod"),
    (dict(score_mod=[flex.softcap(2.0), flex.softcap(3.0)]), TypeError, "at most once"),
    (dict(enable_gqa=None), TypeError, "enable_gqa"),
    (dict(gqa_off=True), ValueError, "enable_gqa=True"),
    (dict(scale=-1.0), ValueError, "scale"),
])
def test_bad_input_is_refused_before_any_kernel(monkeypatch, kw, exc, match):
    monkeypatch.setattr(ops, "_launch", _no_kernel)
    q, k, v = _qkv(2, 4, 2, 256, 256, 16, 16, torch.float32)
    if kw.pop("gqa_off", False):
        kw["enable_gqa"] = False
    else:
        kw.setdefault("enable_gqa", True)
    which = kw.get("block_mask")
    if which == "Q":
        kw["block_mask"] = create_block_mask(masks.causal_mask, None, None, 128, 256)
    elif which == "B":
        kw["block_mask"] = create_block_mask(masks.causal_mask, 3, None, 256, 256)
    elif which == "torch":
        kw["block_mask"] = object()
    with pytest.raises(exc, match=match):
        flex.flex_attention(q, k, v, **kw)


def test_top_level_names():
    assert nki_attn.flex_attention is flex.flex_attention
    assert nki_attn.create_block_mask is create_block_mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_marker_is_block_sparse_with_its_gradient(dtype):
    """``flex.bias``: an additive bias [1, Hq, Sq, Sk] under a per-batch document block mask, forward and the
    gradients of q, k, v and the bias (reduced over the batch) against the dense float64 definition."""
    sq = sk = 300
    mm, nb, nh = _mask_cases(sq, sk)["document"]
    bm = create_block_mask(mm, nb, nh, sq, sk)
    dense = _dense(mm, nb, 1, sq, sk)
    q, k, v = _qkv(2, 4, 2, sq, sk, 32, 32, dtype, seed=8)
    bias = torch.randn(1, 4, sq, sk, generator=torch.Generator().manual_seed(2)).to(dtype)
    dout = torch.randn(2, 4, sq, 32, generator=torch.Generator().manual_seed(3)).to(dtype)

    def grads(fn, tensors):
        leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
        out = fn(*leaves)
        out.backward(dout.to(out.dtype))
        return [out.detach()] + [t.grad.detach() for t in leaves]

    def ours(q, k, v, b):
        return flex.flex_attention(q, k, v, score_mod=flex.bias(b), block_mask=bm, enable_gqa=True)

    def ref(q, k, v, b):
        return dense_attention(q, k, v, dense, 32 ** -0.5, bias=b)[0]

    got = grads(ours, (q, k, v, bias))
    truth = grads(ref, [t.double() for t in (q, k, v, bias)])
    base = grads(ref, (q, k, v, bias))
    for i, (name, n) in enumerate((("out", sk), ("dq", sk), ("dk", sq * 2), ("dv", sq * 2), ("dbias", sk))):
        judge(name, got[i], truth[i], base[i], dtype, n)
    assert got[4].shape == bias.shape and bool((got[4][:, :, 0, 200:] == 0).all())  # hidden keys: no gradient
