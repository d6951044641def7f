"""Shared test setup.

Without a GPU the Triton kernels run under Triton's CPU interpreter, which must be switched on before
triton decorates any kernel, so it is set here, ahead of every test module's imports. The typed config
schemas are registered here too, so that every test that composes configs/ gets the typed config.
engine.compile.plan.compile_regions sets process-wide settings (duck sizing, Dynamo's recompile limit); each test
starts from torch's own.
"""

import io
import logging
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.fx.experimental._config as fx_config

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Each pytest-xdist worker that compiles with Inductor would start a pool of compile processes, one per core: with
# -n 16 on a machine of 16 cores, 256 processes importing torch. One compile thread compiles in the worker itself;
# the workers are the parallelism.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# Tests import the project's top-level packages (msda, models, datasets, ...) from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch._dynamo.config as dynamo_config  # imports triton: after the Triton switch above

from engine.compile.plan import RECOMPILE_LIMIT  # after the path and the Triton switch above
from engine.config.registry import register_configs  # after the path and the Triton switch above
from engine.reporting.log_filter import keep_file_only_off_console

register_configs()


@pytest.fixture(autouse=True)
def _torch_compile_defaults():
    """compile_regions turns duck sizing off (regions="transformer") and raises Dynamo's recompile limit
    (backbone="static") for the process: not for the next test."""
    duck_shape, recompile_limit = fx_config.use_duck_shape, getattr(dynamo_config, RECOMPILE_LIMIT)
    yield
    fx_config.use_duck_shape = duck_shape
    setattr(dynamo_config, RECOMPILE_LIMIT, recompile_limit)


@pytest.fixture
def full_fp32():
    """Float32 matmuls and convolutions in full float32, not TF32, for the test; torch's settings are put back
    afterwards through the same setters (torch's matmul settings are properties, not attributes that a monkeypatch
    can restore)."""
    settings = ((torch.backends.cuda.matmul, "allow_tf32"), (torch.backends.cudnn, "allow_tf32"))
    saved = [getattr(owner, name) for owner, name in settings]
    for owner, name in settings:
        setattr(owner, name, False)
    yield
    for (owner, name), value in zip(settings, saved):
        setattr(owner, name, value)


@pytest.fixture
def console_and_file(tmp_path):
    """The root logger as train.py runs with it: Hydra's console and train.log handlers, FILE_ONLY records kept off
    the console (engine/runtime/console.py). Yields (the console's text buffer, the log file's path)."""
    root = logging.getLogger()
    console_text = io.StringIO()
    console, file = logging.StreamHandler(console_text), logging.FileHandler(tmp_path / "train.log")
    saved = root.handlers[:], root.level
    root.handlers[:] = [console, file]
    root.setLevel(logging.INFO)
    keep_file_only_off_console()
    yield console_text, tmp_path / "train.log"
    file.close()
    root.handlers[:], level = saved
    root.setLevel(level)
    torch._logging.set_logs()  # torch's own logging back to its defaults
