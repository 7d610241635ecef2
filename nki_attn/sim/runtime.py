"""Kernel objects and launches: ``nki.jit``, ``kernel[lnc](...)``, ``nki.simulate``.

A launch turns every numpy array / CPU torch tensor argument into an HBM tensor (``shared_hbm`` under LNC2),
runs the kernel body once per NeuronCore (LNC2: two threads, each with its own ``nl.program_id``), copies back
into the caller's arrays any argument the kernel wrote, and converts the returned ``shared_hbm`` tensors to
arrays of the caller's kind (numpy in, numpy out; torch in, torch out).
"""
import contextlib
import functools
import sys
import threading

import numpy as np

from . import checks, context, frontend, replay
from .errors import NkiValidationError
from .tensor import NkiTensor, from_array, private_hbm, shared_hbm, to_array


def _is_torch(x):
    t = sys.modules.get("torch")
    return t is not None and isinstance(x, t.Tensor)


def _torch_to_numpy(x):
    import torch
    x = x.detach()
    if x.device.type != "cpu":
        raise NkiValidationError(f"the simulator runs on CPU tensors; got a tensor on {x.device}")
    x = x.contiguous()
    if x.dtype == torch.bfloat16:
        import ml_dtypes
        return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return x.numpy()


def _numpy_to_torch(a):
    import ml_dtypes
    import torch
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


class Kernel:
    """A kernel function; ``kernel[lnc]`` selects the LNC degree, calling it launches on the simulator."""

    def __init__(self, fn, lnc=None):
        self.fn = fn
        self.lnc = lnc
        functools.update_wrapper(self, fn)

    def __getitem__(self, lnc):
        if isinstance(lnc, tuple):
            raise NkiValidationError(f"kernel[{lnc}]: multi-axis SPMD grids are legacy; use kernel[lnc] with "
                                     f"lnc in (1, 2)")
        if not isinstance(lnc, (int, np.integer)) or int(lnc) not in (1, 2):
            raise NkiValidationError(f"kernel[{lnc!r}]: the LNC degree must be 1 or 2")
        return Kernel(self.fn, int(lnc))

    def __call__(self, *args, **kwargs):
        return launch(self.fn, self.lnc, args, kwargs)

    def __repr__(self):
        return f"<nki kernel {self.fn.__name__}{'' if self.lnc is None else f'[{self.lnc}]'}>"


def jit(fn=None, **kwargs):
    """``@nki.jit``: wrap a kernel function. ``platform_target=`` is rejected (use
    NEURON_PLATFORM_TARGET_OVERRIDE); ``mode=`` is deprecated and ignored."""
    if "platform_target" in kwargs:
        raise NkiValidationError("jit(platform_target=...) is no longer accepted; set "
                                 "NEURON_PLATFORM_TARGET_OVERRIDE instead")
    unknown = set(kwargs) - {"mode", "debug_kernel", "show_compiler_tool", "additional_compile_opt"}
    if unknown:
        raise NkiValidationError(f"jit: unknown keyword arguments {sorted(unknown)}")
    if fn is None:
        return lambda f: jit(f, **kwargs)
    if isinstance(fn, Kernel):
        return fn
    return Kernel(fn)


def simulate(kernel):
    """``nki.simulate(kernel)(*args)`` / ``nki.simulate(kernel[2])(*args)``: run on the CPU simulator."""
    if not isinstance(kernel, Kernel):
        kernel = Kernel(kernel)
    return lambda *args, **kwargs: launch(kernel.fn, kernel.lnc, args, kwargs)


def simulate_kernel(kernel, *args, **kwargs):
    """Older name: ``nki.simulate_kernel(kernel, *args, **kwargs)``."""
    return simulate(kernel)(*args, **kwargs)


class _Arg:
    __slots__ = ("original", "tensor", "torch")

    def __init__(self, original, tensor, is_torch):
        self.original = original
        self.tensor = tensor
        self.torch = is_torch


