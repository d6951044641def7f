"""What compilation costs a run, as it reports it: the compile clock, recompilations in train.log only, an ETA
that leaves compilation out (engine/compile/clock.py, engine/runtime/console.py, engine/reporting/progress.py)."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from engine.compile.clock import CompileClock, CompileTotals, describe_graphs
from engine.compile.recompile_log import log_recompiles_to_file
from engine.reporting.log_filter import FILE_ONLY
from engine.reporting.progress import Progress


def test_the_clock_counts_the_graphs_and_the_seconds_of_compilation():
    torch._dynamo.reset()
    clock = CompileClock.get()
    before = clock.totals()

    def twice(x):
        return x * 2 + 1

    compiled = torch.compile(twice, backend="aot_eager", dynamic=False)
    compiled(torch.ones(3))
    compiled(torch.ones(4))  # a new static size: a second graph
    compiled(torch.ones(4))  # known: nothing
    spent = clock.totals().since(before)
    assert spent.graphs == 2 and spent.by_function == {"twice": 2}
    assert spent.seconds > 0


def test_the_clock_counts_a_backward_compiled_at_its_first_call():
    torch._dynamo.reset()
    clock = CompileClock.get()

    def heavy(x):
        for _ in range(40):  # a longer graph: more to trace
            x = (x.sin() + 1).relu()
        return x.sum()

    x = torch.randn(5, requires_grad=True)
    loss = torch.compile(heavy, backend="aot_eager")(x)
    before_backward = clock.totals()
    loss.backward()  # the backward compiles at this first call
    spent = clock.totals().since(before_backward)
    assert spent.seconds > 0 and spent.graphs == 0


def test_a_steps_compile_line_gives_each_functions_graphs():
    totals = CompileTotals(seconds=118.6, graphs=3, by_function={"predict": 1, "features": 2})
    assert describe_graphs(totals) == "2 features, 1 predict"
    assert describe_graphs(CompileTotals()) == ""


def test_a_recompilation_is_one_line_in_train_log_and_nothing_on_the_console(console_and_file):
    console_text, train_log = console_and_file
    assert log_recompiles_to_file()
    torch._dynamo.reset()

    def scaled(x, factor: int):
        return x * factor

    compiled = torch.compile(scaled, backend="eager", dynamic=False)
    compiled(torch.ones(2), 2)
    compiled(torch.ones(2), 3)  # a guard on the int fails: a recompilation
    for handler in logging.getLogger().handlers:
        handler.flush()
    lines = [line for line in train_log.read_text().splitlines() if "recompile:" in line]
    assert len(lines) == 1 and "Recompiling function scaled" in lines[0] and "factor" in lines[0]
    assert "Recompiling" not in console_text.getvalue()
    logging.getLogger("train").info("a line for both", extra=None)
    logging.getLogger("train").info("a line for the file", extra=FILE_ONLY)
    assert "a line for both" in console_text.getvalue() and "a line for the file" not in console_text.getvalue()


def test_the_eta_leaves_compilation_out(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    progress = Progress(total_steps=100, start_step=0, enabled=True)
    now[0] += 90.0 + 10 * 0.5  # 10 steps of 0.5 s, 90 s of it compilation
    assert progress.eta_seconds(10, excluded_s=90.0) == pytest.approx(90 * 0.5)
    assert progress.eta_seconds(10) == pytest.approx(90 * 9.5)  # what counting the compilation would promise


def test_the_eta_is_the_whole_runs_with_its_evaluations_to_come(monkeypatch, caplog):
    """A COCO-like schedule: 10 epochs of 100 steps, an evaluation after each. Before the first evaluation its
    time is estimated from the training rate (inference about 3 times as fast per image); after, measured."""
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    evaluations = tuple(range(100, 1001, 100))
    progress = Progress(
        total_steps=1000, start_step=0, enabled=True, steps_per_epoch=100, evaluation_steps=evaluations, val_images=600
    )
    now[0] += 20 * 0.5  # 20 steps of 0.5 s at 20 img/s: an evaluation of 600 images estimated at 10 s
    assert progress.eta_seconds(20, evaluation_s=10.0) == pytest.approx(980 * 0.5 + 10 * 10.0)
    with caplog.at_level(logging.INFO, logger="engine"):
        progress.report(
            step=20, epoch=0, epochs=10, loss=1.0, parts={}, lr=1e-4, step_ms=500, data_ms=1, images_per_s=20.0
        )
        now[0] += 80 * 0.5 + 30.0 + 50 * 0.5  # the rest of the epoch, its evaluation (30 s), half the next epoch
        progress.report(
            step=150,
            epoch=1,
            epochs=10,
            loss=1.0,
            parts={},
            lr=1e-4,
            step_ms=500,
            data_ms=1,
            images_per_s=20.0,
            excluded_s=30.0,
            evaluation_s=30.0,
        )
    first, second = (r.getMessage() for r in caplog.records)
    assert first.endswith("ETA 0:09:50 (run with 10 evaluations of ~0:00:10), epoch 0:00:40")
    # 50 steps already done of epoch 2; 850 left at 0.5 s and 9 evaluations at 30 s
    assert second.endswith("ETA 0:11:35 (run with 9 evaluations of 0:00:30), epoch 0:00:25")
