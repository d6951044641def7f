"""Report of bench/e2e.py: the markdown table and the PNG plots, from the results dict it saves as json."""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def ms_cell(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def _gib(value) -> str:
    return "-" if value is None or value != value else f"{value:.2f}"  # None or NaN: not measured


def mode_label(row: dict, *, gradient_sync: bool = True) -> str:
    """eager, compiled (compile=true) or compiled + CUDA graphs (compile_mode=reduce-overhead); gradient_sync=False
    leaves out how several GPUs synced their gradients (bench/ddp.py's variants, which 1-GPU rows lack)."""
    label = "eager"
    if row["compile"]:
        label = "compiled + CUDA graphs" if row.get("compile_mode") == "reduce-overhead" else "compiled"
        label += ", losses eager" if row.get("losses_compiled") is False else ""
        label += {"static": ", backbone compiled (static shapes)",
                  "dynamic": ", backbone compiled (dynamic shapes)"}.get(row.get("backbone_compiled"), "")
        # Rows without the key ran compile_regions=layers: they were measured before the choice existed
        label += ", the transformer as one graph" if row.get("compile_regions") == "transformer" else ""
    if not gradient_sync:
        return label
    if row.get("gpus", 1) > 1:  # bench/ddp.py's rows; those without a gradient_sync ran DDP
        label += ", all-reduce after backward" if row.get("gradient_sync") == "allreduce" else ", DDP"
    # bench/ddp.py marks the rows run with Dynamo's cuts on; rows written before the trainer turned them off
    # (2026-11-30) had them on without the mark (their run notes say so).
    return label + (", Dynamo's DDP graph cuts" if row.get("ddp_graph_split") else "")


def _step_cell(row: dict) -> str:
    """The median step; with repeats, the median over them and their range."""
    spread = row.get("repeat_ms")
    if not spread:
        return f"{row['step_ms']:.1f}"
    return f"{row['step_ms']:.1f} ({spread[0]:.1f}-{spread[-1]:.1f} over {len(spread)} runs)"


def _sizes(row: dict) -> str:
    if "distinct_shapes" not in row:
        return row["shapes"]
    per_epoch = f", {row['shapes_per_epoch']} in a COCO epoch" if "shapes_per_epoch" in row else ""
    return f"{row['shapes']} ({row['distinct_shapes']} sizes{per_epoch})"


def back_to_back_how(rows: list[dict]) -> str:
    """How these rows' back-to-back figures were taken: as the median of blocks where a row keeps its blocks
    (rows measured since blocks were kept), else from one run of the steps."""
    blocks = {len(r["back_to_back_blocks_ms"]) for r in rows if r.get("back_to_back_blocks_ms")}
    single = any(r.get("back_to_back_ms") is not None and not r.get("back_to_back_blocks_ms") for r in rows)
    if not blocks:
        return "one such run"
    counts = " or ".join(str(n) for n in sorted(blocks))
    return f"the median of {counts} such runs" + ("; one run in rows without blocks" if single else "")


def steptime_lines(rows: list[dict], header: dict, title: str | None = None) -> list[str]:
    batches = ", ".join(sorted({str(r["batch"]) for r in rows}))
    lines = [f"### {title}" if title else f"## Training step, default model, batch {batches}", "",
             f"{header['date']}, {header['gpu']}, torch {header['torch']}, triton {header['triton']}: "
             f"`{header['command']}`.{' ' + header['note'] if header.get('note') else ''} The trainer's own step "
             "(engine.train.step.OptimizerStep: forward, matching and losses, backward, clipping, fused AdamW). Fixed: random "
             "800x1333 batches, median of the timed steps after warm-up, each timed to the end of its GPU work; "
             "back to back: the same number of steps with no sync between them, as train.py runs them, wall time "
             f"per step, {back_to_back_how(rows)}. COCO sizes: batches of the COCO recipe's image sizes (short side "
             "480-800, long side up to 1333), padded as `dataset.pad_to_multiple=N` pads them; one sequence of "
             "sizes run several times: new "
             "sizes is the median of the first pass (each size met for the first time, as early in a run), step "
             "the median of the last (every size met before, as once a run has seen them all; 'in a COCO epoch' "
             "says how many sizes that takes). Two passes eager, three with CUDA graphs, which run a new size "
             "once, record it at its second step and replay it from the third. GPU kernels: device time of the "
             "step's CUDA kernels (torch.profiler), and its share of the step. Syncs: host syncs in one step "
             "(torch.cuda.set_sync_debug_mode). First step: wall time of the first step (kernel and model "
             "compilation). Speed-up: pytorch's step time over this row's, same batch, precision, mode and sizes.",
             "", "| batch | precision | msda | mode | sizes | step ms | back to back ms | new sizes ms "
             "| GPU kernels ms | kernel share | launches | syncs | peak GiB | attention share | first step s "
             "| recompiles | speed-up |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def key(r):
        return r["batch"], r["amp"], mode_label(r), r["shapes"]

    def pct(value) -> str:
        return "-" if value is None else f"{100 * value:.0f}%"

    reference = {key(r): r for r in rows if r["impl"] == "pytorch"}
    for r in rows:
        base = reference.get(key(r))
        cells = [r["batch"], r["amp"].replace("none", "fp32"), r["impl"], mode_label(r), _sizes(r),
                 _step_cell(r), ms_cell(r.get("back_to_back_ms")), ms_cell(r.get("first_pass_ms")),
                 ms_cell(r.get("gpu_kernel_ms")), pct(r.get("kernel_share")),
                 ms_cell(r.get("launches")).removesuffix(".0"), r.get("syncs_per_step", "-"), _gib(r.get("peak_gib")),
                 pct(r.get("attention_share")), ms_cell(r.get("first_step_s")), r.get("recompiles", "-"),
                 f"{base['step_ms'] / r['step_ms']:.2f}x" if base else "-"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    if any(r.get("compile_mode") == "reduce-overhead" and "passes" in r and r["passes"] < 3 for r in rows):
        lines += ["", "The CUDA-graph rows of COCO sizes above come from a run of two passes: its second pass "
                  "holds the recordings of the sizes met once in the first, so where every size was new (pad 1) "
                  "the step is a recording, not a replay; where sizes recur (pad 128), it is mostly replays."]
    lines += annotation_caveat(rows)
    if any(r.get("peak_note") for r in rows):
        note = next(r["peak_note"] for r in rows if r.get("peak_note"))
        lines += ["", f"Peak memory of the CUDA-graph rows is not shown: {note}."]
    idle_rows = [r for r in rows if r.get("gpu_idle_by_phase_ms")]
    if idle_rows:
        lines += ["", "GPU idle per step, charged to what the host was doing meanwhile (torch.profiler; the phases "
                  "of engine.train.step, with the matching's host wait and Hungarian solve as step.matching):", ""]
        for r in idle_rows:
            phases = ", ".join(f"{name.removeprefix('step.')} {ms:.1f}"
                               for name, ms in r["gpu_idle_by_phase_ms"].items())
            lines.append(f"- {r['impl']}, {mode_label(r)}, {r['shapes']}: {r['gpu_idle_ms']:.1f} ms ({phases})")
    for r in rows:
        if r.get("host_profile"):
            lines += ["", f"Host profile of {r['impl']}, {mode_label(r)}, steps on new COCO "
                      "recipe sizes (torch.profiler, CPU, top operations by their own time):", "", "```",
                      r["host_profile"].rstrip(), "```"]
        if r.get("host_cprofile"):
            lines += ["", f"Python profile of {r['impl']}, {mode_label(r)}, fixed-size steps (cProfile: own "
                      "time, then cumulative):", "", "```", r["host_cprofile"].rstrip(), "```"]
    return lines


def annotation_caveat(rows: list[dict]) -> list[str]:
    """A warning under tables whose GPU kernel times were summed before named ranges were left out."""
    if not any(r.get("gpu_kernel_ms") is not None and not r.get("kernel_time_excludes_annotations") for r in rows):
        return []
    return ["", "GPU kernel times (and kernel and attention shares) of these rows also summed the GPU-side spans "
            "of named host ranges (torch.profiler's user annotations: the optimizer's step, compiled regions' "
            "calls, DDP's forward and NCCL's calls), which counts some kernels twice: they overstate the "
            "kernels' time by an amount these runs did not record. Rows measured since are free of it."]


def bench_row_for_trainpy(result: dict, rows: list[dict]) -> dict | None:
    """The step-time row a train.py run compares with: triton, bf16, same mode and padding, COCO sizes.

    train.py pads as dataset.pad_to_multiple says, and a short run meets new sizes only, so the row's first
    pass over new sizes is the figure to compare with.
    """
    return next((r for r in rows if r["impl"] == "triton" and r["amp"] == "bf16"
                 and mode_label(r) == mode_label(result)
                 and r["shapes"].startswith("COCO recipe sizes")
                 and r.get("pad_to_multiple", 1) == result.get("pad_to_multiple", 1)), None)


def trainpy_runs(saved) -> list[dict]:
    """The train.py runs of e2e_h200_trainpy.json, newest first (older files hold one run as a dict)."""
    return [saved] if isinstance(saved, dict) else list(saved)


def trainpy_lines(result: dict, rows: list[dict]) -> list[str]:
    """One train.py run's paragraph: its TensorBoard figure against the bench's of the same run, if any."""
    header = result.get("header", {})
    lines = ["", f"{header.get('date', '')}, {header.get('gpu', '')}, from `{header.get('command', '')}`: "
             f"`python {result['command']}` (synthetic images resized as the COCO recipe does; "
             f"{mode_label(result)}): median of the TensorBoard values after the first interval "
             f"{result['median_step_time_ms']:.1f} ms.{' ' + result['note'] if result.get('note') else ''}"]
    # Only a figure of the same run compares: the one it recorded, else a row of the run that made it.
    bench_ms = result.get("bench_step_ms")
    if bench_ms is None:
        same_run = [r for r in rows if r.get("command") == result.get("header", {}).get("command")]
        bench = bench_row_for_trainpy(result, same_run)
        bench_ms = bench.get("first_pass_ms", bench["step_ms"]) if bench else None
    if bench_ms is not None:
        ratio = result["median_step_time_ms"] / bench_ms
        verdict = "within" if abs(ratio - 1) <= 0.1 else "outside"
        lines.append(f"The bench's step on new sizes of the COCO recipe in the same run, same mode: "
                     f"{bench_ms:.1f} ms; TensorBoard / bench = {ratio:.2f} ({verdict} 10%).")
    # The steady figure has seen every size: only a run whose sizes recur (padded batches) can approach it.
    if (result.get("bench_steady_ms") and result.get("late_step_time_ms")
            and result.get("pad_to_multiple", 1) >= 32 and len(result.get("step_time_ms", [])) >= 4):
        ratio = result["late_step_time_ms"] / result["bench_steady_ms"]
        verdict = "within" if abs(ratio - 1) <= 0.1 else "outside"
        lines.append(f"The last third of the TensorBoard intervals (most sizes met): {result['late_step_time_ms']:.1f} "
                     f"ms, against the bench's step once every size is known, {result['bench_steady_ms']:.1f} ms: "
                     f"{ratio:.2f} ({verdict} 10%).")
    return lines


PARTS = ("steptime", "trainpy", "parity")


def runs_of(rows: list[dict]) -> list[list[dict]]:
    """Step-time rows grouped by the command that measured them, in the order the file holds them, each
    configuration's repeats (bench/e2e.py --repeats) combined into one row."""
    runs: dict[str, list[dict]] = {}
    for r in rows:
        runs.setdefault(r["command"], []).append(r)
    return [combine_repeats(run) for run in runs.values()]


def combine_repeats(rows: list[dict]) -> list[dict]:
    """One row per configuration: medians over its repeats, and the repeats' step times in repeat_ms."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["impl"], r["amp"], mode_label(r), r["batch"], r["shapes"]), []).append(r)
    combined = []
    for group in groups.values():
        if len(group) == 1:
            combined.append(group[0])
            continue
        row = dict(group[0])
        for key in ("step_ms", "first_pass_ms", "gpu_kernel_ms", "launches", "attention_share", "first_step_s",
                    "gpu_idle_ms"):
            values = [r[key] for r in group if r.get(key) is not None]
            row[key] = statistics.median(values) if values else None
        phases = {name for r in group for name in r.get("gpu_idle_by_phase_ms", {})}
        if phases:
            row["gpu_idle_by_phase_ms"] = {name: statistics.median(r.get("gpu_idle_by_phase_ms", {}).get(name, 0.0)
                                                                   for r in group) for name in sorted(phases)}
        row["peak_gib"] = max(r["peak_gib"] for r in group)
        row["syncs_per_step"] = max((r["syncs_per_step"] for r in group if r.get("syncs_per_step") is not None),
                                    default=None)
        if row.get("gpu_kernel_ms") is not None:
            row["kernel_share"] = row["gpu_kernel_ms"] / row["step_ms"]
        row["repeat_ms"] = sorted(r["step_ms"] for r in group)
        combined.append(row)
    return combined


def load_parts(out: Path) -> dict:
    """The results bench/e2e.py saved in ``out``, one json per part: e2e_h200_<part>.json."""
    return {name: json.loads((out / f"e2e_h200_{name}.json").read_text())
            for name in PARTS if (out / f"e2e_h200_{name}.json").exists()}


def write_report(out: Path) -> None:
    """e2e_h200.md from the part files in ``out``."""
    parts = load_parts(out)
    lines = ["# End-to-end training: model.msda=triton vs pytorch", "",
             "Written by `bench/e2e.py` from the json files beside this one; each part names its own run."]
    rows = parts.get("steptime", [])
    runs = runs_of(rows)
    for i, run in enumerate(runs):  # one table per run: speed-ups are ratios within a run
        lines += [""] + steptime_lines(run, run[0], title=None if i == 0 else f"Run {i + 1} of {len(runs)}")
    if "trainpy" in parts:
        lines += ["", "## train/step_time_ms of a real `python train.py` run"]
        for result in trainpy_runs(parts["trainpy"]):
            lines += trainpy_lines(result, rows)
    header = parts["parity"]["header"] if "parity" in parts else {}
    parity = parts["parity"]["parity"] if "parity" in parts else None
    if parity:
        c = parity["comparison"]
        lines += ["", "## Parity on the synthetic set", "",
                  f"{header['date']}, {header['gpu']}: `{header['command']}`. "
                  f"`train.train` with the synthetic defaults ({header['epochs']} epochs, batch {header['parity_batch']}, "
                  f"amp={header['amp']}); "
                  "every run from scratch.", "",
                  "| msda | seed | steps | final loss | AP | AP50 | wall s |", "|---|---|---|---|---|---|---|"]
        for r in parity["runs"]:
            lines.append(f"| {r['impl']} | {r['seed']} | {len(r['losses'])} | {r['losses'][-1]:.4f} | "
                         f"{r['eval']['AP']:.4f} | {r['eval']['AP50']:.4f} | {r['wall_s']:.0f} |")
        by = {(r["impl"], r["seed"]): r["eval"]["AP"] for r in parity["runs"]}
        spread = abs(by[("triton", 0)] - by[("triton", 1)])
        diff = abs(by[("triton", 0)] - by[("pytorch", 0)])
        lines += ["", f"Seed-to-seed spread of triton's AP: {spread:.4f}; triton vs pytorch at seed 0: {diff:.4f} "
                  f"({'within' if diff <= spread else 'outside'} the spread).", "",
                  f"One checkpoint (triton, seed 0) evaluated through each implementation: AP triton "
                  f"{c['AP']['triton']['AP']:.4f}, pytorch {c['AP']['pytorch']['AP']:.4f} (difference "
                  f"{abs(c['AP']['triton']['AP'] - c['AP']['pytorch']['AP']):.4f}); of the "
                  f"{c['detections_compared']} triton detections scoring above {header['score_threshold']}, "
                  f"{100 * c['agreement']:.1f}% have a pytorch detection of the same class with IoU > 0.95 "
                  f"(score difference mean {c['mean_score_diff']:.2e}, max {c['max_score_diff']:.2e})."]
    (out / "e2e_h200.md").write_text("\n".join(lines) + "\n")


def split_runs(steps: list[int], values: list[float]) -> list[tuple[list[int], list[float]]]:
    """Cut a scalar series where its step goes back: two runs that wrote into one TensorBoard directory."""
    runs, start = [], 0
    for i in range(1, len(steps) + 1):
        if i == len(steps) or steps[i] <= steps[i - 1]:
            runs.append((steps[start:i], values[start:i]))
            start = i
    return sorted(runs, key=lambda r: len(r[0]))  # the shorter, this bench's own run first


def plot(out: Path) -> None:
    try:
        import matplotlib
    except ImportError:  # the figures are optional, as bench/parity.py's are
        print("e2e: matplotlib is not installed; no figures (pip install matplotlib)", flush=True)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = load_parts(out)
    if "parity" in parts:
        parity, header = parts["parity"]["parity"], parts["parity"]["header"]
        title = f"{header['gpu']}, {header['date']}"
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for r in parity["runs"]:
            ax.plot(r["losses"], label=f"{r['impl']} seed {r['seed']}", linewidth=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (weighted sum)")
        ax.set_yscale("log")
        ax.set_title(f"Loss curves, synthetic set: {title}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "e2e_loss_curves.png", dpi=110)
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for name, (steps, values) in parity["tensorboard_step_time_ms"].items():
            for i, (run_steps, run_values) in enumerate(split_runs(steps, values)):
                ax.plot(run_steps, run_values, label=name if i == 0 else f"{name} (an earlier run in the same directory)",
                        linewidth=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel("train/step_time_ms (TensorBoard)")
        ax.set_title(f"Step time as TensorBoard shows it: {title}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "e2e_tensorboard_step_time.png", dpi=110)
    # The newest run that timed both implementations: the comparison this project exists for. Runs of one
    # implementation compare settings of ours, which their tables show.
    runs = runs_of(parts.get("steptime", []))
    rows = next((run for run in runs if {r["impl"] for r in run} >= {"triton", "pytorch"}), runs[0] if runs else None)
    if rows:
        # One group of bars per (mode, sizes); the hatched inner bar is the GPU kernel time of the step.
        groups = list(dict.fromkeys((r["batch"], r["amp"], mode_label(r), r["shapes"]) for r in rows))
        fig, ax = plt.subplots(figsize=(9, 4.8))
        for offset, impl in ((-0.2, "triton"), (0.2, "pytorch")):
            found = [next((r for r in rows if (r["batch"], r["amp"], mode_label(r), r["shapes"]) == g
                           and r["impl"] == impl), None) for g in groups]
            xs = [i + offset for i in range(len(groups))]
            ax.bar(xs, [r["step_ms"] if r else 0 for r in found], width=0.4, label=f"msda={impl} step")
            ax.bar(xs, [(r.get("gpu_kernel_ms") or 0) if r else 0 for r in found], width=0.25, fill=False,
                   hatch="//", label=f"msda={impl} GPU kernels")
        ax.set_xticks(range(len(groups)), [f"B{b} {a.replace('none', 'fp32')}\n{m}\n{s}"
                                           for b, a, m, s in groups], fontsize=8)
        ax.set_ylabel("median training step (ms)")
        ax.set_title(f"Training step, default model: {rows[0]['gpu']}, {rows[0]['date']}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "e2e_step_time.png", dpi=110)
