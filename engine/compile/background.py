"""The backbone's graph compiled in a child process, into the run's compile cache, while the run goes on without it.

Cold, the backbone's graph of symbolic sizes (``DeformableDETR.features``, forward and backward) is the longest
compilation of a run's first step at large batches (bench/results/throughput_h200.md). It needs nothing from the
rest of the model, so a child process compiles it while the run compiles the other regions
and takes its first steps with the eager backbone. From the first call after the child has exited, the run calls
the compiled method, whose compilation then finds the child's graph in the cache: Dynamo traces the method again
and loads the graph (seconds) instead of compiling it (minutes). A child that fails costs the run nothing but the
warning that says why: the run compiles the graph itself at that call, as it would have at its first step.

The child builds the graph the run would build: the same model config and compile plan, the settings the graph
depends on as the run's first call finds them (autocast, the matmul precision settings, the default dtype) and
inputs of the first call's sizes, dtype and layout. The graph is the same for every size, but Inductor chooses its
kernels' launch configurations from the sizes it first sees: the child's are the run's. The run switches at a
training call (gradients on: the child compiled forward and backward) of those sizes, or after SWITCH_WITHIN_CALLS
training calls of others: the cached graph holds guards on the sizes it was compiled at, which a call of another
size may fail (on the CPU its backward's do), and then it would be compiled again.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch._dynamo.utils import counters

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
# Lines of a failed child's output the warning quotes.
LOG_TAIL_LINES = 20
# Calls after the child's exit that may go on uncompiled while the run waits for a batch of the child's size.
SWITCH_WITHIN_CALLS = 32


@dataclass(frozen=True)
class BackgroundBackbone:
    """What a child needs to build the model as the run did: the run's model config (a plain dict, resolved), its
    compile.cache_dir, and whether the backbone runs in the channels_last layout (``use_channels_last``)."""

    model_config: dict
    cache_dir: str
    channels_last: bool


def compile_in_background(eager: Callable, compiled: Callable, *, plan, job: BackgroundBackbone) -> Callable:
    """The method to call in place of ``compiled`` (the run's compiled ``features``): ``eager`` until a child
    process, started at the first call, has compiled the same graph into the cache, then ``compiled``."""
    return _BackgroundCompile(eager, compiled, plan=plan, job=job)


class _BackgroundCompile:
    def __init__(self, eager: Callable, compiled: Callable, *, plan, job: BackgroundBackbone):
        self._eager, self._compiled, self._plan, self._job = eager, compiled, plan, job
        self._child: subprocess.Popen | None = None
        self._files: list[Path] = []
        self._started = self._compiled_in = 0.0
        self._done = False
        self._shape: tuple = ()
        self._calls_since_exit = 0

    def __call__(self, images: torch.Tensor, mask: torch.Tensor | None = None):
        if self._done:
            return self._compiled(images, mask)
        if self._child is None:
            if not _graph_of_the_first_call(images, mask):
                self._done = True  # a layout the child does not reproduce: the run compiles the graph itself
                return self._compiled(images, mask)
            self._start(images, mask)
        if self._child.poll() is None or not torch.is_grad_enabled() or \
                (self._child.returncode == 0 and not self._switch_at(images)):
            return self._eager(images, mask)
        self._finish()
        hits = counters["aot_autograd"]["autograd_cache_hit"]
        outputs = self._compiled(images, mask)
        if self._child.returncode == 0 and counters["aot_autograd"]["autograd_cache_hit"] == hits:
            log.warning("the backbone's graph compiled in the child process was not found in the compile cache: "
                        "this process compiled it again")
        return outputs

    def _switch_at(self, images: torch.Tensor) -> bool:
        """Whether to take the compiled method at this call, the child having exited: at its inputs' size, whose
        guards the cached graph meets for certain, or after SWITCH_WITHIN_CALLS other calls."""
        if not self._calls_since_exit:
            self._compiled_in = time.perf_counter() - self._started
        self._calls_since_exit += 1
        return tuple(images.shape) == self._shape or self._calls_since_exit > SWITCH_WITHIN_CALLS

    def wait(self) -> None:
        """Until the child has exited (benchmarks and tests that want the compiled method from the next call)."""
        if self._child is not None and not self._done:
            self._child.wait()

    def _start(self, images: torch.Tensor, mask: torch.Tensor | None) -> None:
        device = images.device
        self._shape = tuple(images.shape)
        autocast = torch.is_autocast_enabled(device.type)
        spec = {"model": self._job.model_config, "plan": asdict(self._plan), "cache_dir": self._job.cache_dir,
                "device": str(device), "images": list(images.shape), "images_dtype": str(images.dtype),
                "images_base": _base_shape(images), "mask": mask is not None,
                "mask_base": None if mask is None else _base_shape(mask),
                "autocast_dtype": str(torch.get_autocast_dtype(device.type)) if autocast else None,
                "matmul": matmul_settings(), "default_dtype": str(torch.get_default_dtype()),
                "channels_last": self._job.channels_last,
                "region": self._eager.__name__}
        job_file = _temporary(".json")
        job_file.write_text(json.dumps(spec))
        output = _temporary(".log")
        self._files = [job_file, output]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                                           if p)}
        with open(output, "w") as out:
            self._child = subprocess.Popen(child_command(job_file), cwd=ROOT, env=env, stdout=out,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self._started = time.perf_counter()
        atexit.register(self._stop)
        log.info("compiling the backbone in a child process (pid %d) while training starts with it uncompiled",
                 self._child.pid)

    def _finish(self) -> None:
        self._done = True
        seconds = time.perf_counter() - self._started
        if self._child.returncode == 0:
            log.info("the backbone's graph was compiled in the background in %.0f s; after %d more calls "
                     "uncompiled, this one loads it from the compile cache", self._compiled_in,
                     self._calls_since_exit - 1)
        else:
            tail = self._files[1].read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            log.warning("compiling the backbone in a child process failed (exit %s after %.0f s); this process "
                        "compiles it now. The child's last lines:\n%s", self._child.returncode, seconds,
                        "\n".join(tail))
        self._remove_files()

    def _stop(self) -> None:
        if self._child is not None and self._child.poll() is None:
            self._child.kill()
            self._child.wait()
        self._remove_files()

    def _remove_files(self) -> None:
        for path in self._files:
            path.unlink(missing_ok=True)
        self._files = []


# The process-wide matmul settings that a compiled graph's cache key holds, those this torch has: fp32_precision
# ("none", "ieee" or "tf32") where it exists, else allow_tf32, which sets it.
MATMUL_SETTINGS = ("fp32_precision", "allow_fp16_reduced_precision_reduction",
                   "allow_bf16_reduced_precision_reduction")


def matmul_settings() -> dict:
    matmul = torch.backends.cuda.matmul
    names = MATMUL_SETTINGS if hasattr(matmul, "fp32_precision") else ("allow_tf32", *MATMUL_SETTINGS[1:])
    return {name: getattr(matmul, name) for name in names}


def apply_matmul_settings(settings: dict) -> None:
    """The run's settings, in the child, through the setters the run uses (torch refuses to read allow_tf32 once both
    it and fp32_precision were set). Only those that differ are set: allow_tf32 set to its default still turns
    fp32_precision from "none" to "ieee", and the graph would be compiled under another key than the run's."""
    matmul = torch.backends.cuda.matmul
    for name, value in settings.items():
        if getattr(matmul, name) == value:
            continue
        if name == "fp32_precision":
            matmul.allow_tf32 = value == "tf32"  # which sets fp32_precision to "tf32" or "ieee"
        else:
            setattr(matmul, name, value)


def child_command(job_file: Path) -> list[str]:
    return [sys.executable, "-m", "engine.compile.compile_child", str(job_file)]


def _graph_of_the_first_call(images: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether the child can reproduce this call's inputs: contiguous tensors (the loaders' batches), each a tensor of
    its own or the leading images of a contiguous batch (a pass of a batch under gradient accumulation). Dynamo
    traces a view through its base, so the graph differs from one of a tensor of its own."""
    return all(t.is_contiguous() and _reproducible_base(t) for t in (images, mask) if t is not None)


def _reproducible_base(tensor: torch.Tensor) -> bool:
    base = tensor._base
    return base is None or (base.is_contiguous() and tensor.storage_offset() == 0
                            and base.shape[1:] == tensor.shape[1:])


def _base_shape(tensor: torch.Tensor) -> list[int] | None:
    """The shape of the batch ``tensor`` leads (``base[:B]``), or None where it is a tensor of its own."""
    return None if tensor._base is None else list(tensor._base.shape)


def _temporary(suffix: str) -> Path:
    handle, name = tempfile.mkstemp(prefix="backbone-compile-", suffix=suffix)
    os.close(handle)
    return Path(name)
