"""The cost-model parameter table: one ``Generation`` per Trainium generation, every number with its source.

This is the ONLY place the cost model (``model.py``) gets hardware numbers from. docs/performance.md embeds the
table rendered by ``python -m nki_attn.profiler`` (a test keeps the two identical).

Source tags, all documents of the public aws-neuron-sdk documentation (folder nki/): A2/A3/A4 = the architecture
guides of NeuronCore v2 (trn1/inf2) / v3 (trn2) / v4 (trn3); PERF = the NKI performance guide; DMA = the NKI DMA
overview ("Introduction to Direct Memory Access (DMA) with NKI"); DMABW = the DMA bandwidth guide ("Guideline to
Avoid Under-Utilizing DMA Bandwidth"); DGE = the Descriptor Generation Engine reference; SH = ``nki.api.shared``
("NKI Engine Selection for Operators Supported on Multiple Engines"). "d" marks a number we derived from the
cited ones.
"""
from dataclasses import dataclass, field, fields

# The name every modeled figure carries (docs say which model produced them).
MODEL = "cost model v2 (dependency-aware schedule; parameters from the public docs, calibrated on the published " \
        "trn2 fp32 / trn1 bf16 matmul tutorial and fused Mamba timings)"


def _p(source, meaning):
    """A dataclass field that carries its source and meaning (rendered into the docs table)."""
    return field(metadata={"source": source, "meaning": meaning})


