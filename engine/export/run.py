"""``python export.py``: a trained detector exported (ONNX or an AOTInductor package), then checked against the
PyTorch model on a sample batch at its shape and, for a dynamic graph, a second one (engine/export/parity.py);
beyond the tolerance the command fails with exit code 1, keeping the file.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from datasets.size_buckets import round_up
from engine.checkpoint.trained_model import load_trained_model
from engine.config.export_schema import (
    SIDE_MULTIPLE,
    ExportConfig,
    ExportFormat,
    MsdaNode,
    default_output_of,
    output_path,
)
from engine.config.registry import check_config
from engine.runtime.distributed import resolve_device
from engine.runtime.output_paths import writable_file
from models.postprocess import PostProcess

from .exportable import ExportableDetector, SampleShape, smallest_multiple, trace
from .parity import check_parity, tolerance_for
from .samples import recorded_validation_folder, sample_batch

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# model.msda per msda_node: triton traces as one msda::attention op per layer, which the TensorRT node replaces.
MSDA_IMPLS = {MsdaNode.reference: "pytorch", MsdaNode.triton: "triton", MsdaNode.tensorrt: "triton"}


def export(cfg: DictConfig) -> dict:
    """Export ``cfg.checkpoint`` as ``cfg`` says; returns {"output", "format", "msda_node", "sample" (where the
    sample images came from), "parity" (ParityReports; empty for msda_node=tensorrt), "seconds" (trace, write)}."""
    cfg = check_config(cfg, ExportConfig)
    path = output_path(cfg).expanduser().resolve()
    check_output(cfg, path)  # before anything is loaded or traced
    device = resolve_device(cfg.device)
    node = attention_node(cfg, device)
    if cfg.format == ExportFormat.aoti:
        from engine.export.aoti import check_cxx_compiler

        check_cxx_compiler()  # before the checkpoint is loaded and the model traced, which take a while
    trained = load_trained_model(
        cfg.checkpoint, cfg.model, device=device, msda=MSDA_IMPLS[node], weights=cfg.checkpoint_weights
    )
    dtype = DTYPES[str(cfg.dtype)]
    detector = ExportableDetector(
        trained.model.to(dtype), PostProcess(num_select=cfg.max_detections) if cfg.postprocess else None
    )
    # The default: the checkpoint's evaluation sides rounded up to 32, at least what the smallest feature level needs.
    least = SIDE_MULTIPLE * smallest_multiple(trained.model)
    height, width = cfg.image_size or [
        max(least, round_up(side, SIDE_MULTIPLE)) for side in (trained.val_size, trained.max_size)
    ]
    shape = SampleShape(batch=cfg.batch_size, height=height, width=width)
    folder = recorded_validation_folder(trained.source.recorded_config)
    sample = sample_batch(shape, folder=folder)
    inputs = sample.inputs(postprocess=cfg.postprocess, dtype=dtype, device=device)
    log.info(
        "exporting %s (step %d, %d classes) to %s: %s, %s on %s, attention %s, sample %d x %d x %d (%s), %s",
        trained.checkpoint,
        trained.step,
        trained.model_config["num_classes"],
        path,
        cfg.format,
        cfg.dtype,
        device,
        node,
        shape.batch,
        shape.height,
        shape.width,
        "dynamic batch and sides" if cfg.dynamic else "static",
        sample.source,
    )

    started = time.perf_counter()
    program = trace(detector, inputs, dynamic=cfg.dynamic)
    traced = time.perf_counter() - started
    runner = write_and_load(cfg, program, detector, path=path, node=node, device=device, trained=trained)
    written = time.perf_counter() - started - traced
    log.info(
        "wrote %s (%.1f MB): traced in %.1f s, %s in %.1f s",
        path,
        path.stat().st_size / 2**20,
        traced,
        "translated" if cfg.format == ExportFormat.onnx else "compiled",
        written,
    )

    reports = []
    if runner is None:
        log.warning(
            "msda_node=tensorrt: %s holds TensorRT's MultiscaleDeformableAttnPlugin_TRT nodes, which no "
            "runtime here implements: the file was NOT run and NOT checked against the PyTorch model (only "
            "its graph was written). Build it with TensorRT (trtexec --onnx=%s) and compare its outputs with "
            "a msda_node=reference export on the same images",
            path,
            path,
        )
    else:
        tolerance = tolerance_for(str(cfg.dtype), logits=cfg.tolerance.logits, boxes=cfg.tolerance.boxes)
        shapes = [shape]
        if cfg.dynamic:  # and another batch and sides, where a size fixed by mistake shows
            shapes.append(
                SampleShape(
                    batch=max(1, shape.batch - 1),
                    height=shape.height + SIDE_MULTIPLE,
                    width=max(least, shape.width - SIDE_MULTIPLE),
                )
            )
        for check_shape in shapes:
            batch = sample if check_shape == shape else sample_batch(check_shape, folder=folder)
            inputs = batch.inputs(postprocess=cfg.postprocess, dtype=dtype, device=device)
            where = f"batch {check_shape.batch}, {check_shape.height} x {check_shape.width}"
            report = check_parity(runner, detector, inputs, tolerance=tolerance, what=f"{path} at {where}")
            log.info("parity at %s: %s", where, report.describe())
            reports.append(report)
    return {
        "output": path,
        "format": str(cfg.format),
        "msda_node": str(node),
        "sample": sample.source,
        "parity": reports,
        "seconds": {"trace": traced, "write": written},
    }


def check_output(cfg: DictConfig, path: Path) -> None:
    """Check that ``path`` can be written; beside the checkpoint only when its folder exists (a mistyped checkpoint
    is its own error, and leaves no folder behind)."""
    default = default_output_of(cfg)
    if cfg.output:
        writable_file(path, setting=f"output={cfg.output}", example=default.name)
    elif path.parent.is_dir():
        writable_file(path, setting=f"output=null (beside checkpoint={cfg.checkpoint})", example=default.name)


def attention_node(cfg: DictConfig, device: torch.device) -> MsdaNode:
    """``cfg.msda_node``, or the format's default on ``device`` (configs/export.yaml)."""
    default = MsdaNode.triton if cfg.format == ExportFormat.aoti and device.type == "cuda" else MsdaNode.reference
    node = MsdaNode(str(cfg.msda_node or default))
    if node == MsdaNode.triton and device.type != "cuda":
        raise ValueError(
            f"msda_node=triton puts the Triton kernels' op in the package, which runs on CUDA, but the "
            f"export is on {device}: set device=cuda, or msda_node=reference for a CPU package"
        )
    return node


