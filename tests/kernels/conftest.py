"""What every kernel test shares: one ``Case`` builder, the float64 reference (the ``golden`` package) and the
accuracy criterion.

The criterion (docs/validation.md derives it). With every error the max absolute difference from a float64
reference computed on the same (already dtype-rounded) inputs:

    err_kernel <= K * (err_golden + err_inputs) + u(dtype) * max|ref|          (K = 2)

* ``err_golden``: error of the torch golden run in the kernel's dtype (FlashAttention's baseline: "no worse than
  K times what the framework itself gets in this dtype").
* ``err_inputs``: backward only, error of the kernel's own formula evaluated by torch in float32 from exactly the
  inputs the kernel gets (``bwd_from_stats``: O rounded to the input dtype, LSE rounded to float32, which the
  golden never reads). It carries what any implementation of that formula must show and the golden's
  self-normalised softmax hides.
* ``u(dtype) * max|ref|``: one rounding of the largest output to the output dtype, a floor for outputs whose
  baselines are ~0.

Any NaN in a kernel output fails; +inf LSE entries (rows that see no key) must sit exactly where the reference has
them, and those rows' O must be exactly 0. ``absolute_band`` is the backward's secondary check: a fixed band per
dtype, ``max|kernel - ref| <= atol + rtol * max|ref|``, valid for the test inputs (N(0, 1) q, k, v, dy).

The score modifications (soft-capping, ALiBi, the additive bias, the logit scale) are one ``ModRow`` each in
``TEST_MODS``; their formulas and gradients come from the golden's ``SCORE_STEPS`` and their kernel keywords and
gradient flags from ``nki_attn.spec.SCORE_MODS``, so no per-modification code sits elsewhere in this file.

Test modules of this folder import these names (``from .conftest import Case``); fixtures are ``target``.
"""
import dataclasses
import math
import re

import ml_dtypes
import numpy as np
import pytest
import torch

from golden import attention_bwd_torch_ref, attention_fwd_torch_ref, compute_o_lse, packing_bounds
from golden import dropout as golden_dropout
from golden.attention_fwd_torch import SCORE_STEPS, visibility_mask
from nki_attn import spec
from nki_attn.kernels.attention_bwd import attention_bwd
from nki_attn.kernels.attention_fwd import attention_fwd

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
K_FACTOR = 2.0
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float64": 2.0 ** -53}
# Secondary absolute bands, max|kernel - ref| <= atol + rtol * max|ref| (see docs/validation.md).
ABS_BANDS = {"float32": (1e-4, 1e-5), "bfloat16": (0.0, 2e-2), "float16": (0.0, 2.5e-3)}


# ----------------------------------------------------------------------------------------------- arrays
def to_np(x):
    """torch tensor -> numpy array of the same dtype (bfloat16 via ml_dtypes)."""
    x = x.detach().contiguous()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return x.numpy()


def dtype_name(dt):
    return str(dt).split(".")[-1]


def as_f64(x):
    """numpy (incl. ml_dtypes bfloat16) or torch -> float64 numpy array."""
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64).numpy()
    return np.asarray(x).astype(np.float64)


def as_t64(x):
    return torch.from_numpy(as_f64(x))


def max_err(a, ref):
    return float(np.max(np.abs(as_f64(a) - as_f64(ref)))) if np.size(ref) else 0.0


def empty_rows(lse):
    """Bool [bs, nheads, seqlen_q] of the rows with lse == +inf (lse layout [bs, nheads, 128, n_tiles])."""
    lse = as_t64(lse)
    return torch.isposinf(lse).transpose(-1, -2).reshape(lse.shape[0], lse.shape[1], -1)


