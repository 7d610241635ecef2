"""Launch-wide configuration and per-core execution state.

A launch (``kernel[lnc](...)``) reads its configuration from the environment once, then runs one Python thread
per NeuronCore. Each thread sees its own ``CoreState`` (program id, engine accumulators) through a thread-local,
and all share the ``Launch`` (target generation, shared-HBM tensors, checking modes).
"""
import contextlib
import os
import threading

import numpy as np

from .errors import NkiValidationError

# Public generation names accepted by NEURON_PLATFORM_TARGET_OVERRIDE and the NeuronCore version each maps to.
_TARGETS = {"trn1": 2, "inf2": 2, "gen2": 2, "trn2": 3, "gen3": 3, "trn3": 4, "gen4": 4}
_TARGET_NAMES = {2: "trn1", 3: "trn2", 4: "trn3"}
DEFAULT_TARGET = "trn2"

# Usable SBUF bytes per partition by NeuronCore version (KLR's sbuf_fmax_bytes; see docs/simulator.md).
SBUF_BYTES_PER_PARTITION = {2: 180224, 3: 212984, 4: 245752}
PSUM_BANK_BYTES = 2048
PSUM_BANKS = 8

_mode_stack = []
_mode_lock = threading.Lock()


@contextlib.contextmanager
def checking(strict=None, capacity=None, frontend=None):
    """Set the checking modes of every launch started inside the ``with`` block.

    ``strict``: raise at the first read of never-written memory (default: env ``NKI_ATTN_SIM_STRICT``, off).
    ``capacity``: raise when live SBUF/PSUM exceeds the target's capacity (default: env
    ``NKI_ATTN_SIM_CAPACITY``, on). ``frontend``: the NKI frontend check (``nki_attn.sim.frontend``): ``"full"``
    or ``True`` (gathering, launch and tracing rules), ``"gather"`` (no tracing rules), ``"off"`` or ``False``
    (default: env ``NKI_ATTN_SIM_FRONTEND``, full). ``None`` keeps the enclosing setting. Peaks are recorded
    either way.
    """
    entry = {"strict": strict, "capacity": capacity, "frontend": frontend}
    with _mode_lock:
        _mode_stack.append(entry)
    try:
        yield
    finally:
        with _mode_lock:
            _mode_stack.remove(entry)


def mode_overrides():
    """The innermost ``checking()`` value of each mode (``None`` where no block set it)."""
    out = {"strict": None, "capacity": None, "frontend": None}
    with _mode_lock:
        for entry in _mode_stack:
            for k, v in entry.items():
                if v is not None:
                    out[k] = v
    return out


# ----------------------------------------------------------------------------------------------------- regions

# ----------------------------------------------------------------------------------------------------- modes
# Checking modes (set by nki_attn.sim.checks.checking) and the frontend switch (nki_attn.sim.frontend): every
# launch reads them here, so that this module, which the others import, imports none of them.
_FRONTEND_MODES = {"": "full", "1": "full", "on": "full", "full": "full", "true": "full", "yes": "full",
                   "gather": "gather", "0": "off", "off": "off", "false": "off", "no": "off"}


def frontend_mode():
    """``"full"``, ``"gather"`` or ``"off"``: the innermost ``checking(frontend=...)``, else env
    ``NKI_ATTN_SIM_FRONTEND`` (default full)."""
    over = mode_overrides()["frontend"]
    raw = over if over is not None else os.environ.get("NKI_ATTN_SIM_FRONTEND", "")
    if raw is True:
        return "full"
    if raw is False:
        return "off"
    key = str(raw).strip().lower()
    if key not in _FRONTEND_MODES:
        raise NkiValidationError(f"NKI_ATTN_SIM_FRONTEND={raw!r} is not a frontend mode; use 1 (all checks, the "
                                 f"default), gather (no tracing checks) or 0 (off)")
    return _FRONTEND_MODES[key]


# Instruction recorders (nki_attn.sim.trace.recording pushes and pops them): every new launch takes the innermost.
_recorders = []


