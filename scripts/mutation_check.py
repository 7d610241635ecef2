"""Mutation testing of the kernels: plant one realistic bug at a time and check that the focused tests catch it.

    python scripts/mutation_check.py                      # every mutation, 2 at a time, table + JSON
    python scripts/mutation_check.py --check-targets      # only check that every snippet is found exactly once
    python scripts/mutation_check.py --only 'i19_*,b_dq*' # a subset (comma-separated names or globs)
    python scripts/mutation_check.py --list               # the mutations, their files and tests

Each mutation is a short, exact source snippet of one file, its replacement (the planted bug), a description,
and the focused tests that should catch it. The script copies the repository's files (tracked and untracked,
not ignored; uncommitted edits included) to a scratch directory per job, applies ONE mutation there, runs
``pytest -x -q`` on the mutation's tests with the scratch copy first on the path, restores the file, and records:

- killed: a test failed (the first failing test is recorded: ``-x`` stops there);
- survived: every test passed with the bug in place;
- timeout: the tests ran longer than ``--timeout`` (counted as killed, shown apart);
- broken target: the snippet is not found exactly once in the current file. The kernels change often; a
  broken target means the mutation must be retargeted to the new code. It is reported loudly, never run, and
  counted as an error (exit 1).

The working tree is never modified. Before the mutations, each distinct test selection is run once on the
unmutated copy (``--no-baseline`` skips it): a selection that fails without a bug would make every kill
meaningless, so the script stops there.

Exit status 0 when no target is broken, the baseline passes and the kill rate (killed + timeout over the
mutations run) is at least ``--min-kill-rate`` (default 1.0: every planted bug caught); else 1. The JSON report
(``--json``, default ``mutation_check.json`` in the current directory) holds every mutation's outcome, killer,
duration and output tail. Run by hand (it takes tens of minutes), not in CI; docs/validation.md, "Mutation
testing", has the measured result.

Retargeting: keep each ``old`` snippet short and unique (one line, or two when one is not unique) and change
only what the bug needs, so that a rewrite of the surrounding code leaves most mutations valid and a broken one
is fixed by editing one string.
"""
import argparse
import concurrent.futures
import fnmatch
import json
import os
import platform
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FWD = "nki_attn/kernels/attention_fwd.py"
BWD = "nki_attn/kernels/attention_bwd.py"
BAND = "nki_attn/kernels/band.py"
STEPS = "nki_attn/kernels/steps.py"
SCORE = "nki_attn/kernels/score_mods.py"
VALIDATION = "nki_attn/kernels/validation.py"
API = "nki_attn/attention.py"

# Focused test selections (pytest arguments), fastest-failing files first: with -x the run stops at the first
# failure, so a killed mutation costs only the tests before its killer.
T_TILING = ["tests/kernels/test_tiling_bruteforce.py", "tests/kernels/test_band_bruteforce.py"]
T_FWD = ["tests/kernels/test_fwd_coverage.py", "tests/kernels/test_fwd_blocking.py"]
T_BWD = ["tests/kernels/test_bwd_coverage.py", "tests/kernels/test_bwd_grouping.py"]
T_VARLEN = ["tests/api/test_varlen_unequal.py"]
T_VALIDATION = ["tests/kernels/test_kernel_errors.py::test_validation_errors",
                "tests/kernels/test_coverage_gaps.py"]


class Mutation:
    """One planted bug: in ``path`` (relative to the repository root) replace the exact snippet ``old`` (found
    exactly once) by ``new``; ``tests`` are the pytest arguments that should catch it."""

    def __init__(self, name, path, old, new, description, tests):
        self.name = name
        self.path = path
        self.old = old
        self.new = new
        self.description = description
        self.tests = list(tests)