def _convert_args(values, buffer, record, path="arg"):
    out = []
    for i, v in enumerate(values):
        if isinstance(v, np.ndarray) or _is_torch(v):
            is_t = _is_torch(v)
            arr = _torch_to_numpy(v) if is_t else v
            t = from_array(arr, buffer, name=f"{path}{i}")
            record.append(_Arg(v, t, is_t))
            out.append(t)
        elif isinstance(v, list) and any(isinstance(e, np.ndarray) or _is_torch(e) for e in v):
            raise NkiValidationError(f"{path}{i}: list kernel arguments are rejected by the compiler; pass a tuple")
        elif isinstance(v, tuple) and any(isinstance(e, np.ndarray) or _is_torch(e) for e in v):
            out.append(tuple(_convert_args(v, buffer, record, path=f"{path}{i}.")))
        else:
            out.append(v)
    return out


_BLAS_ONE_THREAD_MNK = 65536 * 4  # OpenBLAS's own one-thread bound on M*N*K (see launch)
_BLAS = []  # the threadpoolctl controller, made once (finding the loaded BLAS libraries takes milliseconds)


def _one_blas_thread():
    """Context limiting numpy's BLAS to one thread. A simulated matmul is at most 128x128x512: threading it
    buys nothing on an idle machine and, with several processes (pytest -n, harness -j) on few cores,
    oversubscription made launches 3-7x slower (docs/performance.md)."""
    if not _BLAS:
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:  # optional at run time: only speed depends on it
            _BLAS.append(None)
        else:
            _BLAS.append(ThreadpoolController().select(user_api="blas"))
    blas = _BLAS[0]
    if blas is None or all(lib.get("num_threads") == 1 for lib in blas.info()):
        return contextlib.nullcontext()
    return blas.limit(limits=1)


def launch(fn, lnc, args, kwargs):
    """Run ``fn`` on ``lnc`` simulated cores (``None``: no brackets, one core, program_ndim() == 0).

    The NKI frontend check (``nki_attn.sim.frontend``) runs first: code the compiler refuses raises
    ``NkiFrontendError`` before any instruction runs, and the launch runs the instrumented code that checks the
    tracing rules. A launch whose signature was traced before replays the recorded instructions instead of
    running the kernel body (``nki_attn.sim.replay``)."""
    checked = frontend.prepare(fn, args, kwargs)
    key = replay.signature(fn, lnc, args, kwargs)
    # The hardware computes IEEE results (NaN, inf) without complaint; numpy's floating-point warnings on such
    # values are not the kernel's to report. errstate is per thread: run() below sets it for LNC2 cores too.
    if key is not None:
        prog = replay.lookup(key)
        # a program replays one launch at a time (its storages are reused); a concurrent one traces
        if prog is not None and prog.lock.acquire(blocking=False):
            try:
                # OpenBLAS runs a product with M*N*K <= 65536 x GEMM_MULTITHREAD_THRESHOLD (4 by default) on
                # one thread whatever its setting (our reading of its interface/gemm.c), so for a program whose
                # products are all that small the limit changes nothing but its own cost: switching BLAS to one
                # thread and back at every launch wakes its worker threads, which then spin on a core for a
                # while, and on a 2-core machine that doubled the wall time of a tiny model's training step.
                # Such a program leaves the setting alone.
                limit = _one_blas_thread() if prog.blas_size > _BLAS_ONE_THREAD_MNK else contextlib.nullcontext()
                with limit, np.errstate(all="ignore"):
                    return _replay(prog, lnc, args, kwargs)
            finally:
                prog.lock.release()
        if not replay.should_record(key):
            key = None
    with _one_blas_thread(), np.errstate(all="ignore"):
        with checked:
            return _launch(fn, lnc, args, kwargs, key)


