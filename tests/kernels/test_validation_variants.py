"""The shared kernel-side checks (nki_attn/kernels/validation.py) for the variant keywords, and the host wrappers
(nki_attn/kernel_api.py) that raise them as ValueError.

Each rule is exercised with one argument wrong at a time (the message must name the argument and its value), and
the checks must run inside a kernel under the simulator's NKI frontend check (kernel code is NKI's subset: no
raise, no comprehensions, ...).
"""
import numpy as np
import pytest
import torch

import nki_attn.sim as sim
from nki_attn import kernel_api
from nki_attn.backend import nki, nl
from nki_attn.kernels import validation as V


def _t(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype)


def _args(d_qk=64, d_v=64, sq=256, sk=256, h=2, hkv=1, bs=1):
    return dict(q=_t(bs, h, d_qk, sq), k=_t(bs, hkv, d_qk, sk), v=_t(bs, hkv, d_v, sk))


SEED = _t(2, dtype=torch.int32)


@pytest.mark.parametrize("change", [
    dict(),
    dict(d_qk=199, d_v=199),
    dict(d_qk=192, d_v=128),
    dict(d_qk=1, d_v=256),
    dict(sq=128, sk=384),
    dict(sq=384, sk=128),
], ids=str)
@pytest.mark.parametrize("kw", [
    dict(use_causal_mask=True),
    dict(use_causal_mask=True, sliding_window=100),
    dict(window_size=(64, 64)),
    dict(window_size=(-1, 0), use_causal_mask=True),
    dict(window_size=(0, -1)),
    dict(softcap=50.0),
    dict(softcap=7),
    dict(alibi_slopes="alibi"),
    dict(dropout_p=0.1, dropout_seed=SEED),
    dict(dropout_p=0.5, dropout_seed=_t(2, dtype=torch.uint32)),
    dict(dropout_p=0.5, dropout_seed=_t(1, dtype=torch.int32)),
    dict(logit_scale="lscale"),
], ids=str)
def test_spec_arguments_accepted(change, kw):
    a = _args(**change)
    kw = dict(kw)
    if kw.get("alibi_slopes") == "alibi":
        kw["alibi_slopes"] = _t(1, 2)
    if kw.get("logit_scale") == "lscale":
        kw["logit_scale"] = _t(1, 2)
    assert kernel_api.variant_problem(**a, **kw) is None


def _problem(**kw):
    a = _args(**{k: kw.pop(k) for k in ("d_qk", "d_v", "sq", "sk") if k in kw})
    return kernel_api.variant_problem(**a, **kw)


@pytest.mark.parametrize("kw,match", [
    (dict(d_qk=257, d_v=257), "d_head=257 exceeds the supported maximum 256"),
    (dict(d_v=300), "d_v=300 exceeds the supported maximum 256"),
    (dict(d_qk=0, d_v=64), "d_head=0 must be >= 1"),
    (dict(o=_t(1, 2, 64, 256)), None),
    (dict(softcap=-1.0), r"softcap=-1.0 must be a finite number >= 0"),
    (dict(softcap=float("inf")), r"softcap=inf must be a finite"),
    (dict(softcap=True), r"softcap=True must be a finite"),
    (dict(softcap="50"), r"softcap='50' must be a finite"),
    (dict(alibi_slopes=_t(2)), r"alibi_slopes shape \(2,\) must be \[bs, nheads\] = \(1, 2\)"),
    (dict(alibi_slopes=_t(1, 2, dtype=torch.float16)), r"alibi_slopes dtype float16 must be float32"),
    (dict(alibi_slopes=0.5), r"alibi_slopes=0.5 must be None or a float32 tensor"),
    (dict(logit_scale=_t(2)), r"logit_scale shape \(2,\) must be \[bs, nheads\] = \(1, 2\)"),
    (dict(logit_scale=_t(1, 2, dtype=torch.bfloat16)), r"logit_scale dtype bfloat16 must be float32"),
    (dict(logit_scale=2.0), r"logit_scale=2.0 must be None or a float32 tensor \[bs, nheads\]"),
    (dict(window_size=(64,)), r"window_size=\(64,\) must be None or a pair"),
    (dict(window_size=(1.5, 2)), r"window_size=\(1.5, 2\) must be None or a pair"),
    (dict(window_size=(-2, 3)), r"window_size=\(-2, 3\): each side must be >= 0, or -1"),
    (dict(window_size=(3, 0), sliding_window=4, use_causal_mask=True), r"were both given"),
    (dict(sliding_window=4), r"sliding_window=4 is only supported with use_causal_mask=True"),
    (dict(dropout_p=1.0, dropout_seed=SEED), r"dropout_p=1.0 must be a number in \[0, 1\)"),
    (dict(dropout_p=-0.1, dropout_seed=SEED), r"dropout_p=-0.1 must be"),
    (dict(dropout_p=0.1), r"dropout_p=0.1 needs dropout_seed"),
    (dict(dropout_p=0.1, dropout_seed=7), r"dropout_seed=7 must be an int32 or uint32 HBM tensor"),
    (dict(dropout_p=0.1, dropout_seed=_t(2)), r"dropout_seed dtype float32 must be int32 or uint32"),
    (dict(dropout_seed=SEED), r"dropout_seed was given with dropout_p=0.0"),
    (dict(dropout_p=0.1, dropout_seed=_t(1, 2, dtype=torch.int32)), r"dropout_seed shape \(1, 2\) must be \(2,\)"),
    (dict(dropout_p=0.1, dropout_seed=_t(3, dtype=torch.int32)), r"dropout_seed shape \(3,\) must be \(2,\): "
                                                                 r"\(seed, offset\), or \(1,\)"),
    (dict(v=_t(1, 1, 64, 384)), r"v shape \(1, 1, 64, 384\) must be \[bs, nheads_kv, d_v, seqlen_k\]"),
    (dict(d_qk=192, d_v=128, o=_t(1, 2, 192, 256)), r"o shape \(1, 2, 192, 256\) must be \[bs, nheads, d_v, "
                                                   r"seqlen_q\] = \(1, 2, 128, 256\)"),
], ids=str)
def test_spec_arguments_refused(kw, match):
    kw = dict(kw)
    a = _args(**{k: kw.pop(k) for k in ("d_qk", "d_v", "sq", "sk") if k in kw})
    a.update(kw)
    got = kernel_api.variant_problem(**a)
    if match is None:
        assert got is None
    else:
        import re
        assert got is not None and re.search(match, got), got