# ----------------------------------------------------------------------------------------------- the criterion
def check_close(name, kernel, ref, golden, dtype, inputs_err=None, k=K_FACTOR):
    """Assert the criterion of the module docstring for one output; returns the measured numbers."""
    kern = as_f64(kernel)
    r = as_f64(ref)
    assert np.all(np.isfinite(kern)), f"{name}: kernel output has NaN/inf"
    assert kern.shape == r.shape, f"{name}: shape {kern.shape} != reference {r.shape}"
    u = UNIT_ROUNDOFF[dtype_name(dtype)]
    e_k = max_err(kern, r)
    e_g = max_err(golden, r)
    e_i = 0.0 if inputs_err is None else max_err(inputs_err, r)
    mx = float(np.max(np.abs(r))) if r.size else 0.0
    bound = k * (e_g + e_i) + u * mx
    assert e_k <= bound, (f"{name}: kernel error {e_k:.3e} > {k} * (golden {e_g:.3e} + inputs {e_i:.3e}) + "
                          f"u*max|ref| {u * mx:.3e} = {bound:.3e} (dtype {dtype_name(dtype)}, max|ref| {mx:.3e})")
    return {"err": e_k, "golden": e_g, "inputs": e_i, "max": mx, "bound": bound}


def absolute_band(name, kernel, ref, dtype):
    """Secondary fixed band: max|kernel - ref| <= atol + rtol * max|ref| (ABS_BANDS)."""
    atol, rtol = ABS_BANDS[dtype_name(dtype)]
    e = max_err(kernel, ref)
    mx = float(np.max(np.abs(as_f64(ref))))
    assert e <= atol + rtol * mx, f"{name}: error {e:.3e} outside the {dtype_name(dtype)} band {atol} + {rtol}*{mx:.3e}"
    return e


def check_with_inf(name, out, gold, ref, dtype):
    """The criterion on the finite entries of a forward output; +inf entries (rows that see no key) must be
    +inf in the kernel exactly where they are in the reference, and nothing may be NaN."""
    out, gold, ref = (torch.as_tensor(as_f64(x)) for x in (out, gold, ref))
    assert not torch.isnan(out).any(), f"{name}: NaN in the kernel result"
    assert torch.equal(torch.isinf(out), torch.isinf(ref)), f"{name}: inf pattern differs from the reference"
    assert torch.equal(out[torch.isinf(out)], ref[torch.isinf(ref)]), f"{name}: inf sign differs"
    fin = torch.isfinite(ref)
    return check_close(name, out[fin], ref[fin], gold[fin], dtype)


def bwd_from_stats(q, k, v, o, dy, lse, opts, sinks=None, drop=None, compute_dtype=torch.float32):
    """The backward kernel's formula with every variant, evaluated by torch in ``compute_dtype`` from exactly the
    given inputs (kernel layouts; O in the input dtype and LSE in float32 make it the ``err_inputs`` baseline):
    logits = the score modifications of ``opts`` applied to scale S (the golden's ``SCORE_STEPS`` rows, in their
    order: logit scale, soft-capping, ALiBi, bias), masked by the band and packing bounds; P = exp(logits - LSE);
    D = rowsum(O * dO); dS = P (dP - D), taken back through the modifications in reverse order by the same rows'
    backward functions (each also gives its input's gradient, e.g. dbias, dlogit_scale); dV = P^T dO;
    dK = scale dS^T Q; dQ = scale dS K (dropout: dP and the dV operand times M / (1 - p)); dsinks =
    -sum_rows exp(sink - LSE) D. ``opts``: the golden's keywords. Returns numpy float64 arrays by output name."""
    f = lambda x: as_t64(x).to(compute_dtype)  # noqa: E731
    q, k, v, o, dy, lse = (f(x) for x in (q, k, v, o, dy, lse))
    bs, h, d, sq = q.shape
    hk, sk = k.shape[1], k.shape[3]
    g = h // hk
    scale = 1.0 / math.sqrt(d) if opts.get("softmax_scale") is None else opts["softmax_scale"]
    qt, ot, dot = (x.transpose(-1, -2) for x in (q, o, dy))                       # [b, h, sq, d]
    kt = k.transpose(-1, -2).repeat_interleave(g, dim=1)
    vt = v.transpose(-1, -2).repeat_interleave(g, dim=1)
    rows = lse.transpose(-1, -2).reshape(bs, h, sq)                                 # row t*128+p
    s = torch.matmul(qt, kt.transpose(-1, -2)) * scale
    ctx = dict(bs=bs, nheads=h, seqlen_q=sq, seqlen_k=sk, scale=scale, adt=compute_dtype)
    applied = []
    for row in SCORE_STEPS:
        value = opts.get(row[0])
        if _is_on(value):
            s, kept = row[1](s, value, ctx)
            applied.append((row, value, kept))
    vis = visibility_mask(sq, sk, opts.get("use_causal_mask", False), opts.get("sliding_window"),
                          opts.get("bound_min"), opts.get("bound_max"), opts.get("window_size"))
    s = s.masked_fill(~vis, float("-inf"))
    p = torch.exp(s - rows[..., None])
    dd = (ot * dot).sum(-1)
    dp = torch.matmul(dot, vt.transpose(-1, -2))
    pv = p
    if drop is not None:
        dp = dp * drop.to(compute_dtype)
        pv = p * drop.to(compute_dtype)
    ds = torch.nan_to_num(p * (dp - dd[..., None]), nan=0.0)
    mod_grads = {}
    for row, value, kept in reversed(applied):
        if row[2] is not None:
            ds, grad = row[2](ds, value, kept, ctx)
            if row[3] is not None:
                mod_grads[_grad_name(row[3])] = grad
    dq = torch.matmul(ds, kt) * scale
    dk = (torch.matmul(ds.transpose(-1, -2), qt) * scale).reshape(bs, hk, g, sk, -1).sum(2)
    dv = torch.matmul(pv.transpose(-1, -2), dot).reshape(bs, hk, g, sk, -1).sum(2)
    out = {"dq": dq.transpose(-1, -2), "dk": dk.transpose(-1, -2), "dv": dv.transpose(-1, -2)}
    if sinks is not None:
        sk_ = f(sinks).reshape(bs, h, -1)
        psink = torch.exp(sk_[:, :, None, :] - rows[..., None])                     # [b, h, sq, ns]
        out["dsinks"] = (-(psink * dd[..., None]).sum(2)).reshape(tuple(np.shape(sinks)))
    out.update(mod_grads)
    return {n: as_f64(x) for n, x in out.items()}


