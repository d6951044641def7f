"""Profiles of training steps: train.py's profile_steps (engine/train/hooks/profiling.py: its trace and the GPU's busy
share), the phases a step names for the profiler (engine.train.step's step.forward / step.losses / step.backward /
step.update, the criterion's step.matching), and the GPU time by part of a step (bench/step_profile.py).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch
from helpers import hook_run_state, image_batch, make_step, two_box_targets
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from bench.step_profile import gpu_time_by_part
from engine.train.hooks.base import Ending, EpochEnd, StepDone
from engine.train.hooks.profiling import StepProfiler, busy_time, is_device_work


def test_only_kernels_copies_and_memsets_count_as_gpu_work_not_the_gpu_spans_of_named_ranges():
    def event(device, annotation):
        return SimpleNamespace(device_type=device, is_user_annotation=annotation)

    assert is_device_work(event(DeviceType.CUDA, False))
    assert not is_device_work(event(DeviceType.CUDA, True))  # a record_function range's GPU-side twin
    assert not is_device_work(event(DeviceType.CPU, False))
    assert not is_device_work(event(DeviceType.CPU, True))


def test_a_training_step_names_its_phases_for_the_profiler():
    torch.manual_seed(0)
    step = make_step("base")
    images, mask = image_batch()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(images, mask, two_box_targets())
    names = {e.name for e in prof.events() if e.name.startswith("step.")}
    assert names == {"step.forward", "step.losses", "step.matching", "step.backward", "step.update"}


def test_busy_time_counts_overlapping_activities_once_and_only_inside_the_window():
    assert busy_time([(1, 5), (4, 9), (22, 30)], 0, 25) == 8 + 3
    assert busy_time([(-5, 2), (3, 4)], 0, 10) == 2 + 1
    assert busy_time([], 0, 10) == 0


def _event(name, start, end, *, device=False, annotation=False):
    return SimpleNamespace(
        name=name,
        time_range=SimpleNamespace(start=start, end=end),
        is_user_annotation=annotation,
        device_type=DeviceType.CUDA if device else DeviceType.CPU,
    )


@pytest.mark.parametrize(
    "steps, first, last, warned",
    [
        ((5, 9), 1, 3, "this run trains steps 1 to 3"),  # beyond the run's end
        ((5, 9), 12, 20, "this run trains steps 12 to 20"),  # a resume after the range
        ((5, 9), 21, 20, "this run trains no step"),  # a resume of a finished run
        ((5, 9), 9, 20, None),
        ((5, 9), 1, 5, None),
        ((5, 9), 6, 8, None),
    ],
)
def test_a_range_the_run_never_reaches_is_said_at_its_start(tmp_path, caplog, steps, first, last, warned):
    with caplog.at_level("WARNING"):
        StepProfiler(steps).start(hook_run_state(tmp_path, start_step=first - 1, total_steps=last))
    if warned is None:
        assert not caplog.records
    else:
        assert f"profile_steps=[{steps[0]},{steps[1]}] will profile nothing: {warned}" in caplog.text


class _FakeProfile:
    """torch.profiler.profile as StepProfiler uses it, recording what each profile was asked to record. Its kernels
    span 900 us (two of them, overlapping), and a named range's GPU twin that must not count; ``records``: whether
    it records any GPU activity (CUPTI may not be allowed to)."""

    started: ClassVar[list] = []
    records = True

    def __init__(self, activities):
        self.activities = activities
        _FakeProfile.started.append(activities)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def events(self):
        if not self.records:
            return []
        return [
            _event("kernel_a", 0, 600, device=True),
            _event("kernel_b", 300, 900, device=True),
            _event("step.forward", 0, 2000, device=True, annotation=True),
        ]

    def export_chrome_trace(self, path):
        Path(path).write_text("{}")


class _HostClock:
    """time.perf_counter for engine.train.hooks.profiling: each step takes 2 ms of the host's time."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def fake_gpu_profiler(monkeypatch, tmp_path):
    """A StepProfiler of a GPU run with torch.profiler, the GPU's syncs and the host's clock faked; each step of
    ``run`` takes 2 ms of the host's clock."""
    import torch.profiler

    import engine.train.hooks.profiling as profiling

    _FakeProfile.started, _FakeProfile.records = [], True
    syncs = []
    monkeypatch.setattr(torch.profiler, "profile", _FakeProfile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    clock = _HostClock()
    monkeypatch.setattr(profiling.time, "perf_counter", clock)

    def make(steps):
        profiler = StepProfiler(steps)
        profiler.run = hook_run_state(tmp_path, device=torch.device("cuda"))
        profiler.clock, profiler.syncs, profiler.profiled = clock, syncs, []
        return profiler

    return make


def _step_done(number: int) -> StepDone:
    return StepDone(
        number=number, epoch=0, values=None, names=(), size=(2, 3, 8, 8), images=2, data_s=0.0, compute=None
    )


def _run(profiler, numbers, *, epoch_ends_after=None):
    run = profiler.run
    for number in numbers:
        profiler.before_step(run, number)
        profiler.profiled.append(run.timing.profiling)
        profiler.clock.now += 2e-3
        profiler.after_step(run, _step_done(number))
        if number == epoch_ends_after:
            profiler.epoch_end(run, EpochEnd(epoch=0, complete=True))
    profiler.close(run, Ending.DONE)


def test_a_gpu_profile_records_the_gpu_alone_and_its_busy_share_over_the_host_clocks_wall_time(
    fake_gpu_profiler, tmp_path
):
    """The kernels span 900 us of the 3 steps' 6 ms: the steps' time is the host's, not the kernels' span, which
    would leave out the time the GPU had nothing queued; overlapping kernels count once, a range's GPU twin not."""
    from torch.profiler import ProfilerActivity

    profiler = fake_gpu_profiler((3, 5))
    _run(profiler, range(1, 9))
    assert _FakeProfile.started == [[ProfilerActivity.CUDA]]
    assert profiler.profiled == [False, False, True, True, True, False, False, False]
    summary = profiler.summary
    assert summary["profiled_steps"] == [3, 5] and summary["steps"] == 3
    assert summary["step_ms"] == pytest.approx(2.0) and summary["gpu_busy"] == pytest.approx(0.9 / 6)
    assert summary["gpu_work_ms"] == pytest.approx(0.3)
    assert profiler.run.timing.profile == summary and summary["trace"] == "profile_steps_3-5.json"
    assert [p.name for p in tmp_path.iterdir()] == ["profile_steps_3-5.json"]
    assert len(profiler.syncs) == 2  # before and after: no earlier step's kernel in it, all of its own


def test_an_epochs_end_inside_the_range_ends_the_profile_there(fake_gpu_profiler):
    profiler = fake_gpu_profiler((3, 8))
    _run(profiler, range(1, 12), epoch_ends_after=4)
    assert len(_FakeProfile.started) == 1  # the next epoch's steps 5-8 are not profiled
    assert profiler.summary["profiled_steps"] == [3, 4] and profiler.summary["steps"] == 2


def test_a_run_that_ends_inside_the_range_is_profiled_up_to_its_end(fake_gpu_profiler):
    profiler = fake_gpu_profiler((3, 8))
    _run(profiler, range(1, 6))
    assert profiler.summary["profiled_steps"] == [3, 5]


def test_a_gpu_profile_without_gpu_activity_has_an_unknown_busy_share_not_zero(fake_gpu_profiler, caplog):
    """CUPTI may record nothing (no permission to trace): the share is unknown, never reported as 0%."""
    _FakeProfile.records = False
    profiler = fake_gpu_profiler((3, 5))
    with caplog.at_level("WARNING"):
        _run(profiler, range(1, 9))
    assert profiler.summary["gpu_busy"] is None and profiler.summary["gpu_work_ms"] is None
    assert "recorded no GPU activity in steps 3-5" in caplog.text


def test_a_profiler_that_fails_costs_a_warning_not_the_run(tmp_path, caplog, monkeypatch):
    def broken_export(self, path):
        raise OSError("disk full")

    monkeypatch.setattr(profile, "export_chrome_trace", broken_export)
    run = hook_run_state(tmp_path, total_steps=3)
    profiler = StepProfiler((1, 1))
    with caplog.at_level("WARNING"):
        assert profiler.before_step(run, 1)
        torch.ones(3).sum()
        assert profiler.after_step(run, _step_done(1))
    assert profiler.summary["error"] == "profiling steps 1-1 failed: disk full"
    assert run.timing.profile == profiler.summary and not run.timing.profiling
    assert "the run goes on unprofiled" in caplog.text and not list(tmp_path.iterdir())


def _kernel(name, ts, dur, grid=(1, 1, 1), correlation=None, cat="kernel"):
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "ts": ts,
        "dur": dur,
        "args": {"grid": list(grid), **({"correlation": correlation} if correlation is not None else {})},
    }


