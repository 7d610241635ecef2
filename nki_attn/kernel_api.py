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
``dropout_seed``, ``logit_scale``: ``VARIANT_KEYWORDS``). ``variant_problem`` checks the arguments against the rules of
docs/semantics.md alone. The PyTorch op pair (``nki_attn.ops``) launches the bare kernels: its arguments were
checked once on the host (``nki_attn.spec``), and it asks ``CheckedKernel.problem_of`` only when a kernel's own
assert fails.
"""
import inspect

from .backend import nl
from .kernels import attention_bwd as _bwd
from .kernels import attention_fwd as _fwd
from .kernels import score_mods as _score_mods
from .kernels import validation as _validation

# the variant keywords of both kernels, with their defaults (the "off" value of each variant): the score
# modifications' inputs from their table (``kernels.score_mods.SCORE_MODS``), then the window and dropout
VARIANT_KEYWORDS = tuple((m.keywords[0], m.off) for m in _score_mods.SCORE_MODS) + (
    ("window_size", None), ("dropout_p", 0.0), ("dropout_seed", None))


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


def variant_problem(q, k, v, o=None, dy=None, lse=None, sinks=None, bound_min=None, bound_max=None,
                    use_causal_mask=False, softmax_scale=None, sliding_window=None, window_size=None, dropout_p=0.0,
                    dropout_seed=None, **mods):
    """The first problem of these arguments under the rules of docs/semantics.md (``validation.attention_problem``),
    or None. Tensors are any host arrays (torch, numpy); layouts as in ``validation.attention_problem``; the
    score modifications' keywords (``softcap``, ``alibi_slopes``, ``attn_bias``, ``bias_grad``, ``logit_scale``:
    ``kernels.score_mods.MOD_KEYWORDS``) come as ``mods`` (TypeError for any other keyword)."""
    for key in mods:
        if key not in _score_mods.MOD_KEYWORDS:
            raise TypeError(f"variant_problem() got an unexpected keyword argument {key!r}")
    mods = {key: _host(value) for key, value in mods.items()}
    return _validation.attention_problem(
        _host(q), _host(k), _host(v), _host(o), _host(dy), _host(lse), _host(sinks), _host(bound_min),
        _host(bound_max), use_causal_mask, softmax_scale, sliding_window, window_size, dropout_p,
        _host(dropout_seed), mods=mods)


class CheckedKernel:
    """A kernel whose call first evaluates ``problem`` (the kernel's own check, same parameters) on the host, once,
    and raises ``ValueError`` with its message; ``kernel[lnc]`` selects the LNC degree as on the kernel itself."""

    def __init__(self, kernel, problem, lnc=None):
        self.kernel = kernel
        self.problem = problem
        self.lnc = lnc
        self.signature = inspect.signature(getattr(kernel, "fn", kernel))
        params = inspect.signature(problem).parameters
        self.problem_params = params
        # a problem function taking ``**mods`` (the score modifications' keywords) gets every argument
        self.problem_takes_all = any(p.kind == p.VAR_KEYWORD for p in params.values())

    def __getitem__(self, lnc):
        return CheckedKernel(self.kernel, self.problem, lnc)

    def accepts(self, name):
        """True when the kernel itself has the keyword ``name``."""
        return name in self.signature.parameters

    def problem_of(self, *args, **kwargs):
        """The kernel's own verdict on these arguments: None when valid, else its message. TypeError for a call
        that does not fit the kernel's signature."""
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        given = {}
        for name, value in bound.arguments.items():
            if name in self.problem_params or self.problem_takes_all:
                given[name] = _host(value)
        return self.problem(**given)

    def check(self, *args, **kwargs):
        """Raise ``ValueError`` (or ``TypeError`` for a call that does not fit the signature) without launching."""
        message = self.problem_of(*args, **kwargs)
        if message is not None:
            raise ValueError(message)

    def __call__(self, *args, **kwargs):
        self.check(*args, **kwargs)
        kernel = self.kernel if self.lnc is None else self.kernel[self.lnc]
        return kernel(*args, **kwargs)

    def __repr__(self):
        return f"<checked {self.kernel!r}{'' if self.lnc is None else f'[{self.lnc}]'}>"


attention_fwd = CheckedKernel(_fwd.attention_fwd, _fwd.fwd_problem)
attention_bwd = CheckedKernel(_bwd.attention_bwd, _bwd.bwd_problem)

__all__ = ["attention_fwd", "attention_bwd", "CheckedKernel", "VARIANT_KEYWORDS", "variant_problem"]