def sum_to(x, shape):
    """``x`` (e.g. ``[bs, h, sq, sk]``) summed over the dims a tensor of ``shape`` (as many dims) broadcasts."""
    x = torch.as_tensor(as_f64(x)) if not isinstance(x, torch.Tensor) else x
    dims = [i for i in range(len(shape)) if shape[i] == 1 and x.shape[i] != 1]
    return x.sum(dim=dims, keepdim=True) if dims else x


def _is_on(value):
    """A score modification's golden / kernel input applies: given, and (a number) not 0."""
    return value is not None and not (isinstance(value, float) and value == 0.0)


def _grad_name(golden_key):
    """The kernel output name of a golden gradient key: ``out_dbias_ref`` -> ``dbias``."""
    return golden_key[len("out_"):-len("_ref")]


def check_fwd_outputs(o, lse, q, k, v, sinks, mixed, opts):
    """Check the forward kernel's (o, lse) for inputs q, k, v, sinks (the dtype the kernel got) against the golden
    on float64 copies (``ref``) and in the dtype with ``mixed`` (``golden``); ``opts``: the golden's keywords.
    o must be [bs, h, d_v, seqlen_q] in q's dtype, lse [bs, h, 128, seqlen_q / 128] float32; rows without a
    visible key (and without a sink) must have o exactly 0. Returns (o_ref, lse_ref)."""
    dbl = lambda x: None if x is None else x.to(torch.float64)  # noqa: E731
    o_ref, lse_ref = attention_fwd_torch_ref(dbl(q), dbl(k), dbl(v), sinks_ref=dbl(sinks), **opts)
    o_gold, lse_gold = attention_fwd_torch_ref(q, k, v, sinks_ref=sinks, mixed_precision=mixed, **opts)
    bs, h, _, sq = q.shape
    assert tuple(o.shape) == (bs, h, v.shape[2], sq) and o.dtype == q.dtype
    assert tuple(lse.shape) == (bs, h, 128, sq // 128) and lse.dtype == torch.float32
    check_with_inf("o", o, o_gold, o_ref, q.dtype)
    check_with_inf("lse", lse, lse_gold, lse_ref, torch.float32)
    empty = empty_rows(lse_ref)
    if empty.any():
        o_rows = torch.as_tensor(as_f64(o)).transpose(-1, -2)
        assert torch.all(o_rows[empty] == 0), "o: a row that sees no key is not 0"
    return o_ref, lse_ref


# ----------------------------------------------------------------------------------------------- the Case builder
def alibi_slopes(bs, h):
    """FlashAttention-style geometric slopes 2^(-8 (i + 1) / h), a little different per batch entry: [bs, h]."""
    base = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], dtype=torch.float32)
    return torch.stack([base * (1.0 + 0.25 * b) for b in range(bs)])


