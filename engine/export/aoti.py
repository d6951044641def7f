"""format=aoti: the traced detector compiled by AOTInductor into one .pt2 package, and the loaded package.

``torch._inductor.aoti_compile_and_package`` compiles the ExportedProgram (engine/export/exportable.py) for the device
its weights are on: C++ kernels for the CPU, Triton kernels (built to cubins) for CUDA, and a C++ wrapper that
runs them; the package holds the weights too. Another process runs it without this project's model code::

    import torch
    detector = torch._inductor.aoti_load_package("checkpoint.pt2")
    pred_logits, pred_boxes = detector(images, mask)        # engine/export/exportable.py says what they are

The deformable attention in the package:
- msda_node=reference (the default on the CPU): the grid_sample decomposition (msda/reference.py), compiled by
  Inductor like the rest; the package needs nothing but torch.
- msda_node=triton (the default on CUDA): one call of the registered operator msda::attention per layer.
  msda::attention is a ``torch.library.custom_op``, which torch.export and Inductor treat as opaque: the
  package calls it through the dispatcher by name (AOTInductor's proxy executor), so the loading process must
  ``import msda`` first (it registers the op and its Triton kernels; triton must be installed), else the call
  fails naming msda::attention. Had the op been declared with ``torch.library.triton_op`` (its kernels launched
  through ``torch.library.wrap_triton``), torch.export would keep it whole and AOTInductor would decompose it
  into its Triton kernels and compile them into the package (torch/_library/triton.py, "Export custom triton
  op"), so that no import would be needed. That needs a launcher whose configuration choice (msda/launch.py
  reads the sizes in Python) is traceable with symbolic sizes; the kernels are not rewritten here.

``quick_compile`` (tests, ``bench/export_latency.py --quick``): the C++ wrapper is compiled without
optimization; the package's host code runs slower.

The C++ compiler (Inductor's: $CXX, else g++) must link libstdc++ as a shared library. One without libstdc++.so
(a toolchain built for static linking) puts a private copy of it into the package, and the process that loads
the package then crashes in ``aoti_load_package`` (a segmentation fault inside the package's copy; seen with
torch 2.11, CPU and CUDA packages alike). ``check_cxx_compiler`` refuses such a compiler before the compilation.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from engine.errors import AotiCompilerError

# Inductor settings of quick_compile (the module docstring): only the wrapper's optimization is lowered; the
# kernels are built as a real export builds them.
QUICK_COMPILE = {"aot_inductor.compile_wrapper_opt_level": "O0"}


def inductor_cxx() -> str:
    """The C++ compiler Inductor compiles packages with: $CXX, else g++ (as found on PATH)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler  # private: present in the torch releases we run

        return get_cpp_compiler()
    except Exception:  # not there, or no compiler found (Inductor says so itself when it compiles)
        return os.environ.get("CXX", "g++")


def has_shared_libstdcxx(compiler: str) -> bool | None:
    """Whether ``compiler`` finds a libstdc++.so to link (it prints the library's path; one that has none prints
    the bare name back); None when it cannot be asked."""
    try:
        found = subprocess.run([compiler, "-print-file-name=libstdc++.so"], capture_output=True, text=True,
                               timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if found.returncode != 0:
        return None
    return os.sep in found.stdout.strip()


def check_cxx_compiler(compiler: str | None = None) -> None:
    """Raise AotiCompilerError when ``compiler`` (default: Inductor's) would link libstdc++ statically. Only on
    Linux, where packages link libstdc++; a compiler that is missing or cannot be asked is left to Inductor's
    own error."""
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