@pytest.mark.parametrize(
    "matching",
    [("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy"), ("_assignment_kernel", "kernel")],
    ids=["solved on the host", "solved on the device"],
)
def test_the_gpu_time_of_a_step_is_charged_to_its_parts_by_what_each_piece_is_and_where_it_falls(matching):
    """Two steps of hand-made GPU work, 10 us a piece, in a step's order: the backbone, the encoder (its attention
    on a large grid), the decoder (on a small one), the matching (its copy to the host, or its solve on the device),
    the losses, the backward in reverse, the update; a graph replay's kernels (one correlation id) stay together."""
    events, t = [], 0.0

    def add(name, grid=(1, 1, 1), correlation=None, cat="kernel"):
        nonlocal t
        events.append(_kernel(name, t, 10.0, grid, correlation, cat))
        t += 10.0

    for step in range(2):
        add("conv_fprop")  # backbone
        add("value_proj_gemm", correlation=100 + step)  # an encoder layer as one graph: its rest, its attention
        add("msda_forward_kernel", grid=(4000, 8, 1), correlation=100 + step)
        add("ffn_gemm")  # encoder rest
        add("msda_forward_kernel", grid=(60, 8, 1))  # decoder attention
        add("heads_gemm")  # decoder rest
        add(matching[0], cat=matching[1])  # the matching
        add("focal_loss_kernel")  # losses
        add("msda_backward_kernel", grid=(60, 8, 1))  # decoder attention backward
        add("ffn_gemm_backward")  # decoder rest
        add("msda_backward_kernel", grid=(4000, 8, 1))  # encoder attention backward
        add("conv_dgrad")  # backbone
        add("multi_tensor_apply_kernel<FusedAdamMathFunctor>")  # update
        t += 20.0  # idle between steps
    parts = gpu_time_by_part({"traceEvents": events}, steps=2)
    us = {part: round(ms * 1e3, 6) for part, ms in parts.items()}
    assert us == {
        "backbone": 20.0,
        "encoder attention": 20.0,
        "encoder rest": 20.0,
        "decoder attention": 20.0,
        "decoder rest": 20.0,
        "matching and losses": 20.0,
        "update": 10.0,
        "copies": 0.0,
        "idle": 10.0,
    }
    assert gpu_time_by_part({"traceEvents": []}, steps=2) == {}