def logit_scales(bs, h, mul=1.0):
    """Per-head logit scales (learned temperatures) around 1, none a power of two, different per head and batch
    row, times ``mul``: float32 [bs, h]."""
    return torch.tensor([[mul * (0.55 + 0.37 * i + 0.11 * b) for i in range(h)] for b in range(bs)],
                        dtype=torch.float32)


# the additive bias's shape by token suffix, for [bs, h, sq, sk]: per head (shared by the batch), per batch entry
# (shared by the heads), one for all, full, and a key-padding bias [bs, 1, 1, sk]
BIAS_SHAPES = {"h": lambda bs, h, sq, sk: (1, h, sq, sk), "b": lambda bs, h, sq, sk: (bs, 1, sq, sk),
               "1": lambda bs, h, sq, sk: (1, 1, sq, sk), "full": lambda bs, h, sq, sk: (bs, h, sq, sk),
               "keys": lambda bs, h, sq, sk: (bs, 1, 1, sk)}


@dataclasses.dataclass(frozen=True)
class ModRow:
    """What the kernel tests add for one score modification (one row of ``TEST_MODS``). Everything else comes
    from the modification's declarations: its kernel keyword, "off" value, gradient and gradient flag from the
    host's row (``nki_attn.spec.SCORE_MODS``, by ``name``), its float64 formula and gradient (reference and
    inputs baseline alike) from the golden's ``SCORE_STEPS`` row of that keyword.

    Fields: ``name`` (``spec.ScoreMod.name``); ``case_kw`` (the ``Case`` keyword; false: off); ``token`` and
    ``pattern`` (the matrix's variant token, a regex whose groups ``parse`` turns into the Case value);
    ``build(value, bs, h, sq, sk, rnd)`` (the golden's input in float64 or a number; ``rnd(*shape)`` draws N(0, 1)
    rounded to the dtype, after every other input); ``in_dtype`` (the kernel gets the input rounded to the case's
    dtype, else as built); ``grad_shape(bs, h, sq, sk)`` (the kernel gradient's shape when it is not the input's:
    the check sums it over the input's broadcast dims)."""
    name: str
    case_kw: str
    token: str
    pattern: str
    parse: object
    build: object
    in_dtype: bool = False
    grad_shape: object = None

    @property
    def host(self):
        return next(m for m in spec.SCORE_MODS if m.name == self.name)

    @property
    def keyword(self):
        """The kernels' (and the golden's) keyword."""
        return self.host.kernel

    @property
    def grad(self):
        """The kernel's gradient output name, or None."""
        if self.host.grad == "none":
            return None
        key = next(row[3] for row in SCORE_STEPS if row[0] == self.keyword)
        return _grad_name(key)


# One row per score modification, in the host table's order (the order of the backward's gradient outputs).
TEST_MODS = (
    ModRow("softcap", "softcap", "cap", r"cap([\d.]+)", lambda g: float(g[0]),
           lambda c, bs, h, sq, sk, rnd: float(c)),
    ModRow("alibi", "alibi", "alibi", r"alibi", lambda g: True,
           lambda c, bs, h, sq, sk, rnd: alibi_slopes(bs, h)),
    ModRow("bias", "bias", "bias", r"bias(h|b|1|full|keys)", lambda g: g[0],
           lambda c, bs, h, sq, sk, rnd: rnd(*BIAS_SHAPES[c](bs, h, sq, sk)), in_dtype=True,
           grad_shape=lambda bs, h, sq, sk: (bs, h, sq, sk)),
    ModRow("logit_scale", "logit", "lscale", r"lscale([\d.]+)", lambda g: float(g[0]),
           lambda c, bs, h, sq, sk, rnd: logit_scales(bs, h, c)),
)
assert [m.name for m in TEST_MODS] == [m.name for m in spec.SCORE_MODS], "one TEST_MODS row per spec.SCORE_MODS row"
MOD_GRADS = tuple(m.grad for m in TEST_MODS if m.grad)
GRAD_NAMES = ("dq", "dk", "dv", "dsinks") + MOD_GRADS
FLOAT32_GRADS = ("dsinks",) + MOD_GRADS


