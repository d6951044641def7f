"""Reports of bench/msda.py: the launch table as Python source, per-row summaries, the targets, markdown."""

from __future__ import annotations

from pathlib import Path

DISTS = ("uniform", "realistic")
DTYPES = ("fp32", "bf16")


def table_source(table: dict, header: dict) -> str:
    lines = [f"# Measured on {header['gpu']}, {header['date']}, torch {header['torch']}, triton {header['triton']}:",
             f"# {header['command']}", "TUNED: dict = {"]
    lines += [f"    {key!r}: {value!r}," for key, value in sorted(table.items(), key=lambda kv: str(kv[0]))]
    return "\n".join(lines + ["}"]) + "\n"


def summary_line(r) -> str:
    t, p = r["triton"], r["pytorch"]
    line = (f"{r['workload']:<17} {r['dtype']} {r['locations']:<9} {r['scheme']:<6} fwd {t['fwd']:.3f} "
            f"fwd+bwd {t['fwd_bwd']:.3f} ms | ref {p['fwd']:.3f} / {p['fwd_bwd']:.3f} | x{p['fwd'] / t['fwd']:.1f} / "
            f"x{p['fwd_bwd'] / t['fwd_bwd']:.1f} | det bwd {r['det_bwd']:.3f} vs {r['default_bwd']:.3f} "
            f"(x{r['det_bwd'] / r['default_bwd']:.2f}, bitwise {r['det_bitwise_5']}) | err {r['max_rel_err']:.1e}")
    if "eager_fwd_bwd" in t:
        line += (f" | eager fwd+bwd {t['eager_fwd_bwd']:.3f} (host {t['eager_fwd_bwd_host']:.3f}, launchers "
                 f"{t['eager_launch_host']:.3f}) vs ref {p['eager_fwd_bwd']:.3f} "
                 f"(x{p['eager_fwd_bwd'] / t['eager_fwd_bwd']:.1f}), graph {t['graph_fwd_bwd']:.3f}")
    return line


def target_checks(rows) -> list:
    def find(workload, dtype, dist="uniform"):
        return next(r for r in rows if (r["workload"], r["dtype"], r["locations"]) == (workload, dtype, dist))

    checks = []
    enc = find("encoder N2", "fp32")
    ratio = enc["pytorch"]["fwd_bwd"] / enc["triton"]["fwd_bwd"]
    checks.append(("encoder N2 fp32 uniform fwd+bwd >= 16.5x", f"{ratio:.1f}x", ratio >= 16.5))
    ratio = enc["pytorch"]["fwd"] / enc["triton"]["fwd"]
    checks.append(("encoder N2 fp32 uniform fwd >= 17x", f"{ratio:.1f}x", ratio >= 17))
    for dist in DISTS:
        speed = find("encoder N2", "fp32", dist)["triton"]["fwd_bwd"] / find("encoder N2", "bf16", dist)["triton"]["fwd_bwd"]
        checks.append((f"encoder N2 bf16 fwd+bwd >= 1.3x faster than fp32 ({dist})", f"{speed:.2f}x", speed >= 1.3))
    for workload in ("decoder N4 Lq300", "decoder N4 Lq900"):
        for dtype in DTYPES:
            r = find(workload, dtype)
            eager = r["pytorch"]["eager_fwd_bwd"] / r["triton"]["eager_fwd_bwd"]
            bench = r["pytorch"]["fwd_bwd"] / r["triton"]["fwd_bwd"]
            checks.append((f"{workload} {dtype} eager fwd+bwd >= 7x", f"{eager:.1f}x eager loop, {bench:.1f}x do_bench",
                           eager >= 7))
    bitwise = all(r["det_bitwise_5"] for r in rows)
    cost = max(r["det_bwd"] / r["default_bwd"] for r in rows if r["workload"].startswith("encoder"))
    checks.append(("deterministic grad_value bitwise identical over 5 runs (all rows)", str(bitwise), bitwise))
    checks.append(("deterministic backward <= 1.5x the default backward (worst encoder row)", f"{cost:.2f}x",
                   cost <= 1.5))
    return checks