def active_recorder():
    """The innermost active instruction Recorder (nki_attn.sim.trace), or None."""
    return _recorders[-1] if _recorders else None


def target_version(name=None):
    """NeuronCore version (2, 3, 4) for a target name, or for NEURON_PLATFORM_TARGET_OVERRIDE when ``None``."""
    raw = name if name is not None else os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "") or DEFAULT_TARGET
    key = raw.strip().lower()
    if key not in _TARGETS:
        raise NkiValidationError(
            f"NEURON_PLATFORM_TARGET_OVERRIDE={raw!r} is not a known target; use one of {sorted(_TARGETS)}")
    return _TARGETS[key]


def target_name(version):
    return _TARGET_NAMES[version]


def _env_flag(name, default):
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    return raw.strip().lower() not in ("0", "false", "no", "off")


class Launch:
    """State shared by the cores of one kernel launch."""

    def __init__(self, lnc, grid):
        self.version = target_version()
        self.lnc = lnc
        self.grid = grid  # False when launched without brackets (program_ndim() == 0)
        self.precise_fp = _env_flag("NKI_PRECISE_FP", True)
        modes = mode_overrides()
        # Checking modes (nki_attn.sim.checks): the innermost checking() block wins over the environment.
        self.strict = modes["strict"] if modes["strict"] is not None else _env_flag("NKI_ATTN_SIM_STRICT", False)
        self.capacity = (modes["capacity"] if modes["capacity"] is not None
                         else _env_flag("NKI_ATTN_SIM_CAPACITY", True))
        self.frontend = frontend_mode()  # "full", "gather" or "off" (nki_attn.sim.frontend)
        self.track_memory = True
        self.peak_sbuf_bytes = 0
        self.peak_psum_banks = 0
        self.lock = threading.Lock()
        self.shared_allocs = []  # shared_hbm tensors by allocation order, one storage for all cores
        self.tracer = active_recorder()


class EagerLaunch(Launch):
    """The implicit launch of instructions called outside any kernel (tests, notebooks): it re-reads the
    target and precision from the environment at every access, so they can change between calls."""

    def __init__(self):
        super().__init__(lnc=1, grid=False)
        # Instructions called outside a kernel (tests, notebooks) build tiles by hand, so the launch-scoped
        # checking modes do not apply to them.
        self.strict = False
        self.capacity = False
        self.frontend = "off"
        self.track_memory = False

    @property
    def version(self):
        return target_version()

    @version.setter
    def version(self, _):
        pass

    @property
    def precise_fp(self):
        return _env_flag("NKI_PRECISE_FP", True)

    @precise_fp.setter
    def precise_fp(self, _):
        pass

    @property
    def tracer(self):
        return active_recorder()

    @tracer.setter
    def tracer(self, _):
        pass


class CoreState:
    """What one NeuronCore's thread sees."""

    def __init__(self, launch, program_id, mem=None):
        self.launch = launch
        self.program_id = program_id
        self.shared_counter = 0
        # Engine accumulators are per-lane fp32 state that persists between instructions. They start poisoned
        # so a kernel that reads one it never reset gets NaN instead of a plausible number.
        self.scalar_acc = np.full(128, np.nan, dtype=np.float32)
        self.vector_acc = np.full(128, np.nan, dtype=np.float32)
        # This core's live SBUF/PSUM account (nki_attn.sim.checks.MemAccount, given by the launch that tracks
        # memory; None for eager instructions).
        self.mem = mem
        # The instruction stream being recorded for replay (nki_attn.sim.replay.Recording), or None.
        self.recorder = None


_local = threading.local()


def current():
    """The CoreState of the calling thread; outside a launch, the thread's eager single-core state."""
    state = getattr(_local, "state", None)
    if state is None:
        state = getattr(_local, "eager", None)
        if state is None:
            state = _local.eager = CoreState(EagerLaunch(), 0)
    return state


def set_current(state):
    _local.state = state


def version():
    return current().launch.version
