"""Candidates: whose kernels a harness run judges.

By default the harness judges this project's kernels (``runner.KernelCandidate``). ``nki-attn check
--candidate-bwd MODULE:FUNCTION`` (and ``--candidate-fwd``) judges someone else's instead: any function with the
backward signature our kernel and the NKI Library's ``attention_bwd`` share,

    bwd(q, k, v, o, dy, lse, sinks=None, bound_min=None, bound_max=None, use_causal_mask=False,
        mixed_precision=..., softmax_scale=None, sliding_window=None) -> (dq, dk, dv[, dsinks])

(layouts: q, o, dy, dq ``[b, h, d, sq]``; k, v, dk, dv ``[b, hk, d, sk]``; lse ``[b, h, 128, sq // 128]``, row
``t * 128 + p`` at ``[p, t]``; sinks, dsinks ``[b, h]`` or ``[b, h, n]``; bounds float32 ``[sq]``), and a forward
with our contract ``fwd(q, k, v, sinks, bound_min, bound_max, use_causal_mask=, mixed_precision=,
softmax_scale=, sliding_window=) -> (o, lse)`` or the NKI Library's ``attention_cte`` (``fwd_contract="cte"``:
called with its own arguments, its training outputs -max and 1/sum turned into lse = max + log(sum)). The side
not given is ours.

``MODULE`` is an importable module or a path to a ``.py`` file. On the simulator the module is imported after
``nki_attn.sim.install_as_nki()``, so its ``import nki`` gets the backend our kernels run on; with the real
``nki`` installed, the real one.

Refusals. A kernel rejects what it does not support: NKI kernels with ``assert`` (a compile-time error on
hardware), host code with ``ValueError`` / ``NotImplementedError``, and a function whose signature lacks a
parameter a row needs cannot take it. Such a failure *of a call into the candidate* is ``Unsupported``: the row
is reported as unsupported with the message and does not fail the run. Any other exception (IndexError,
TypeError inside the kernel, the simulator's hardware-limit errors, ...), wrong outputs, NaN, or a wrong number
of outputs is a failing row. An assert can also be a kernel's internal consistency check firing on a bug; the
harness cannot tell the two apart, so every unsupported row is listed with its message in the report and the
summary, and a run in which no row could be judged fails.
"""
import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys

import torch

from ..spec import GRAD_MODS
from .errors import CandidateError, Unsupported  # noqa: F401 - re-exported: candidates' refusals are named here
from .runner import KernelCandidate

BUILTIN = "nki-kernels"
# Exceptions that mean "this input is not supported" when a call into the candidate raises them.
REFUSALS = (AssertionError, ValueError, NotImplementedError)
FWD_CONTRACTS = ("lse", "cte")
PMAX = 128


@dataclasses.dataclass(frozen=True)
class CandidateSpec:
    """What to judge: ``bwd`` / ``fwd`` as ``MODULE:FUNCTION`` strings (None: ours), ``fwd_contract`` "lse" (our
    ``(o, lse)``) or "cte" (the NKI Library's ``attention_cte``). Picklable, so rows can run in worker processes."""

    bwd: str = None
    fwd: str = None
    fwd_contract: str = "lse"

    @property
    def builtin(self):
        """True when nothing external is judged (this project's kernels)."""
        return self.bwd is None and self.fwd is None

    def describe(self):
        """One line naming what is judged, e.g. ``bwd my_kernels.py:my_bwd + fwd nki-kernels``."""
        if self.builtin:
            return BUILTIN
        fwd = self.fwd + (" (attention_cte contract)" if self.fwd_contract == "cte" else "") if self.fwd else BUILTIN
        return f"bwd {self.bwd or BUILTIN} + fwd {fwd}"

    def as_dict(self):
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------------------------------- loading
def prepare_backend():
    """Make ``import nki`` in a candidate's module give the backend our kernels run on (the simulator here)."""
    from ..backend import BACKEND
    if BACKEND == "sim":
        from .. import sim
        sim.install_as_nki(force=True)


_LOADED = {}


