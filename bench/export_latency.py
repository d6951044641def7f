"""Latency of an exported detector: the AOTInductor package against the compiled and the eager PyTorch model.

    python bench/export_latency.py                           # on a GPU: batch 1 and 8 at 800 x 1333
    python bench/export_latency.py --quick                   # CPU, tiny model, 96 x 128: a check of the script
    python bench/export_latency.py --checkpoint PATH --dtype bf16

Ways to run the same model on the same batches, in one process, one after the other:
  eager     ``DeformableDETR.detect`` as predict.py runs it (model.msda=triton on CUDA)
  compiled  ``detect`` compiled as engine/compile/plan.py compiles it for evaluation (compile.evaluation=true: one
            static graph per batch shape, CUDA graphs on a GPU: compile.mode=reduce-overhead, auto's choice for
            long runs); its first call at each shape compiles, and is reported apart
  graphs    (GPU) ``detect`` of the eager model recorded as a CUDA graph per shape (compile.mode=graphs, auto's
            choice for evaluation and short runs)
  aoti      the package that ``python export.py format=aoti`` writes (dynamic batch and sides, the attention as
            msda::attention on CUDA: the process has imported msda), traced and compiled once, reported apart; it
            is built in a child process and loaded and timed in another, as a deployment loads it, so that a crash
            there (a segfault in packaging or loading) is reported and the other ways are still measured
Images are 800 x 1333 (the COCO recipe's evaluation size; padded to 800 x 1344 as every batch is, to
multiples of 32), random, with a padding mask; the model is the default Deformable DETR (ResNet-50) with
random weights unless --checkpoint names one: latency does not depend on the weights. Each figure is the
median of --repeats timed calls after --warmup untimed ones, the GPU synchronized around each call. The
outputs of the compiled model and of the package are compared with eager's (largest absolute differences).
Writes export_latency_h200.json and .md (--quick: into outputs/bench unless --out says otherwise).
"""

from __future__ import annotations

import argparse
import copy
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import cell, header_lines, out_dir, run_header, table, write_report  # noqa: E402
from bench.train_runs import compose_config  # noqa: E402
from datasets.json_file import write_json  # noqa: E402
from engine.checkpoint.trained_model import load_trained_model  # noqa: E402
from engine.compile.plan import CompilePlan, compile_model  # noqa: E402
from engine.export.aoti import QUICK_COMPILE, AotiRunner, inductor_cxx, write_aoti  # noqa: E402
from engine.export.exportable import ExportableDetector, SampleShape, trace  # noqa: E402
from engine.export.samples import random_batch  # noqa: E402
from models import build_model  # noqa: E402

NAME = "export_latency_h200"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
PACKAGE = "detector.pt2"  # in the run's temporary folder
# The model timed: the COCO detector (the train config's default dataset, synthetic, would make it the tiny one).
FULL_MODEL = ["dataset=coco"]
# The quick check's model: the tests' tiny one (tests/trained_checkpoint.py), which the CPU runs in a second.
QUICK_MODEL = [
    "model=tiny",
    "model.hidden_dim=32",
    "model.nheads=2",
    "model.enc_layers=1",
    "model.dec_layers=1",
    "model.dim_feedforward=64",
    "model.num_queries=12",
    "model.num_feature_levels=3",
    "model.num_classes=4",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="report folder (bench/results; quick: outputs/bench)")
    parser.add_argument("--quick", action="store_true", help="CPU, tiny model, 96 x 128, batches 1 and 2")
    parser.add_argument("--checkpoint", type=Path, default=None, help="a checkpoint to time (default: random weights)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="weights and images (default fp32)")
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="batch sizes (default 1 8; quick 1 2)")
    size_help = "image size before padding to 32 (default 800 1333; quick 96 128)"
    parser.add_argument("--size", type=int, nargs=2, default=None, metavar=("H", "W"), help=size_help)
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls per configuration (default 5; quick 1)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per configuration (default 20; quick 3)")
    parser.add_argument(
        "--aoti-timeout-s",
        type=float,
        default=360,
        help="stop the AOTInductor process after this many seconds (default 360)",
    )
    # The package's child processes (measure_aoti): build it into DIR, then load and time it.
    parser.add_argument("--aoti-build", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--aoti-run", type=Path, default=None, help=argparse.SUPPRESS)
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    args.batches = args.batches or ([1, 2] if args.quick else [1, 8])
    args.size = args.size or ([96, 128] if args.quick else [800, 1333])
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 5)
    args.repeats = args.repeats if args.repeats is not None else (3 if args.quick else 20)
    if min(args.batches) < 1 or args.warmup < 0 or args.repeats < 1 or args.aoti_timeout_s <= 0:
        parser.error("--batches must be >= 1, --warmup >= 0, --repeats >= 1 and --aoti-timeout-s > 0")
    return args


