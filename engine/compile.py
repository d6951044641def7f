"""``compile=true``: the transformer's layers through torch.compile, for training and for evaluation.

Regional compilation: each encoder and decoder layer is compiled in place (``nn.Module.compile``), and
layers of one kind share one graph, so the warm-up costs two graphs rather than the whole network's.
That is where the step's thousands of small launches are (attention projections, softmax, layer norms,
feed-forward, the deformable attention op itself, which is a registered operator and traced with no
break). The ResNet backbone stays eager: its kernels are few and large, and its stride-2 size arithmetic
would make a compiled graph specialize on the parity of the image size.

Dynamic shapes from the first call: the COCO recipe feeds a different padded image size almost every
batch (short side 480-800, long side up to 1333), and a layer's graph with symbolic sizes serves them all.
Recompilations are logged (torch's "recompiles" log), so a shape that does force one shows in train.log.
Module names and state_dict keys are unchanged: checkpoints of a compiled run load anywhere.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def compile_regions(model: torch.nn.Module, *, backend: str = "inductor") -> torch.nn.Module:
    """Compile ``model``'s (a DeformableDETR) encoder and decoder layers in place; returns the model."""
    torch._logging.set_logs(recompiles=True)
    layers = [*model.transformer.encoder.layers, *model.transformer.decoder.layers]
    for layer in layers:
        layer.compile(dynamic=True, backend=backend)
    log.info("torch.compile (backend %s, dynamic shapes) of the %d transformer layers; the first steps of "
             "training and of evaluation include the compilation", backend, len(layers))
    return model