def test_shape_facts():
    s = V.attention_shape(_t(1, 4, 199, 256), _t(1, 2, 199, 384), v=_t(1, 2, 128, 384), use_causal_mask=True,
                          window_size=(10, -1), dropout_p=0.1, mods={"softcap": 50.0, "alibi_slopes": _t(1, 4)})
    assert (s.d_qk, s.d_v, s.d_head, s.group, s.off) == (199, 128, 199, 2, 128)
    assert s.qk_tiles == [(0, 128), (128, 71)] and s.v_tiles == [(0, 128)]
    assert s.band == (118, 128) and s.banded
    assert (s.softcap, s.alibi, s.dropout_p, s.dropout) == (50.0, True, 0.1, True)
    assert [m.name for m in s.active] == ["softcap", "alibi"]  # the applied score_mods rows, in table order
    plain = V.attention_shape(_t(1, 1, 64, 256), _t(1, 1, 64, 256))
    assert (plain.d_v, plain.softcap, plain.alibi, plain.dropout, plain.banded) == (64, 0.0, False, False, False)


def test_checks_run_in_a_kernel_under_the_frontend_check():
    q = np.zeros((1, 2, 199, 256), np.float32)
    k = np.zeros((1, 1, 199, 384), np.float32)
    v = np.zeros((1, 1, 128, 384), np.float32)
    slopes = np.zeros((1, 2), np.float32)
    seed = np.zeros((2,), np.int32)
    with sim.checking(frontend="full"):
        _kernel_ok(q, k, v, slopes, seed, use_causal_mask=True, softcap=50.0, window_size=(64, 64),
                   dropout_p=0.1)
        with pytest.raises(AssertionError, match=r"softcap=-1.0 must be a finite number"):
            _kernel_ok(q, k, v, slopes, seed, softcap=-1.0)


@nki.jit
def _kernel_ok(q, k, v, alibi_slopes, dropout_seed, use_causal_mask=False, softcap=0.0, window_size=None,
               dropout_p=0.0):
    mods = {"softcap": softcap, "alibi_slopes": alibi_slopes}
    problem = V.attention_problem(q, k, v, use_causal_mask=use_causal_mask, window_size=window_size,
                                  dropout_p=dropout_p, dropout_seed=dropout_seed, mods=mods, kernel="probe")
    assert problem is None, problem
    shp = V.attention_shape(q, k, v=v, use_causal_mask=use_causal_mask, window_size=window_size,
                            dropout_p=dropout_p, mods=mods)
    out = nl.ndarray((1, len(shp.qk_tiles) + len(shp.v_tiles)), dtype=nl.float32, buffer=nl.shared_hbm)
    return out


def test_kernel_api_drops_variant_keywords_at_default_and_refuses_others():
    """A variant keyword the kernel does not take: accepted at its default, refused (ValueError naming it) when
    set; an invalid value is reported as invalid first, whatever the kernel implements."""
    fwd = kernel_api.attention_fwd
    q = _t(1, 2, 64, 256)
    k = _t(1, 1, 64, 256)
    valid = {"softcap": dict(softcap=0.5), "alibi_slopes": dict(alibi_slopes=_t(1, 2)),
             "window_size": dict(window_size=(2, 2)), "dropout_p": dict(dropout_p=0.5, dropout_seed=SEED),
             "dropout_seed": dict(dropout_p=0.5, dropout_seed=SEED), "logit_scale": dict(logit_scale=_t(1, 2))}
    for item in kernel_api.VARIANT_KEYWORDS:
        name, default = item
        if fwd.accepts(name):
            continue
        fwd.check(q, k, k, **{name: default})  # accepted at its default
        with pytest.raises(ValueError, match=r"(softcap|alibi_slopes|window_size|dropout_p|dropout_seed)=.* is "
                                             r"not supported by attention_fwd"):
            fwd.check(q, k, k, **valid[name])
    with pytest.raises(ValueError, match=r"softcap=-2.0 must be a finite number >= 0"):
        fwd.check(q, k, k, softcap=-2.0)
    with pytest.raises(ValueError, match=r"window_size=\(4, 4\) and sliding_window=3 were both given"):
        fwd.check(q, k, k, use_causal_mask=True, sliding_window=3, window_size=(4, 4))
