"""engine/compile/background.py: the backbone's graph compiled in a child process while the run calls it
uncompiled; from the first call after the child has exited, the run's compiled method finds the child's graph in
the cache. A child that fails leaves the run compiling the graph itself, with a warning that quotes the child; one
still running when the run ends is stopped. Which runs do it (engine/train/build.py)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
import torch._inductor.utils as inductor_utils
from helpers import image_batch, tiny_cfg
from omegaconf import OmegaConf
from torch._dynamo.utils import counters

from engine.compile import background
from engine.compile.background import BackgroundBackbone, compile_in_background
from engine.compile.plan import CompilePlan, compile_model
from engine.runtime.distributed import DistContext
from engine.train.build import _backbone_in_child
from models import build_model
from models.deformable_detr import DeformableDETR

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)
ROOT = Path(__file__).resolve().parents[1]


def _job(cfg, tmp_path) -> BackgroundBackbone:
    return BackgroundBackbone(model_config=OmegaConf.to_container(cfg, resolve=True), cache_dir=str(tmp_path),
                              channels_last=False)


def _features_loss(outputs) -> torch.Tensor:
    srcs, _, pos = outputs
    return sum(s.square().mean() for s in srcs) + sum(p.mean() for p in pos)


@pytest.mark.parametrize("pass_of", [None, 4], ids=["whole batch", "first pass of a batch of 4"])
def test_the_child_compiles_the_backbone_and_the_run_loads_its_graph_from_the_cache(tmp_path, monkeypatch, pass_of):
    """On the CPU with Inductor: the calls run the eager method while the child compiles, and after it until one
    of the child's size; that call's compilation is a cache hit of AOTAutograd and Inductor, and its outputs and
    gradients are the eager method's. Under gradient accumulation a pass's images are a view of the batch's, which
    Dynamo traces through its base: the child reproduces it."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    # Inductor's in-process caches of an earlier test's compile cache (named clear_inductor_caches in older torch)
    (getattr(inductor_utils, "clear_caches", None) or inductor_utils.clear_inductor_caches)()
    torch.manual_seed(0)
    torch._dynamo.reset()
    cfg = tiny_cfg(backbone="resnet18")
    model, _, _ = build_model(cfg)
    plan = CompilePlan(mode="default", regions="layers", backbone="dynamic", backend="inductor")
    with inductor_config.patch(fx_graph_cache=True), functorch_config.patch(enable_autograd_cache=True):
        compile_model(model, plan, background=_job(cfg, tmp_path))
        images, mask = image_batch(B=pass_of or 2, H=96, W=128, pad_w=16, pixels=True)
        if pass_of:
            images, mask = images[:2], mask[:2]
        counters.clear()
        first = model.features(images, mask)  # starts the child; eager meanwhile
        assert not counters["stats"]["unique_graphs"]
        torch.testing.assert_close(first, DeformableDETR.features(model, images, mask), rtol=0, atol=0)
        model.features.wait()
        other = image_batch(B=2, H=128, W=96, pad_w=8, pixels=True)
        torch.testing.assert_close(model.features(*other), DeformableDETR.features(model, *other), rtol=0, atol=0)
        assert not counters["stats"]["unique_graphs"]  # not the child's size: still the eager method
        counters.clear()
        compiled = model.features(images, mask)
        _features_loss(compiled).backward()
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1, dict(counters["aot_autograd"])
    assert counters["inductor"]["fxgraph_cache_miss"] == 0, dict(counters["inductor"])
    compiled_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    eager = DeformableDETR.features(model, images, mask)
    _features_loss(eager).backward()
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)
    assert compiled_grads
    for name, grad in compiled_grads.items():
        torch.testing.assert_close(grad, model.get_parameter(name).grad, rtol=1e-3, atol=1e-5, msg=name)


class _Calls:
    def __init__(self, name: str):
        self.__name__, self.calls = name, 0

    def __call__(self, images, mask=None):
        self.calls += 1
        return images


def _failing_child(job_file):
    return [sys.executable, "-c", "import sys; print('the child could not build the model'); sys.exit(3)"]


