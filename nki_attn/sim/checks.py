"""Hazard and capacity checks that the hardware does not forgive and the public simulator does not make.

Three kinds of bookkeeping live here, each attached to a ``Storage`` only when a launch asks for it, so an
instruction pays one attribute test per operand when the checks are off:

- **Strict mode** (``NKI_ATTN_SIM_STRICT=1`` or ``checking(strict=True)``): every storage of the launch carries
  a per-element "written" mask (kernel arguments start fully written). An instruction that reads an element no
  instruction wrote raises at once, naming the instruction, the operand, the tensor region and the first
  unwritten element. A kernel returning a tensor with unwritten elements raises too.
- **LNC2 write ownership**: under ``kernel[2]`` every shared-HBM storage remembers which core wrote each element
  during the launch. A core writing an element the other core already wrote raises (the order of the two writes
  is undefined on hardware); a core rewriting its own elements is fine.
- **Capacity**: each core counts its live SBUF bytes per partition and PSUM banks from allocation until the
  Python object dies (the compiler frees a tensor after its last use; Python lifetime is a conservative proxy),
  records the peaks, and raises when an allocation would exceed the generation's capacity.

``last_launch_stats()`` returns the peaks and modes of the most recent launch; ``checking()`` switches the modes
for launches started inside a ``with`` block.
"""
import contextlib
import math
import threading
from collections import Counter

import numpy as np

from . import context
from .context import checking, mode_overrides  # noqa: F401 - public here
from .errors import NkiValidationError

# The checking modes live in context (a launch reads them there); checking() is public here.
def _storage_shape_in(t):
    """The storage shape counted in elements of ``t.dtype`` (a bit-cast view rescales the last dim)."""
    st = t.storage
    shape = list(st.shape)
    if t.dtype.itemsize != st.dtype.itemsize:
        shape[-1] = shape[-1] * st.dtype.itemsize // t.dtype.itemsize
    return tuple(shape)


def element_index(t, flat):
    """Multi-index in the tensor's storage shape of flat element ``flat`` (in units of ``t.dtype``)."""
    return tuple(int(i) for i in np.unravel_index(int(flat), _storage_shape_in(t)))


def region(t):
    """``name[a:b, c:d]``: the bounding box of a view in the coordinates of its whole tensor (error messages)."""
    idx = t.flat_indices().reshape(-1)
    multi = np.unravel_index(idx, _storage_shape_in(t))
    parts = [f"{int(m.min())}:{int(m.max()) + 1}" for m in multi]
    return f"{t.name}[{', '.join(parts)}]"


def _mask_view(mask, t):
    """Writable bool view of a per-storage-element mask covering exactly the elements of view ``t``.

    Views of the storage dtype map one to one (a strided view of the mask). A bit-cast view of another element
    size cannot be expressed as a strided view, so it gets a gather/scatter pair instead (rare)."""
    st = t.storage
    if t.dtype.itemsize == st.dtype.itemsize:
        return t.over(mask), None
    vs, ss = t.dtype.itemsize, st.dtype.itemsize
    idx = t.flat_indices()
    if vs < ss:
        sidx = idx * vs // ss
    else:
        r = vs // ss
        sidx = (idx * r)[..., None] + np.arange(r)
    return mask[sidx], sidx


def _flat_at(t, pos):
    """Flat storage index (in ``t.dtype`` elements) of the view element at multi-index ``pos``."""
    return t.offset + int(sum(int(i) * s for i, s in zip(pos[:t.ndim], t.strides)))


def _first_false(view, t):
    """Flat index (in ``t.dtype`` elements) of the first False element of a mask view of ``t``."""
    return _flat_at(t, np.argwhere(~view)[0])


# ----------------------------------------------------------------------------------------------------- reads / writes
def check_read(instr, operand, t):
    """Strict mode: raise if any element of ``t`` was never written. Call only when ``t.storage.written`` is set."""
    view, _ = _mask_view(t.storage.written, t)
    if view.all():
        return
    flat = _first_false(view, t)
    where = f"{instr}: {operand}" if operand else instr
    raise NkiValidationError(
        f"{where}: reads {region(t)}, but element {list(element_index(t, flat))} of {t.name} was never written "
        f"(uninitialised read; strict mode, NKI_ATTN_SIM_STRICT)")