def load_function(spec):
    """The callable named by ``spec``: ``MODULE:FUNCTION`` (an importable module) or ``PATH.py:FUNCTION``.

    A file's directory is put on ``sys.path`` first, so the module can import its neighbours. Raises ValueError
    naming the spec and what is wrong (no colon, module not found, import error, no such function, not callable).
    """
    if spec in _LOADED:
        return _LOADED[spec]
    target, sep, name = str(spec).rpartition(":")
    if not sep or not target or not name:
        raise ValueError(f"{spec!r} must be MODULE:FUNCTION or PATH.py:FUNCTION, e.g. my_kernels.py:my_bwd")
    prepare_backend()
    if target.endswith(".py") or os.sep in target:
        module = _import_file(spec, target)
    else:
        try:
            module = importlib.import_module(target)
        except Exception as exc:  # noqa: BLE001 - reported as a usage error naming the module
            raise ValueError(f"{spec!r}: importing module {target} failed: {type(exc).__name__}: {exc}") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise ValueError(f"{spec!r}: {target} has no attribute {name!r}")
    if not callable(fn):
        raise ValueError(f"{spec!r}: {name} is a {type(fn).__name__}, not a function or kernel")
    _LOADED[spec] = fn
    return fn


def _import_file(spec, target):
    """Import the module of a ``.py`` file. A file inside a package (folders with ``__init__.py``, such as a
    kernel of the NKI Library) is imported by its dotted name with the package's root on ``sys.path``, so its
    relative imports work; a lone file under a private name with its folder on ``sys.path``."""
    path = os.path.abspath(target)
    if not os.path.isfile(path):
        raise ValueError(f"{spec!r}: file {target} does not exist")
    folder, parts = os.path.dirname(path), [os.path.splitext(os.path.basename(path))[0]]
    while os.path.isfile(os.path.join(folder, "__init__.py")):
        parts.insert(0, os.path.basename(folder))
        folder = os.path.dirname(folder)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        if len(parts) > 1:
            return importlib.import_module(".".join(parts))
        mod_name = "nki_attn_candidate_" + hashlib.sha1(path.encode()).hexdigest()[:10]
        if mod_name in sys.modules:
            return sys.modules[mod_name]
        loader_spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[mod_name] = module
        try:
            loader_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[mod_name]
            raise
        return module
    except Exception as exc:  # noqa: BLE001 - reported as a usage error naming the file
        raise ValueError(f"{spec!r}: importing {target} failed: {type(exc).__name__}: {exc}") from None


def accepts_lnc(fn):
    """True when ``fn[2]`` gives a two-core launch of ``fn`` (NKI kernels do; plain functions do not)."""
    try:
        return callable(fn[2])
    except Exception:  # noqa: BLE001 - any failure means no
        return False


def _signature(fn):
    """The call signature of a kernel or function, or None when it cannot be read."""
    for obj in (getattr(fn, "signature", None), getattr(fn, "fn", None), fn):
        if isinstance(obj, inspect.Signature):
            return obj
        if obj is None:
            continue
        try:
            return inspect.signature(obj)
        except (TypeError, ValueError):
            continue
    return None


def _takes(sig, name):
    """True when a call may pass keyword ``name`` (unknown signatures are assumed to take it)."""
    if sig is None:
        return True
    return name in sig.parameters or any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())


def call(fn, args, kwargs, what):
    """``fn(*args, **kwargs)`` with refusals turned into ``Unsupported`` (module docstring)."""
    sig = _signature(fn)
    if sig is not None:
        try:
            sig.bind(*args, **kwargs)
        except TypeError as exc:
            raise Unsupported(f"{what}: its signature does not take this row's arguments ({exc})") from None
    try:
        return fn(*args, **kwargs)
    except REFUSALS as exc:
        raise Unsupported(f"{what} refused the row: {type(exc).__name__}: {exc}") from exc


def _trimmed(positional):
    """Drop trailing Nones so that a kernel without sinks or packing parameters can still run plain rows."""
    out = list(positional)
    while out and out[-1] is None:
        out.pop()
    return out


def _options(fn, use_causal_mask, mixed_precision, softmax_scale, sliding_window):
    """Keyword arguments of a call: only those that differ from the contract's defaults, and mixed_precision
    where the function takes it."""
    kw = {}
    if use_causal_mask:
        kw["use_causal_mask"] = True
    if _takes(_signature(fn), "mixed_precision"):
        kw["mixed_precision"] = mixed_precision
    if softmax_scale:
        kw["softmax_scale"] = softmax_scale
    if sliding_window:
        kw["sliding_window"] = sliding_window
    return kw


