"""Shared test setup.

Without a GPU the Triton kernels run under Triton's CPU interpreter, which must be switched on before
triton decorates any kernel, so it is set here, ahead of every test module's imports. The typed config
schemas are registered here too, so that every test that composes configs/ gets the typed config.
"""

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests import the project's top-level packages (msda, models, datasets, ...) from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import register_configs  # noqa: E402  (after the path and the Triton switch above)

register_configs()
