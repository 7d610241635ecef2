"""Statistical and structural tests of the dropout keep mask (golden.dropout).

Every statistical bound is a 5-sigma binomial bound (docs/semantics.md, "Dropout"): if the n decisions were
independent Bernoulli(q) draws, the number kept K has mean n q and standard deviation sqrt(n q (1 - q)), and
|K - n q| > 5 sigma has probability 5.7e-7. The same holds for "agreement" counts: two independent masks with
keep probability q agree on an element with probability a = q**2 + (1 - q)**2, so the number of agreeing
elements is Binomial(n, a). The seeds are fixed, so each test is deterministic; the bound says how far a
hash that behaves like independent draws may stray, and a structural defect (correlated tiles, heads, rows,
key blocks, seed bits) shows up as a deviation of dozens of sigma.
"""
import math

import pytest
import torch

from golden import dropout as D

SIGMAS = 5.0
BIG_Q, BIG_K = 65536 + 256, 65536 + 1024


def _binomial_ok(count, n, q):
    sd = math.sqrt(n * q * (1.0 - q))
    return abs(count - n * q) <= SIGMAS * sd + 1e-9, (count, n * q, sd)


def _agreement_ok(m1, m2, q):
    n = m1.numel()
    a = q * q + (1.0 - q) * (1.0 - q)
    return _binomial_ok(int((m1 == m2).sum()), n, a)


@pytest.fixture(scope="module")
def values():
    """16-bit hash values of a 2 x 4 x 256 x 1024 problem (2M elements)."""
    return D.hash_values(D.make_seed(20260601, 3), 2, 4, 256, 1024)


# ----------------------------------------------------------------------------------------------- the interface
def test_keep_mask_shape_dtype_and_determinism():
    s = D.make_seed(7)
    m = D.keep_mask(s, 0.25, 2, 3, 64, 100)
    assert m.shape == (2, 3, 64, 100) and m.dtype == torch.bool
    assert torch.equal(m, D.keep_mask(s.clone(), 0.25, 2, 3, 64, 100))
    # a sub-problem is a slice of the bigger one: the mask depends on (b, h, i, j) only
    assert torch.equal(D.keep_mask(s, 0.25, 1, 2, 10, 30), m[:1, :2, :10, :30])


def test_int32_and_uint32_seeds_with_the_same_bits_agree():
    s = D.make_seed(-5, 2**31 + 9)
    u = s.to(torch.int64) & 0xFFFFFFFF
    su = u.to(torch.uint32)
    assert D.seed_words(s) == D.seed_words(su) == (2**32 - 5, 2**31 + 9)
    assert torch.equal(D.keep_mask(s, 0.5, 1, 1, 16, 64), D.keep_mask(su, 0.5, 1, 1, 16, 64))


def test_one_word_seed_is_offset_zero():
    one = torch.tensor([77], dtype=torch.int32)
    assert D.seed_words(one) == (77, 0)
    assert torch.equal(D.keep_mask(one, 0.3, 1, 2, 16, 64), D.keep_mask(D.make_seed(77, 0), 0.3, 1, 2, 16, 64))


def test_p_zero_keeps_everything_and_threshold_rule():
    assert D.keep_threshold(0.0) == 65536
    assert D.keep_mask(D.make_seed(1), 0.0, 1, 2, 32, 64).all()
    assert D.keep_threshold(0.5) == 32768 and D.keep_threshold(0.1) == round(0.9 * 65536)
    # the keep probability T / 65536 is within 2**-17 of 1 - p
    for p in (0.1, 0.3, 0.77, 0.999, 1 - 2**-17 + 1e-12):
        assert abs(D.keep_threshold(p) / 65536 - (1 - p)) <= 2**-17 + 1e-15


@pytest.mark.parametrize("bad, msg", [
    (42, "must be an int32 or uint32 tensor"),
    (torch.tensor([1, 2], dtype=torch.int64), "dtype"),
    (torch.tensor([1, 2, 3], dtype=torch.int32), "shape"),
])
def test_bad_seed_is_a_clear_error(bad, msg):
    with pytest.raises(ValueError, match=msg):
        D.keep_mask(bad, 0.1, 1, 1, 8, 8)


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="dropout_p"):
        D.keep_mask(D.make_seed(1), 1.0, 1, 1, 8, 8)
    with pytest.raises(ValueError, match="nheads"):
        D.keep_mask(D.make_seed(1), 0.1, 1, 2**20 + 1, 8, 8)
    with pytest.raises(ValueError, match="seed"):
        D.make_seed(2**32)


