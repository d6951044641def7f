"""Where the GPU idles in a training step: the step's named phases and bench/e2e's attribution of idle time.

bench/e2e.py and bench/ddp.py charge every moment the GPU has nothing to run to the innermost phase the host
was in (engine.train.step's step.forward / step.losses / step.backward / step.update, the criterion's
step.matching); these tests check the attribution on hand-made timelines, and that a real step names its
phases for the profiler.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import image_batch, make_step, two_box_targets
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from engine.reporting.gpu_profile import (
    GPU_ONLY,
    STEP_PHASES,
    WITH_HOST,
    StepProfiler,
    busy_time,
    combine_parts,
    describe,
    idle_by_phase,
    is_device_work,
    profiled_parts,
    summarize,
)

PHASES = [("step.forward", 0, 10), ("step.losses", 10, 20), ("step.matching", 12, 15), ("step.backward", 20, 30)]


def test_idle_time_goes_to_the_innermost_phase_around_it():
    busy = [(1, 5), (4, 9), (22, 30)]  # overlapping activities count once
    assert idle_by_phase(busy, PHASES) == {"step.forward": 2, "step.losses": 7, "step.matching": 3,
                                          "step.backward": 2}


def test_idle_time_outside_every_phase_is_not_counted():
    busy = [(-50, -40), (0, 10), (10, 30), (60, 70)]  # before, during and after the phases
    assert idle_by_phase(busy, PHASES) == {}
    assert idle_by_phase([], []) == {}


def test_a_gpu_that_never_runs_idles_for_the_whole_of_every_phase():
    assert idle_by_phase([], PHASES) == pytest.approx({"step.forward": 10, "step.losses": 7, "step.matching": 3,
                                                       "step.backward": 10})


def test_several_steps_add_up_per_phase():
    second = [(name, a + 100, b + 100) for name, a, b in PHASES]
    busy = [(1, 9), (101, 109)]
    idle = idle_by_phase(busy, PHASES + second)
    assert idle == pytest.approx({"step.forward": 4, "step.losses": 14, "step.matching": 6, "step.backward": 20})


def test_nested_phases_that_start_together_charge_the_inner_one_whatever_their_order():
    nested = [("step.losses", 10, 20), ("step.matching", 10, 15)]
    for phases in (nested, nested[::-1]):
        assert idle_by_phase([], phases) == {"step.matching": 5, "step.losses": 5}


@pytest.mark.parametrize("seed", range(5))
def test_idle_by_phase_equals_a_count_of_every_idle_moment(seed):
    """Fresh random timelines (overlapping activities, nested and crossing ranges) against a brute force over unit
    moments: each idle moment goes to the latest-starting range around it, of those starting together the shorter."""
    gen = torch.Generator().manual_seed(seed)

    def intervals(count, span):
        starts = torch.randint(0, 200, (count,), generator=gen).tolist()
        return [(a, a + 1 + int(torch.randint(0, span, (1,), generator=gen))) for a in starts]

    busy = intervals(30, 12)
    phases = [(f"step.{i}", a, b) for i, (a, b) in enumerate(intervals(25, 60))]
    expected: dict[str, float] = {}
    for t in range(min(a for _, a, _ in phases), max(b for _, _, b in phases)):
        around = [p for p in phases if p[1] <= t < p[2]]
        if around and not any(a <= t < b for a, b in busy):
            name = max(around, key=lambda p: (p[1], -p[2]))[0]
            expected[name] = expected.get(name, 0) + 1
    assert idle_by_phase(busy, phases) == pytest.approx(expected)


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
    names = {e.name for e in prof.events() if e.name.startswith(STEP_PHASES)}
    assert names == {"step.forward", "step.losses", "step.matching", "step.backward", "step.update"}


def test_busy_time_counts_overlapping_activities_once_and_only_inside_the_window():
    assert busy_time([(1, 5), (4, 9), (22, 30)], 0, 25) == 8 + 3
    assert busy_time([(-5, 2), (3, 4)], 0, 10) == 2 + 1
    assert busy_time([], 0, 10) == 0


def _event(name, start, end, *, device=False, annotation=False):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), is_user_annotation=annotation,
                           device_type=DeviceType.CUDA if device else DeviceType.CPU)


def test_a_profiles_summary_gives_the_busy_share_and_the_idle_time_per_step_by_phase():
    """Two steps of 100 us: the GPU works 60 us of each, overlapping kernels counted once and a named range's GPU
    twin not at all; it waits for the loader, the matching, and between steps outside any phase."""
    events = []
    for offset in (0, 100):
        events += [_event("step.data", offset, offset + 10), _event("step.forward", offset + 10, offset + 40),
                   _event("step.losses", offset + 40, offset + 70), _event("step.matching", offset + 45, offset + 60),
                   _event("kernel_a", offset + 10, offset + 40, device=True),
                   _event("kernel_b", offset + 30, offset + 40, device=True),
                   _event("step.forward", offset + 10, offset + 45, device=True, annotation=True),
                   _event("kernel_c", offset + 60, offset + 90, device=True)]
    summary = summarize(events, steps=2, cuda=True)
    assert summary["step_ms"] == pytest.approx(190 / 2 / 1e3)  # the window: from 0 to the last kernel's end
    assert summary["gpu_busy"] == pytest.approx(120 / 190)
    assert summary["gpu_work_ms"] == pytest.approx(60 / 1e3)
    idle = summary["gpu_idle_by_phase_ms"]
    # Per step: 10 us in the loader, 5 in the losses before the matching, 15 in the matching, and 10 us between the
    # first step's last kernel and the second step (outside every phase) over the two steps.
    assert idle == pytest.approx({"data": 10e-3, "matching": 15e-3, "losses": 5e-3, "other": 5e-3})
    assert list(idle)[0] == "matching"  # the largest first
    assert summarize(events, steps=2, cuda=False)["gpu_busy"] is None


def test_a_gpu_profile_without_gpu_activity_has_an_unknown_busy_share_not_zero():
    """CUPTI may record nothing (no permission to trace): the share is unknown, never reported as 0%."""
    host_only = [_event("step.forward", 0, 500), _event("step.backward", 500, 1000)]
    summary = summarize(host_only, steps=1, cuda=True)
    assert summary["step_ms"] == pytest.approx(1.0)
    assert summary["gpu_busy"] is None and summary["gpu_work_ms"] is None and summary["gpu_idle_by_phase_ms"] == {}
    with_kernel = summarize(host_only + [_event("kernel", 100, 400, device=True)], steps=1, cuda=True)
    assert with_kernel["gpu_busy"] == pytest.approx(0.3)
    assert with_kernel["gpu_idle_by_phase_ms"] == pytest.approx({"forward": 0.2, "backward": 0.5, "other": 0.0})


@pytest.mark.parametrize("steps, first, last, warned", [
    ((5, 9), 1, 3, "this run trains steps 1 to 3"),  # beyond the run's end
    ((5, 9), 12, 20, "this run trains steps 12 to 20"),  # a resume after the range
    ((5, 9), 21, 20, "this run trains no step"),  # a resume of a finished run
    ((5, 9), 9, 20, None), ((5, 9), 1, 5, None), ((5, 9), 6, 8, None),
])
def test_a_range_the_run_never_reaches_is_said_at_its_start(tmp_path, caplog, steps, first, last, warned):
    profiler = StepProfiler(steps, output_dir=tmp_path, device=torch.device("cpu"))
    with caplog.at_level("WARNING"):
        profiler.plan(first, last)
    if warned is None:
        assert not caplog.records
    else:
        assert f"profile_steps=[{steps[0]},{steps[1]}] will profile nothing: {warned}" in caplog.text


def test_a_profile_that_records_no_events_costs_a_warning_not_the_run(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(profile, "events", lambda self: [])
    profiler = StepProfiler((1, 1), output_dir=tmp_path, device=torch.device("cpu"))
    with caplog.at_level("WARNING"):
        assert profiler.before_step(1)
        torch.ones(3).sum()
        assert profiler.after_step(1)
    assert profiler.summary["error"] == "profiling steps 1-1 failed: torch.profiler recorded no events"
    assert "the run goes on unprofiled" in caplog.text and not list(tmp_path.iterdir())


@pytest.mark.parametrize("steps, gpu_traced, parts", [
    ((3, 8), True, [(GPU_ONLY, 3, 5), (WITH_HOST, 6, 8)]),
    ((3, 9), True, [(GPU_ONLY, 3, 5), (WITH_HOST, 6, 9)]),  # an odd count: the host's part takes the extra step
    ((4, 5), True, [(GPU_ONLY, 4, 4), (WITH_HOST, 5, 5)]),
    ((4, 4), True, [(WITH_HOST, 4, 4)]),  # one step: its phases, in the one trace there is
    ((3, 8), False, [(WITH_HOST, 3, 8)]),  # no GPU to measure alone
])
def test_a_gpu_profile_measures_the_busy_share_before_it_records_the_host(steps, gpu_traced, parts):
    assert profiled_parts(steps, gpu_traced=gpu_traced) == parts


def _part(first, last, *, step_ms, busy, idle):
    return {"profiled_steps": [first, last], "steps": last - first + 1, "step_ms": step_ms, "gpu_busy": busy,
            "gpu_work_ms": None if busy is None else busy * step_ms, "gpu_idle_by_phase_ms": idle,
            "trace": f"profile_steps_{first}-{last}.json"}


def test_the_busy_share_comes_from_the_gpu_only_part_and_the_idle_phases_from_the_host_part():
    gpu = _part(1, 5, step_ms=100.0, busy=0.96, idle={"other": 4.0})
    host = _part(6, 10, step_ms=110.0, busy=0.80, idle={"matching": 12.0, "losses": 10.0})
    both = combine_parts({GPU_ONLY: gpu, WITH_HOST: host})
    assert both["profiled_steps"] == [1, 10] and both["steps"] == 10
    assert (both["step_ms"], both["gpu_busy"], both["gpu_work_ms"]) == (100.0, 0.96, 96.0)
    assert both["gpu_idle_by_phase_ms"] == {"matching": 12.0, "losses": 10.0}
    assert both["trace"] == "profile_steps_6-10.json"
    assert both["with_host_ranges"] == {"profiled_steps": [6, 10], "steps": 5, "step_ms": 110.0, "gpu_busy": 0.80,
                                        "gpu_work_ms": 88.0}
    line = describe(both)
    assert "110.0 ms per step, GPU busy 80.0%" in line and "GPU busy 96.0% (96.0 ms of work)" in line
    # The first part alone (an epoch ended inside it): its figures, no phases.
    alone = combine_parts({GPU_ONLY: gpu})
    assert alone["gpu_busy"] == 0.96 and alone["gpu_idle_by_phase_ms"] == {} and "with_host_ranges" not in alone
    assert alone["trace"] == "profile_steps_1-5.json"
    # No GPU activity recorded alone (CUPTI's activity only with the host's): the host part's figures.
    blind = combine_parts({GPU_ONLY: _part(1, 5, step_ms=100.0, busy=None, idle={}), WITH_HOST: host})
    assert (blind["step_ms"], blind["gpu_busy"]) == (110.0, 0.80)


class _FakeProfile:
    """torch.profiler.profile as StepProfiler uses it, recording what each profile was asked to record. Each part's
    kernels span 900 us; ``gpu_alone_records``: whether a profile of the GPU's activity alone records them."""

    started: list = []
    gpu_alone_records = True

    def __init__(self, activities):
        self.activities = activities
        _FakeProfile.started.append(activities)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def events(self):
        host = ProfilerActivity.CPU in self.activities
        traced = ProfilerActivity.CUDA in self.activities and (host or _FakeProfile.gpu_alone_records)
        kernel = [_event("kernel", 0, 900, device=True)] if traced else []
        return kernel + ([_event("step.forward", 0, 500), _event("step.matching", 500, 1000)] if host else [])

    def export_chrome_trace(self, path):
        Path(path).write_text("{}")


