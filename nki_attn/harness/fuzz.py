"""Fuzzing: random combinations of every feature, each judged like a preset row (``nki-attn check --fuzz N``).

A preset row is a combination someone chose; users combine features nobody chose (soft-capping with sinks,
ALiBi with d_qk != d_v, a window with packing and GQA). ``draw(seed, i)`` builds case ``i`` of a seeded run from
its own generator, so case ``i`` is the same whatever N is and a run of 2000 starts with the run of 10. Each case
is an ordinary ``cases.Case``: the runner checks it against the float64 golden with the rules of
``tolerance`` (no rule is specific to fuzzing), and a failing one is printed as the ``nki-attn check --case``
line that replays it (``replay_line``), then shrunk (``shrink``) to the smallest case that still fails.

What a case draws (all independently, sizes kept small so that 2000 cases are practical on 2 cores):

* dtype: float32, bfloat16, float16 (or those given);
* seqlen_q and seqlen_k independently: 1, 2..16, 17..200 (any length goes through the PyTorch API's padding
  path), or 128 / 256 (the kernels directly, 30 % of cases, where dropout is possible);
* batch 1-2; kv heads 1-2 and a GQA group of 1-4; head_dim 1..256 (mostly <= 96) and d_v != head_dim;
* causal; a causal sliding window, or a two-sided ``window_size`` with either side -1 (unbounded), 0 or a
  length; soft-capping (c in [0.5, 5], 30 or 50); ALiBi slopes per (batch, head) ``[b, h]``, per head ``[h]``,
  BLOOM's, or of either sign; 1-3 sinks per head, some of them -inf (a whole head's, or the first of every
  head); a softmax scale (random, or 2 and 4, the powers of two the forward applies in its exponent);
* packing (``cu_seqlens``) with empty sequences and trailing query rows that see no key;
* dropout (kernel-path cases), checked through the keep mask the golden regenerates from the case's seed.
"""
import dataclasses
import random
import shlex

from .cases import TILE, Case

DTYPES = ("float32", "bfloat16", "float16")
# Feature tags of ``features_of``: what a run's coverage counts, and what the tests require N draws to cover.
FEATURES = ("float32", "bfloat16", "float16", "seqlen_q=1", "seqlen_k=1", "unaligned", "kernel_path", "sq!=sk",
            "gqa", "mqa", "batch2", "dv!=dqk", "head_dim>128", "causal", "window", "window_size",
            "window_unbounded_side", "softcap", "alibi[b,h]", "alibi[h]", "alibi_bloom", "alibi_signed", "sinks",
            "sinks2+", "sink_-inf", "head_all_-inf", "scale", "packing", "empty_sequence", "empty_rows", "dropout")


def _length(rng, aligned):
    if aligned:
        return rng.choice((TILE, 2 * TILE))
    kind = rng.random()
    if kind < 0.12:
        return 1
    if kind < 0.4:
        return rng.randint(2, 16)
    return rng.randint(17, 200)


def _head_dim(rng):
    kind = rng.random()
    if kind < 0.5:
        return rng.choice((8, 16, 32, 64))
    if kind < 0.8:
        return rng.randint(1, 96)
    if kind < 0.9:
        return 128
    return rng.randint(129, 256)


def _side(rng, s):
    kind = rng.random()
    if kind < 0.25:
        return -1
    if kind < 0.4:
        return 0
    return rng.randint(0, max(1, s))


def _packing(rng, s):
    """cu_seqlens over ``s`` tokens: 1-4 sequences, empty ones included (repeated offsets) and, one time in
    three, a gap at the end (query rows that see no key)."""
    end = s if rng.random() < 0.67 else rng.randint(0, s)
    cuts = sorted(rng.randint(0, end) for _ in range(rng.randint(0, 3)))
    if rng.random() < 0.5 and cuts:  # an empty sequence for sure
        cuts.insert(rng.randrange(len(cuts)), cuts[rng.randrange(len(cuts))])
        cuts.sort()
    return (0, *cuts, end)


