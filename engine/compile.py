"""``compile=true``: the model through torch.compile, for training and for evaluation.

Dynamic shapes from the first call: the COCO recipe feeds a different padded image size almost every
batch (short side 480-800, long side up to 1333), and one graph with symbolic sizes serves them all where
static graphs would recompile for each. The deformable attention is a registered operator (msda), so the
graph has no break there. Recompilations are logged (torch's "recompiles" log) so a shape that does
force one is visible in train.log.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def compile_module(module: torch.nn.Module, *, backend: str = "inductor") -> torch.nn.Module:
    """``torch.compile(module, dynamic=True)``; the first call of each mode (train / eval) compiles."""
    torch._logging.set_logs(recompiles=True)
    log.info("compiling the model with torch.compile (backend %s, dynamic shapes); the first steps include "
             "the compilation", backend)
    return torch.compile(module, dynamic=True, backend=backend)
