"""An ONNX graph valid at the opset asked for, and the check that it is, before the file is run.

torch.onnx's exporter builds the graph at opset 18 and converts it down for an older ``opset``, but its
optimization passes run after that conversion and write ``Split`` in opset 18's form (the ``num_outputs``
attribute), which older opsets do not have: onnxruntime and onnx's checker refuse such a file. ``fit_opset`` puts
those nodes back into the form of Split-13 (the sizes of the parts as a second input). ``check_opset`` then makes
sure the file declares the opset asked for and passes onnx's checker, so that an opset the tool chain cannot
write is a message naming ``opset``, not a file that no runtime loads.
"""

from __future__ import annotations

from pathlib import Path

from engine.config.export_schema import DEFAULT_OPSET

# The first opset whose Split takes num_outputs (the number of equal parts) instead of the parts' sizes.
SPLIT_NUM_OUTPUTS_OPSET = 18


def fit_opset(model, opset: int):
    """``model`` (an onnx.ModelProto, changed in place and returned) with every node in ``opset``'s form."""
    if opset < SPLIT_NUM_OUTPUTS_OPSET:
        _split_sizes_as_input(model, opset)
    return model


def _split_sizes_as_input(model, opset: int) -> None:
    """Each Split with ``num_outputs`` gets the sizes of its parts as an int64 initializer instead: opset 18's
    rule (equal parts, the last smaller when the size does not divide) computed from the input's static size."""
    import numpy as np
    from onnx import helper, numpy_helper

    graph = model.graph
    sizes_of = static_shapes(graph)
    for node in graph.node:
        if node.op_type != "Split" or node.domain not in ("", "ai.onnx"):
            continue
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if "num_outputs" not in attributes:
            continue
        parts, axis = int(attributes["num_outputs"]), int(attributes.get("axis", 0))
        shape = sizes_of.get(node.input[0])
        size = shape[axis] if shape is not None and -len(shape) <= axis < len(shape) else None
        if size is None:
            raise ValueError(f"opset={opset}: the graph splits {node.input[0]!r} along a dimension whose size is known "
                             f"only when it runs, which Split before opset {SPLIT_NUM_OUTPUTS_OPSET} cannot express: "
                             f"export with opset={SPLIT_NUM_OUTPUTS_OPSET} or later")
        part = -(-size // parts)
        name = f"{node.name or node.output[0]}_sizes"
        graph.initializer.append(numpy_helper.from_array(
            np.array([part] * (parts - 1) + [size - part * (parts - 1)], dtype=np.int64), name))
        kept = [a for a in node.attribute if a.name != "num_outputs"]
        del node.attribute[:]
        node.attribute.extend(kept)
        del node.input[1:]
        node.input.append(name)


def static_shapes(graph) -> dict[str, list[int | None]]:
    """name -> shape (None for a dimension known only at run time) of the graph's initializers, inputs, outputs
    and the values it records shapes for."""
    shapes: dict[str, list[int | None]] = {t.name: list(t.dims) for t in graph.initializer}
    for value in (*graph.input, *graph.output, *graph.value_info):
        tensor = value.type.tensor_type
        if value.name not in shapes and tensor.HasField("shape"):
            shapes[value.name] = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
    return shapes


def check_opset(path: Path, opset: int) -> None:
    """The file at ``path`` declares ``opset`` for ONNX's own operators and passes onnx's checker; else a ValueError
    naming the opset (the file is left where it is)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    declared = [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")]
    if declared != [opset]:
        raise ValueError(f"opset={opset}: the ONNX exporter wrote opset {declared} instead, so {path} is not the file "
                         f"asked for; export with another opset (the default is {DEFAULT_OPSET})")
    try:
        onnx.checker.check_model(str(path))
    except onnx.checker.ValidationError as error:
        raise ValueError(f"opset={opset}: {path} is not a valid ONNX file at that opset, and runtimes would refuse it "
                         f"({str(error).strip().splitlines()[0]}); export with another opset (the default is "
                         f"{DEFAULT_OPSET})") from error
