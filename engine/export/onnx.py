"""format=onnx: the traced detector as an ONNX file, and the onnxruntime session the parity check runs it with.

torch.onnx.export's dynamo exporter (``dynamo=True``: torch.export's graph translated by onnxscript) takes the
ExportedProgram that engine/export/exportable.py traced, so the symbolic batch and sides become the file's dynamic
axes. The TorchScript exporter cannot export this model: it traces the level sizes as tensors, which the
attention's host-integer layout refuses. The deformable attention goes in as the reference decomposition
(grid_sample, ONNX GridSample), or, with msda_node=tensorrt, as TensorRT's plugin node
(engine/export/tensorrt.py). The file records how it was made in its metadata (``metadata_props``).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import numpy as np
import torch

from .onnx_opset import check_opset, fit_opset

log = logging.getLogger(__name__)
# Loggers of the ONNX tool chain, which log every optimization step at INFO (hundreds of lines per export).
CHATTY_LOGGERS = ("onnxscript", "onnx_ir", "torch.onnx")


def write_onnx(program: torch.export.ExportedProgram, path: Path, *, input_names: tuple[str, ...],
               output_names: tuple[str, ...], opset: int, tensorrt: bool = False,
               metadata: dict[str, str] | None = None) -> Path:
    """``program`` as an ONNX file at ``path`` (opset ``opset``), its inputs and outputs named as given; a ValueError
    naming the opset when the file written is not valid at that opset (engine/export/onnx_opset.py)."""
    import onnx

    table = None
    if tensorrt:
        from .tensorrt import translation_table

        table = translation_table()
    with quieter(CHATTY_LOGGERS):
        onnx_program = torch.onnx.export(program, dynamo=True, opset_version=opset, input_names=list(input_names),
                                         output_names=list(output_names), custom_translation_table=table,
                                         optimize=True, verbose=False)
    model = fit_opset(onnx_program.model_proto, opset)
    for key, value in (metadata or {}).items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, str(value)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path))
    check_opset(path, opset)
    return path


@contextlib.contextmanager
def quieter(names: tuple[str, ...], level: int = logging.ERROR):
    """The loggers ``names`` at ``level`` or above while the block runs."""
    loggers = [logging.getLogger(name) for name in names]
    saved = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(max(level, logger.getEffectiveLevel()))
    try:
        yield
    finally:
        for logger, old in zip(loggers, saved):
            logger.setLevel(old)


class OnnxRunner:
    """An onnxruntime session of an ONNX file, called like the PyTorch detector: tensors in, tensors out.

    On a CUDA ``device`` it asks for onnxruntime's CUDA provider (onnxruntime-gpu) with TF32 off, falling back to
    the CPU provider when the installed onnxruntime has none (logged)."""

    def __init__(self, path: Path, *, device: torch.device):
        import onnxruntime

        providers = ["CPUExecutionProvider"]
        if device.type == "cuda":
            if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
                providers.insert(0, ("CUDAExecutionProvider", {"device_id": device.index or 0, "use_tf32": 0}))
            else:
                log.warning("onnxruntime has no CUDA provider here (pip install onnxruntime-gpu): the parity check "
                            "runs the ONNX file on the CPU")
        self.path = path
        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3  # errors only: its warnings about unused initializers are noise here
        try:
            self.session = onnxruntime.InferenceSession(str(path), sess_options=options, providers=providers)
        except Exception as error:  # onnxruntime raises its own types, e.g. for a kernel it lacks (float16 on the CPU)
            raise ValueError(
                f"onnxruntime ({', '.join(p if isinstance(p, str) else p[0] for p in providers)}) cannot load {path}, "
                f"so it could not be checked: {str(error).strip()[:500]}. The file is written; "
                f"{what_to_try(path)}") from error
        self.input_names = [i.name for i in self.session.get_inputs()]

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if len(inputs) != len(self.input_names):
            raise ValueError(f"the ONNX file takes {len(self.input_names)} inputs ({', '.join(self.input_names)}), "
                             f"got {len(inputs)}")
        feed = {name: tensor.detach().cpu().numpy() for name, tensor in zip(self.input_names, inputs)}
        try:
            outputs = self.session.run(None, feed)
        except Exception as error:  # e.g. a kernel this onnxruntime lacks (float16 ones on the CPU provider)
            raise ValueError(
                f"onnxruntime ({', '.join(self.session.get_providers())}) could not run the exported file, so it "
                f"could not be checked: {str(error).strip()[:500]}. The file is written; {what_to_try(self.path)}") \
                from error
        return tuple(torch.from_numpy(np.asarray(output)) for output in outputs)


def what_to_try(path: Path) -> str:
    """Advice for a file onnxruntime could not load or run: onnxruntime's CPU provider lacks most float16 kernels,
    so a float16 file is checked in fp32 or on a GPU; a float32 file it should run, unless it is older than the
    file's opset."""
    import onnx
    import onnxruntime

    model = onnx.load(str(path), load_external_data=False)
    if any(i.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16 for i in model.graph.input):
        return "to check it here, export dtype=fp32, or on a GPU with onnxruntime-gpu installed (device=cuda)"
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    return (f"a float32 file should load: onnxruntime {onnxruntime.__version__} may be older than its opset "
            f"({opset}): export with the default opset, or install a newer onnxruntime")
