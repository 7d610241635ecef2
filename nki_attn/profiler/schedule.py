"""Dependency-aware schedule of a recorded trace: when each instruction would start and end on its engine.

The cost model (``model.py``) prices each instruction; this module places them on a timeline, per core:

- each compute engine (TensorE, VectorE, ScalarE, GpSimdE) runs its instructions in program order, one at a time
  (each engine has its own sequencer and instruction stream, A2);
- a DMA is split into queue pieces (``model.dma_pieces``); each queue runs its pieces in order. A transfer's
  pieces start no earlier than ``dma_latency_ns`` after it is ready (the semaphore-to-start latency, DMABW):
  latency delays the transfer, it does not occupy the queue, so queued transfers hide it. A DMA triggered from a
  compute engine (``engine=`` of ``dma_copy``) is issued in that engine's program order, so it is not ready before
  the engine finished what precedes it;
- a hardware-DGE instruction first holds one of the ``dge_instances`` DGE blocks for ``dge_instr_ns``;
- the shared SBUF / PSUM ports (``model.RESOURCES``) are held for the instruction's time;
- an instruction is ready when the instructions it depends on are done. Dependencies are read-after-write,
  write-after-read and write-after-write on overlapping tile regions (the trace's ``Operand.span`` of one
  allocation): a matmul accumulating into a PSUM region writes it, so a reader of an accumulation group waits for
  its last matmul, and a new group waits for the readers of the previous one. A result is visible
  ``InstrCost.latency_ns`` after its instruction ends (the tensor access overhead), and a dependency between two
  different engines adds ``sem_wait_ns`` (the semaphore the compiler inserts, A2).

``Schedule.time_ns`` is the last result's time on the slowest core. Every engine, queue and shared resource is
busy at most once at a time here, so it is never below the perfect-overlap bound (``Profile.time_overlap_ns``).
"""
from collections import defaultdict

from .model import DGE

SEM_WAIT = "semaphore wait"
DMA_LATENCY = "DMA latency"
ACCESS = "access overhead"
_TRIGGER = {"scalar": "ScalarE", "activation": "ScalarE", "vector": "VectorE", "gpsimd": "GpSimdE",
            "pool": "GpSimdE", "tensor": "TensorE", "pe": "TensorE"}


class Event:
    """One scheduled instruction: trace ``index``, ``rec`` (the trace Record), ``cost`` (InstrCost), ``core``,
    ``engine``; ``start`` / ``end`` of its occupancy (a DMA: first piece start, last piece end); ``done``: when
    its result is visible; ``pieces``: ``[(track, start, end)]`` for every track it occupied (engine, ``DMA qN``,
    ``DGE N``, shared port); ``pred``: the event whose finish bound its start (None: it started at time 0 or after
    the DMA latency alone); ``wait``: what stood between ``pred`` and its start (``SEM_WAIT``, ``DMA_LATENCY``,
    ``ACCESS``, or None when the track was simply busy)."""

    __slots__ = ("index", "rec", "cost", "core", "engine", "start", "end", "done", "pieces", "pred", "wait")

    def __init__(self, index, rec, cost):
        self.index, self.rec, self.cost = index, rec, cost
        self.core, self.engine = rec.core, cost.engine
        self.start = self.end = self.done = 0.0
        self.pieces = []
        self.pred = None
        self.wait = None


def _overlap(a, b):
    return a[0] < b[1] and b[0] < a[1] and a[2] < b[3] and b[2] < a[3]


def _covers(a, b):
    """True when span ``a`` contains span ``b``."""
    return a[0] <= b[0] and b[1] <= a[1] and a[2] <= b[2] and b[3] <= a[3]


