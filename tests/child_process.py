"""The environment for tests that start ``python train.py`` (or torchrun) as a child process."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment, with the repository root first on PYTHONPATH and ``extra`` added.

    The caller's PYTHONPATH stays behind the root: packages may be installed there (as on a machine that
    adds them with pip --target), and a child that lost it could not import them.
    """
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, **extra, "PYTHONPATH": pythonpath}