# ----------------------------------------------------------------------------------------------------- adapters
def cte_forward(fn, q, k, v, sinks=None, bound_min=None, bound_max=None, use_causal_mask=False,
                softmax_scale=None, sliding_window=None):
    """Our forward contract on top of the NKI Library's ``attention_cte`` in its training mode.

    Heads join the batch (``[b * h, d, sq]``; kv heads likewise, which is the library's GQA convention), v is
    passed as ``[b * hk, sk, d]``, ``tp_q=False, tp_k=False, tp_out=True, cache_softmax=True``; its outputs o
    ``[b * h, d, sq]``, -max and 1/sum ``[b * h, 128, sq // 128]`` become o ``[b, h, d, sq]`` and
    lse = max + log(sum) ``[b, h, 128, sq // 128]`` (float32). With a sliding window or packing bounds the
    library requires ``scale=1``, so q is scaled on the host, in its dtype, as our kernels do on the device. It takes one sink
    per head: rows with more are ``Unsupported``.
    """
    b, h, d, sq = q.shape
    hk, sk = k.shape[1], k.shape[3]
    if v.shape[2] != d:
        raise Unsupported(f"attention_cte takes one head_dim for q, k and v; the row has d_qk={d}, d_v={v.shape[2]}")
    scale = softmax_scale or d ** -0.5
    q3 = q.reshape(b * h, d, sq)
    k3 = k.reshape(b * hk, d, sk)
    v3 = v.reshape(b * hk, d, sk).transpose(1, 2).contiguous()
    kw = dict(causal_mask=bool(use_causal_mask), tp_q=False, tp_k=False, tp_out=True, cache_softmax=True)
    if sliding_window or bound_min is not None:
        # its sliding-window and bounds (range_select) paths require scale=1
        q3 = (q3.to(torch.float32) * scale).to(q.dtype)
        scale = 1.0
    if sliding_window:
        kw["sliding_window"] = int(sliding_window)
    kw["scale"] = float(scale)
    if sinks is not None:
        if sinks.dim() == 3 and sinks.shape[-1] != 1:
            raise Unsupported(f"attention_cte takes one sink per head; the row has {sinks.shape[-1]}")
        kw["sink"] = sinks.reshape(b * h, 1).to(torch.float32).contiguous()
    if bound_min is not None:
        kw["bound_min"] = bound_min.reshape(sq, 1).contiguous()
        kw["bound_max"] = bound_max.reshape(sq, 1).contiguous()
    res = call(fn, (q3, k3, v3), kw, "candidate forward (attention_cte contract)")
    if not isinstance(res, (tuple, list)) or len(res) != 3:
        raise CandidateError("candidate forward (attention_cte contract) must return (o, -max, 1/sum) with "
                             f"cache_softmax=True; got {type(res).__name__}"
                             + (f" of {len(res)}" if isinstance(res, (tuple, list)) else ""))
    o, neg_max, recip = (torch.as_tensor(x) for x in res)
    lse = -neg_max.to(torch.float32) - torch.log(recip.to(torch.float32))
    return o.reshape(b, h, d, sq), lse.reshape(b, h, PMAX, -1)


