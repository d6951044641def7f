"""The deformable attention as TensorRT's ``MultiscaleDeformableAttnPlugin_TRT`` node, for msda_node=tensorrt.

TensorRT's ONNX parser finds the plugin by op_type, ``plugin_version`` ("1"; "2" has the same inputs) and
``plugin_namespace`` ("": TensorRT's own); the domain "trt" only satisfies ONNX. The plugin takes value
(N, S, M, D) float32 or float16, spatial_shapes (L, 2) int32 (H_l, W_l), level_start_index (L,) int32,
sampling_locations (N, Lq, M, L, P, 2) (x, y) in [0, 1] and softmaxed attention_weights (N, Lq, M, L, P) in value's
dtype, and returns (N, Lq, M, D). ``translate_attention`` replaces each msda::attention node (model.msda=triton) with
it; no runtime here implements it, so such a file is checked for its graph only.
"""

from __future__ import annotations

import onnx
import torch
from onnx.defs import OpSchema
from onnxscript import ir
from onnxscript import opset18 as op
from onnxscript.values import Op, Opset

PLUGIN_NAME = "MultiscaleDeformableAttnPlugin_TRT"
PLUGIN_VERSION = "1"
PLUGIN_DOMAIN = "trt"
PLUGIN_INPUTS = ("value", "spatial_shapes", "level_start_index", "sampling_locations", "attention_weights")


def _plugin_schema() -> OpSchema:
    """The node's signature, for onnxscript's graph builder (not registered with onnx: nothing else needs it)."""
    parameter = OpSchema.FormalParameter
    inputs = [
        parameter(name, "tensor(int32)" if name in ("spatial_shapes", "level_start_index") else "T")
        for name in PLUGIN_INPUTS
    ]
    attributes = [
        OpSchema.Attribute(name, OpSchema.AttrType.STRING, description, required=False)
        for name, description in (
            ("plugin_version", "the plugin's version in TensorRT's registry"),
            ("plugin_namespace", "the plugin's namespace; empty for TensorRT's"),
        )
    ]
    return OpSchema(
        PLUGIN_NAME,
        PLUGIN_DOMAIN,
        1,
        inputs=inputs,
        outputs=[parameter("output", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], "value's type")],
        attributes=attributes,
    )


_PLUGIN = Op(Opset(PLUGIN_DOMAIN, 1), PLUGIN_NAME, _plugin_schema())


def _as_vector(size):
    """A (1,) int64 tensor of one level size: a constant when the export fixed it, else the traced scalar."""
    if isinstance(size, int):
        return op.Constant(value_ints=[size])
    return op.Reshape(size, op.Constant(value_ints=[1]))


def translate_attention(value, sampling_locations, attention_weights, flat_levels, deterministic):
    """msda::attention(value, sampling_locations, attention_weights, [H_0, W_0, H_1, ...], deterministic) as the
    plugin node (``deterministic`` concerns only the backward). The host-integer level sizes become the two int32
    tensors; the float inputs are cast to value's dtype (the model computes sampling locations in float32)."""
    spatial_shapes = op.Reshape(
        op.Concat(*[_as_vector(size) for size in flat_levels], axis=0), op.Constant(value_ints=[-1, 2])
    )  # (L, 2) int64
    level_sizes = op.ReduceProd(spatial_shapes, op.Constant(value_ints=[1]), keepdims=0)  # (L,)
    level_start_index = op.CumSum(level_sizes, op.Constant(value_int=0), exclusive=1)  # 0, S_0, S_0 + S_1, ...
    output = _PLUGIN(
        value,
        op.Cast(spatial_shapes, to=onnx.TensorProto.INT32),
        op.Cast(level_start_index, to=onnx.TensorProto.INT32),
        op.CastLike(sampling_locations, value),
        op.CastLike(attention_weights, value),
        plugin_version=PLUGIN_VERSION,
        plugin_namespace="",
    )
    # The plugin's output type and shape, for readers of the graph (ONNX cannot infer a foreign node's).
    output.dtype = value.dtype
    if value.shape is not None and sampling_locations.shape is not None:
        output.shape = ir.Shape([value.shape[0], sampling_locations.shape[1], value.shape[2], value.shape[3]])
    return op.Reshape(output, op.Constant(value_ints=[0, 0, -1]))  # (N, Lq, M * D)


def translation_table() -> dict:
    """torch.onnx.export's custom_translation_table for msda_node=tensorrt."""
    import msda  # noqa: F401  (registers msda::attention)

    return {torch.ops.msda.attention.default: translate_attention}
