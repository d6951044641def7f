"""format=onnx: the traced detector as an ONNX file, and the onnxruntime session the parity check runs it with.

torch.onnx.export's dynamo exporter translates the ExportedProgram, so its symbolic sizes become dynamic axes (the
TorchScript exporter traces the level sizes as tensors, which the attention refuses)."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import numpy as np
import torch

from engine.config.export_schema import DEFAULT_OPSET

log = logging.getLogger(__name__)
# The first opset whose Split takes num_outputs (the number of equal parts) instead of the parts' sizes.
SPLIT_NUM_OUTPUTS_OPSET = 18


def write_onnx(
    program: torch.export.ExportedProgram,
    path: Path,
    *,
    input_names: tuple[str, ...],
    output_names: tuple[str, ...],
    opset: int,
    tensorrt: bool = False,
    metadata: dict[str, object] | None = None,
) -> Path:
    """``program`` as an ONNX file at ``path``, ``metadata`` (as strings) in its metadata_props; a ValueError
    naming the opset when the file is not valid at ``opset`` (check_opset)."""
    import onnx

    table = None
    if tensorrt:
        from .tensorrt import translation_table

        table = translation_table()
    with quieter():
        onnx_program = torch.onnx.export(
            program,
            dynamo=True,
            opset_version=opset,
            input_names=list(input_names),
            output_names=list(output_names),
            custom_translation_table=table,
            optimize=True,
            verbose=False,
        )
    model = fit_opset(onnx_program.model_proto, opset)
    for key, value in (metadata or {}).items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, str(value)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path))
    check_opset(path, opset)
    return path


@contextlib.contextmanager
def quieter():
    """The ONNX tool chain's loggers (each optimization step at INFO) at ERROR or above while the block runs."""
    loggers = [logging.getLogger(name) for name in ("onnxscript", "onnx_ir", "torch.onnx")]
    saved = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(max(logging.ERROR, logger.getEffectiveLevel()))
    try:
        yield
    finally:
        for logger, old in zip(loggers, saved):
            logger.setLevel(old)


def fit_opset(model, opset: int):
    """``model`` (an onnx.ModelProto, changed in place and returned) with every node in ``opset``'s form.

    torch.onnx converts its opset-18 graph down to ``opset`` but then optimizes it, writing Split with opset 18's
    ``num_outputs``, which older opsets refuse: each such Split gets its parts' sizes as a second input instead
    (opset 18's rule: equal parts, the last smaller)."""
    from onnx import numpy_helper

    if opset >= SPLIT_NUM_OUTPUTS_OPSET:
        return model
    graph = model.graph
    # name -> shape (None for a dimension known only at run time) of every value the graph records a shape for
    shapes: dict[str, list[int | None]] = {t.name: list(t.dims) for t in graph.initializer}
    for value in (*graph.input, *graph.output, *graph.value_info):
        tensor = value.type.tensor_type
        if value.name not in shapes and tensor.HasField("shape"):
            shapes[value.name] = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
    for node in graph.node:
        num_outputs = next((a for a in node.attribute if a.name == "num_outputs"), None)
        if node.op_type != "Split" or node.domain not in ("", "ai.onnx") or num_outputs is None:
            continue
        parts, axis = num_outputs.i, next((a.i for a in node.attribute if a.name == "axis"), 0)
        shape = shapes.get(node.input[0])
        size = shape[axis] if shape is not None and -len(shape) <= axis < len(shape) else None
        if size is None:
            raise ValueError(
                f"opset={opset}: the graph splits {node.input[0]!r} along a dimension whose size is known "
                f"only when it runs, which Split before opset {SPLIT_NUM_OUTPUTS_OPSET} cannot express: "
                f"export with opset={SPLIT_NUM_OUTPUTS_OPSET} or later"
            )
        part = -(-size // parts)
        name = f"{node.name or node.output[0]}_sizes"
        graph.initializer.append(
            numpy_helper.from_array(np.array([part] * (parts - 1) + [size - part * (parts - 1)], dtype=np.int64), name)
        )
        node.attribute.remove(num_outputs)
        del node.input[1:]
        node.input.append(name)
    return model


def check_opset(path: Path, opset: int) -> None:
    """ValueError naming the opset unless the file at ``path`` declares ``opset`` and passes onnx's checker."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    declared = [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")]
    if declared != [opset]:
        raise ValueError(
            f"opset={opset}: the ONNX exporter wrote opset {declared} instead, so {path} is not the file "
            f"asked for; export with another opset (the default is {DEFAULT_OPSET})"
        )
    try:
        onnx.checker.check_model(str(path))
    except onnx.checker.ValidationError as error:
        raise ValueError(
            f"opset={opset}: {path} is not a valid ONNX file at that opset, and runtimes would refuse it "
            f"({str(error).strip().splitlines()[0]}); export with another opset (the default is "
            f"{DEFAULT_OPSET})"
        ) from error


class OnnxRunner:
    """An onnxruntime session of an ONNX file, called like the PyTorch detector: tensors in, tensors out. On CUDA
    it asks for the CUDA provider with TF32 off, else (logged) runs on the CPU."""

    def __init__(self, path: Path, *, device: torch.device):
        import onnxruntime

        providers = ["CPUExecutionProvider"]
        if device.type == "cuda":
            if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
                providers.insert(0, ("CUDAExecutionProvider", {"device_id": device.index or 0, "use_tf32": 0}))
            else:
                log.warning(
                    "onnxruntime has no CUDA provider here (pip install onnxruntime-gpu): the parity check "
                    "runs the ONNX file on the CPU"
                )
        self.path = path
        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3  # errors only: its warnings about unused initializers are noise here
        try:
            self.session = onnxruntime.InferenceSession(str(path), sess_options=options, providers=providers)
        except Exception as error:  # onnxruntime raises its own types, e.g. for a kernel it lacks (float16 on the CPU)
            raise ValueError(
                f"onnxruntime ({', '.join(p if isinstance(p, str) else p[0] for p in providers)}) cannot load {path}, "
                f"so it could not be checked: {str(error).strip()[:500]}. The file is written; "
                f"{what_to_try(path)}"
            ) from error
        self.input_names = [i.name for i in self.session.get_inputs()]

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if len(inputs) != len(self.input_names):
            raise ValueError(
                f"the ONNX file takes {len(self.input_names)} inputs ({', '.join(self.input_names)}), got {len(inputs)}"
            )
        feed = {name: tensor.detach().cpu().numpy() for name, tensor in zip(self.input_names, inputs)}
        try:
            outputs = self.session.run(None, feed)
        except Exception as error:  # e.g. a kernel this onnxruntime lacks (float16 ones on the CPU provider)
            raise ValueError(
                f"onnxruntime ({', '.join(self.session.get_providers())}) could not run the exported file, so it "
                f"could not be checked: {str(error).strip()[:500]}. The file is written; {what_to_try(self.path)}"
            ) from error
        return tuple(torch.from_numpy(np.asarray(output)) for output in outputs)


def what_to_try(path: Path) -> str:
    """Advice for a file onnxruntime could not load or run (its CPU provider lacks most float16 kernels)."""
    import onnx
    import onnxruntime

    model = onnx.load(str(path), load_external_data=False)
    if any(i.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16 for i in model.graph.input):
        return "to check it here, export dtype=fp32, or on a GPU with onnxruntime-gpu installed (device=cuda)"
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    return (
        f"a float32 file should load: onnxruntime {onnxruntime.__version__} may be older than its opset "
        f"({opset}): export with the default opset, or install a newer onnxruntime"
    )
