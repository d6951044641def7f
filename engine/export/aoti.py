"""format=aoti: the traced detector compiled by AOTInductor into one .pt2 package, and the loaded package.

msda_node=triton keeps each attention as a ``torch.library.custom_op`` called by name, so the loading process must
``import msda`` first, with triton installed (a ``triton_op`` would be compiled in, but msda/launch.py's
configuration choice is not traceable with symbolic sizes)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import torch._inductor

from engine.errors import AotiCompilerError

# quick_compile (tests, bench/export_latency.py --quick): the C++ wrapper unoptimized, the kernels as usual.
QUICK_COMPILE = {"aot_inductor.compile_wrapper_opt_level": "O0"}


def inductor_cxx() -> str:
    """The C++ compiler Inductor compiles packages with: $CXX, else g++ (as found on PATH)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler  # private: present in the torch releases we run

        return get_cpp_compiler()
    except Exception:  # not there, or no compiler found (Inductor says so itself when it compiles)
        return os.environ.get("CXX", "g++")


def has_shared_libstdcxx(compiler: str) -> bool | None:
    """Whether ``compiler`` finds a libstdc++.so (it prints a path, else the bare name); None if it cannot say."""
    try:
        found = subprocess.run([compiler, "-print-file-name=libstdc++.so"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return os.sep in found.stdout.strip() if found.returncode == 0 else None


def check_cxx_compiler(compiler: str | None = None) -> None:
    """AotiCompilerError when ``compiler`` (default: Inductor's) has no shared libstdc++ (Linux only): it would put
    a static copy into the package, and loading that segfaults. One that cannot be asked is left to Inductor."""
    if not sys.platform.startswith("linux"):
        return
    compiler = compiler or inductor_cxx()
    if has_shared_libstdcxx(compiler) is not False:
        return
    fallback = shutil.which("g++")
    suggestion = (
        f"CXX={fallback}"
        if fallback and has_shared_libstdcxx(fallback)
        else "CXX= a compiler whose -print-file-name=libstdc++.so gives a path"
    )
    raise AotiCompilerError(
        f"format=aoti: the C++ compiler {compiler} has no shared libstdc++ (`{compiler} -print-file-name=libstdc++.so`"
        f" finds no file), so it would link a static copy into the package, and torch crashes (a segmentation "
        f"fault) loading such a package. Run the export with {suggestion} (Inductor compiles with $CXX, else g++)"
    )


def write_aoti(program: torch.export.ExportedProgram, path: Path, *, quick: bool = False) -> Path:
    """``program`` compiled and packaged at ``path`` (a .pt2 file)."""
    check_cxx_compiler()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # an earlier export's package: replaced whole
    return Path(
        torch._inductor.aoti_compile_and_package(
            program, package_path=str(path), inductor_configs=dict(QUICK_COMPILE) if quick else None
        )
    )


class AotiRunner:
    """A loaded AOTInductor package, called like the PyTorch detector: tensors in, a tuple of tensors out."""

    def __init__(self, path: Path):
        try:
            self.package = torch._inductor.aoti_load_package(str(path))
        except Exception as error:  # the loader raises RuntimeError from C++ for a missing op, a wrong file, ...
            raise RuntimeError(f"cannot load the AOTInductor package {path}: {error}") from error

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            return tuple(self.package(*inputs))
