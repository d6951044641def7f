"""format=aoti: the traced detector compiled by AOTInductor into one .pt2 package, and the loaded package.

``torch._inductor.aoti_compile_and_package`` compiles the ExportedProgram (engine/exportable.py) for the device
its weights are on: C++ kernels for the CPU, Triton kernels (built to cubins) for CUDA, and a C++ wrapper that
runs them; the package holds the weights too. Another process runs it without this project's model code::

    import torch
    detector = torch._inductor.aoti_load_package("checkpoint.pt2")
    pred_logits, pred_boxes = detector(images, mask)        # engine/exportable.py says what they are

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
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# Inductor settings of quick_compile (the module docstring). Kernels stay vectorized: a package built without
# (cpp.simdlen=0) records no CPU instruction set, and torch 2.11 crashed loading it on an AVX-512 host.
QUICK_COMPILE = {"aot_inductor.compile_wrapper_opt_level": "O0"}
# Releases before this one crashed (a segmentation fault) loading the packages this project writes: torch 2.11 on an
# H200 machine, in aoti_load_package's native loader, CPU and CUDA packages alike, also in a fresh process. Torch
# 2.14 loads them (CI); 2.12 and 2.13 were not tried.
LOADER_CRASHED_BELOW = (2, 12)


def torch_release() -> tuple[int, int]:
    """(major, minor) of the torch in use."""
    return tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def write_aoti(program: torch.export.ExportedProgram, path: Path, *, quick: bool = False) -> Path:
    """``program`` compiled and packaged at ``path`` (a .pt2 file)."""
    import torch._inductor

    if torch_release() < LOADER_CRASHED_BELOW:
        log.warning("format=aoti on torch %s: loading the packages this project writes crashed on torch 2.11 (a "
                    "segmentation fault in torch's package loader, also in a fresh process); torch 2.14 loads them. "
                    "The package is written first, then loaded for the parity check.", torch.__version__)
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
