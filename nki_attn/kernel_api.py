"""Host-side entry points for calling the NKI kernels directly: check the arguments, then launch.

Kernel code is NKI's compile-time subset, which has no ``raise``: an invalid argument makes the kernel fail an
``assert`` (on hardware, a compile error). These wrappers run each kernel's own check first, in ordinary Python,
and raise ``ValueError`` with the kernel's message before anything is launched::

    from nki_attn.kernel_api import attention_bwd, attention_fwd
    o, lse = attention_fwd(q, k, v, use_causal_mask=True)             # same signature as the kernel
    dq, dk, dv = attention_bwd[2](q, k, v, o, dy, lse, use_causal_mask=True)   # kernel[lnc] works too

Arguments and results are those of ``nki_attn.kernels.attention_fwd.attention_fwd`` /
``nki_attn.kernels.attention_bwd.attention_bwd`` (layouts in their docstrings and docs/kernel-*.md), including the
variant keywords of docs/semantics.md (``softcap``, ``alibi_slopes``, ``window_size``, ``dropout_p``,
``dropout_seed``: ``VARIANT_KEYWORDS``). A variant keyword the kernel does not take is accepted at its default
(and dropped) and refused with ``ValueError`` otherwise, so callers can always pass the full keyword set.
``variant_problem`` checks the arguments against the rules of docs/semantics.md alone (every feature allowed),
independently of what a kernel implements.
"""
import inspect

from .backend import nl
from .kernels import attention_bwd as _bwd
from .kernels import attention_fwd as _fwd
from .kernels import validation as _validation

# the keywords issue #14 appended to both kernels, with their defaults (the "off" value of each variant)
VARIANT_KEYWORDS = (("softcap", 0.0), ("alibi_slopes", None), ("window_size", None), ("dropout_p", 0.0),
                    ("dropout_seed", None))


class _HostTensor:
    """Shape and dtype of a host array (numpy, CPU torch) as the kernel-side checks read them: ``shape`` a tuple
    of ints, ``dtype`` the NKI dtype of the same name (so ``str(dtype)`` compares like it does in a kernel)."""

    __slots__ = ("shape", "dtype")

    def __init__(self, x):
        self.shape = tuple(int(s) for s in x.shape)
        name = str(x.dtype).split(".")[-1]  # torch.bfloat16 -> bfloat16; numpy and ml_dtypes print the bare name
        self.dtype = getattr(nl, name, name)


def _host(v):
    return _HostTensor(v) if hasattr(v, "shape") and hasattr(v, "dtype") else v


def _at_default(value, default):
    if default is None:
        return value is None
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value == default


def variant_problem(q, k, v, o=None, dy=None, lse=None, sinks=None, bound_min=None, bound_max=None,
                    use_causal_mask=False, softmax_scale=None, sliding_window=None, softcap=0.0, alibi_slopes=None,
                    window_size=None, dropout_p=0.0, dropout_seed=None):
    """The first problem of these arguments under the rules of docs/semantics.md with every variant allowed
    (``validation.attention_problem`` with all ``FEATURES``), or None. Tensors are any host arrays (torch,
    numpy); layouts as in ``validation.attention_problem``."""
    return _validation.attention_problem(
        _host(q), _host(k), _host(v), _host(o), _host(dy), _host(lse), _host(sinks), _host(bound_min),
        _host(bound_max), use_causal_mask, softmax_scale, sliding_window, softcap, _host(alibi_slopes),
        window_size, dropout_p, _host(dropout_seed), supports=_validation.FEATURES)


_SPEC_PARAMS = tuple(inspect.signature(variant_problem).parameters)