class Case:
    """One attention problem: inputs, kernel arguments, and the references both kernels are judged against.

    Inputs are N(0, 1) (times ``q_mul`` for q, so soft-capping reaches its non-linear range) rounded to ``dtype``
    and kept in float64; sinks the same times ``sink_mul``, or all ``sink_value``. Layouts are the kernels':
    q ``[bs, h, d, sq]``, k ``[bs, hk, d, sk]``, v ``[bs, hk, dv, sk]``, dy like o ``[bs, h, dv, sq]``, sinks
    ``[bs, h]`` (one) or ``[bs, h, sinks]``. ``cu``: packed sequence boundaries (``golden.packing_bounds``, rows
    past the last are padding that sees nothing). ``dropout_seed``: the ``(seed, offset)`` pair of
    ``golden.dropout.make_seed``. ``**mods``: the score modifications by their ``ModRow.case_kw`` (``softcap``:
    the cap; ``alibi``: True for ``alibi_slopes``; ``bias``: a ``BIAS_SHAPES`` key; ``logit``: ``logit_scales``
    times it), each false for off; the backward returns their gradients after dsinks, in ``TEST_MODS`` order.

    ``fwd()`` / ``check_fwd(o, lse)``: the forward kernel on these inputs and its check against the golden on the
    float64 inputs (``ref``) and in the dtype (``golden``). ``bwd()`` / ``check_bwd(grads)``: the backward kernel
    fed the float64 forward's O (rounded to the dtype) and LSE (float32), checked with the inputs baseline and the
    absolute band too. The references are computed on first use.
    """

    def __init__(self, bs=1, h=1, hk=1, d=64, dv=None, sq=256, sk=None, dtype="float32", mixed=False,
                 causal=False, window=None, window_size=None, sinks=0, sink_mul=1.0, cu=None, scale=None,
                 dropout_p=0.0, dropout_seed=(1234, 7), q_mul=1.0, sink_value=None, seed=0, **mods):
        unknown = set(mods) - {m.case_kw for m in TEST_MODS}
        if unknown:
            raise TypeError(f"Case: unknown keyword(s) {sorted(unknown)}")
        sk = sq if sk is None else sk
        dv = d if dv is None else dv
        self.dtype, self.mixed, self.tdt = dtype, mixed, DTYPES[dtype]
        gen = torch.Generator().manual_seed(seed)

        def rnd(*shape, mul=1.0):  # N(0, 1) rounded to the dtype, held in float64
            return (torch.randn(*shape, generator=gen, dtype=torch.float64) * mul).to(self.tdt).to(torch.float64)

        self.q64 = rnd(bs, h, d, sq, mul=q_mul)
        self.k64, self.v64, self.dy64 = rnd(bs, hk, d, sk), rnd(bs, hk, dv, sk), rnd(bs, h, dv, sq)
        self.sinks64 = None
        if sinks:
            self.sinks64 = rnd(bs, h, mul=sink_mul) if sinks == 1 else rnd(bs, h, sinks, mul=sink_mul)
            if sink_value is not None:  # one logit for every sink (dominant sinks, sinks of empty rows)
                self.sinks64 = torch.full_like(self.sinks64, sink_value).to(self.tdt).to(torch.float64)
        bmin = bmax = None
        if cu is not None:
            bmin, bmax = packing_bounds(cu, seqlen_q=sq)
        self.opts = dict(use_causal_mask=causal, softmax_scale=scale, sliding_window=window, bound_min=bmin,
                         bound_max=bmax, window_size=window_size)
        if dropout_p > 0.0:
            self.opts.update(dropout_p=dropout_p, dropout_seed=golden_dropout.make_seed(*dropout_seed))
        # the kernels' keywords: only the variants a case sets; the others stay at the kernels' defaults
        self.kwargs = {key: val for key, val in self.opts.items() if val is not None
                       and not (key == "dropout_p" and val == 0.0)}
        # the score modifications (in table order; an input drawn by ``rnd`` comes after every other input)
        self.mods = []
        for m in TEST_MODS:
            value = mods.get(m.case_kw)
            self.opts[m.keyword] = m.build(value, bs, h, sq, sk, rnd) if value else m.host.off
            if value:
                self.mods.append(m)
                val = self.opts[m.keyword]
                self.kwargs[m.keyword] = val.to(self.tdt) if m.in_dtype else val
        self.q, self.k, self.v, self.dy = (x.to(self.tdt) for x in (self.q64, self.k64, self.v64, self.dy64))
        self.sinks = None if self.sinks64 is None else self.sinks64.to(self.tdt)
        self.kwargs["use_causal_mask"] = causal
        self.kwargs["mixed_precision"] = mixed
        if self.sinks is not None:
            self.kwargs["sinks_ref"] = self.sinks
        self._bwd_refs = None

    @property
    def drop(self):
        """The dropout multiplier M / (1 - p) ``[bs, h, sq, sk]`` (float64) of the seed, or None without dropout
        (the golden's keep mask; built on use, as the forward's references regenerate it themselves)."""
        p = self.opts.get("dropout_p", 0.0)
        if not p:
            return None
        bs, h, _, sq = self.q64.shape
        keep = golden_dropout.keep_mask(self.opts["dropout_seed"], p, bs, h, sq, self.k64.shape[3])
        return keep.to(torch.float64) / (1.0 - p)

    # -------------------------------------------------------------------------------------------- forward
    def fwd(self, lnc=None, **extra):
        """attention_fwd on the inputs (torch tensors), optionally launched on ``lnc`` cores; returns (o, lse)."""
        kern = attention_fwd if lnc is None else attention_fwd[lnc]
        return kern(self.q, self.k, self.v, **dict(self.kwargs, **extra))

    def check_fwd(self, o, lse):
        """Assert the criterion for o (q's dtype) and the finite lse entries (float32); returns (o_ref, lse_ref)."""
        return check_fwd_outputs(o, lse, self.q, self.k, self.v, self.sinks, self.mixed, self.opts)

    # -------------------------------------------------------------------------------------------- backward
    def bwd_refs(self):
        """Dict with the backward kernel's positional arguments (``args``: q, k, v, o, dy in the dtype and lse in
        float32, numpy), the float64 reference gradients (``ref``), the golden in the dtype (``golden``), the
        inputs baseline (``inputs``) and the float64 forward's ``lse``."""
        if self._bwd_refs is None:
            no_drop = {key: val for key, val in self.opts.items() if key not in ("dropout_p", "dropout_seed")}
            drop = self.drop
            o, lse, _ = compute_o_lse(self.q64, self.k64, self.v64, sinks=self.sinks64, mixed_precision=False,
                                      dropout_mask=drop, **no_drop)
            ref = attention_bwd_torch_ref(self.q64, self.k64, self.v64, o, self.dy64, lse, sinks_ref=self.sinks64,
                                          **self.opts)
            low = [self.q, self.k, self.v, o.to(self.tdt), self.dy]
            lse32 = lse.to(torch.float32)
            golden = attention_bwd_torch_ref(*low, lse32, sinks_ref=self.sinks, mixed_precision=self.mixed,
                                             **self.opts)
            inputs = bwd_from_stats(*low, lse32, self.opts, sinks=self.sinks, drop=drop)
            self._bwd_refs = dict(args=[to_np(x) for x in low] + [to_np(lse32)], ref=ref, golden=golden,
                                  inputs=inputs, lse=lse, drop=drop)
        return self._bwd_refs

    def grad_names(self):
        """The names of the backward kernel's outputs, in order: dq, dk, dv, then dsinks if given, then the
        gradient of each score modification the case applies that has one (``TEST_MODS`` order)."""
        return ["dq", "dk", "dv"] + ["dsinks"] * (self.sinks is not None) + [m.grad for m in self.mods if m.grad]

    def bwd_kwargs(self):
        """The backward kernel's keywords (numpy arrays)."""
        return {key: (to_np(val) if isinstance(val, torch.Tensor) else val) for key, val in self.kwargs.items()}

    def bwd(self, k_section_len=None, lnc=None, **extra):
        """attention_bwd on the inputs, with K/V sections of ``k_section_len`` keys when given, launched on
        ``lnc`` cores when given; returns the gradients (dq, dk, dv[, dsinks])."""
        kern = attention_bwd if lnc is None else attention_bwd[lnc]
        if k_section_len is not None:
            extra["k_section_len"] = k_section_len
        for m in self.mods:  # a gradient computed only on request: request it
            if m.host.grad_flag:
                extra.setdefault(m.host.grad_flag, True)
        return kern(*self.bwd_refs()["args"], **self.bwd_kwargs(), **extra)

    def check_bwd(self, out, inputs=None):
        """Assert the criterion and the absolute band for every gradient; ``inputs`` replaces the inputs baseline
        (the kernel's formula from other O and LSE). Returns the measured numbers by name."""
        r = self.bwd_refs()
        inputs = r["inputs"] if inputs is None else inputs
        names = self.grad_names()
        assert len(out) == len(names)
        for name, got in zip(names, out):
            want = "float32" if name in FLOAT32_GRADS else self.dtype
            assert dtype_name(got.dtype) == want, f"{name}: dtype {got.dtype}, expected {want}"
        if self.sinks is not None:
            assert tuple(np.shape(out[3])) == tuple(self.sinks.shape)
        out = list(out)
        dims = (*self.q.shape[:2], self.q.shape[3], self.k.shape[3])
        for m in self.mods:  # a modification's gradient: its input's shape, or summed to it here (the bias's)
            if m.grad:
                i, shape = names.index(m.grad), tuple(self.opts[m.keyword].shape)
                assert tuple(np.shape(out[i])) == (shape if m.grad_shape is None else m.grad_shape(*dims)), m.grad
                if tuple(np.shape(out[i])) != shape:
                    out[i] = sum_to(out[i], shape)
        # a query row that sees no key has dq exactly 0; a key no query sees has dk, dv exactly 0
        b = self.opts
        vis = visibility_mask(self.q.shape[3], self.k.shape[3], b["use_causal_mask"], b["sliding_window"],
                              b["bound_min"], b["bound_max"], b["window_size"]).numpy()
        assert np.all(as_f64(out[0])[..., ~vis.any(axis=1)] == 0.0), "dq: a row that sees no key is not 0"
        for name, got in zip(("dk", "dv"), out[1:3]):
            assert np.all(as_f64(got)[..., ~vis.any(axis=0)] == 0.0), f"{name}: a key no query sees is not 0"
        stats = {}
        for name, got in zip(names, out):
            key = f"out_{name}_ref"
            stats[name] = check_close(name, got, r["ref"][key], r["golden"][key], self.dtype,
                                      inputs_err=inputs[name])
            absolute_band(name, got, r["ref"][key], self.dtype)
        return stats