def build_detector_model(args, device: torch.device) -> torch.nn.Module:
    """The model to time, in eval mode on ``device``, in --dtype, with the Triton attention on CUDA."""
    msda = "triton" if device.type == "cuda" else "pytorch"
    cfg = compose_config([*(QUICK_MODEL if args.quick else FULL_MODEL), "model.pretrained=none", f"model.msda={msda}"])
    if args.checkpoint is not None:
        model = load_trained_model(args.checkpoint, cfg.model, device=device, msda=msda).model
    else:
        torch.manual_seed(0)
        model = build_model(cfg.model)[0].to(device).eval()
    return model.to(DTYPES[args.dtype])


def padded(side: int) -> int:
    return -(-side // 32) * 32


def batch_inputs(batch: int, args, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(images, mask) of ``batch`` random images of --size, padded to multiples of 32 (the padding masked)."""
    height, width = args.size
    shape = SampleShape(batch=batch, height=padded(height), width=padded(width))
    sample = random_batch(shape, seed=batch)
    sample.mask[:, height:, :] = True
    sample.mask[:, :, width:] = True
    return sample.inputs(postprocess=False, dtype=DTYPES[args.dtype], device=device)


def timed_ms(call, inputs, *, warmup: int, repeats: int, device: torch.device) -> float:
    """Median wall time of ``call(*inputs)`` in ms, the device synchronized before and after each call."""

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    with torch.no_grad():
        for _ in range(warmup):
            call(*inputs)
        times = []
        for _ in range(repeats):
            synchronize()
            started = time.perf_counter()
            call(*inputs)
            synchronize()
            times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def largest_differences(outputs, expected) -> dict[str, float]:
    return {
        name: float((a.float() - b.float()).abs().max()) for name, a, b in zip(("logits", "boxes"), outputs, expected)
    }


def aoti_build(args, device: torch.device, workdir: Path) -> None:
    """The package built in a process of its own (see ``measure_aoti``): traced and compiled into
    ``workdir``/detector.pt2; aoti.json holds the times. The model is built as the parent builds it (the same seed),
    so the outputs compare."""
    model = build_detector_model(args, device)
    eager = ExportableDetector(model).eval()
    started = time.perf_counter()
    sample = batch_inputs(max(2, min(args.batches)), args, device)  # a dynamic batch is traced at 2 or more
    program = trace(eager, sample, dynamic=True)
    traced = time.perf_counter() - started
    print(f"package: traced in {traced:.1f} s", flush=True)
    package = write_aoti(program, workdir / PACKAGE, quick=args.quick)
    seconds = {"trace": traced, "compile": time.perf_counter() - started - traced}
    print(f"package: compiled in {seconds['compile']:.1f} s", flush=True)
    record = {"aoti_export_s": seconds, "package_mb": package.stat().st_size / 2**20, "aoti_ms": {}}
    write_json(workdir / "aoti.json", record)


def aoti_run(args, device: torch.device, workdir: Path) -> None:
    """The package loaded in a fresh process, as a deployment loads it, then per batch one call whose outputs go
    to ``workdir`` and the timed calls, added to aoti.json. The batches are built as the parent builds them."""
    record = json.loads((workdir / "aoti.json").read_text())
    started = time.perf_counter()
    aoti = AotiRunner(workdir / PACKAGE)
    record["aoti_load_s"] = time.perf_counter() - started
    print(f"package: loaded in {record['aoti_load_s']:.1f} s", flush=True)
    for batch in args.batches:
        inputs = batch_inputs(batch, args, device)
        torch.save([t.cpu() for t in aoti(*inputs)], workdir / f"aoti_outputs_{batch}.pt")
        record["aoti_ms"][str(batch)] = timed_ms(aoti, inputs, warmup=args.warmup, repeats=args.repeats, device=device)
        print(f"batch {batch}: aoti {record['aoti_ms'][str(batch)]:.1f} ms", flush=True)
        write_json(workdir / "aoti.json", record)


def measure_aoti(argv: list[str], workdir: Path, timeout_s: float) -> tuple[dict, str | None]:
    """``aoti_build``, then ``aoti_run``, each in a child process: a crash in packaging or in the package (a
    segfault) ends that process, not the measurements of the other ways, and children that run past ``timeout_s``
    together are stopped, leaving them time. Their output is passed through as it comes (faulthandler on: a crash
    prints the Python stack it happened in). Returns the record they wrote (whatever it holds) and their failure."""
    deadline = time.perf_counter() + timeout_s
    error = None
    for part in ("build", "run"):
        error = run_child(argv + [f"--aoti-{part}", str(workdir)], deadline - time.perf_counter(), timeout_s)
        if error:
            error = f"the AOTInductor {part} process {error} (its output is in the console log)"
            break
    written = workdir / "aoti.json"
    return (json.loads(written.read_text()) if written.exists() else {}), error


def run_child(argv: list[str], timeout_s: float, budget_s: float) -> str | None:
    """This script with ``argv`` in a child process, stopped after ``timeout_s``, its output printed: how it failed,
    or None."""
    command = [sys.executable, "-X", "faulthandler", str(Path(__file__).resolve()), *argv]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    stopped = threading.Event()

    def stop():
        stopped.set()
        child.kill()

    timer = threading.Timer(max(timeout_s, 0.0), stop)
    timer.start()
    try:
        for line in child.stdout:
            print(line, end="", flush=True)
            lines.append(line)
        returncode = child.wait()
    finally:
        timer.cancel()
    if returncode == 0:
        return None
    if stopped.is_set():
        ended = f"was stopped when the AOTInductor share ran out ({budget_s:.0f} s, --aoti-timeout-s)"
    elif returncode < 0:
        ended = f"was killed by {signal.Signals(-returncode).name}"
    else:
        ended = f"exited with code {returncode}"
    steps = [line.strip() for line in lines if line.startswith(("package:", "batch "))]
    return ended + (f" after '{steps[-1]}'" if steps else " before its first step")


def measure(args, argv: list[str], device: torch.device, workdir: Path, report: Callable[[dict], None]) -> None:
    """Every row (module docstring), handed to ``report`` as each batch is measured, so that a run stopped
    partway keeps its report of what it measured. The package first, in its own process (its trace must not see
    the process-wide options that compile_model sets, and it is as large as the weights: written into ``workdir``)."""
    aoti, aoti_error = measure_aoti(argv, workdir, args.aoti_timeout_s)
    if aoti_error:
        print(f"AOTInductor: {aoti_error}", flush=True)
    model = build_detector_model(args, device)
    eager = ExportableDetector(model).eval()
    compiled_model = copy.deepcopy(model)
    mode = "reduce-overhead" if device.type == "cuda" else "default"  # Inductor with CUDA graphs on a GPU
    compile_model(compiled_model, CompilePlan(mode=mode, evaluation=True, backbone="static"))
    compiled = ExportableDetector(compiled_model).eval()
    ways = [("eager", eager), ("compiled", compiled)]
    if device.type == "cuda":  # the eager model's CUDA graphs (compile.mode=graphs), nothing compiled
        graphed_model = copy.deepcopy(model)
        compile_model(graphed_model, CompilePlan(mode="graphs", evaluation=True))
        ways.append(("graphs", ExportableDetector(graphed_model).eval()))
    inductor_options = QUICK_COMPILE if args.quick else {}  # the package's quick_compile, for a like comparison
    measured = {
        **{key: aoti.get(key) for key in ("aoti_export_s", "aoti_load_s", "package_mb")},
        "aoti_error": aoti_error,
        "compile_mode": mode,
        "parameters_m": sum(p.numel() for p in model.parameters()) / 1e6,
    }

    rows = []
    for batch in args.batches:
        inputs = batch_inputs(batch, args, device)
        with torch.no_grad():
            expected = tuple(t.clone() for t in eager(*inputs))
            started = time.perf_counter()
            with torch._inductor.config.patch(inductor_options):
                first = tuple(t.clone() for t in compiled(*inputs))  # compiles this shape's graph
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            compile_s = time.perf_counter() - started
        row = {
            "batch": batch,
            "compiled_first_call_s": compile_s,
            "compiled_vs_eager": largest_differences(first, expected),
        }
        outputs = workdir / f"aoti_outputs_{batch}.pt"
        if str(batch) in aoti.get("aoti_ms", {}):
            row["aoti_ms"] = aoti["aoti_ms"][str(batch)]
            row["aoti_vs_eager"] = largest_differences([t.to(device) for t in torch.load(outputs)], expected)
        for name, call in ways:
            row[f"{name}_ms"] = timed_ms(call, inputs, warmup=args.warmup, repeats=args.repeats, device=device)
        timed = [name for name, _ in ways] + (["aoti"] if "aoti_ms" in row else [])
        print(f"batch {batch}: " + ", ".join(f"{name} {row[f'{name}_ms']:.1f} ms" for name in timed), flush=True)
        rows.append(row)
        report({"rows": rows, **measured})


def setup(args) -> dict:
    """What the run timed, for its report's header."""
    return {
        "cxx": inductor_cxx(),
        "quick": args.quick,
        "batches": args.batches,
        "model": "the tests' tiny model (ResNet-18, --quick)" if args.quick else "Deformable DETR, ResNet-50",
        "weights": str(args.checkpoint) if args.checkpoint else "random",
        "dtype": args.dtype,
        "image_size": list(args.size),
        "padded_size": [padded(s) for s in args.size],
        "warmup": args.warmup,
        "repeats": args.repeats,
    }


def report_lines(record: dict) -> list[str]:
    h, rows = record["header"], record["rows"]
    lines = header_lines(
        "Exported detector latency",
        h,
        f"Model: {h['model']} ({record['parameters_m']:.1f} M parameters, {h['weights']} weights), {h['dtype']}, "
        f"{' x '.join(map(str, h['image_size']))} images padded to {' x '.join(map(str, h['padded_size']))}; median ms "
        f"of {h['repeats']} calls after {h['warmup']} warm-up calls, the device synchronized around each. eager: "
        f"`detect` as predict.py runs it; torch.compile: compile.mode={record['compile_mode']}, a graph per batch "
        "shape, its first call (compilation, with the machine's Inductor cache) apart; AOTInductor: the package "
        f"`python export.py format=aoti` writes, built once for every batch and size (C++ compiler: {h['cxx']}) and "
        "loaded by another process; CUDA graphs: the eager model's (compile.mode=graphs, GPU only). Ratios are to "
        "eager, same run; diff: the largest absolute difference of the logits from eager's."
        + (
            " --quick: a check that the script runs (the package's wrapper built unoptimized: quick_compile, "
            "engine/export/aoti.py); these figures say nothing about speed."
            if h["quick"]
            else ""
        ),
    )
    cells = []
    for r in rows:
        eager, aoti = r["eager_ms"], r.get("aoti_ms")
        times = [cell(eager), cell(r["compiled_ms"]), cell(aoti), cell(r.get("graphs_ms"))]
        ratios = [f"{r['compiled_ms'] / eager:.2f}", cell(None if aoti is None else aoti / eager, ".2f")]
        aoti_diff = f"{r['aoti_vs_eager']['logits']:.1e}" if "aoti_vs_eager" in r else "-"
        diffs = [f"{r['compiled_vs_eager']['logits']:.1e}", aoti_diff]
        cells.append([r["batch"], *times, *ratios, cell(r["compiled_first_call_s"]), *diffs])
    lines += table(
        "batch | eager ms | torch.compile ms | AOTInductor ms | CUDA graphs ms | compile / eager | AOTInductor / eager "
        "| compile first call s | diff compile | diff AOTInductor",
        cells,
    )
    seconds = record.get("aoti_export_s")
    if seconds:
        lines += [
            "",
            f"AOTInductor package: traced in {seconds['trace']:.1f} s, compiled in "
            f"{seconds['compile']:.1f} s ({record['package_mb']:.0f} MB), loaded in "
            f"{cell(record.get('aoti_load_s'))} s.",
        ]
    if record.get("aoti_error"):
        lines += ["", f"AOTInductor: {record['aoti_error']}."]
    missing = [batch for batch in h["batches"] if batch not in {row["batch"] for row in rows}]
    if missing:
        lines += ["", f"Not measured, the run ended first: batch {', '.join(map(str, missing))}."]
    return lines


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device("cpu" if args.quick else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/export_latency.py measures on a GPU and none is available here; --quick runs on the CPU")
    if args.aoti_build is not None:
        aoti_build(args, device, args.aoti_build)
        return
    if args.aoti_run is not None:
        aoti_run(args, device, args.aoti_run)
        return
    out = out_dir(args.out, args.quick)
    head = run_header(**setup(args))

    def report(measured: dict) -> None:
        record = {"header": head, **measured}
        write_report(NAME, record, report_lines(record), out=out)
        print(f"wrote {out / NAME}.md and .json ({len(measured['rows'])} of {len(args.batches)} batches)", flush=True)

    with tempfile.TemporaryDirectory() as workdir:
        measure(args, argv if argv is not None else sys.argv[1:], device, Path(workdir), report)


if __name__ == "__main__":
    main()
