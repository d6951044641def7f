"""What an evaluation tells the user (engine/evaluation/, engine/reporting/cocoeval_log.py and progress.py): progress
lines during inference, COCOeval's summary table on the console and the rest of its printing in train.log only,
and the time split between inference and COCOeval."""

from __future__ import annotations

import logging
import re
import time

import pytest
import torch
from helpers import FixedDetector

from datasets import build_data_loader, build_dataset
from datasets.cocoeval_backend import faster_coco_eval_installed
from engine.evaluation.coco import evaluate_coco
from engine.reporting.progress import EvaluationProgress
from engine.runtime.precision import Precision
from models.postprocess import PostProcess

needs_faster = pytest.mark.skipif(
    not faster_coco_eval_installed(), reason="faster-coco-eval is not installed (pip install faster-coco-eval)"
)
CPU = torch.device("cpu")
# Printed by both pycocotools and faster-coco-eval on every evaluation.
COCOEVAL_NOISE = ("Loading and preparing results...", "index created!", "Accumulating evaluation results...")


@pytest.fixture(scope="module")
def val_set(tmp_path_factory):
    cfg = {
        "name": "synthetic",
        "root": str(tmp_path_factory.mktemp("report") / "syn"),
        "num_train": 1,
        "num_val": 10,
        "image_size": 64,
        "seed": 5,
        "val_size": 64,
        "max_size": 80,
    }
    return build_dataset("val", cfg)


def evaluate(val_set, **kwargs):
    loader = build_data_loader(val_set, batch_size=3, num_workers=0, train=False)
    return evaluate_coco(
        model=FixedDetector(),
        postprocess=PostProcess(),
        loader=loader,
        coco_gt=val_set.coco,
        device=CPU,
        precision=Precision(amp="none", device=CPU),
        **kwargs,
    )


def logged(console_and_file) -> tuple[str, str]:
    console_text, train_log = console_and_file
    for handler in logging.getLogger().handlers:
        handler.flush()
    return console_text.getvalue(), train_log.read_text()


@pytest.mark.parametrize("backend", ["pycocotools", pytest.param("faster", marks=needs_faster)])
def test_cocoeval_printing_goes_to_train_log_and_only_its_table_to_the_console(
    console_and_file, val_set, backend, capsys
):
    evaluation = evaluate(val_set, backend=backend)
    console, file = logged(console_and_file)
    assert "Loading and preparing" not in capsys.readouterr().out, "nothing printed to stdout"
    table = [line for line in console.splitlines() if re.match(r"\s*Average (Precision|Recall)", line)]
    assert len(table) == 12, "the summary table, the same 12 lines whichever COCOeval ran"
    assert f"(AP) @[ IoU=0.50:0.95 | area=   all | maxDets=100 ] = {evaluation.stats['AP']:.3f}" in table[0]
    assert all(line in file for line in table)
    for noise in COCOEVAL_NOISE:
        assert noise in file, noise
        assert noise not in console, noise
    if backend == "faster":  # its two extra lines (AR at IoU .50 and .75) are kept for the file
        assert re.search(r"Average Recall\s+\(AR\) @\[ IoU=0\.50\s+\|", file)


def test_progress_lines_and_the_time_split(console_and_file, val_set):
    evaluation = evaluate(val_set, backend="pycocotools", progress_every_s=0)
    console, _ = logged(console_and_file)
    # 10 images in batches of 3: a line after each batch but the last, which the closing line replaces.
    progress = re.findall(r"evaluation (\d+)/10 images \[\s*\d+%\] (\S+) img/s \| ETA (\S+)", console)
    assert [int(done) for done, _, _ in progress] == [3, 6, 9]
    assert progress[0][1:] == ("?", "?"), "no rate from the first batch alone (it holds any warm-up)"
    assert all(float(rate) > 0 and re.fullmatch(r"\d+:\d\d:\d\d", eta) for _, rate, eta in progress[1:])
    assert evaluation.inference_s > 0 and evaluation.cocoeval_s > 0 and evaluation.cocoeval_backend == "pycocotools"
    closing = re.search(
        r"evaluation of 10 images: inference ([\d.]+) s \(([\d.]+) img/s\), COCOeval ([\d.]+) s "
        r"\(pycocotools\)",
        console,
    )
    assert closing, console
    assert float(closing.group(1)) == pytest.approx(evaluation.inference_s, abs=0.051)
    assert float(closing.group(3)) == pytest.approx(evaluation.cocoeval_s, abs=0.051)


def test_no_progress_lines_within_the_interval(console_and_file, val_set):
    evaluate(val_set, backend="pycocotools", progress_every_s=3600)
    console, _ = logged(console_and_file)
    assert not re.search(r"evaluation \d+/10 images", console)
    assert "evaluation of 10 images: inference" in console


def test_rate_and_eta_leave_the_first_batch_out(monkeypatch, caplog):
    now = [50.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    progress = EvaluationProgress(total_images=20, every_s=2.5, enabled=True)
    with caplog.at_level(logging.INFO, logger="engine"):
        now[0] += 10.0  # the first batch of 2 images: 10 s of warm-up
        progress.update(2)
        for batch in range(2, 6):  # then a batch of 2 images per second
            now[0] += 1.0
            progress.update(2 * batch)
    assert progress.images_per_s(10) == pytest.approx(2.0)
    assert progress.eta_seconds(10) == pytest.approx(5.0)
    # Every 2.5 s: after the first batch (10 s in), then 3 s later.
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("evaluation ")]
    assert lines == [
        "evaluation 2/20 images [ 10%] ? img/s | ETA ?",
        "evaluation 8/20 images [ 40%] 2.0 img/s | ETA 0:00:06",
    ]


def test_progress_is_silent_where_disabled_and_names_the_share_of_several_processes(monkeypatch, caplog):
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    quiet = EvaluationProgress(total_images=10, every_s=0, enabled=False)
    shared = EvaluationProgress(total_images=5, every_s=0, enabled=True, share_of=10)
    with caplog.at_level(logging.INFO, logger="engine"):
        for images in (1, 2):
            now[0] += 1.0
            quiet.update(images)
            shared.update(images)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "evaluation 1/5 images [ 20%] (this process's share of 10) ? img/s | ETA ?",
        "evaluation 2/5 images [ 40%] (this process's share of 10) 1.0 img/s | ETA 0:00:03",
    ]
    with pytest.raises(ValueError, match=r"every_s must be >= 0 seconds, got -1"):
        EvaluationProgress(total_images=1, every_s=-1, enabled=True)


def test_an_unknown_backend_fails_before_any_inference(val_set):
    class NoBatches:
        dataset = val_set

        def __iter__(self):
            raise AssertionError("inference started before the backend was checked")

    with pytest.raises(ValueError, match=r"backend must be one of auto, faster, pycocotools, got 'fastest'"):
        evaluate_coco(
            model=FixedDetector(),
            postprocess=PostProcess(),
            loader=NoBatches(),
            coco_gt=val_set.coco,
            device=CPU,
            precision=Precision(amp="none", device=CPU),
            backend="fastest",
        )
