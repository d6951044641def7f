"""Report of bench/e2e.py: the markdown table and the PNG plots, from the results dict it saves as json."""

from __future__ import annotations

from pathlib import Path


def write_report(results: dict, out: Path, header: dict) -> None:
    lines = [f"# End-to-end training on {header['gpu']}: model.msda=triton vs pytorch", "",
             f"Date {header['date']}; torch {header['torch']}, triton {header['triton']}, Python {header['python']}.",
             f"Command: `{header['command']}`", ""]
    rows = results.get("steptime", [])
    if rows:
        lines += [f"## Training step, default model, random {header['height']}x{header['width']} batches", "",
                  "Median of the timed steps after warm-up (forward, matching and losses, backward, clipping, "
                  "AdamW); peak = max GPU memory allocated; attention = share of GPU kernel time in the "
                  "attention op (Triton msda kernels, or grid_sampler kernels for the reference).", "",
                  "| batch | precision | msda | step ms | images/s | peak GiB | attention share | speed-up | memory ratio |",
                  "|---|---|---|---|---|---|---|---|---|"]
        ref = {(r["batch"], r["amp"]): r for r in rows if r["impl"] == "pytorch"}
        for r in rows:
            base = ref.get((r["batch"], r["amp"]))
            speed = base["step_ms"] / r["step_ms"] if base else float("nan")
            mem = r["peak_gib"] / base["peak_gib"] if base else float("nan")
            lines.append(f"| {r['batch']} | {r['amp'].replace('none', 'fp32')} | {r['impl']} | {r['step_ms']:.1f} | "
                         f"{r['images_per_s']:.1f} | {r['peak_gib']:.2f} | {100 * r['attention_share']:.1f}% "
                         f"| {speed:.2f}x | {mem:.2f} |")
    parity = results.get("parity")
    if parity:
        c = parity["comparison"]
        lines += ["", "## Parity on the synthetic set", "",
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


def plot(results: dict, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parity = results.get("parity")
    if parity:
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
    rows = results.get("steptime")
    if rows:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        labels = sorted({(r["batch"], r["amp"]) for r in rows})
        for offset, impl in ((-0.2, "triton"), (0.2, "pytorch")):
            ms = [next((r["step_ms"] for r in rows if (r["batch"], r["amp"]) == key and r["impl"] == impl), 0.0)
                  for key in labels]
            ax.bar([i + offset for i in range(len(labels))], ms, width=0.4, label=f"msda={impl}")
        ax.set_xticks(range(len(labels)), [f"batch {b}\n{a.replace('none', 'fp32')}" for b, a in labels])
        ax.set_ylabel("median training step (ms)")
        ax.set_title(f"Training step, 800x1333: {title}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "e2e_step_time.png", dpi=110)