def note_write(instr, operand, t, keep=None, matmul=False):
    """Record that an instruction wrote view ``t`` (``keep``: bool mask of the elements actually written).

    Sets the dirty flag (arguments are copied back), the PSUM matmul/non-matmul history, the strict-mode written
    mask and, under LNC2, the per-element writer core of shared HBM."""
    st = t.storage
    st.dirty = True
    if st.mm_written is not None:
        mm = t.over(st.mm_written)
        other = t.over(st.other_written)
        if matmul:
            mm[...] = True
            other[...] = False
        elif keep is None:
            other[...] = True
        else:
            other[keep.reshape(t.shape)] = True
    if st.written is not None:
        view, sidx = _mask_view(st.written, t)
        if sidx is None:
            if keep is None:
                view[...] = True
            else:
                view[keep.reshape(t.shape)] = True
        else:
            st.written[sidx if keep is None else sidx[keep.reshape(t.shape)]] = True
    if st.writer is not None:
        _note_core_write(instr, operand, t)


def _note_core_write(instr, operand, t):
    core = context.current().program_id
    st = t.storage
    with context.current().launch.lock:
        view, sidx = _mask_view(st.writer, t)
        clash = (view != -1) & (view != core)
        if clash.any():
            pos = np.argwhere(clash)[0]
            other = int(view[tuple(pos)])
            flat = _flat_at(t, pos)
            where = f"{instr}: {operand}" if operand else instr
            raise NkiValidationError(
                f"{where}: core {core} writes {region(t)}, but core {other} already wrote element "
                f"{list(element_index(t, flat))} of {t.name} in this launch; two LNC2 cores writing the same "
                f"HBM region is a race on hardware (split the output between the cores by nl.program_id)")
        if sidx is None:
            view[...] = core
        else:
            st.writer[sidx] = core


def check_returned(t):
    """Strict mode: a kernel output (returned tensor) must be written everywhere."""
    st = t.storage
    if st.written is None:
        return
    view, _ = _mask_view(st.written, t)
    if not view.all():
        flat = _first_false(view, t)
        raise NkiValidationError(
            f"kernel output {region(t)}: element {list(element_index(t, flat))} was never written (strict mode, "
            f"NKI_ATTN_SIM_STRICT)")


# ----------------------------------------------------------------------------------------------------- capacity
def _kib(n):
    return f"{n} B" if n < 4096 else f"{n / 1024:.1f} KiB"


class MemAccount:
    """Live on-chip memory of one core during a launch: SBUF bytes per partition and PSUM banks, with peaks.

    Tensors allocated without ``address=`` add their size (the compiler packs them); tensors placed with
    ``address=`` occupy their byte range (SBUF: the highest end address of a live placed tensor counts) or their
    banks (PSUM: each bank used by a live placed tensor counts once), since placed tensors may share storage on
    purpose (circular buffers)."""

    def __init__(self, version, core, check):
        self.version = version
        self.core = core
        self.check = check
        self.sbuf_cap = context.SBUF_BYTES_PER_PARTITION[version]
        self.lock = threading.Lock()
        self.sbuf_free = 0
        self.sbuf_ends = Counter()
        self.psum_free = 0
        self.psum_banks = [0] * context.PSUM_BANKS
        self.peak_sbuf = 0
        self.peak_psum = 0
        self.live = {}

    def _sbuf_now(self, extra_free=0, extra_end=0):
        top = max(self.sbuf_ends) if self.sbuf_ends else 0
        return self.sbuf_free + extra_free + max(top, extra_end)

    def _psum_now(self, extra_free=0, extra_banks=()):
        used = sum(1 for i, c in enumerate(self.psum_banks) if c or i in extra_banks)
        return self.psum_free + extra_free + used

    def _largest(self, kind):
        """The four largest live tensors of one buffer kind, for error messages."""
        items = sorted((e for e in self.live.values() if e[1] == kind), key=lambda e: -e[2])[:4]
        unit = (lambda b: f"{b} bank{'s' if b > 1 else ''}") if kind == "psum" else _kib
        return ", ".join(f"{n} ({unit(b)}{', placed' if placed else ''})" for n, _, b, _, placed in items)

    def allocate(self, st, address):
        """Account a new on-chip storage; raise (before accounting it) if it does not fit."""
        per_part = st.free_size * st.dtype.itemsize
        tname = context.target_name(self.version)
        with self.lock:
            if st.buffer.kind == "sbuf":
                if address is not None:
                    start = int(address[1])
                    end = start + per_part
                    if self.check and end > self.sbuf_cap:
                        raise NkiValidationError(
                            f"nl.ndarray: {st.name}: placed at SBUF bytes {start}..{end} of each partition, beyond "
                            f"the {self.sbuf_cap} B per partition usable on {tname} (tile_size.sbuf_fmax_bytes)")
                    now = self._sbuf_now(extra_end=end)
                else:
                    now = self._sbuf_now(extra_free=per_part)
                if self.check and now > self.sbuf_cap:
                    raise NkiValidationError(
                        f"nl.ndarray: {st.name}: SBUF capacity exceeded on core {self.core}: allocating "
                        f"{_kib(per_part)} per partition ({st.dtype} {st.shape}) brings live SBUF to {now} B per "
                        f"partition; {tname} has {self.sbuf_cap} B (tile_size.sbuf_fmax_bytes). Largest live "
                        f"tensors: {self._largest('sbuf') or 'none'}")
                if address is not None:
                    self.sbuf_ends[end] += 1
                    key = end
                else:
                    self.sbuf_free += per_part
                    key = None
                self.peak_sbuf = max(self.peak_sbuf, now)
                self.live[st.uid] = (st.name, "sbuf", per_part, key, address is not None)
            else:
                banks = max(1, math.ceil(per_part / context.PSUM_BANK_BYTES))
                if address is not None:
                    b0 = int(address[1]) // context.PSUM_BANK_BYTES
                    rng = tuple(range(b0, b0 + banks))
                    if self.check and rng[-1] >= context.PSUM_BANKS:
                        raise NkiValidationError(
                            f"nl.ndarray: {st.name}: placed at PSUM banks {b0}..{rng[-1]}; PSUM has "
                            f"{context.PSUM_BANKS} banks of {context.PSUM_BANK_BYTES} B per partition")
                    rng = tuple(b for b in rng if b < context.PSUM_BANKS)
                    now = self._psum_now(extra_banks=rng)
                else:
                    rng = None
                    now = self._psum_now(extra_free=banks)
                if self.check and now > context.PSUM_BANKS:
                    raise NkiValidationError(
                        f"nl.ndarray: {st.name}: PSUM capacity exceeded on core {self.core}: allocating "
                        f"{banks} bank(s) ({st.dtype} {st.shape}, {per_part} B per partition) needs {now} of the "
                        f"{context.PSUM_BANKS} banks (2 KiB each, 16 KiB per partition). Live PSUM tensors: "
                        f"{self._largest('psum') or 'none'}")
                if rng is not None:
                    for b in rng:
                        self.psum_banks[b] += 1
                else:
                    self.psum_free += banks
                self.peak_psum = max(self.peak_psum, now)
                self.live[st.uid] = (st.name, "psum", banks, rng, address is not None)
        st.acct = self

    def release(self, st):
        """Forget a storage (called when its Python object dies)."""
        with self.lock:
            entry = self.live.pop(st.uid, None)
            if entry is None:
                return
            _, kind, size, key, _ = entry
            if kind == "sbuf":
                if key is None:
                    self.sbuf_free -= size
                else:
                    self.sbuf_ends[key] -= 1
                    if not self.sbuf_ends[key]:
                        del self.sbuf_ends[key]
            elif key is None:
                self.psum_free -= size
            else:
                for b in key:
                    self.psum_banks[b] -= 1