def test_a_failed_child_leaves_the_run_compiling_the_graph_itself_with_a_warning_that_quotes_it(
        tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(background, "child_command", _failing_child)
    eager, compiled = _Calls("features"), _Calls("compiled")
    method = compile_in_background(eager, compiled, plan=CompilePlan(mode="default"),
                                   job=BackgroundBackbone(model_config={}, cache_dir=str(tmp_path),
                                                          channels_last=False))
    images = torch.zeros(2, 3, 8, 8)
    method(images)
    assert (eager.calls, compiled.calls) == (1, 0)
    files = list(method._files)  # the child's job and output
    assert files and all(f.is_file() for f in files)
    method.wait()
    with caplog.at_level(logging.WARNING, logger="engine.compile.background"):
        method(images)
        method(images)
    assert (eager.calls, compiled.calls) == (1, 2)
    assert "compiling the backbone in a child process failed (exit 3" in caplog.text
    assert "this process compiles it now" in caplog.text and "the child could not build the model" in caplog.text
    assert not any(f.exists() for f in files)  # nothing of the child left behind


def test_a_call_the_child_cannot_reproduce_compiles_in_the_run_and_starts_no_child(tmp_path, monkeypatch):
    monkeypatch.setattr(background, "child_command", lambda job_file: pytest.fail("a child was started"))
    eager, compiled = _Calls("features"), _Calls("compiled")
    method = compile_in_background(eager, compiled, plan=CompilePlan(mode="default"),
                                   job=BackgroundBackbone(model_config={}, cache_dir=str(tmp_path),
                                                          channels_last=False))
    method(torch.zeros(2, 3, 8, 8).to(memory_format=torch.channels_last))
    assert (eager.calls, compiled.calls) == (0, 1)


def test_a_child_still_compiling_when_the_run_ends_is_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr(background, "child_command",
                        lambda job_file: [sys.executable, "-c", "import time; time.sleep(600)"])
    eager, compiled = _Calls("features"), _Calls("compiled")
    method = compile_in_background(eager, compiled, plan=CompilePlan(mode="default"),
                                   job=BackgroundBackbone(model_config={}, cache_dir=str(tmp_path),
                                                          channels_last=False))
    method(torch.zeros(2, 3, 8, 8))
    child = method._child
    assert child.poll() is None
    method._stop()  # what the run's exit calls
    assert child.poll() is not None
    assert (eager.calls, compiled.calls) == (1, 0)


@pytest.mark.parametrize("device, world_size, backbone, backend, expected", [
    (GPU, 1, "dynamic", "inductor", True),
    (CPU, 1, "dynamic", "inductor", False),  # the CPU's cores are the run's
    (GPU, 2, "dynamic", "inductor", False),  # ranks would switch at different steps
    (GPU, 1, "static", "inductor", False),   # a graph per size: nothing to compile ahead
    (GPU, 1, "eager", "inductor", False),
    (GPU, 1, "dynamic", "aot_eager", False),  # nothing cached to load
])
def test_which_runs_compile_the_backbone_in_a_child(device, world_size, backbone, backend, expected):
    cfg = tiny_cfg()
    ctx = DistContext(rank=0, world_size=world_size, local_rank=0, device=device)
    plan = CompilePlan(mode="reduce-overhead" if backend == "inductor" else "default", backbone=backbone,
                       backend=backend)
    job = _backbone_in_child(cfg, OmegaConf.create({"cache_dir": "/tmp/cache"}), plan, ctx, channels_last=True)
    assert (job is not None) == expected
    if expected:
        assert job.cache_dir == "/tmp/cache" and job.channels_last
        assert job.model_config["num_classes"] == cfg.num_classes  # plain values, as JSON carries them


@pytest.mark.parametrize("run_sets", ["pass", "matmul.allow_tf32 = False", "matmul.allow_tf32 = True"],
                         ids=["untouched", "allow_tf32=False", "allow_tf32=True"])
def test_the_child_takes_the_runs_matmul_settings_as_the_cache_key_holds_them(run_sets):
    """The compiled graph's cache key holds torch.backends.cuda.matmul's settings: a fresh child process ends with
    exactly the run's, also where the run set allow_tf32 to its default (which still changes fp32_precision), and can
    still read allow_tf32 (Inductor does). Both sides are processes of their own: the settings are process-wide."""

    def settings_after(code: str, *args: str) -> dict:
        done = subprocess.run([sys.executable, "-c", "import json, sys, torch; from engine.compile import background; "
                               f"matmul = torch.backends.cuda.matmul; {code}; matmul.allow_tf32; "
                               "print(json.dumps(background.matmul_settings()))", *args],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    run = settings_after(run_sets)
    child = settings_after("background.apply_matmul_settings(json.loads(sys.argv[1]))", json.dumps(run))
    assert child == run
    assert (settings_after("pass") == run) == (run_sets == "pass")  # the run's setting is one a fresh process lacks


def test_the_run_takes_the_compiled_backbone_at_a_training_call_of_the_childs_size(tmp_path, monkeypatch):
    """The child compiled a training graph (forward and backward) at the first call's size: an evaluation call
    (no gradients) or a call of another size after it has exited still runs the eager method."""
    monkeypatch.setattr(background, "child_command", lambda job_file: [sys.executable, "-c", "pass"])
    eager, compiled = _Calls("features"), _Calls("compiled")
    method = compile_in_background(eager, compiled, plan=CompilePlan(mode="default"),
                                   job=BackgroundBackbone(model_config={}, cache_dir=str(tmp_path),
                                                          channels_last=False))
    first, other = torch.zeros(2, 3, 8, 8), torch.zeros(2, 3, 8, 16)
    method(first)
    method.wait()
    with torch.no_grad():
        method(first)
    method(other)
    assert (eager.calls, compiled.calls) == (3, 0)
    method(first)
    method(other)
    assert (eager.calls, compiled.calls) == (3, 2)