# ----------------------------------------------------------------------------------------------- statistics
def test_values_are_uniform(values):
    # chi-square over the 256 buckets of the top 8 bits; 255 degrees of freedom: mean 255, sd sqrt(510)
    n = values.numel()
    counts = torch.bincount((values >> 8).flatten(), minlength=256).to(torch.float64)
    chi2 = float(((counts - n / 256) ** 2 / (n / 256)).sum())
    assert chi2 <= 255 + SIGMAS * math.sqrt(2 * 255), chi2
    # every bit is fair
    for bit in range(16):
        ok, info = _binomial_ok(int(((values >> bit) & 1).sum()), n, 0.5)
        assert ok, (bit, info)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.999])
def test_keep_rate_within_binomial_bounds(values, p):
    q = D.keep_threshold(p) / 65536
    m = values < D.keep_threshold(p)
    ok, info = _binomial_ok(int(m.sum()), m.numel(), q)
    assert ok, info
    # per (batch, head) too
    for b in range(m.shape[0]):
        for h in range(m.shape[1]):
            ok, info = _binomial_ok(int(m[b, h].sum()), m[b, h].numel(), q)
            assert ok, (b, h, info)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_independent_across_heads_batch_and_tiles(values, p):
    q = D.keep_threshold(p) / 65536
    m = values < D.keep_threshold(p)
    pairs = {
        "heads": (m[:, 0], m[:, 1]),
        "heads 1/3": (m[:, 1], m[:, 3]),
        "batch": (m[0], m[1]),
        "query tiles (+128 rows)": (m[:, :, :128], m[:, :, 128:]),
        "key tiles (+512 cols)": (m[..., :512], m[..., 512:]),
        "key tiles (+128 cols)": (m[..., :896], m[..., 128:]),
    }
    for lag in (1, 2, 3, 4, 8, 16, 64):
        pairs[f"columns +{lag}"] = (m[..., :-lag], m[..., lag:])
        pairs[f"rows +{lag}"] = (m[:, :, :-lag], m[:, :, lag:])
    for name, (a, b) in pairs.items():
        ok, info = _agreement_ok(a, b, q)
        assert ok, (name, info)


def test_independent_across_key_blocks_and_far_rows():
    # columns j and j + 65536 share m = j & 0xFFFF: only the row words (key block) differ
    s = D.make_seed(99, 1)
    q = 0.5
    near = D.hash_values(s, 1, 2, BIG_Q, BIG_K, q_range=range(256), k_range=range(0, 1024)) < 32768
    far = D.hash_values(s, 1, 2, BIG_Q, BIG_K, q_range=range(256), k_range=range(65536, 65536 + 1024)) < 32768
    ok, info = _agreement_ok(near, far, q)
    assert ok, info
    # rows i and i + 65536 (differing in bit 16 only)
    rows_far = D.hash_values(s, 1, 2, BIG_Q, BIG_K, q_range=range(65536, 65536 + 256), k_range=range(1024)) < 32768
    ok, info = _agreement_ok(near, rows_far, q)
    assert ok, info


@pytest.mark.parametrize("other", [(1234, 1), (1234 ^ (1 << 16), 0), (1234 ^ (1 << 31), 0), (1235, 0),
                                   (1234, 1 << 16)])
def test_independent_across_seeds_and_offsets(other):
    q = 0.5
    base = D.keep_mask(D.make_seed(1234, 0), 0.5, 1, 2, 256, 1024)
    m = D.keep_mask(D.make_seed(*other), 0.5, 1, 2, 256, 1024)
    ok, info = _agreement_ok(base, m, q)
    assert ok, (other, info)


@pytest.mark.parametrize("seed", [(0, 0), (99, 1), (42, 42), (2**31, 0), (-1, 2**32 - 1)])
def test_small_and_structured_seeds_are_as_good(seed):
    # seeds with few set bits once left the row words small (a mixing round that never reached the high half)
    v = D.hash_values(D.make_seed(*seed), 1, 2, 256, 512)
    n = v.numel()
    for bit in range(16):
        ok, info = _binomial_ok(int(((v >> bit) & 1).sum()), n, 0.5)
        assert ok, (bit, info)
    m = v < 32768
    for name, (a, b) in {"columns +1": (m[..., :-1], m[..., 1:]), "rows +1": (m[:, :, :-1], m[:, :, 1:]),
                         "heads": (m[:, 0], m[:, 1])}.items():
        ok, info = _agreement_ok(a, b, 0.5)
        assert ok, (name, info)
