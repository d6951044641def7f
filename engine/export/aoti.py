"""format=aoti: the traced detector compiled by AOTInductor into one .pt2 package (weights included), and the
loaded package. Another process runs it without this project's model code::

    detector = torch._inductor.aoti_load_package("checkpoint.pt2")
    pred_logits, pred_boxes = detector(images, mask)        # engine/export/exportable.py says what they are

msda_node=reference (the CPU default) compiles the grid_sample decomposition like the rest: the package needs only
torch. msda_node=triton (the CUDA default) keeps one msda::attention call per layer, a ``torch.library.custom_op``
that the package calls by name, so the loading process must ``import msda`` first (with triton installed).
(A ``torch.library.triton_op`` would be compiled into the package, but msda/launch.py's configuration choice is
not traceable with symbolic sizes.)

The C++ compiler (Inductor's: $CXX, else g++) must have a shared libstdc++: one without puts a static copy into
the package, and loading it then segfaults. ``check_cxx_compiler`` refuses such a compiler before compiling.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

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
    """AotiCompilerError when ``compiler`` (default: Inductor's) would link libstdc++ statically (Linux only); a
    compiler that cannot be asked is left to Inductor's own error."""
    if not sys.platform.startswith("linux"):
        return
    compiler = compiler or inductor_cxx()
    if has_shared_libstdcxx(compiler) is not False:
        return
    fallback = shutil.which("g++")
    suggestion = (f"CXX={fallback}" if fallback and has_shared_libstdcxx(fallback)
                  else "CXX= a compiler whose -print-file-name=libstdc++.so gives a path")
    raise AotiCompilerError(
        f"format=aoti: the C++ compiler {compiler} has no shared libstdc++ (`{compiler} -print-file-name=libstdc++.so`"
        f" finds no file), so it would link a static copy into the package, and torch crashes (a segmentation "
        f"fault) loading such a package. Run the export with {suggestion} (Inductor compiles with $CXX, else g++)")


def write_aoti(program: torch.export.ExportedProgram, path: Path, *, quick: bool = False) -> Path:
    """``program`` compiled and packaged at ``path`` (a .pt2 file)."""
    import torch._inductor

    check_cxx_compiler()
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.unlink()  # an earlier export's package: replaced whole
    written = torch._inductor.aoti_compile_and_package(program, package_path=str(path),
                                                       inductor_configs=dict(QUICK_COMPILE) if quick else None)
    return Path(written)


class AotiRunner:
    """A loaded AOTInductor package, called like the PyTorch detector: tensors in, a tuple of tensors out."""

    def __init__(self, path: Path):
        import torch._inductor

        try:
            self.package = torch._inductor.aoti_load_package(str(path))
        except Exception as error:  # the loader raises RuntimeError from C++ for a missing op, a wrong file, ...
            raise RuntimeError(f"cannot load the AOTInductor package {path}: {error}") from error

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            return tuple(self.package(*inputs))