@dataclass(frozen=True)
class Generation:
    """Hardware numbers of one NeuronCore generation, per NeuronCore. Clocks in GHz (= cycles per ns)."""

    name: str = _p("-", "target name (NEURON_PLATFORM_TARGET_OVERRIDE)")
    nc_version: int = _p("A2, A3, A4", "NeuronCore version")
    # --- TensorE
    tensor_ghz: float = _p("A2, A3, A4", "TensorE clock (GHz)")
    pe_dim: int = _p("A2, A3, A4", "systolic array is pe_dim x pe_dim (K rows x M columns)")
    mm_min_cycles: int = _p("A2, PERF (MM_INIT_LATENCY = 64 cycles on v2; no v3/v4 figure published, reused)",
                            "minimum TensorE cycles per matmul (instruction turnaround)")
    load_stationary_speedup: int = _p("PERF (fast LoadStationary), A2",
                                      "LoadStationary of M columns takes M / this cycles, hidden under the "
                                      "previous matmul unless longer")
    fp32_matmul_factor: int = _p("A2/A3/A4 peak ratio bf16 : fp32 (92 : 23, 79 : 20)",
                                 "fp32 matmul cycles = this x bf16 cycles")
    fp32_transpose_factor: int = _p("notes §7 (v3 transpose mode: fp32 transposes 2x faster than fp32 matmuls)",
                                    "fp32 TensorE transpose cycles = this x bf16 cycles")
    # --- VectorE
    vector_ghz: float = _p("A2, A3, A4", "VectorE clock (GHz)")
    vector_width_other: int = _p("A2 table (128 input/output); A3, A4 tables (256 input/output for data types "
                                 "other than bf16/fp16)",
                                 "VectorE elements per cycle (all lanes) outside the bf16/fp16 perf mode; / 128 "
                                 "lanes = elements per partition per cycle of each input stream")
    vector_fast_copy: int = _p("A3 (perf mode; width 512 bf16 / 128 lanes); v2 has none",
                               "speedup of tensor_copy / tensor_scalar with all operands bf16/fp16 in SBUF, "
                               "unit inner stride")
    vector_half_copy: int = _p("A3 (perf mode, strided or one side in PSUM)",
                               "speedup of those when strided or one operand is in PSUM")
    vector_fast_tt: int = _p("A3 (perf mode)", "speedup of tensor_tensor with both inputs in SBUF, all bf16/fp16")
    vector_reciprocal_factor: int = _p("SH (reciprocal: max(MIN_II, 8N) cycles on VectorE)",
                                       "VectorE reciprocal cycles per element (no width speedup: SH states 8N)")
    vector_gpsimd_port: str = _p("A3 (v3 lifts v2's VectorE/GpSimdE SBUF exclusion; the perf mode uses a bus "
                                 "shared with GpSimdE); A4 silent (v3 kept)",
                                 "which VectorE instructions share GpSimdE's SBUF port: all (v2), perf_mode "
                                 "(v3+: those running in the bf16/fp16 perf mode), none")
    vector_scalar_psum_shared: bool = _p("A3 (VectorE and ScalarE may access PSUM in parallel from v3 on; "
                                         "disallowed in v2)",
                                         "VectorE and ScalarE instructions touching PSUM serialise (v2)")
    # --- ScalarE
    scalar_ghz: float = _p("A2, A3, A4", "ScalarE clock (GHz)")
    scalar_fast_copy: int = _p("A4 (2x for bf16/fp16 tensor_scalar / tensor_copy; width 256 bf16); 1 before v4",
                               "ScalarE speedup of tensor_copy / tensor_scalar on bf16/fp16")
    # --- GpSimdE
    gpsimd_ghz: float = _p("A2, A3, A4", "GpSimdE clock (GHz)")
    # --- shared by Vector / Scalar / GpSimd
    min_ii_cycles: int = _p("SH (MIN_II: minimum instruction initiation interval, roughly 64 engine cycles)",
                            "an instruction takes at least this many cycles: max(MIN_II, work)")
    static_overhead_cycles: int = _p("trn1: A2 (VectorE static instruction overhead 100 cycles; ScalarE "
                                     "inherits VectorE's notes), PERF (~100 cycles); trn2/trn3: 0, calibrated on "
                                     "fused Mamba v3 (trn2): with 100 the VectorE-bound sweep is 16-32 % too slow",
                                     "cycles added where static_overhead_applies says")
    static_overhead_applies: str = _p("A2 (only for back-to-back instructions each depending on the previous "
                                      "one's output, or with N << 128: MIN_II covers the latter, SH)",
                                      "dependent: an instruction reading what the engine's previous instruction "
                                      "wrote; all: every instruction")
    # --- DMA
    dma_queues: int = _p("DMA (16 DMA engines per NeuronCore)", "DMA queues (engines) per core")
    dma_partitions_per_queue: int = _p("DMA (each engine moves 8 SBUF partitions of a transfer)",
                                       "SBUF partitions served by one queue")
    dma_queue_bytes_per_ns: float = _p("trn2/trn3: DMABW table (BW / engine 23 / 33 B/ns); trn2 measured 32 KiB in "
                                       "1416 ns on one engine, DMA. trn1: calibrated on the trn1 bf16 matmul "
                                       "tutorial (tiled / hoist_load / block_free: ~100 GB/s per core achieved, "
                                       "6.5 B/ns per queue; the table's 17 B/ns peak is not reached by those "
                                       "kernels' 256 B - 1 KiB rows)",
                                       "sustained bandwidth of one queue (bytes/ns = GB/s)")
    dma_min_piece_ns: float = _p("calibrated on trn2 fp32 matmul v2 (total and DMA active time): an 850 ns "
                                 "occupancy floor (read off the DMA figure 'throughput vs bytes per partition', a "
                                 "single-transfer measurement that includes the start latency) makes v2 44 % too "
                                 "slow, so it is latency (dma_latency_ns), not occupancy: 0; the sensitivity "
                                 "runs cover 0-850",
                                 "a queue piece occupies its queue at least this long (ns)")
    dma_fixed_ns: float = _p("trn2: calibrated on trn2 fp32 matmul v2 (total, DMA active; v3's DMA active "
                             "agrees): per-packet overhead (DMABW: 'descriptor setup, synchronization'); trn3 "
                             "reuses trn2's; trn1: 0 (its calibrated bandwidth already absorbs it)",
                             "queue occupancy added to every piece (ns)")
    dma_latency_ns: float = _p("DMABW (semaphore-to-start latency ~1300 ns cross-engine)",
                               "a transfer's pieces start no earlier than this after it is ready (latency: delays "
                               "the transfer, does not occupy the queue)")
    dge_instr_ns: float = _p("A3, DGE (a hardware-DGE DMA instruction takes ~600 ns on NeuronCore-v3); v2 has "
                             "no HWDGE; A4 silent (v3 kept)",
                             "DGE time of a DMA issued with dge_mode=hwdge (ns)")
    dge_instances: int = _p("A3, DGE (two DGE instances per NeuronCore)", "DGE blocks per core")
    dma_transpose_hbm_eff: float = _p("A3 (DMA transpose <= 90% of DMA throughput from HBM)",
                                      "dma_transpose bandwidth fraction, HBM source")
    dma_transpose_sbuf_eff: float = _p("A3 (<= 50% SBUF -> SBUF)", "dma_transpose bandwidth fraction, SBUF source")
    dge_transpose_split: bool = _p("ISA dma_transpose (hardware-DGE path: 3-D/4-D src.shape[0] in {1, 2, 4, 8, "
                                   "16}; only dge_mode unknown/hwdge allowed for direct transposes); AMBIGUOUS "
                                   "whether the compiler splits (a sensitivity parameter)",
                                   "a direct dma_transpose takes the hardware-DGE path, split into "
                                   "ceil(src partitions / 16) instructions, each paying dge_instr_ns and its own "
                                   "queue pieces")
    dma_transpose_whole_piece: bool = _p("A3 ('SBUF2SBUF transpose can achieve up to 50% of DMA throughput'), "
                                         "PERF ('Excessive use of DMA transposes ... can degrade DMA bandwidth "
                                         "significantly')",
                                         "the efficiency divides the whole piece's occupancy (floor and fixed "
                                         "cost included); False: the earlier rule (bandwidth scaled, then the "
                                         "copy's floor)")
    dge_charge_transposes: bool = _p("ISA dma_transpose (direct transposes only take dge_mode unknown / hwdge: "
                                     "the hardware DGE), DGE (~600 ns per hardware-DGE instruction)",
                                     "every direct dma_transpose pays dge_instr_ns per instruction; False: the "
                                     "earlier model (only when the kernel forced dge_mode=hwdge)")
    # --- the schedule
    sem_wait_ns: float = _p("calibrated on trn2 fp32 matmul v2 TensorE active time (34.82 ms for 28.0 ms of "
                            "matmuls: ~200 ns per matmul waiting on its DMA); reused for trn1/trn3. The largest "
                            "documented figure, DMABW's ~1300 ns cross-engine semaphore-to-start latency, is the "
                            "sensitivity maximum",
                            "added to the ready time of an instruction waiting on another engine's result")
    access_overhead_cycles: int = _p("A2 ('Tensor access overhead ... a static overhead approximately 60 cycles "
                                     "on NeuronCore-v2 ... engines can typically hide some of this latency'); "
                                     "v3/v4 silent (v2 kept)",
                                     "engine cycles after a compute instruction ends before its result is "
                                     "visible: latency, not occupancy (hidden unless a consumer waits)")
    gpsimd_vector_factor: float = _p("sensitivity only (the docs give GpSimd no rule of thumb); 0 = the default "
                                     "rule N x inputs cycles at the GpSimdE clock",
                                     "when > 0, GpSimdE costs this x what VectorE would take for the same "
                                     "instruction")
    hbm_bytes_per_ns: float = _p("d: device HBM / cores: 820 GB/s / 2 (A2), 3 TB/s / 8 (A3), 4.7 TB/s / 8 (A4)",
                                 "HBM bandwidth per core (GB/s), for HBM utilisation only")
    peak_tflops_documented: float = _p("A2, A3, A4 (bf16/fp16 dense)", "documented TensorE peak (TFLOPS)")

    @property
    def peak_flops_per_ns(self):
        """TensorE bf16 peak in FLOP/ns: one multiply-add per PE per cycle, ``2 * pe_dim^2 * tensor_ghz``. It
        reproduces the documented peak (``peak_tflops_documented``) to within 1%."""
        return 2 * self.pe_dim * self.pe_dim * self.tensor_ghz

    @property
    def peak_tflops(self):
        return self.peak_flops_per_ns / 1000.0