# ----------------------------------------------------------------------------------------------------- candidate
class ExternalCandidate:
    """Someone else's backward and/or forward (``CandidateSpec``), ours for the side not given; ``lnc=2``
    launches the given kernels as ``kernel[2]`` (refused by the CLI when they do not accept it)."""

    def __init__(self, spec, lnc=1):
        self.spec, self.lnc = spec, lnc
        self.name = spec.describe()
        self.ours = KernelCandidate(lnc=lnc)
        self._bwd = load_function(spec.bwd) if spec.bwd else None
        self._fwd = load_function(spec.fwd) if spec.fwd else None
        if lnc == 2:
            self._bwd = self._bwd[2] if self._bwd is not None else None
            self._fwd = self._fwd[2] if self._fwd is not None else None

    def with_lnc(self, lnc):
        """The same candidate launched with ``lnc`` cores, or None when a given kernel does not accept ``[lnc]``."""
        fns = [load_function(s) for s in (self.spec.bwd, self.spec.fwd) if s]
        if lnc != 1 and not all(accepts_lnc(f) for f in fns):
            return None
        return ExternalCandidate(self.spec, lnc)

    def fwd(self, q, k, v, sinks=None, bound_min=None, bound_max=None, use_causal_mask=False, mixed_precision=True,
            softmax_scale=None, sliding_window=None, **variants):
        """``variants``: the attention-variant keywords a row uses (``window_size``, ``dropout_p``,
        ``dropout_seed``, and the kernel keyword of each score modification of ``nki_attn.spec.SCORE_MODS`` it
        sets: ``softcap``, ``alibi_slopes``, ``attn_bias``, ``logit_scale``), passed by name; a candidate whose
        signature lacks one is Unsupported."""
        if self._bwd is not None:
            # a backward that cannot take the row's arguments refuses it before any forward work is spent: the
            # bind the backward's own call will make, with the forward's tensors standing in for o, dy and lse
            sig = _signature(self._bwd)
            if sig is not None:
                try:
                    sig.bind(*_trimmed((q, k, v, q, q, q, sinks, bound_min, bound_max)),
                             **_options(self._bwd, use_causal_mask, mixed_precision, softmax_scale, sliding_window),
                             **variants)
                except TypeError as exc:
                    raise Unsupported(f"candidate backward: its signature does not take this row's arguments "
                                      f"({exc})") from None
        if self._fwd is None:
            return self.ours.fwd(q, k, v, sinks, bound_min, bound_max, use_causal_mask=use_causal_mask,
                                 mixed_precision=mixed_precision, softmax_scale=softmax_scale,
                                 sliding_window=sliding_window, **variants)
        if self.spec.fwd_contract == "cte":
            if variants:
                raise Unsupported(f"the attention_cte adapter passes none of {sorted(variants)}")
            return cte_forward(self._fwd, q, k, v, sinks, bound_min, bound_max, use_causal_mask, softmax_scale,
                               sliding_window)
        res = call(self._fwd, _trimmed((q, k, v, sinks, bound_min, bound_max)),
                   {**_options(self._fwd, use_causal_mask, mixed_precision, softmax_scale, sliding_window),
                    **variants},
                   "candidate forward")
        if not isinstance(res, (tuple, list)) or len(res) != 2:
            raise CandidateError(f"candidate forward must return (o, lse); got {_describe(res)}")
        return res[0], res[1]

    def bwd(self, q, k, v, o, dy, lse, sinks=None, bound_min=None, bound_max=None, use_causal_mask=False,
            mixed_precision=True, softmax_scale=None, sliding_window=None, **variants):
        """``variants`` as in ``fwd``."""
        if self._bwd is None:
            return self.ours.bwd(q, k, v, o, dy, lse, sinks, bound_min, bound_max, use_causal_mask=use_causal_mask,
                                 mixed_precision=mixed_precision, softmax_scale=softmax_scale,
                                 sliding_window=sliding_window, **variants)
        res = call(self._bwd, _trimmed((q, k, v, o, dy, lse, sinks, bound_min, bound_max)),
                   {**_options(self._bwd, use_causal_mask, mixed_precision, softmax_scale, sliding_window),
                    **variants},
                   "candidate backward")
        # then one gradient per score modification whose gradient the row asks for, in SCORE_MODS order
        names = "dq, dk, dv" + (", dsinks" if sinks is not None else "") + "".join(
            ", d" + m.name for m in GRAD_MODS
            if (variants.get(m.grad_flag) if m.grad_flag else m.kernel in variants))
        want = names.count(",") + 1
        if not isinstance(res, (tuple, list)) or len(res) != want:
            raise CandidateError(f"candidate backward must return ({names}); got {_describe(res)}")
        return res


def _describe(res):
    return f"{type(res).__name__} of {len(res)}" if isinstance(res, (tuple, list)) else type(res).__name__


_CACHE = {}


def make(spec=None, lnc=1):
    """The candidate a row runs: ours for ``spec`` None or builtin, else an ``ExternalCandidate`` (cached per
    process, so worker processes load a candidate's module once)."""
    if spec is None or spec.builtin:
        return KernelCandidate(lnc=lnc)
    key = (spec, lnc)
    if key not in _CACHE:
        _CACHE[key] = ExternalCandidate(spec, lnc)
    return _CACHE[key]