def write_and_load(
    cfg: DictConfig, program, detector: ExportableDetector, *, path: Path, node: MsdaNode, device: torch.device, trained
):
    """Write ``program`` in ``cfg.format`` to ``path``; return what runs it (None for the TensorRT node)."""
    if cfg.format == ExportFormat.aoti:
        from engine.export.aoti import AotiRunner, write_aoti

        write_aoti(program, path, quick=cfg.quick_compile)
        return AotiRunner(path)
    from engine.export.onnx import OnnxRunner, write_onnx

    metadata = {
        "checkpoint": trained.checkpoint,
        "step": trained.step,
        "weights": trained.source.loaded_weights,  # the model EMA's or the trained ones
        "dtype": cfg.dtype,
        "msda_node": node,
        "inputs": ", ".join(detector.input_names),
        "outputs": ", ".join(detector.output_names),
        "categories": trained.categories,
    }
    if node == MsdaNode.tensorrt:
        metadata["parity"] = (
            "not checked: the attention is TensorRT's plugin node, which no runtime at export time implemented"
        )
    write_onnx(
        program,
        path,
        input_names=detector.input_names,
        output_names=detector.output_names,
        opset=cfg.opset,
        tensorrt=node == MsdaNode.tensorrt,
        metadata={f"deformable_detr.{key}": value for key, value in metadata.items()},
    )
    return None if node == MsdaNode.tensorrt else OnnxRunner(path, device=device)