_COMMON = dict(pe_dim=128, mm_min_cycles=64, load_stationary_speedup=4, fp32_matmul_factor=4,
               vector_reciprocal_factor=8, min_ii_cycles=64,
               static_overhead_applies="dependent", dma_queues=16, dma_partitions_per_queue=8,
               dma_min_piece_ns=0.0, dma_latency_ns=1300.0, dge_instances=2,
               dma_transpose_hbm_eff=0.9, dma_transpose_sbuf_eff=0.5,
               dge_transpose_split=True, dge_charge_transposes=True, dma_transpose_whole_piece=True, sem_wait_ns=200.0, access_overhead_cycles=60, gpsimd_vector_factor=0.0)

TRN1 = Generation(name="trn1", nc_version=2, tensor_ghz=2.8, fp32_transpose_factor=4, vector_ghz=1.12,
                  vector_width_other=128, vector_fast_copy=1, vector_half_copy=1, vector_fast_tt=1,
                  vector_gpsimd_port="all", vector_scalar_psum_shared=True, scalar_ghz=1.4, scalar_fast_copy=1,
                  gpsimd_ghz=1.4, dma_queue_bytes_per_ns=6.5, dma_fixed_ns=0.0, static_overhead_cycles=100,
                  dge_instr_ns=0.0, hbm_bytes_per_ns=410.0,
                  peak_tflops_documented=92.0, **_COMMON)
TRN2 = Generation(name="trn2", nc_version=3, tensor_ghz=2.4, fp32_transpose_factor=2, vector_ghz=0.96,
                  vector_width_other=256, vector_fast_copy=4, vector_half_copy=2, vector_fast_tt=2,
                  vector_gpsimd_port="perf_mode", vector_scalar_psum_shared=False, scalar_ghz=1.2,
                  scalar_fast_copy=1, gpsimd_ghz=1.2, dma_queue_bytes_per_ns=23.0, dma_fixed_ns=150.0,
                  static_overhead_cycles=0, dge_instr_ns=600.0,
                  hbm_bytes_per_ns=375.0,
                  peak_tflops_documented=79.0, **_COMMON)