class _HostClock:
    """time.perf_counter for engine.reporting.gpu_profile: each step takes 2 ms of the host's time."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def fake_gpu_profiler(monkeypatch, tmp_path):
    import torch.profiler

    import engine.reporting.gpu_profile as gpu_profile

    _FakeProfile.started, _FakeProfile.gpu_alone_records = [], True
    syncs = []
    monkeypatch.setattr(torch.profiler, "profile", _FakeProfile)
    monkeypatch.setattr(torch.profiler, "supported_activities", lambda: {ProfilerActivity.CPU, ProfilerActivity.CUDA})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    clock = _HostClock()
    monkeypatch.setattr(gpu_profile.time, "perf_counter", clock)

    def make(steps):
        profiler = StepProfiler(steps, output_dir=tmp_path, device=torch.device("cuda"))
        profiler.clock, profiler.syncs = clock, syncs
        return profiler

    return make


def _run_steps(profiler, numbers, stop_after=None, warming=()):
    for number in numbers:
        profiler.before_step(number)
        profiler.clock.now += 2e-3
        profiler.after_step(number, warm=number not in warming)
        if number == stop_after:
            profiler.stop()


def test_a_gpu_profile_runs_its_two_parts_and_writes_both_traces(fake_gpu_profiler, tmp_path):
    profiler = fake_gpu_profiler((3, 8))
    _run_steps(profiler, range(1, 12), warming=(2, 4, 7, 10))
    assert _FakeProfile.started == [[ProfilerActivity.CUDA], [ProfilerActivity.CPU, ProfilerActivity.CUDA]]
    summary = profiler.summary
    assert summary["warming_steps"] == [4, 7]  # those profiled, in either part
    assert "step(s) 4, 7 compiled, recorded a graph or met a new batch size" in describe(summary)
    assert summary["profiled_steps"] == [3, 8] and summary["with_host_ranges"]["profiled_steps"] == [6, 8]
    assert summary["gpu_idle_by_phase_ms"]["matching"] == pytest.approx(0.1 / 3)  # 100 us idle in 3 steps
    assert summary["trace"] == "profile_steps_6-8.json"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile_steps_3-5.json", "profile_steps_6-8.json"]


def test_an_epochs_end_inside_the_first_part_ends_the_profile_there(fake_gpu_profiler):
    profiler = fake_gpu_profiler((3, 8))
    _run_steps(profiler, range(1, 12), stop_after=4)
    assert _FakeProfile.started == [[ProfilerActivity.CUDA]]  # the next epoch's steps 5-8 are not profiled
    assert profiler.summary["profiled_steps"] == [3, 4] and profiler.summary["steps"] == 2
    assert "with_host_ranges" not in profiler.summary and profiler.summary["gpu_busy"] is not None


def test_a_run_resumed_inside_the_second_part_records_the_host_for_the_steps_left(fake_gpu_profiler):
    profiler = fake_gpu_profiler((3, 8))
    _run_steps(profiler, range(7, 12))
    assert _FakeProfile.started == [[ProfilerActivity.CPU, ProfilerActivity.CUDA]]
    assert profiler.summary["profiled_steps"] == [7, 8] and profiler.summary["gpu_idle_by_phase_ms"]


def test_the_busy_share_is_over_the_host_clocks_wall_time_with_the_gpu_synced_at_each_parts_ends(fake_gpu_profiler):
    """Each part's kernels span 900 us of its 3 steps of 2 ms: the steps' time is the host's, not the kernels' span,
    which would leave out the time the GPU had nothing queued."""
    profiler = fake_gpu_profiler((3, 8))
    _run_steps(profiler, range(1, 12))
    summary = profiler.summary
    assert summary["step_ms"] == pytest.approx(2.0) and summary["gpu_busy"] == pytest.approx(0.9 / 6)
    assert summary["gpu_busy_steps"] == [3, 5] and summary["with_host_ranges"]["step_ms"] == pytest.approx(2.0)
    assert len(profiler.syncs) == 4  # before and after each part: no earlier step's kernel in it, all of its own


def test_a_gpu_only_part_that_records_nothing_gives_way_to_the_host_parts_figures_and_says_so(fake_gpu_profiler,
                                                                                              caplog):
    _FakeProfile.gpu_alone_records = False
    profiler = fake_gpu_profiler((3, 8))
    with caplog.at_level("WARNING"):
        _run_steps(profiler, range(1, 12))
    summary = profiler.summary
    assert "error" not in summary and summary["gpu_busy_steps"] == [6, 8]
    assert summary["gpu_busy"] == pytest.approx(0.9 / 6)
    assert "recorded no GPU activity in steps 3-5, which recorded it alone" in caplog.text
    line = describe(summary)
    assert "the steps before them recorded no GPU activity" in line and "activity alone recorded" not in line


def test_a_torch_that_cannot_trace_the_gpu_profiles_the_host_in_one_part(fake_gpu_profiler, monkeypatch, caplog):
    import torch.profiler

    monkeypatch.setattr(torch.profiler, "supported_activities", lambda: {ProfilerActivity.CPU})
    profiler = fake_gpu_profiler((3, 8))
    with caplog.at_level("WARNING"):
        _run_steps(profiler, range(1, 12))
    assert _FakeProfile.started == [[ProfilerActivity.CPU]]
    assert profiler.summary["profiled_steps"] == [3, 8] and profiler.summary["gpu_busy"] is None
    assert "the GPU's busy share is unknown" in caplog.text