def run_fwd_case(**kw):
    """Build a Case, run the forward kernel and check it; returns (case, o, lse)."""
    c = Case(**kw)
    o, lse = c.fwd()
    c.check_fwd(o, lse)
    return c, o, lse


def run_bwd_case(k_section_len=None, **kw):
    """Build a Case, run the backward kernel (``k_section_len`` forces sections) and check it; returns (case,
    grads)."""
    c = Case(**kw)
    out = c.bwd(k_section_len)
    c.check_bwd(out)
    return c, out


def make_qkv(bs=1, nheads=1, nheads_kv=1, d=64, sq=256, sk=None, dtype=torch.float32, seed=0):
    """q, k, v of a Case (torch, in ``dtype``), for forward tests that transform inputs before the check."""
    c = Case(bs=bs, h=nheads, hk=nheads_kv, d=d, sq=sq, sk=sk, dtype=dtype_name(dtype), seed=seed)
    return c.q, c.k, c.v


def run_and_check(q, k, v, *, sinks=None, bound_min=None, bound_max=None, causal=False, mixed=True, scale=None,
                  window=None):
    """The forward kernel on the given inputs, checked (``check_fwd_outputs``); returns (o, lse, o_ref, lse_ref)."""
    opts = dict(bound_min=bound_min, bound_max=bound_max, use_causal_mask=causal, softmax_scale=scale,
                sliding_window=window)
    o, lse = attention_fwd(q, k, v, sinks_ref=sinks, mixed_precision=mixed, **opts)
    o_ref, lse_ref = check_fwd_outputs(o, lse, q, k, v, sinks, mixed, opts)
    return o, lse, o_ref, lse_ref