TRN3 = Generation(name="trn3", nc_version=4, tensor_ghz=2.4, fp32_transpose_factor=2, vector_ghz=1.2,
                  vector_width_other=256, vector_fast_copy=4, vector_half_copy=2, vector_fast_tt=2,
                  vector_gpsimd_port="perf_mode", vector_scalar_psum_shared=False, scalar_ghz=1.2,
                  scalar_fast_copy=2, gpsimd_ghz=1.2, dma_queue_bytes_per_ns=33.0, dma_fixed_ns=150.0,
                  static_overhead_cycles=0, dge_instr_ns=600.0,
                  hbm_bytes_per_ns=588.0,
                  peak_tflops_documented=79.0, **_COMMON)

GENERATIONS = {g.name: g for g in (TRN1, TRN2, TRN3)}


def generation(name):
    """The ``Generation`` of a target name (``trn1``, ``trn2``, ``trn3``; ``inf2``/``gen2``... are aliases)."""
    key = {"inf2": "trn1", "gen2": "trn1", "gen3": "trn2", "gen4": "trn3"}.get(name.lower(), name.lower())
    if key not in GENERATIONS:
        raise ValueError(f"unknown target {name!r}; use one of {sorted(GENERATIONS)}")
    return GENERATIONS[key]


def _fmt(v):
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def render_table():
    """The parameter table as Markdown: one row per parameter, one column per generation, then meaning and
    source."""
    gens = list(GENERATIONS.values())
    head = "| parameter | " + " | ".join(g.name for g in gens) + " | meaning | source |"
    rows = [head, "|" + "---|" * (len(gens) + 3)]
    for f in fields(Generation):
        if f.name == "name":
            continue
        vals = " | ".join(_fmt(getattr(g, f.name)) for g in gens)
        rows.append(f"| `{f.name}` | {vals} | {f.metadata['meaning']} | {f.metadata['source']} |")
    derived = " | ".join(f"{g.peak_tflops:.1f}" for g in gens)
    rows.append(f"| peak TFLOPS used (d) | {derived} | 2 x pe_dim² x tensor_ghz / 1000 | d |")
    return "\n".join(rows)



# The cost-model corrections, each as the parameter values that undo it (docs/performance.md, "Changes to the
# model", reports the figures before and after each one). ``revert(gen, names)`` rebuilds an earlier model.
CORRECTIONS = {
    "dma_fixed_cost_is_latency": dict(dma_fixed_ns=1300.0, dma_min_piece_ns=0.0),
    "vector_width_other": dict(vector_width_other=128),
    "min_ii_and_dependent_overhead": dict(min_ii_cycles=0, static_overhead_applies="all"),
    "vector_gpsimd_port": dict(vector_gpsimd_port="none", vector_scalar_psum_shared=False),
    "dge_issue_cost": dict(dge_instr_ns=0.0),
}


# The changes of the calibrated, dependency-aware model (cost model v2), per generation where they differ: the
# parameter values that undo each (docs/performance.md reports the figures before and after each).
CORRECTIONS_V2 = {
    "dma_transpose_whole_piece": {"*": dict(dma_transpose_whole_piece=False)},
    "hwdge_transpose": {"*": dict(dge_transpose_split=False, dge_charge_transposes=False)},
    "access_overhead": {"*": dict(access_overhead_cycles=0)},
    "semaphore_wait": {"*": dict(sem_wait_ns=0.0)},
    "calibrated_dma": {"trn1": dict(dma_queue_bytes_per_ns=17.0, dma_min_piece_ns=850.0),
                       "*": dict(dma_fixed_ns=0.0, dma_min_piece_ns=850.0)},
    "calibrated_static_overhead": {"trn1": {}, "*": dict(static_overhead_cycles=100)},
}
CORRECTIONS.update({k: v for k, v in CORRECTIONS_V2.items()})


def revert(gen, names):
    """``gen`` with the named ``CORRECTIONS`` undone (an earlier model, for before/after figures)."""
    from dataclasses import replace
    changes = {}
    order = list(CORRECTIONS)
    for name in names:
        if name not in CORRECTIONS:
            raise ValueError(f"unknown correction {name!r}; use one of {sorted(CORRECTIONS)}")
    # undo the latest first, so an earlier correction's values win where two touch the same parameter
    for name in sorted(names, key=order.index, reverse=True):
        if name not in CORRECTIONS:
            raise ValueError(f"unknown correction {name!r}; use one of {sorted(CORRECTIONS)}")
        c = CORRECTIONS[name]
        if "*" in c:
            c = c.get(gen.name, c["*"])
        changes.update({k: v for k, v in c.items() if not k.startswith("_")})
    return replace(gen, **changes)