def draw(seed, i, dtypes=DTYPES):
    """Case ``i`` of the fuzz run with ``seed`` (named ``fuzz<seed>-<i>``; its inputs are seeded by that name).

    Every drawn case satisfies ``cases.Case``'s own rules and the harness's (dropout on kernel-path cases only,
    packing with batch 1 and seqlen_q == seqlen_k), so a refusal comes from the candidate, not the generator.
    """
    rng = random.Random(f"nki-attn-fuzz:{seed}:{i}")
    dtype = rng.choice(tuple(dtypes))
    aligned = rng.random() < 0.3
    sq, sk = _length(rng, aligned), _length(rng, aligned)
    batch = 2 if rng.random() < 0.25 else 1
    kv = rng.choice((1, 1, 2))
    group = rng.choice((1, 1, 2, 3, 4))
    d = _head_dim(rng)
    f = dict(batch=batch, heads=kv * group, kv_heads=kv, d_head=d, dtype=dtype)
    if rng.random() < 0.3:
        f["d_v"] = rng.choice((_head_dim(rng), max(1, d // 2)))
    f["causal"] = rng.random() < 0.5
    mask = rng.random()
    if mask < 0.15 and f["causal"]:
        f["window"] = rng.randint(1, max(sq, sk) + 2)
    elif mask < 0.5:
        f["window_size"] = (_side(rng, sk), _side(rng, sk))
    if rng.random() < 0.3:
        f["softcap"] = rng.choice((round(rng.uniform(0.5, 5.0), 3), 30.0, 50.0))
    if rng.random() < 0.25:
        f["alibi"] = rng.choice(("random", "random_h", "bloom", "signed"))
    if rng.random() < 0.3:
        f["num_sinks"] = rng.choice((1, 1, 2, 3))
        if rng.random() < 0.4:
            f["sinks_inf"] = rng.choice(("head", "first"))
    if rng.random() < 0.25:
        f["scale"] = rng.choice((round(rng.uniform(0.05, 1.5), 4), 2.0, 4.0))
    if rng.random() < 0.2:
        sk = sq
        f["batch"] = 1
        f["cu_seqlens"] = _packing(rng, sq)
    if aligned and rng.random() < 0.25:
        f["dropout"] = rng.choice((0.1, 0.17, 0.5))
    return Case(name=f"fuzz{seed}-{i}", seqlen_q=sq, seqlen_k=sk, **f)


def draw_many(n, seed, dtypes=DTYPES):
    """Cases ``0 .. n - 1`` of the run with ``seed``."""
    return [draw(seed, i, dtypes) for i in range(n)]


def features_of(case):
    """The ``FEATURES`` tags a case exercises."""
    t = {case.dtype}
    if case.seqlen_q == 1:
        t.add("seqlen_q=1")
    if case.seqlen_k == 1:
        t.add("seqlen_k=1")
    t.add("unaligned" if case.via_api else "kernel_path")
    if case.seqlen_q != case.seqlen_k:
        t.add("sq!=sk")
    if case.heads != case.kv_heads:
        t.add("mqa" if case.kv_heads == 1 else "gqa")
    if case.batch > 1:
        t.add("batch2")
    if case.dv != case.d_head:
        t.add("dv!=dqk")
    if case.d_head > 128:
        t.add("head_dim>128")
    for flag, tag in ((case.causal, "causal"), (case.window, "window"), (case.window_size, "window_size"),
                      (case.softcap, "softcap"), (case.num_sinks, "sinks"), (case.num_sinks > 1, "sinks2+"),
                      (case.sinks_inf, "sink_-inf"), (case.scale, "scale"), (case.cu_seqlens, "packing"),
                      (case.dropout, "dropout")):
        if flag:
            t.add(tag)
    if case.window_size and -1 in case.window_size:
        t.add("window_unbounded_side")
    if case.sinks_inf == "head" or (case.sinks_inf == "first" and case.num_sinks == 1):
        t.add("head_all_-inf")
    if case.alibi:
        t.add({"random": "alibi[b,h]", "random_h": "alibi[h]", "bloom": "alibi_bloom",
               "signed": "alibi_signed"}[case.alibi])
    cu = case.cu_seqlens
    if cu:
        if any(b == a for a, b in zip(cu[:-1], cu[1:])):
            t.add("empty_sequence")
        if cu[-1] < case.seqlen_q:
            t.add("empty_rows")
    return t


def coverage(cases):
    """How many of ``cases`` exercise each ``FEATURES`` tag (every tag listed, 0 included)."""
    counts = dict.fromkeys(FEATURES, 0)
    for c in cases:
        for tag in features_of(c):
            counts[tag] += 1
    return counts


def replay_line(case, spec=None, lnc=1):
    """The command line that re-runs ``case`` alone with the same candidate: ``nki-attn check --case '<json>'``
    (the case's JSON, name included, so it sees the same inputs), plus the candidate options and ``--lnc``."""
    parts = ["nki-attn", "check", "--case", case.to_json()]
    if spec is not None and not spec.builtin:
        if spec.bwd:
            parts += ["--candidate-bwd", spec.bwd]
        if spec.fwd:
            parts += ["--candidate-fwd", spec.fwd]
            if spec.fwd_contract != "lse":
                parts += ["--fwd-contract", spec.fwd_contract]
    if lnc != 1:
        parts += ["--lnc", str(lnc)]
    return " ".join(shlex.quote(p) for p in parts)


# ----------------------------------------------------------------------------------------------------- shrinking
def size(case):
    """What shrinking minimises, compared as a tuple: elements of the score matrices times the head dims, then
    the number of features the case carries."""
    elems = case.batch * case.heads * case.seqlen_q * case.seqlen_k * (case.d_head + case.dv)
    return elems, len(features_of(case) - set(DTYPES) - {"unaligned", "kernel_path"})


def valid(case):
    """True when ``case`` is one ``draw`` could produce (the harness's constraints, see ``draw``)."""
    if case.dropout and case.via_api:
        return False
    if case.window and not case.causal:
        return False
    if case.cu_seqlens:
        cu = case.cu_seqlens
        if case.batch != 1 or case.seqlen_q != case.seqlen_k or cu[0] != 0 or cu[-1] > case.seqlen_q \
                or any(b < a for a, b in zip(cu[:-1], cu[1:])):
            return False
    return min(case.batch, case.heads, case.kv_heads, case.seqlen_q, case.seqlen_k, case.d_head) >= 1 \
        and case.heads % case.kv_heads == 0


def _lengths_below(s, aligned_only):
    if aligned_only:
        return [t for t in range(TILE, s, TILE)]
    return sorted({1, 2, s // 4, s // 2, s - 1} - {0, s})


def smaller(case):
    """Candidate reductions of ``case``, largest first: each feature removed, then batch, heads, lengths and head
    dims reduced. Only valid cases strictly smaller by ``size`` are yielded."""
    rep = dataclasses.replace
    out = []
    drops = [dict(dropout=0.0), dict(softcap=0.0), dict(alibi=""), dict(num_sinks=0, sinks_inf=""),
             dict(sinks_inf=""), dict(window=0), dict(window_size=()), dict(causal=False, window=0),
             dict(scale=0.0), dict(cu_seqlens=()), dict(d_v=0), dict(batch=1)]
    if case.num_sinks > 1:
        drops.append(dict(num_sinks=1, sinks_inf=case.sinks_inf if case.sinks_inf != "first" else ""))
    group = case.heads // case.kv_heads
    drops += [dict(heads=group, kv_heads=1), dict(heads=case.kv_heads)]
    if group > 1:
        drops.append(dict(heads=case.kv_heads * (group // 2)))
    for k in ("d_head", "d_v"):
        dim = case.d_head if k == "d_head" else case.dv
        drops += [{k: t} for t in sorted({1, dim // 2, dim - 1} - {0, dim})]
    packed = bool(case.cu_seqlens)
    for t in _lengths_below(case.seqlen_q, bool(case.dropout)):
        if packed:
            drops.append(dict(seqlen_q=t, seqlen_k=t, cu_seqlens=tuple(min(c, t) for c in case.cu_seqlens)))
        else:
            drops.append(dict(seqlen_q=t))
    if not packed:
        drops += [dict(seqlen_k=t) for t in _lengths_below(case.seqlen_k, bool(case.dropout))]
    here = size(case)
    for kw in drops:
        try:
            c = rep(case, **kw)
        except ValueError:
            continue
        if c != case and valid(c) and size(c) < here and c not in out:
            out.append(c)
    return out


def shrink(case, fails, budget=40):
    """The smallest case reachable from the failing ``case`` by ``smaller`` steps that still fails.

    Greedy: take the first reduction for which ``fails(candidate_case)`` is True and start again from it, until
    none fails or ``budget`` calls of ``fails`` are spent. Returns (smallest failing case, calls made).
    """
    calls = 0
    best = case
    progress = True
    while progress and calls < budget:
        progress = False
        for c in smaller(best):
            if calls >= budget:
                break
            calls += 1
            if fails(c):
                best, progress = c, True
                break
    return best, calls


def summary(rows, cases, seed, failures, wall_seconds):
    """The report's ``fuzz`` section: seed, counts by status, feature coverage, unsupported messages (first 200
    characters, counted), and per failure its case, replay line and shrunk case."""
    counts = {s: 0 for s in ("pass", "fail", "error", "unsupported")}
    reasons = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
        if r["status"] == "unsupported":
            key = r.get("error", "")[:200]
            reasons[key] = reasons.get(key, 0) + 1
    return {"n": len(cases), "seed": seed, "counts": counts, "coverage": coverage(cases),
            "unsupported_reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1])),
            "failures": failures, "wall_seconds": wall_seconds}
