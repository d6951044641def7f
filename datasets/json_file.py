"""JSON files written whole: the object goes to a hidden temporary file beside ``path``, renamed over it once
complete, so that a reader, or a run killed mid-write, never meets half a file."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_json(path: str | os.PathLike, obj, *, indent: int | None = None) -> Path:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=indent)
    os.replace(tmp, path)
    return path