M = Mutation
MUTATIONS = [
    # ---- the five bugs an audit of the suite found it missed (retargeted to the current kernels)
    M("i19_1_dq_scratch_from_3_sections", BWD, "self.n_sections > 1", "self.n_sections > 2",
      "missed-bug audit, bug 1: the fp32 dQ scratch only from 3 K/V sections (bf16 dQ partial sums with 2)", T_BWD),
    M("i19_2_varlen_no_bottom_right", API, "rel = pos + (len_k - len_q)", "rel = pos",
      "missed-bug audit, bug 2: varlen causal/window without the per-sequence bottom-right offset len_k - len_q",
      T_VARLEN),
    M("i19_3_fully_visible_lo_off_by_one", BAND, "return k0 < q1 - 1 + lo_rel", "return k0 < q1 - 2 + lo_rel",
      "missed-bug audit, bug 3: the lower-mask test (band_needs_lo_mask, the window side) one key short",
      T_TILING + T_BWD + T_FWD),
    M("i19_4_visible_lt_as_le", BAND, "k1 - 1 >= q0 + lo_rel", "k1 - 1 > q0 + lo_rel",
      "missed-bug audit, bug 4: band_tile_visible's window-side comparison off by one (a tile with one visible key "
      "skipped)",
      T_TILING + T_BWD + T_FWD),
    M("i19_5_d_in_last_section", BWD, "            if st.blk_first and blk.first:\n                _rowsum_o_dy",
      "            if st.blk_first and blk.first and blk.last:\n                _rowsum_o_dy",
      "missed-bug audit, bug 5 (retargeted to the pipelined backward): D = rowsum(O*dO) only for tiles with one "
      "visible section, so the sections of the others and dsinks read D before anything wrote it", T_BWD),
    # ---- backward: sections, blocks, dQ partial sums
    M("b_first_section_is_0", BWD, "first = c.first_sec[i] == s", "first = s == 0",
      "a query tile's first section taken as section 0, not its first visible one (D unset, dQ reloads garbage)",
      T_BWD),
    M("b_last_section_is_final", BWD, "last = c.last_sec[i] == s", "last = s == c.n_sections - 1",
      "a query tile's last section taken as the final section (dQ never scaled/written when a window ends "
      "earlier)", T_BWD),
    M("b_dq_reload_from_out_dq", BWD, "        if c.dq_scratch:\n            t = nl.ndarray((rn,",
      "        if c.dq_scratch and False:\n            t = nl.ndarray((rn,",
      "wrong dQ scratch reload: the last section reloads out_dq instead of the fp32 scratch", T_BWD),
    M("b_dq_matmul_overwrites_reload", BWD, "accumulate=not (dq_fresh and v.dq_first and ch == 0))",
      "accumulate=not (v.dq_first and ch == 0))",
      "wrong start flag: a later section's first dQ matmul overwrites the reloaded partial sum", T_BWD),
    M("b_dq_scale_in_first_section", BWD, "    if blk.last:\n        scale = c.scale",
      "    if blk.first:\n        scale = c.scale",
      "wrong scale placement: dQ scaled in a tile's first section instead of its last", T_BWD),
    M("b_dvdk_segments_overwrite", BWD, "segs.append((j * PMAX, e * PMAX, acc))",
      "segs.append((j * PMAX, e * PMAX, False))",
      "wrong accumulation start flag: every member's dV/dK matmul overwrites the group's PSUM", T_BWD),
    M("b_dvdk_section_offset", BWD, "a0 = kt.u0 - sec.k_lo", "a0 = kt.u0",
      "dV/dK eviction at the absolute key offset instead of the section-relative one", T_BWD),
    M("k_classify_drops_last_chunk", BAND, "for c0 in range(t0, t1, PMAX):",
      "for c0 in range(t0, t1 - PMAX, PMAX):",
      "off-by-one tile bound: the band planner never looks at a key tile's last 128-key chunk (visits trimmed "
      "by it, one-chunk tiles skipped)", T_TILING + T_BWD + T_FWD),
    M("b_block_head_offset", BWD, "h_abs0 = item.kvh * c.group + blk.h0\n    ncols = blk.nt * PMAX\n    dy_b",
      "h_abs0 = item.kvh * c.group\n    ncols = blk.nt * PMAX\n    dy_b",
      "wrong block index: a block of a split GQA group loads the group's first heads", T_BWD),
    # ---- backward: masks
    M("b_causal_mask_off_by_one", BWD, "offset=q0 + c.hi_rel - k0 - a)", "offset=q0 + c.hi_rel - k0 - a + 1)",
      "band's upper side (causal) element mask on P off by one (each query sees the next key)", T_BWD),
    M("b_window_mask_one_wider", BWD, "offset=k0 - q0 - c.lo_rel)", "offset=k0 - q0 - c.lo_rel + 1)",
      "band's lower side (sliding window) element mask on P one key wider", T_BWD),
    M("b_window_mask_extent", BWD, "e = min(kw, q0 + PMAX - 1 + c.lo_rel - k0)",
      "e = min(kw, PMAX)",
      "band's lower-side mask applied to too few columns (only the visit's first 128-key chunk, though the "
      "window edge of the tile's last rows lies further right)", T_BWD),
    M("b_packing_window_bound", BWD, "operand0=float(c.lo_rel), op1=nl.maximum",
      "operand0=float(c.lo_rel - 1), op1=nl.maximum",
      "band's lower side (window) folded into the packing bounds one key wider (trn2 range_select path)", T_BWD),
    M("b_packing_causal_bound", BWD, "operand0=float(c.hi_rel + 1),", "operand0=float(c.hi_rel),",
      "band's upper side (causal) folded into the packing bounds drops the diagonal", T_BWD),
    # ---- backward: GQA and sinks
    M("b_neg_lse_heads", BWD, "lse_ref[b, hk * c.group:(hk + 1) * c.group, :, :]",
      "lse_ref[b, hk * c.nheads_kv:hk * c.nheads_kv + c.group, :, :]",
      "wrong GQA head mapping of the LSE load (nheads_kv for the group size)", T_BWD),
    M("b_dsinks_logit_offset", BWD, "offset=(b * c.nheads + hk * g_n) * ns))",
      "offset=(b * c.nheads + hk * c.nheads_kv) * ns))",
      "wrong dsinks: sink logits of kv head hk read at hk * nheads_kv instead of hk * group", T_BWD),
    M("b_dsinks_store_heads", BWD, "out_dsinks[b, hk * g_n:(hk + 1) * g_n, :]",
      "out_dsinks[b, hk * c.nheads_kv:hk * c.nheads_kv + g_n, :]",
      "wrong dsinks: stored at hk * nheads_kv instead of hk * group (3-D sinks)", T_BWD),
    M("b_dsinks_sign", BWD, "data=prod, axis=2, negate=True)", "data=prod, axis=2, negate=False)",
      "wrong dsinks: sign of dS_sink = -exp(sink - LSE) * D dropped", T_BWD),
    M("b_no_key_rows_d_unset", BWD, "        nisa.memset(dst=dsum, value=0.0)\n", "",
      "D of query tiles that see no key left unset (bottom-right causal, seqlen_q > seqlen_k; dsinks reads it)",
      T_BWD),
    # ---- forward: online softmax
    M("f_no_o_rescale", FWD, "operand0=alpha[:, u:u + 1], op1=nl.add, operand1=o_ps)",
      "operand0=1.0, op1=nl.add, operand1=o_ps)",
      "missing rescale: O not multiplied by alpha when the running max grows", T_FWD),
    M("f_no_l_rescale", FWD, "nisa.tensor_tensor(dst=rs[:, :, kb], data1=l_sum, data2=alpha, op=nl.multiply)",
      "nisa.tensor_copy(dst=rs[:, :, kb], src=l_sum)",
      "missing rescale: l not multiplied by alpha when the running max grows", T_FWD),
    M("f_alpha_reversed", FWD, "data1=pm[:, :, kb], data2=pm_next[:, :, kb], op=nl.subtract",
      "data1=pm_next[:, :, kb], data2=pm[:, :, kb], op=nl.subtract",
      "alpha = exp(m' - m) instead of exp(m - m')", T_FWD),
    M("f_start_flag_never_set", FWD, "            blk.started[u] = True", "            blk.started[u] = False",
      "wrong start flag: every key block overwrites O instead of accumulating", T_FWD),
    M("f_lse_sign", FWD, "data1=log_l, data2=bias, op=nl.subtract", "data1=log_l, data2=bias, op=nl.add",
      "lse = log(l) + bias instead of log(l) - bias (= c m + log l)", T_FWD),
    M("f_empty_rows_lse_zero", FWD, "on_true=lse_real, on_false=POS_INF)", "on_true=lse_real, on_false=0.0)",
      "a row with no visible key gets LSE 0 instead of +inf", T_FWD),
    M("f_scale_twice", FWD, "self.exp_scale = shp.softcap if shp.softcap > 0 else shp.scale",
      "self.exp_scale = shp.softcap if shp.softcap > 0 else shp.scale * shp.scale",
      "wrong scale placement: the softmax scale applied twice by the forward's float32 exponent", T_FWD),
    M("b_dk_eviction_unscaled", BWD, "self.dk_scale = a.scale", "self.dk_scale = 1.0",
      "wrong scale placement: dK leaves PSUM without the softmax scale (Q is not scaled at load)", T_BWD),
    M("b_row_d_from_o", BWD, "    return c.tiles[s][i][0].k1 - c.tiles[s][i][0].k0 == PMAX\n", "    return False\n",
      "D of the rows whose keys fit one 128-key chunk taken from the bf16 O (rowsum(O*dO)) instead of summed from "
      "the visit's P and dP", ["tests/kernels/test_bwd_exact_d.py"]),
    M("b_evict_unwritten_chunks", BWD, "    for wr in _runs(kt.wrote, 0, len(kt.wrote)):\n",
      "    for wr in [(0, len(kt.wrote))]:\n",
      "stale PSUM: a group's dV/dK eviction covers chunks of the key tile's span that no member's matmul wrote "
      "(a block mask leaves such chunks between two members' runs)",
      ["tests/masks/test_flex.py::test_fwd_bwd_mixed_chunk_classes_inside_key_tiles"]),
    M("s_block_slot_from_tile", STEPS, "block_partial_count(bl.rows[tile.t], kt0, c0 + ka // PMAX)",
      "block_partial_count(bl.rows[tile.t], c0, c0 + ka // PMAX)",
      "wrong bitmap slot: a tile that starts inside its key tile (the backward splits key tiles at SKIP chunks) "
      "reads the slots of the key tile's first PARTIAL chunks",
      ["tests/masks/test_flex.py::test_fwd_bwd_tile_split_at_a_skip_chunk_reads_its_own_bits"]),
    M("f_split_chunk_from_column", STEPS, "cls = row[c0 + keys[j] // PMAX]", "cls = row[c0 + j]",
      "wrong chunk of a split key tile: the forward (its runs back to back) takes a chunk's class, and so its mask "
      "and bitmap slot, from its column in the runs instead of its key (the chunk of the SKIP gap, or an earlier "
      "chunk's bits)",
      ["tests/masks/test_flex.py::test_fwd_bwd_split_key_tiles_visit_only_their_runs"]),
    M("f_split_pv_skips_nothing", FWD, "moving=vt[:, i * ch + lo + chunks[c] - kb.c_lo, :])",
      "moving=vt[:, i * ch + lo + c - kb.c_lo, :])",
      "the forward's split key tile multiplies its runs' P by the V of the tile's first chunks (a SKIP chunk's V "
      "read instead of the next run's)",
      ["tests/masks/test_flex.py::test_fwd_bwd_split_key_tiles_visit_only_their_runs"]),
    M("b_one_section_per_item", BWD, "    return section_len < seqlen_k or items > 1\n",
      "    return section_len < seqlen_k\n",
      "SBUF overflow: several work items keep the whole-length section although the pipeline holds two at once "
      "(the one predicate of the section sizing and the budget's live sections)",
      ["tests/kernels/test_bwd_plan.py::test_several_work_items_keep_two_sections_within_sbuf"]),
    # ---- the score-modification table (score_mods.SCORE_MODS) and the loops that read it
    M("r_logit_scale_rank_last", SCORE,
      'ScoreMod("logit_scale", ("logit_scale",), None, 0,', 'ScoreMod("logit_scale", ("logit_scale",), None, 4,',
      "wrong score-step order: the logit scale applied after soft-capping and the bias instead of first",
      ["tests/kernels/test_matrix.py::test_fwd[bf16-causal+cap2+biash+lscale1-d64-s256-b2h2k1]",
       "tests/kernels/test_matrix.py::test_bwd[bf16-causal+cap2+biash+lscale1-d64-s256-b2h2k1]"]),
    M("r_mod_ds_ignored", BWD, "        if ms.ds is not None:\n            ds = ms.ds\n",
      "        if ms.ds is not None:\n            ds = ds\n",
      "a row's dS step never replaces the kernel's: the bias gradient is never written",
      ["tests/kernels/test_bias_kernels.py"]),
    # ---- forward: masks and tile bounds
    M("k_classify_run_drops_last", BAND, "            k1 = c0 + PMAX\n", "            k1 = c0\n",
      "off-by-one tile bound: a member's visible chunk run loses its last chunk", T_TILING + T_FWD + T_BWD),
    M("f_window_bound_off_by_one", FWD, "offset=cfg.lo_rel, channel_multiplier=1)",
      "offset=cfg.lo_rel - 1, channel_multiplier=1)",
      "band's lower side (window) key bound one key wider (trn2+ range_select bounds)", T_FWD),
    M("f_causal_bound_drops_diagonal", FWD, "offset=cfg.hi_rel + 1, channel_multiplier=1)",
      "offset=cfg.hi_rel, channel_multiplier=1)",
      "band's upper side (causal) key bound q + hi_rel instead of q + hi_rel + 1 (the diagonal masked)", T_FWD),
    M("f_trn1_window_affine", FWD, "offset=ks - q0 - cfg.lo_rel)", "offset=ks - q0 - cfg.lo_rel + 1)",
      "trn1 affine mask of the band's lower side (window) one key wider",
      ["tests/kernels/test_coverage_gaps.py::test_trn1_affine_window_mask"] + T_FWD),
    M("k_packing_tiles_full", BAND, "if packing or needs_lo or needs_hi:", "if needs_lo or needs_hi:",
      "dropped mask: packing tiles classified as fully visible when the band would allow it",
      T_TILING + T_FWD + T_BWD),
    M("k_mask_step_ignores_kind", STEPS, 'if tile.kind == "full":', 'if tile.kind != "skip":',
      "dropped mask: every visible tile gets the mask step of a fully visible one", T_FWD + T_BWD),
    # ---- forward: blocks, sections, offsets
    M("f_kv_load_offset", FWD, "kvh = work.kvh\n    key0 = kb.kt0 * K_TILE + kb.c_lo * PMAX",
      "kvh = work.kvh\n    key0 = kb.kt0 * K_TILE",
      "K/V of a key block loaded from the block start, not from its first visible chunk", T_FWD),
    M("f_v_chunk_index", FWD, "moving=vt[:, i * ch + lo + chunks[c] - kb.c_lo, :]",
      "moving=vt[:, i * ch + chunks[c] - kb.c_lo, :]",
      "wrong V^T chunk in the PV matmul (the member's first visible chunk of the tile ignored)", T_FWD),
    M("f_block_column", FWD, "col = (j0 + u) * PMAX", "col = u * PMAX",
      "wrong block index: a block's O goes to the slab's first members' columns", T_FWD),
    M("f_slab_tile", FWD, "tiles.append(slab.t0 + j // g)", "tiles.append(j // g)",
      "wrong slab index: a member's query tile taken relative to its slab", T_FWD),
    # ---- forward: GQA and sinks
    M("f_q_head_mapping", FWD, "src=hbm.q[b, kvh * g + h,", "src=hbm.q[b, kvh * cfg.shp.nheads_kv + h,",
      "wrong GQA head mapping: Q of kv head kvh read at kvh * nheads_kv + h", T_FWD),
    M("f_sink_offset", FWD, "offset=(b * shp.nheads + kvh * g) * ns))",
      "offset=(b * shp.nheads + kvh * shp.nheads_kv) * ns))",
      "wrong GQA head mapping of the sink logits (nheads_kv for the group size)", T_FWD),
    M("f_sink_sum_dropped", FWD, "nisa.tensor_copy(dst=l_sum, src=per_member(cfg, l0, j0, n))",
      "nisa.memset(dst=l_sum, value=0.0, engine=nisa.engine.gpsimd)",
      "sinks dropped from the softmax denominator (their max kept)", T_FWD),
    # ---- the band planner (band.py: the band and the tile classification both kernels plan with)
    M("t_sliding_window_one_wider", BAND, "lo_rel = max(lo_rel, off - sliding_window + 1)",
      "lo_rel = max(lo_rel, off - sliding_window)",
      "the sliding-window band one key wider", T_TILING + T_BWD + T_FWD),
    M("t_key_range_end", BAND, "k_end = min(seqlen_k, q1 + hi_rel)", "k_end = min(seqlen_k, q1 - 1 + hi_rel)",
      "band_key_range one key short at its end", T_TILING),
    M("t_band_right_side", BAND, "hi_rel = min(hi_rel, off + right)", "hi_rel = min(hi_rel, off + right + 1)",
      "two-sided window band one key wider on the right", T_TILING),
    # ---- validation
    M("v_dropout_p_one_accepted", VALIDATION, "dropout_p >= 0.0 and dropout_p < 1.0)",
      "dropout_p >= 0.0 and dropout_p <= 1.0)",
      "dropout_p=1.0 accepted (the kept values' 1 / (1 - p) divides by zero)",
      ["tests/kernels/test_validation_variants.py::test_spec_arguments_refused"] + T_VALIDATION),
    M("v_window_zero_accepted", VALIDATION, "or sliding_window < 1:", "or sliding_window < 0:",
      "sliding_window=0 accepted", T_VALIDATION),
]