class Schedule:
    """The timeline of ``records`` priced by ``costs`` (one InstrCost per record, None to skip) on ``gen``.

    Attributes: ``events`` (Event, trace order, skipped records left out); ``end_by_core`` {core: last done}.
    """

    def __init__(self, records, costs, gen):
        self.gen = gen
        self.events = []
        free = defaultdict(float)            # (core, track) -> when the track is next free
        last_on = {}                         # (core, track) -> the event that last held it
        writes = defaultdict(list)           # allocation uid -> [(span, done, engine, event)]
        reads = defaultdict(list)            # allocation uid -> [(span, end, engine, event)]
        sem, lat = gen.sem_wait_ns, gen.dma_latency_ns
        for i, (rec, cost) in enumerate(zip(records, costs)):
            if cost is None:
                continue
            ev = Event(i, rec, cost)
            core, eng = rec.core, cost.engine
            ready, pred, wait = 0.0, None, None

            def need(t, who, why):
                nonlocal ready, pred, wait
                if t > ready:
                    ready, pred, wait = t, who, why

            def dep(entry_eng, who, visible):
                # The same engine runs in order and forwards its own results (the static overhead of a dependent
                # instruction is priced in its cost); another engine waits for the visible result and the
                # semaphore, except a DMA, whose semaphore-to-start latency is added below.
                if entry_eng == eng:
                    need(who.end, who, None)
                elif eng == "DMA":
                    need(visible, who, ACCESS if visible > who.end else None)
                else:
                    need(visible + sem, who, SEM_WAIT if sem else (ACCESS if visible > who.end else None))

            for s in rec.srcs:
                for span, done, weng, who in writes.get(s.uid, ()):
                    if _overlap(span, s.span):
                        dep(weng, who, done)
            d = rec.dst
            if d is not None:
                for span, done, weng, who in writes.get(d.uid, ()):
                    if _overlap(span, d.span):
                        dep(weng, who, done)
                for span, end, reng, who in reads.get(d.uid, ()):
                    if _overlap(span, d.span):
                        dep(reng, who, end)

            if eng == "DMA":
                trig = _TRIGGER.get((rec.info or {}).get("trigger"))
                if trig is not None:
                    need(free[(core, trig)], last_on.get((core, trig)), None)
                # Each hardware-DGE instruction holds the earliest free DGE block, then its own queue pieces
                # may start; the DGE work overlaps the semaphore-to-start latency.
                gate = []
                for _ in range(cost.dge):
                    t_free, b = min((free[(core, f"{DGE} {b}")], b) for b in range(max(gen.dge_instances, 1)))
                    track = f"{DGE} {b}"
                    t0 = max(ready, t_free)
                    ev.pieces.append((track, t0, t0 + gen.dge_instr_ns))
                    free[(core, track)] = t0 + gen.dge_instr_ns
                    gate.append((t0 + gen.dge_instr_ns, last_on.get((core, track)) if t_free > ready else None))
                    last_on[(core, track)] = ev
                per_group = len(cost.queues) // len(gate) if gate else len(cost.queues)
                starts, ends = [], []
                for j, (q, ns) in enumerate(cost.queues):
                    t_lat = ready + lat
                    t_dge, p_dge = gate[j // per_group] if gate else (0.0, None)
                    track = f"DMA q{q}"
                    t0 = max(t_lat, t_dge, free[(core, track)])
                    if j == 0:
                        if t0 == free[(core, track)] and t0 > max(t_lat, t_dge):
                            pred, wait = last_on.get((core, track)), None
                        elif t_dge > t_lat:
                            pred, wait = p_dge or pred, None
                        elif lat > 0:
                            wait = DMA_LATENCY
                    free[(core, track)] = t0 + ns
                    last_on[(core, track)] = ev
                    ev.pieces.append((track, t0, t0 + ns))
                    starts.append(t0)
                    ends.append(t0 + ns)
                ev.start, ev.end = min(starts), max(ends)
                ev.done = ev.end
            else:
                tracks = [eng] + [r for r, _ in cost.shared]
                for tr in tracks:
                    if free[(core, tr)] > ready:
                        ready, pred, wait = free[(core, tr)], last_on.get((core, tr)), None
                ev.start, ev.end = ready, ready + cost.ns
                ev.done = ev.end + cost.latency_ns
                # A semaphore wait that bound the start runs on the waiting engine's sequencer: the engine shows
                # it as active time (neuron-profile's engine active time; calibrated on the trn2 matmul v2).
                hold = sem if wait == SEM_WAIT and pred is not None and ready - sem >= free[(core, eng)] else 0.0
                for tr in tracks:
                    free[(core, tr)] = ev.end
                    last_on[(core, tr)] = ev
                    ev.pieces.append((tr, ev.start - (hold if tr == eng else 0.0), ev.end))
            ev.pred, ev.wait = pred, wait

            for s in rec.srcs:
                reads[s.uid].append((s.span, ev.end, eng, ev))
            if d is not None:
                span = d.span
                writes[d.uid] = [w for w in writes[d.uid] if not _covers(span, w[0])] + [(span, ev.done, eng, ev)]
                if d.uid in reads:
                    # Readers of what this write fully covers finished before it started (write-after-read).
                    reads[d.uid] = [r for r in reads[d.uid] if r[3] is ev or not _covers(span, r[0])]
            self.events.append(ev)
        self.end_by_core = {}
        for ev in self.events:
            self.end_by_core[ev.core] = max(self.end_by_core.get(ev.core, 0.0), ev.done)

    @property
    def time_ns(self):
        """Scheduled time: the last result of the slowest core (0 for an empty trace)."""
        return max(self.end_by_core.values(), default=0.0)

    def active_ns(self, prefix, core=None):
        """Time during which at least one track whose name starts with ``prefix`` is busy (the union of its
        intervals; ``"DMA q"``: any DMA queue, what neuron-profile calls DMA active time), on ``core`` or the
        slowest core."""
        if core is None:
            core = max(self.end_by_core, key=self.end_by_core.get) if self.end_by_core else None
        spans = sorted((t0, t1) for ev in self.events if ev.core == core
                       for tr, t0, t1 in ev.pieces if tr.startswith(prefix) and t1 > t0)
        total, cur0, cur1 = 0.0, None, None
        for t0, t1 in spans:
            if cur1 is None or t0 > cur1:
                if cur1 is not None:
                    total += cur1 - cur0
                cur0, cur1 = t0, t1
            else:
                cur1 = max(cur1, t1)
        return total + (cur1 - cur0 if cur1 is not None else 0.0)

    def critical_path(self):
        """Events on the critical path of the slowest core, first to last: from the last result back through each
        event's ``pred``."""
        if not self.events:
            return []
        ev = max(self.events, key=lambda e: e.done)
        path = []
        while ev is not None:
            path.append(ev)
            ev = ev.pred
        return path[::-1]

    def critical_path_by_kind(self):
        """``{kind: ns}`` of the critical path: each event's occupancy under ``"engine instr"``, the gaps between
        events under ``SEM_WAIT`` / ``DMA_LATENCY`` / ``ACCESS`` (what bound the start) or ``"idle"``. Sums to
        ``time_ns``."""
        out = defaultdict(float)
        t = 0.0
        for ev in self.critical_path():
            gap = ev.start - t
            if gap > 1e-9:
                out[ev.wait or "idle"] += gap
            # A DMA's pieces run on several queues and its pred is the first piece's, so its first piece may start
            # before the pred ends: only the part after the time already accounted for is on the path.
            if ev.end > max(ev.start, t):
                out[f"{ev.engine} {ev.rec.instr}"] += ev.end - max(ev.start, t)
            t = max(t, ev.end)
        tail = self.time_ns - t
        if tail > 1e-9:
            out[ACCESS] += tail
        return dict(out)


def chrome_trace(schedule, title=""):
    """The schedule in the Chrome trace event format (a dict to ``json.dump``): one process per core, one thread
    (track) per engine, DMA queue, DGE block and shared port, one complete event (``ph: "X"``, microseconds) per
    instruction on each track it held, with its name, kernel source line, operand shapes and bytes in ``args``.
    Perfetto and chrome://tracing open it."""
    order = {"TensorE": 0, "VectorE": 1, "ScalarE": 2, "GpSimdE": 3}
    tracks = {}
    for ev in schedule.events:
        for tr, _, _ in ev.pieces:
            tracks.setdefault((ev.core, tr), None)

    def key(ct):
        core, tr = ct
        if tr in order:
            return core, order[tr], 0
        if tr.startswith("DMA q"):
            return core, 10, int(tr[5:])
        return core, 20, tr
    out = []
    cores = sorted({c for c, _ in tracks})
    for core in cores:
        out.append({"ph": "M", "name": "process_name", "pid": core, "tid": 0,
                    "args": {"name": f"core {core} (modeled{', ' + title if title else ''})"}})
    for tid, ct in enumerate(sorted(tracks, key=key), start=1):
        tracks[ct] = tid
        out.append({"ph": "M", "name": "thread_name", "pid": ct[0], "tid": tid, "args": {"name": ct[1]}})
        out.append({"ph": "M", "name": "thread_sort_index", "pid": ct[0], "tid": tid, "args": {"sort_index": tid}})
    for ev in schedule.events:
        r = ev.rec
        args = {"line": r.line, "dst": repr(r.dst) if r.dst is not None else None,
                "srcs": [repr(s) for s in r.srcs], "bytes": r.bytes_moved, "trace_index": ev.index}
        if ev.wait:
            args["waited_on"] = ev.wait
        for tr, t0, t1 in ev.pieces:
            out.append({"ph": "X", "name": r.instr, "cat": ev.engine, "pid": ev.core, "tid": tracks[(ev.core, tr)],
                        "ts": t0 / 1e3, "dur": max(t1 - t0, 0.0) / 1e3, "args": args})
    return {"traceEvents": out, "displayTimeUnit": "ns",
            "otherData": {"model": "modeled by the nki_attn cost model (not measured)", "title": title,
                          "time_ns": schedule.time_ns}}