def _launch(fn, lnc, args, kwargs, key=None):
    n = lnc or 1
    lau = context.Launch(n, grid=lnc is not None)
    if n > 1 and lau.version < 3:
        raise NkiValidationError(f"kernel[{n}]: LNC2 exists on trn2/trn3 only; the target is "
                                 f"{context.target_name(lau.version)}")
    prev = getattr(context._local, "state", None)
    states = [context.CoreState(lau, pid, checks.MemAccount(lau.version, pid, lau.capacity)
                                if lau.track_memory else None) for pid in range(n)]
    context.set_current(states[0])
    rec = replay.Recording() if key is not None and n == 1 else None
    try:
        record = []
        buffer = shared_hbm if n > 1 else private_hbm
        keys = list(kwargs)
        conv = _convert_args(list(args) + [kwargs[k] for k in keys], buffer, record)
        targs, tkw = conv[:len(args)], dict(zip(keys, conv[len(args):]))
        results = [None] * n
        errors = [None] * n
        if rec is not None:
            for i, a in enumerate(record):
                rec.add_storage(a.tensor.storage, arg=i)
            states[0].recorder = rec

        def run(pid):
            context.set_current(states[pid])
            try:
                with np.errstate(all="ignore"):
                    results[pid] = fn(*targs, **tkw)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                errors[pid] = exc
            finally:
                context.set_current(None)

        if n == 1:
            results[0] = fn(*targs, **tkw)
        else:
            threads = [threading.Thread(target=run, args=(pid,), name=f"nki-core{pid}") for pid in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for e in errors:
                if e is not None:
                    raise e
    finally:
        states[0].recorder = None
        context.set_current(prev)
        stats = checks.LaunchStats(lau, states)
        lau.peak_sbuf_bytes, lau.peak_psum_banks = stats.peak_sbuf_bytes, stats.peak_psum_banks
        checks.set_last_launch_stats(stats)
    out = _finish(results[0], record, lau)
    if rec is not None:
        replay.store(key, rec, [a.tensor for a in record], results[0], stats, lau.strict)
    return out


def _finish(res, record, lau):
    """After the kernel: strict output check, arguments the kernel wrote copied back, results converted."""
    if lau.strict:
        _check_outputs(res)
    for a in record:
        if a.tensor.storage.dirty:
            back = to_array(a.tensor)
            if a.torch:
                a.original.copy_(_numpy_to_torch(back).to(a.original.dtype))
            else:
                a.original[...] = back
    as_torch = any(a.torch for a in record)
    return _convert_results(res, as_torch, record)


def _array_args(values, out):
    """The array arguments in ``_convert_args``' order: (original, numpy array, is torch)."""
    for v in values:
        if isinstance(v, np.ndarray) or _is_torch(v):
            is_t = _is_torch(v)
            out.append((v, _torch_to_numpy(v) if is_t else v, is_t))
        elif isinstance(v, tuple):
            _array_args(v, out)
    return out


def _replay(prog, lnc, args, kwargs):
    """A launch of a recorded signature: the recorded instructions on the new arguments' data."""
    lau = context.Launch(1, grid=lnc is not None)
    lau.track_memory = False
    prev = getattr(context._local, "state", None)
    context.set_current(context.CoreState(lau, 0, None))
    try:
        arrays = _array_args(list(args) + [kwargs[k] for k in kwargs], [])
        record = [_Arg(orig, t, is_t) for (orig, _, is_t), t in zip(arrays, prog.args)]
        res = prog.run([arr for _, arr, _ in arrays])
    finally:
        context.set_current(prev)
    # capacity and peaks depend on the signature only: those of the traced launch
    checks.set_last_launch_stats(prog.stats)
    return _finish(res, record, lau)


def _check_outputs(res):
    """Strict mode: every returned tensor must be fully written."""
    if isinstance(res, NkiTensor):
        checks.check_returned(res)
    elif isinstance(res, (tuple, list)):
        for r in res:
            _check_outputs(r)
    elif isinstance(res, dict):
        for r in res.values():
            _check_outputs(r)


def _convert_results(res, as_torch, record):
    if isinstance(res, NkiTensor):
        args = {id(a.tensor.storage) for a in record}
        if res.buffer is not shared_hbm and id(res.storage) not in args:
            raise NkiValidationError(f"returned tensor {res.name} is in {res.buffer.name}; kernel outputs must be "
                                     f"allocated with buffer=nl.shared_hbm")
        arr = to_array(res)
        return _numpy_to_torch(arr) if as_torch else arr
    if isinstance(res, tuple):
        return tuple(_convert_results(r, as_torch, record) for r in res)
    if isinstance(res, list):
        return [_convert_results(r, as_torch, record) for r in res]
    if isinstance(res, dict):
        return {k: _convert_results(v, as_torch, record) for k, v in res.items()}
    return res
