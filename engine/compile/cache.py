"""Compiled graphs and kernels kept between runs: ``compile.cache_dir`` for Inductor's, AOTAutograd's and
Triton's caches, so that a second run or a resume on the same machine skips most of the compilation."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch._functorch.config
import torch._inductor.config

# Each cache's environment variable -> its folder under compile.cache_dir; a variable the user set wins.
CACHE_VARIABLES = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}
_set_here: dict[str, str] = {}


def _chosen_by_user(variable: str) -> bool:
    """Whether ``variable`` holds neither our value nor torch's own default (which importing torch._inductor sets)."""
    value = os.environ.get(variable)
    if value is None or value == _set_here.get(variable):
        return False
    if variable != "TORCHINDUCTOR_CACHE_DIR":
        return True
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # another torch: no default of its own to tell apart
        return True
    return value != os.path.abspath(default_cache_dir())


def use_compile_cache(cache_dir: str) -> Path:
    """Keep Inductor's (with AOTAutograd's) and Triton's caches under ``cache_dir``; returns it resolved. Call before
    anything compiles: both read their variables when they first need them."""
    root = Path(os.path.expanduser(cache_dir)).resolve()
    for variable, folder in CACHE_VARIABLES.items():
        if not _chosen_by_user(variable):
            _set_here[variable] = os.environ[variable] = str(root / folder)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(
            f"compile.cache_dir={cache_dir}: cannot create {root} ({error.strerror}); point it at a writable directory"
        ) from error
    torch._inductor.config.fx_graph_cache = True
    if hasattr(torch._functorch.config, "enable_autograd_cache"):
        torch._functorch.config.enable_autograd_cache = True
    return root