class CheckedKernel:
    """A kernel whose call first evaluates ``problem`` (the kernel's own check, same parameters) on the host and
    raises ``ValueError`` with its message; ``kernel[lnc]`` selects the LNC degree as on the kernel itself."""

    def __init__(self, kernel, problem, lnc=None):
        self.kernel = kernel
        self.problem = problem
        self.lnc = lnc
        self.signature = inspect.signature(getattr(kernel, "fn", kernel))
        self.problem_params = inspect.signature(problem).parameters
        self.name = getattr(getattr(kernel, "fn", kernel), "__name__", "the kernel")

    def __getitem__(self, lnc):
        return CheckedKernel(self.kernel, self.problem, lnc)

    def accepts(self, name):
        """True when the kernel itself has the keyword ``name``."""
        return name in self.signature.parameters

    def _kernel_kwargs(self, kwargs):
        # variant keywords the kernel does not have: drop them at their default, refuse them otherwise
        out = dict(kwargs)
        for item in VARIANT_KEYWORDS:
            name, default = item
            if name in out and not self.accepts(name):
                value = out.pop(name)
                if not _at_default(value, default):
                    shown = "a tensor" if hasattr(value, "shape") else repr(value)
                    raise ValueError(f"{name}={shown} is not supported by {self.name} (this kernel has no {name} "
                                     f"argument yet; leave it at {default!r})")
        return out

    def check(self, *args, **kwargs):
        """Raise ``ValueError`` (or ``TypeError`` for a call that does not fit the signature) without launching."""
        self._spec_check(args, kwargs)
        self._check(args, self._kernel_kwargs(kwargs))

    def _spec_check(self, args, kwargs):
        # the rules of docs/semantics.md first (variant_problem), so that an invalid value is reported as such
        # even for a variant this kernel does not implement; then the kernel's own check
        named = dict(zip(self.signature.parameters, args))
        named.update(kwargs)
        spec = {}
        for name, value in named.items():
            key = name[:-4] if name.endswith("_ref") else name
            if key in _SPEC_PARAMS:
                spec[key] = value
        if "q" in spec and "k" in spec and "v" in spec:
            message = variant_problem(**spec)
            if message is not None:
                raise ValueError(message)

    def _check(self, args, kwargs):
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        given = {}
        for name, value in bound.arguments.items():
            if name in self.problem_params:
                given[name] = _host(value)
        message = self.problem(**given)
        if message is not None:
            raise ValueError(message)

    def __call__(self, *args, **kwargs):
        self._spec_check(args, kwargs)
        kwargs = self._kernel_kwargs(kwargs)
        self._check(args, kwargs)
        kernel = self.kernel if self.lnc is None else self.kernel[self.lnc]
        return kernel(*args, **kwargs)

    def __repr__(self):
        return f"<checked {self.kernel!r}{'' if self.lnc is None else f'[{self.lnc}]'}>"


attention_fwd = CheckedKernel(_fwd.attention_fwd, _fwd.fwd_problem)
attention_bwd = CheckedKernel(_bwd.attention_bwd, _bwd.bwd_problem)

__all__ = ["attention_fwd", "attention_bwd", "CheckedKernel", "VARIANT_KEYWORDS", "variant_problem"]


# ----------------------------------------------------------------------------------------------------- features
class _Probe:
    """A stand-in array for probing a kernel's checks: ``shape`` and an NKI ``dtype``, no data."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape, dtype="float32"):
        self.shape = tuple(shape)
        self.dtype = getattr(nl, dtype)


def _probe_args(feature, d_qk=64, d_v=64, sq=256, sk=256):
    """Smallest valid arguments exercising ``feature`` (a ``validation.FEATURES`` name), for both kernels."""
    kw = {}
    if feature == "causal_unequal":
        sq, sk = 128, 256
        kw["use_causal_mask"] = True
    elif feature == "head_dim_any":
        d_qk = d_v = 199
    elif feature == "d_v":
        d_v = 32
    elif feature == "softcap":
        kw["softcap"] = 30.0
    elif feature == "alibi":
        kw["alibi_slopes"] = _Probe((1, 2))
    elif feature == "window_size":
        kw["window_size"] = (16, 16)
    elif feature == "dropout":
        kw["dropout_p"] = 0.25
        kw["dropout_seed"] = _Probe(DROPOUT_SEED_SHAPE, DROPOUT_SEED_DTYPE)
    q = _Probe((1, 2, d_qk, sq))
    k = _Probe((1, 1, d_qk, sk))
    v = _Probe((1, 1, d_v, sk))
    o = _Probe((1, 2, d_v, sq))
    lse = _Probe((1, 2, 128, sq // 128))
    return q, k, v, o, lse, kw


# the kernels' dropout seed: int32 (or uint32) [2] = (seed, offset), docs/semantics.md "Dropout"
DROPOUT_SEED_SHAPE = _validation.DROPOUT_SEED_SHAPE
DROPOUT_SEED_DTYPE = "int32"
_SUPPORT_CACHE = {}


def supports(feature):
    """True when both kernels implement ``feature`` (a ``validation.FEATURES`` name): their own checks accept a
    minimal call that uses it. The torch API routes a variant natively when supported and raises
    NotImplementedError otherwise. Cached per feature (the kernels are fixed for the life of the process)."""
    if feature not in _validation.FEATURES:
        raise ValueError(f"feature={feature!r} must be one of {_validation.FEATURES}")
    key = (feature, attention_fwd.kernel, attention_bwd.kernel)
    if key not in _SUPPORT_CACHE:
        q, k, v, o, lse, kw = _probe_args(feature)
        ok = True
        for item in ((attention_fwd, (q, k, v)), (attention_bwd, (q, k, v, o, o, lse))):
            checked, args = item
            try:
                checked.check(*args, **kw)
            except (ValueError, TypeError):
                ok = False
        _SUPPORT_CACHE[key] = ok
    return _SUPPORT_CACHE[key]


__all__ += ["supports", "DROPOUT_SEED_SHAPE", "DROPOUT_SEED_DTYPE"]