# Mutations of code no launch reaches today (equivalent mutants: no test can kill them), kept for when it becomes
# live; run with --with-pending. Empty now: b_no_key_rows_d_unset (the backward's no-key query tiles) became
# reachable with bottom-right causal and seqlen_q > seqlen_k and moved into MUTATIONS.
PENDING = []


# ----------------------------------------------------------------------------------------------- targets
class BrokenTarget(Exception):
    """A mutation's snippet is not found exactly once in its file: the mutation must be retargeted."""


def target_count(text, old):
    """How many times the snippet ``old`` occurs in ``text`` (non-overlapping)."""
    return text.count(old)


def apply_mutation(text, m):
    """``text`` with the mutation's snippet replaced; BrokenTarget unless it occurs exactly once."""
    n = target_count(text, m.old)
    if n != 1:
        where = "not found" if n == 0 else f"found {n} times (must be unique)"
        raise BrokenTarget(f"{m.name}: snippet {m.old!r} {where} in {m.path}")
    return text.replace(m.old, m.new, 1)


def check_targets(root, mutations):
    """``{name: None or problem}`` for every mutation against the files under ``root``."""
    out = {}
    for m in mutations:
        p = os.path.join(root, m.path)
        if not os.path.isfile(p):
            out[m.name] = f"{m.name}: file {m.path} does not exist"
            continue
        with open(p) as f:
            text = f.read()
        try:
            apply_mutation(text, m)
            out[m.name] = None
        except BrokenTarget as e:
            out[m.name] = str(e)
    return out


