"""Host-side entry points for calling the NKI kernels directly: check the arguments, then launch.

Kernel code is NKI's compile-time subset, which has no ``raise``: an invalid argument makes the kernel fail an
``assert`` (on hardware, a compile error). These wrappers run each kernel's own check first, in ordinary Python,
and raise ``ValueError`` with the kernel's message before anything is launched::

    from nki_attn.kernel_api import attention_bwd, attention_fwd
    o, lse = attention_fwd(q, k, v, use_causal_mask=True)             # same signature as the kernel
    dq, dk, dv = attention_bwd[2](q, k, v, o, dy, lse, use_causal_mask=True)   # kernel[lnc] works too

Arguments and results are those of ``nki_attn.kernels.attention_fwd.attention_fwd`` /
``nki_attn.kernels.attention_bwd.attention_bwd`` (layouts in their docstrings and docs/kernel-*.md).
"""
import inspect

from .backend import nl
from .kernels import attention_bwd as _bwd
from .kernels import attention_fwd as _fwd


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


class CheckedKernel:
    """A kernel whose call first evaluates ``problem`` (the kernel's own check, same parameters) on the host and
    raises ``ValueError`` with its message; ``kernel[lnc]`` selects the LNC degree as on the kernel itself."""

    def __init__(self, kernel, problem, lnc=None):
        self.kernel = kernel
        self.problem = problem
        self.lnc = lnc
        self.signature = inspect.signature(getattr(kernel, "fn", kernel))

    def __getitem__(self, lnc):
        return CheckedKernel(self.kernel, self.problem, lnc)

    def check(self, *args, **kwargs):
        """Raise ``ValueError`` (or ``TypeError`` for a call that does not fit the signature) without launching."""
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        message = self.problem(**{k: _host(v) for k, v in bound.arguments.items()})
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

__all__ = ["attention_fwd", "attention_bwd", "CheckedKernel"]
