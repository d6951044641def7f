"""The child process of engine/compile/background.py: it builds the model as the run did and runs the compiled
region once, forward and backward, on inputs like the run's first call, which compiles its graph into the run's
compile cache; then it exits.

    python -m engine.compile.compile_child JOB.json
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch
from torch.utils._pytree import tree_leaves

from models import build_model

from .background import apply_matmul_settings
from .cache import use_compile_cache
from .plan import CompilePlan, compile_model


def compile_region(spec: dict) -> None:
    """In the child: build the model as the run did and run its compiled region (``features``) forward and backward
    once on inputs of the run's first call, which compiles the graph into the cache."""
    use_compile_cache(spec["cache_dir"])
    apply_matmul_settings(spec["matmul"])
    torch.set_default_dtype(getattr(torch, spec["default_dtype"].removeprefix("torch.")))
    device = torch.device(spec["device"])
    model, _, _ = build_model({**spec["model"], "pretrained": "none"})  # the weights are inputs of the graph
    model.to(device)
    if spec["channels_last"]:
        model.use_channels_last()
    compile_model(model, CompilePlan(**spec["plan"]))
    B, _, H, W = spec["images"]
    dtype = getattr(torch, spec["images_dtype"].removeprefix("torch."))
    if dtype == torch.uint8:
        def pixels(shape):
            return torch.randint(0, 256, shape, dtype=dtype, device=device)
    else:
        def pixels(shape):
            return torch.randn(shape, dtype=dtype, device=device)

    images = _like_the_run(spec["images"], spec["images_base"], pixels)
    mask = None
    if spec["mask"]:
        def padded_right(shape):
            padding = torch.zeros(shape, dtype=torch.bool, device=device)
            padding[..., W // 2:] = True
            return padding

        mask = _like_the_run([B, H, W], spec["mask_base"], padded_right)
    autocast_dtype = spec["autocast_dtype"]
    with torch.autocast(device.type, dtype=getattr(torch, autocast_dtype.removeprefix("torch.")) if autocast_dtype
                        else None, enabled=autocast_dtype is not None):
        outputs = getattr(model, spec["region"])(images, mask)
        loss = sum(t.float().mean() for t in tree_leaves(outputs) if torch.is_tensor(t) and t.requires_grad)
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _like_the_run(shape: list[int], base: list[int] | None, make) -> torch.Tensor:
    """A tensor of ``shape`` made by ``make``, or, where the run's was the leading part of a batch of shape ``base``
    (a view, whose graph Dynamo traces through its base), the same slice of such a batch."""
    return make(shape) if base is None else make(base)[:shape[0]]


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    compile_region(json.loads(Path(argv[1]).read_text()))


if __name__ == "__main__":
    main(sys.argv)
