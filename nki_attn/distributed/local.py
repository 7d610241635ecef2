"""Run a function on N local processes joined in a torch.distributed group over the loopback interface.

For tests, examples and the figure scripts on one machine (on a cluster use torchrun or your launcher: the ring
functions only need an initialized process group). Bounded: a process group timeout makes a stuck collective
raise inside the workers, and a wall-clock deadline kills the workers this call started, so a hang fails
instead of blocking.
"""
import datetime
import os
import socket
import sys
import tempfile
import time
import traceback

import torch

__all__ = ["run_local", "free_port"]


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loopback_ifname():
    try:
        names = [n for _, n in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


def _entry(rank, world_size, port, backend, fn, args, out_dir, pg_timeout, threads):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    ifname = _loopback_ifname()
    if ifname and backend == "gloo":
        os.environ["GLOO_SOCKET_IFNAME"] = ifname  # gloo's own connections stay on loopback too
    if threads:
        torch.set_num_threads(threads)
    path = os.path.join(out_dir, f"rank{rank}.pt")
    import torch.distributed as dist
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, path)
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent with its traceback
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _start_method(fn):
    main = sys.modules.get("__main__")
    if fn.__module__ == "__main__" and not getattr(main, "__file__", None):
        return "fork"  # defined in `python -c` / a REPL: only a forked child can see it
    return "spawn"


def run_local(fn, world_size, *args, timeout=300.0, backend="gloo", start_method=None, threads=1):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new processes and return their results.

    Args:
        fn: a picklable function (module level); its return value must be picklable by ``torch.save``.
        world_size: number of processes (ranks), >= 1.
        timeout: seconds for the whole run; the process group gets the same timeout, so a stuck collective
            raises in the workers, and the workers still alive at the deadline are killed (TimeoutError).
        backend: torch.distributed backend; ``gloo`` for CPU tensors.
        start_method: ``spawn`` (default) or ``fork`` (default when ``fn`` lives in a ``python -c`` script or a
            REPL, which spawned processes cannot import).
        threads: torch threads per worker (None: torch's default); 1 avoids oversubscribing small machines.
    Returns:
        list of the ranks' return values, in rank order.
    Raises:
        RuntimeError with the first failing rank's traceback; TimeoutError at the deadline.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"run_local: world_size={world_size!r}: must be an int >= 1")
    ctx = torch.multiprocessing.get_context(start_method or _start_method(fn))
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="nki_attn_dist_") as out_dir:
        procs = [ctx.Process(target=_entry, args=(r, world_size, port, backend, fn, args, out_dir, timeout,
                                                  threads), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        failed = None
        try:
            while any(p.is_alive() for p in procs):
                failed = next((r for r, p in enumerate(procs) if p.exitcode not in (None, 0)), None)
                if failed is not None or time.monotonic() > deadline:
                    break
                procs[[p.is_alive() for p in procs].index(True)].join(0.05)
            failed = next((r for r, p in enumerate(procs) if p.exitcode not in (None, 0)), failed)
        finally:
            if failed is not None:  # the others usually fail within moments (lost peer): keep their reports
                grace = time.monotonic() + 10
                for p in procs:
                    p.join(max(0.0, grace - time.monotonic()))
            alive = [r for r, p in enumerate(procs) if p.is_alive()]
            for r in alive:
                procs[r].kill()  # our own children, by handle
            for p in procs:
                p.join(5)
        results = []
        for r in range(world_size):
            path = os.path.join(out_dir, f"rank{r}.pt")
            results.append(torch.load(path, weights_only=False) if os.path.exists(path) else None)
        if failed is not None:
            # every failed rank, since a rank that lost its peer fails too (listed after the others)
            bad = [r for r, p in enumerate(procs)
                   if (results[r] is not None and not results[r]["ok"]) or p.exitcode not in (None, 0)]
            bad.sort(key=lambda r: "closed by peer" in str((results[r] or {}).get("error", "")))
            msg = "\n".join(f"rank {r} of {world_size} failed:\n"
                             + (results[r]["error"] if results[r] else f"exit code {procs[r].exitcode}")
                             for r in bad)
            raise RuntimeError(f"run_local: {msg}")
        if alive:
            raise TimeoutError(f"run_local: ranks {alive} of {world_size} still running after {timeout} s "
                               f"(killed)")
        for r, res in enumerate(results):
            if res is None or not res["ok"]:
                raise RuntimeError(f"run_local: rank {r} of {world_size} returned no result "
                                   f"(exit code {procs[r].exitcode})")
        return [res["result"] for res in results]