# ----------------------------------------------------------------------------------------------- row vocabulary
# The matrix names a row by four short strings, so a row reads like FlashAttention's test ids:
#   dtype    "fp32" | "bf16" | "fp16", "-nomix" for mixed_precision=False
#   variant  "+"-joined tokens (``VARIANT_TOKENS``), "plain" for none
#   shape    "d{d}[v{dv}]-s{sq}[x{sk}]"
#   heads    "[b{bs}]h{h}k{hk}"
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# (the score modifications' tokens come from ``TEST_MODS``)
VARIANT_TOKENS = {
    "causal": r"causal", "swa": r"swa(\d+)", "win": r"win(-?\d+):(-?\d+)",
    "sinks": r"sinks(\d+)", "sinkmul": r"sinkmul([\d.]+)", "sinkval": r"sinkval([\d.]+)", "cu": r"cu([\d-]+)",
    "scale": r"scale([\d.]+)", "drop": r"drop([\d.]+)", "qmul": r"qmul([\d.]+)", "sec": r"sec(\d+)",
    "seed": r"seed(\d+)", **{m.token: m.pattern for m in TEST_MODS},
}
MOD_TOKENS = {m.token: m for m in TEST_MODS}


def case_kwargs(dtype, variant, shape, heads):
    """Case keywords of a matrix row (vocabulary above), plus ``k_section_len`` (token ``sec``) for the backward.
    Unknown tokens raise, so a typo in a row cannot silently drop a variant."""
    base, _, mix = dtype.partition("-")
    kw = dict(dtype=DTYPE_NAMES[base], mixed=mix != "nomix")
    m = re.fullmatch(r"d(\d+)(?:v(\d+))?-s(\d+)(?:x(\d+))?", shape)
    assert m, f"shape {shape!r}"
    kw.update(d=int(m[1]), dv=int(m[2]) if m[2] else None, sq=int(m[3]), sk=int(m[4]) if m[4] else None)
    m = re.fullmatch(r"(?:b(\d+))?h(\d+)k(\d+)", heads)
    assert m, f"heads {heads!r}"
    kw.update(bs=int(m[1] or 1), h=int(m[2]), hk=int(m[3]))
    sec = None
    for tok in ([] if variant == "plain" else variant.split("+")):
        name = next((n for n, pat in VARIANT_TOKENS.items() if re.fullmatch(pat, tok)), None)
        assert name is not None, f"unknown variant token {tok!r} in {variant!r}"
        g = re.fullmatch(VARIANT_TOKENS[name], tok).groups()
        if name in MOD_TOKENS:
            kw[MOD_TOKENS[name].case_kw] = MOD_TOKENS[name].parse(g)
        elif name == "causal":
            kw[name] = True
        elif name == "swa":
            kw["window"] = int(g[0])
        elif name == "win":
            kw["window_size"] = (int(g[0]), int(g[1]))
        elif name == "sinks":
            kw["sinks"] = int(g[0])
        elif name == "sinkmul":
            kw["sink_mul"] = float(g[0])
        elif name == "sinkval":
            kw["sink_value"] = float(g[0])
        elif name == "cu":
            kw["cu"] = [int(x) for x in g[0].split("-")]
        elif name == "scale":
            kw["scale"] = float(g[0])
        elif name == "drop":
            kw["dropout_p"] = float(g[0])
        elif name == "qmul":
            kw["q_mul"] = float(g[0])
        elif name == "sec":
            sec = int(g[0])
        elif name == "seed":
            kw["seed"] = int(g[0])
    return kw, sec


# ----------------------------------------------------------------------------------------------- fixtures
@pytest.fixture
def target(monkeypatch):
    """set_target(name): run the kernels as on that Trainium generation (trn1, trn2, trn3) for this test."""
    def set_target(name):
        monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", name)
    return set_target