def write_markdown(rows, records, table, header, out: Path):
    lines = [f"# msda kernel benchmark on {header['gpu']}", "",
             f"Date {header['date']}; torch {header['torch']}, triton {header['triton']}, Python {header['python']}. "
             f"Command: `{header['command']}`; {header['seconds']:.0f} s.", "",
             "Median ms (triton.testing.do_bench) through the public op; bwd = autograd over a retained graph; ratios = reference / "
             "Triton in the same run; det = deterministic backward (launcher alone) against the default backward; "
             "bitwise = all gradients equal over 5 deterministic runs; peak = extra memory of fwd+bwd; err = largest "
             "relative L2 error of output and gradients against the fp32 reference. Decoder rows (uniform): eager = "
             "wall ms per forward+backward of a 100-call Python loop (host-bound), graph = CUDA-graph replay (GPU "
             "time), host = the loop's time before its final synchronize, for the public op and for the two "
             "launchers alone (no validation, no autograd).", "",
             "| workload | dtype | locations | scheme | fwd | bwd | fwd+bwd | ref fwd | ref fwd+bwd | fwd x | fwd+bwd x "
             "| det bwd | default bwd | det cost | bitwise | peak MiB | ref peak MiB | err | eager fwd+bwd | ref eager "
             "| eager x | graph fwd+bwd | host: op | host: launchers |", "|" + "---|" * 24]
    for r in rows:
        t, p = r["triton"], r["pytorch"]
        eager = (f"{t['eager_fwd_bwd']:.3f} | {p['eager_fwd_bwd']:.3f} | {p['eager_fwd_bwd'] / t['eager_fwd_bwd']:.1f} "
                 f"| {t['graph_fwd_bwd']:.4f} | {t['eager_fwd_bwd_host']:.3f} | {t['eager_launch_host']:.3f}"
                 ) if "eager_fwd_bwd" in t else "| | | | |"
        lines.append(f"| {r['workload']} | {r['dtype']} | {r['locations']} | {r['scheme']} | {t['fwd']:.3f} | "
                     f"{t['bwd']:.3f} | {t['fwd_bwd']:.3f} | {p['fwd']:.3f} | {p['fwd_bwd']:.3f} | "
                     f"{p['fwd'] / t['fwd']:.1f} | {p['fwd_bwd'] / t['fwd_bwd']:.1f} | {r['det_bwd']:.3f} | "
                     f"{r['default_bwd']:.3f} | {r['det_bwd'] / r['default_bwd']:.2f} | {r['det_bitwise_5']} | "
                     f"{t['peak_mib']:.0f} | {p['peak_mib']:.0f} | {r['max_rel_err']:.1e} | {eager} |")
    lines += ["", "## Targets", "", "| target | measured | met |", "|---|---|---|"]
    lines += [f"| {name} | {value} | {'yes' if ok else 'NO'} |" for name, value, ok in target_checks(rows)]
    (out / "msda_h200.md").write_text("\n".join(lines) + "\n")
    if records:
        sweep_lines = [f"# msda launch-configuration sweep on {header['gpu']}", "", f"Command: `{header['command']}`",
                       "", "| D | workload | dtype | locations | kind | config | ms |", "|---|---|---|---|---|---|---|"]
        sweep_lines += [f"| {r['D']} | {r['workload']} | {r['dtype']} | {r['locations']} | {r['kind']} | "
                        f"{r['config']} | {r['ms']:.4f} |" for r in records]
        sweep_lines += ["", "## Picked launch table (msda_launch_table.py)", "", "```python",
                        table_source(table, header), "```"]
        (out / "msda_sweep.md").write_text("\n".join(sweep_lines) + "\n")
