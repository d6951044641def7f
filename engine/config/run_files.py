"""The file of a run directory that ``checkpoint=`` and ``resume=`` take the directory for: its latest checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

LATEST = "checkpoint.pth"


def named_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint file ``path`` names: itself, or, for a run directory, its checkpoint.pth."""
    path = Path(path).expanduser()
    return path / LATEST if path.is_dir() else path