def select(mutations, only):
    """The mutations whose name matches one of the comma-separated names/globs of ``only`` (all when None)."""
    if not only:
        return list(mutations)
    pats = [p.strip() for p in only.split(",") if p.strip()]
    picked = [m for m in mutations if any(fnmatch.fnmatchcase(m.name, p) for p in pats)]
    if not picked:
        raise SystemExit(f"--only {only!r} matches no mutation (see --list)")
    return picked


# ----------------------------------------------------------------------------------------------- scratch copies
def repo_files(repo):
    """Paths (relative) of the repository's files: tracked and untracked-but-not-ignored, as the working tree has
    them (uncommitted edits included). Without git: every file outside .git and caches."""
    try:
        r = subprocess.run(["git", "-C", repo, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           capture_output=True, check=True)
        files = [f for f in r.stdout.decode().split("\0") if f]
        return sorted(f for f in files if os.path.isfile(os.path.join(repo, f)))
    except (OSError, subprocess.CalledProcessError):
        out = []
        for d, dirs, names in os.walk(repo):
            dirs[:] = [x for x in dirs if x not in (".git", "__pycache__", ".pytest_cache")]
            for n in names:
                out.append(os.path.relpath(os.path.join(d, n), repo))
        return sorted(out)


def make_scratch(repo, dest):
    """Copy the repository's files into the (new or empty) directory ``dest``; returns ``dest``."""
    for rel in repo_files(repo):
        src = os.path.join(repo, rel)
        dst = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy2(src, dst)
    return dest


def scratch_env(root):
    """Environment of a test run in the scratch copy: it comes first on the path (ahead of an editable install),
    no bytecode is written (a mutated and a restored file can share an mtime), no plugin autoloading surprises."""
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def check_scratch_imports(root):
    """Fail unless ``import nki_attn`` in the scratch environment loads the scratch copy."""
    r = subprocess.run([sys.executable, "-c", "import nki_attn, os; print(os.path.realpath(nki_attn.__file__))"],
                       cwd=root, env=scratch_env(root), capture_output=True, text=True)
    path = r.stdout.strip()
    if r.returncode != 0 or not path.startswith(os.path.realpath(root)):
        raise SystemExit(f"the scratch copy {root} does not import its own nki_attn (got {path!r}, "
                         f"{r.stderr[-500:]!r})")


# ----------------------------------------------------------------------------------------------- running
def pytest_command(tests, stop_first=True, workers=0):
    """pytest on ``tests``: quiet, no cache, stop at the first failure (a mutation run), ``workers`` xdist
    processes (0: in process)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(workers)]
    if stop_first:
        cmd.append("-x")
    return cmd + list(tests)


def test_union(mutations):
    """The distinct pytest arguments of the mutations' tests, in first-use order (the baseline run)."""
    out = []
    for m in mutations:
        for t in m.tests:
            if t not in out:
                out.append(t)
    return out


def classify(returncode, output):
    """``(status, killer)`` of a pytest run: status killed / survived / error; killer the first failing test
    (or the collection error) for a kill."""
    lines = output.splitlines()
    # "FAILED tests/x.py::test[id] - message": the test id may contain spaces, the message follows " - "
    failed = [ln.split(" ", 1)[1].split(" - ")[0].strip() for ln in lines
              if ln.startswith(("FAILED ", "ERROR ")) and " " in ln]
    if returncode == 0:
        return "survived", None
    if returncode == 1:
        return "killed", failed[0] if failed else "(a test failed)"
    if returncode == 2 and ("error during collection" in output or "errors during collection" in output
                            or failed):
        # the mutated module does not import: a crash the tests see, so a kill
        return "killed", "collection error: " + (failed[0] if failed else "?")
    return "error", f"pytest exit status {returncode}"


def run_tests(root, tests, timeout, stop_first=True, workers=0):
    """Run pytest on ``tests`` in ``root``: ``(status, killer, seconds, returncode, output tail)``."""
    t0 = time.perf_counter()
    try:
        r = subprocess.run(pytest_command(tests, stop_first, workers), cwd=root, env=scratch_env(root),
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"")
        out = out.decode(errors="replace") if isinstance(out, bytes) else out
        return "timeout", f"(over {timeout:.0f} s)", time.perf_counter() - t0, None, out[-2000:]
    out = r.stdout + r.stderr
    status, killer = classify(r.returncode, out)
    return status, killer, time.perf_counter() - t0, r.returncode, out[-2000:]


def run_mutation(root, m, timeout):
    """Apply ``m`` in the scratch copy ``root``, run its tests, restore the file. Returns the result dict."""
    p = os.path.join(root, m.path)
    with open(p) as f:
        original = f.read()
    res = {"name": m.name, "path": m.path, "description": m.description, "tests": m.tests}
    try:
        mutated = apply_mutation(original, m)
    except BrokenTarget as e:
        res.update(status="broken-target", killer=None, seconds=0.0, returncode=None, output=str(e))
        return res
    try:
        with open(p, "w") as f:
            f.write(mutated)
        status, killer, secs, rc, out = run_tests(root, m.tests, timeout)
    finally:
        with open(p, "w") as f:
            f.write(original)
    res.update(status=status, killer=killer, seconds=round(secs, 1), returncode=rc, output=out)
    return res


def summarize(results):
    """Counts and kill rate: killed + timeout over the mutations that ran (broken targets and errors are not in
    the denominator; they fail the run on their own)."""
    counts = {}
    for r in results:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    ran = counts.get("killed", 0) + counts.get("timeout", 0) + counts.get("survived", 0)
    caught = counts.get("killed", 0) + counts.get("timeout", 0)
    return {"counts": counts, "ran": ran, "caught": caught, "kill_rate": caught / ran if ran else 0.0}


def exit_status(summary, min_kill_rate, baseline_ok=True):
    """0 when nothing is broken, no run errored, the baseline passed and the kill rate reaches the minimum."""
    c = summary["counts"]
    if c.get("broken-target", 0) or c.get("error", 0) or not baseline_ok:
        return 1
    return 0 if summary["kill_rate"] >= min_kill_rate - 1e-12 else 1


def table(results):
    """Markdown table of the results, in the list's order."""
    lines = ["| # | mutation | file | bug | result | caught by | s |", "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(results, 1):
        killer = r.get("killer") or ""
        lines.append(f"| {i} | `{r['name']}` | {os.path.basename(r['path'])} | {r['description']} | "
                     f"**{r['status']}** | {('`' + killer + '`') if killer else '-'} | {r['seconds']:.0f} |")
    return "\n".join(lines)


def banner(msg):
    bar = "!" * 100
    print(f"\n{bar}\n{msg}\n{bar}\n", file=sys.stderr, flush=True)


def run_all(repo, mutations, jobs, timeout, baseline=True, log=print):
    """Check targets, make ``jobs`` scratch copies, run the baseline and the mutations. Returns
    ``(results, baseline_results)``."""
    broken = check_targets(repo, mutations)
    results = {}
    for m in mutations:
        if broken[m.name]:
            results[m.name] = {"name": m.name, "path": m.path, "description": m.description, "tests": m.tests,
                               "status": "broken-target", "killer": None, "seconds": 0.0, "returncode": None,
                               "output": broken[m.name]}
    if any(broken.values()):
        banner("BROKEN TARGETS (retarget these mutations to the current code; counted as errors):\n  "
               + "\n  ".join(v for v in broken.values() if v))
    runnable = [m for m in mutations if not broken[m.name]]
    base = tempfile.mkdtemp(prefix="mutation_check_")
    roots = queue.Queue()
    try:
        for j in range(jobs):
            root = make_scratch(repo, os.path.join(base, f"job{j}"))
            roots.put(root)
        check_scratch_imports(os.path.join(base, "job0"))
        baseline_results = []
        if baseline and runnable:
            union = test_union(runnable)
            log(f"baseline: {len(union)} test argument(s) on the unmutated copy, pytest -n {jobs}")
            root = os.path.join(base, "job0")
            st, failed, secs, rc, out = run_tests(root, union, timeout * 2, stop_first=False, workers=jobs)
            b = {"tests": union, "status": "passed" if st == "survived" else st, "failed": failed,
                 "seconds": round(secs, 1), "output": out}
            baseline_results.append(b)
            log(f"  baseline {b['status']} in {b['seconds']:.0f} s" + (f" ({failed})" if failed else ""))
            if b["status"] != "passed":
                banner("BASELINE FAILS: the tests fail without any mutation; fix that first\n" + out[-1500:])
                return [results.get(m.name, {"name": m.name, "path": m.path, "description": m.description,
                                             "tests": m.tests, "status": "not-run", "killer": None,
                                             "seconds": 0.0, "returncode": None, "output": ""})
                        for m in mutations], baseline_results
        lock = threading.Lock()
        done = [0]

        def one(m):
            root = roots.get()
            try:
                r = run_mutation(root, m, timeout)
            finally:
                roots.put(root)
            with lock:
                done[0] += 1
                log(f"[{done[0]}/{len(runnable)}] {r['status']:>13} {r['seconds']:6.0f} s  {m.name}"
                    + (f"  <- {r['killer']}" if r["killer"] else ""))
            return r
        with concurrent.futures.ThreadPoolExecutor(jobs) as ex:
            for r in ex.map(one, runnable):
                results[r["name"]] = r
        return [results[m.name] for m in mutations], baseline_results
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", default=REPO, help="repository root to copy (default: this script's repository)")
    ap.add_argument("--only", help="comma-separated mutation names or globs (default: all)")
    ap.add_argument("--jobs", type=int, default=2, help="mutations run at once, 1 or 2 (default 2)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per pytest run (default 900)")
    ap.add_argument("--min-kill-rate", type=float, default=1.0, help="exit 1 below this kill rate (default 1.0)")
    ap.add_argument("--json", default="mutation_check.json", help="report path (default mutation_check.json)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of each test selection")
    ap.add_argument("--with-pending", action="store_true",
                    help="also run PENDING (mutations of code no launch reaches yet; they survive)")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--check-targets", action="store_true",
                    help="only check that every snippet occurs exactly once; exit 1 when one does not")
    args = ap.parse_args(argv)
    if args.jobs not in (1, 2):
        ap.error(f"--jobs={args.jobs}: must be 1 or 2 (the machine has 2 cores and is shared)")
    if not 0.0 <= args.min_kill_rate <= 1.0:
        ap.error(f"--min-kill-rate={args.min_kill_rate}: must be within [0, 1]")
    pool = MUTATIONS + (PENDING if args.with_pending else [])
    names = [m.name for m in pool]
    if len(set(names)) != len(names):
        raise SystemExit("duplicate mutation names")
    muts = select(pool, args.only)
    if args.list or args.check_targets:
        broken = check_targets(args.repo, muts)
        for m in muts:
            flag = "BROKEN " if broken[m.name] else "ok     "
            print(f"{flag}{m.name:36s} {m.path:36s} {m.description}")
            if args.list:
                print(f"{'':43s}tests: {' '.join(m.tests)}")
        bad = [v for v in broken.values() if v]
        if bad:
            banner("BROKEN TARGETS:\n  " + "\n  ".join(bad))
        print(f"{len(muts)} mutations, {len(bad)} broken target(s)")
        return 1 if bad else 0

    t0 = time.perf_counter()
    print(f"{len(muts)} mutations, {args.jobs} at a time, timeout {args.timeout:.0f} s per run", flush=True)
    results, base = run_all(args.repo, muts, args.jobs, args.timeout, baseline=not args.no_baseline,
                            log=lambda s: print(s, flush=True))
    summary = summarize(results)
    baseline_ok = all(b["status"] == "passed" for b in base)
    rc = exit_status(summary, args.min_kill_rate, baseline_ok)
    print()
    print(table(results))
    c = summary["counts"]
    print(f"\nkill rate {summary['caught']}/{summary['ran']} = {summary['kill_rate']:.1%} (killed "
          f"{c.get('killed', 0)}, timeout {c.get('timeout', 0)}, survived {c.get('survived', 0)}, broken targets "
          f"{c.get('broken-target', 0)}, errors {c.get('error', 0)}); {time.perf_counter() - t0:.0f} s")
    for r in results:
        if r["status"] == "survived":
            print(f"SURVIVED: {r['name']}: {r['description']}")
    if c.get("broken-target"):
        banner(f"{c['broken-target']} BROKEN TARGET(S): retarget them (see above); the run counts as failed")
    for r in results:
        if r["status"] == "error":
            print(f"ERROR: {r['name']}: {r['killer']}\n{r['output'][-1500:]}", file=sys.stderr)
    report = {"summary": summary, "min_kill_rate": args.min_kill_rate, "exit_status": rc, "baseline": base,
              "results": results, "jobs": args.jobs, "timeout": args.timeout,
              "python": platform.python_version(), "seconds": round(time.perf_counter() - t0, 1)}
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    print(f"report: {args.json}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
