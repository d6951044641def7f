"""The one current report of a benchmark: bench/results/<name>.json and <name>.md, overwritten by each run.

Every report is headed by what makes its figures reproducible: the date, the GPU, the torch and triton versions,
the commit and the exact command. History lives in git, not in the files.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

from datasets.json_file import write_json

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
# Where a bench's quick or smoke run writes unless told: never over the committed reports.
TRIAL = ROOT / "outputs" / "bench"


def out_dir(out: Path | None, trial: bool) -> Path:
    """--out if given, else bench/results for a real run and outputs/bench for a quick/smoke one."""
    return out if out is not None else (TRIAL if trial else RESULTS)


def commit() -> str:
    """The checkout's commit, with "+changes" when its tracked files differ from it ("unknown" outside git).
    BENCH_COMMIT, where set, names it instead: a lent GPU machine's copy of a working tree can keep an older HEAD."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def run_header(**extra) -> dict:
    """Date, GPU, versions, commit and command of this run (``extra`` added as given)."""
    import torch
    import triton

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    return {
        "date": datetime.date.today().isoformat(),
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "commit": commit(),
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        **extra,
    }


def header_lines(title: str, header: dict, how_to_read: str) -> list[str]:
    """The top of a report: its title, the run it comes from, and one paragraph on how to read it."""
    return [
        f"# {title}",
        "",
        f"{header['date']}, {header['gpu']}, torch {header['torch']}, triton {header['triton']}, "
        f"commit {header['commit']}:",
        "",
        f"    {header['command']}",
        "",
        how_to_read,
        "",
    ]


def table(columns: list[str] | str, rows: list[list]) -> list[str]:
    """A markdown table; ``columns`` a list of names or its header row as markdown writes it, "a | b | c"."""
    if isinstance(columns, str):
        columns = columns.split(" | ")
    return [
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
        *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows),
    ]


def cell(value, spec: str = ".1f") -> str:
    """A table cell: ``value`` formatted, or "-" when it was not measured (None or NaN)."""
    return "-" if value is None or value != value else format(value, spec)


def pyplot(bench: str):
    """matplotlib.pyplot drawing into files (the Agg backend), or None, with a note, without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print(f"{bench}: matplotlib is not installed; no figure (pip install matplotlib)", flush=True)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_report(name: str, record: dict, lines: list[str], *, out: Path = RESULTS) -> tuple[Path, Path]:
    """``record`` as <out>/<name>.json and ``lines`` as <out>/<name>.md, each replacing the previous run's whole."""
    out.mkdir(parents=True, exist_ok=True)
    md = out / f"{name}.md"
    tmp = md.with_name(f".{md.name}.tmp")
    tmp.write_text("\n".join(lines).rstrip() + "\n")
    tmp.replace(md)
    return write_json(out / f"{name}.json", record, indent=2), md