# ----------------------------------------------------------------------------------------------------- stats
class LaunchStats:
    """What one launch used: peak live SBUF bytes per partition and PSUM banks per core, and the modes it ran
    with. ``peak_sbuf_bytes`` / ``peak_psum_banks`` are the maxima over cores (each core has its own memory)."""

    def __init__(self, launch, states):
        self.target = context.target_name(launch.version)
        self.lnc = launch.lnc
        self.strict = launch.strict
        self.capacity_checked = launch.capacity
        self.frontend = launch.frontend
        self.sbuf_capacity_bytes = context.SBUF_BYTES_PER_PARTITION[launch.version]
        self.psum_capacity_banks = context.PSUM_BANKS
        self.per_core = [(s.mem.peak_sbuf, s.mem.peak_psum) if s.mem is not None else (0, 0) for s in states]
        self.peak_sbuf_bytes = max(p[0] for p in self.per_core)
        self.peak_psum_banks = max(p[1] for p in self.per_core)

    def memory_report(self):
        """One line per core: peak SBUF bytes per partition (and share of capacity) and peak PSUM banks."""
        lines = [f"{self.target}, lnc={self.lnc}, strict={self.strict}, capacity checked={self.capacity_checked}, "
                 f"frontend={self.frontend}"]
        for core, (sb, ps) in enumerate(self.per_core):
            lines.append(f"core {core}: SBUF peak {sb} B per partition ({100.0 * sb / self.sbuf_capacity_bytes:.1f}% "
                         f"of {self.sbuf_capacity_bytes}), PSUM peak {ps}/{self.psum_capacity_banks} banks")
        return "\n".join(lines)

    def __repr__(self):
        return (f"LaunchStats(target={self.target!r}, lnc={self.lnc}, peak_sbuf_bytes={self.peak_sbuf_bytes}, "
                f"peak_psum_banks={self.peak_psum_banks}, strict={self.strict}, frontend={self.frontend!r})")


_last = [None]


def set_last_launch_stats(stats):
    """Called by the runtime at the end of every launch (successful or not)."""
    _last[0] = stats


def last_launch_stats():
    """``LaunchStats`` of the most recent kernel launch in this process (None before the first one)."""
    return _last[0]
