"""The deformable attention as TensorRT's multi-scale deformable attention plugin node, for msda_node=tensorrt.

TensorRT ships the plugin ``MultiscaleDeformableAttnPlugin_TRT`` in libnvinfer_plugin (added with TensorRT OSS
8.4.1 / the 22.05 containers; version "1" implements IPluginV2DynamicExt, deprecated since TensorRT 10.11, which
added version "2" on IPluginV3 with the same inputs, output and no attributes). Its ONNX parser builds a plugin
for a node it does not know from the node's op_type (the plugin's name) and its ``plugin_version`` and
``plugin_namespace`` attributes. The plugin takes, in this order:

    value               (N, S, M, D)        float32 or float16
    spatial_shapes      (L, 2) int32        (H_l, W_l) per level
    level_start_index   (L,) int32          offset of each level in S
    sampling_locations  (N, Lq, M, L, P, 2) value's dtype, normalized (x, y) in [0, 1]
    attention_weights   (N, Lq, M, L, P)    value's dtype, softmaxed
and returns (N, Lq, M, D) in value's dtype (its getOutputDimensions), which a Reshape makes (N, Lq, M * D),
what msda::attention returns. These are msda::attention's inputs: the model is exported with model.msda=triton,
so that each attention call is one msda::attention node in the traced graph, and ``translate_attention`` below
turns each into the plugin node; the level layout, which the op takes as host integers (symbolic sizes), becomes
the two int32 tensors computed from them, and the float inputs are cast to value's dtype (the plugin takes one
float type; the model computes sampling locations in float32).

No runtime here implements the node: an ONNX file with it is checked for its graph only (the nodes, their
inputs' types and shapes), never run. The node's domain is "trt" (ONNX needs a domain for an operator outside
its own); the attributes name the plugin's version 1 and the empty namespace TensorRT's own plugins live in.
"""

from __future__ import annotations

import onnx
from onnx.defs import OpSchema
from onnxscript import ir
from onnxscript import opset18 as op
from onnxscript.values import Opset

try:  # where onnxscript keeps Op; both places have it in the versions that torch 2.11+ installs
    from onnxscript._internal.values import Op
except ImportError:  # pragma: no cover - older onnxscript
    from onnxscript.values import Op

PLUGIN_NAME = "MultiscaleDeformableAttnPlugin_TRT"
PLUGIN_VERSION = "1"
PLUGIN_DOMAIN = "trt"
PLUGIN_INPUTS = ("value", "spatial_shapes", "level_start_index", "sampling_locations", "attention_weights")


def _plugin_schema() -> OpSchema:
    """The node's signature, for onnxscript's graph builder (not registered with onnx: nothing else needs it)."""
    parameter = OpSchema.FormalParameter
    inputs = [parameter(name, "tensor(int32)" if name in ("spatial_shapes", "level_start_index") else "T")
              for name in PLUGIN_INPUTS]
    attributes = [OpSchema.Attribute(name, OpSchema.AttrType.STRING, description, required=False)
                  for name, description in (("plugin_version", "the plugin's version in TensorRT's registry"),
                                            ("plugin_namespace", "the plugin's namespace; empty for TensorRT's"))]
    return OpSchema(PLUGIN_NAME, PLUGIN_DOMAIN, 1, inputs=inputs, outputs=[parameter("output", "T")],
                    type_constraints=[("T", ["tensor(float)", "tensor(float16)"], "value's type")],
                    attributes=attributes)


_PLUGIN = Op(Opset(PLUGIN_DOMAIN, 1), PLUGIN_NAME, _plugin_schema())


def _as_vector(size):
    """A (1,) int64 tensor of one level size: a constant when the export fixed it, else the traced scalar."""
    if isinstance(size, int):
        return op.Constant(value_ints=[size])
    return op.Reshape(size, op.Constant(value_ints=[1]))


def translate_attention(value, sampling_locations, attention_weights, flat_levels, deterministic):
    """msda::attention(value, sampling_locations, attention_weights, [H_0, W_0, H_1, ...], deterministic) as the
    plugin node; ``deterministic`` only concerns the backward, which an inference graph has not."""
    spatial_shapes = op.Reshape(op.Concat(*[_as_vector(size) for size in flat_levels], axis=0),
                                op.Constant(value_ints=[-1, 2]))  # (L, 2) int64
    level_sizes = op.ReduceProd(spatial_shapes, op.Constant(value_ints=[1]), keepdims=0)  # (L,)
    level_start_index = op.CumSum(level_sizes, op.Constant(value_int=0), exclusive=1)  # 0, S_0, S_0 + S_1, ...
    output = _PLUGIN(value, op.Cast(spatial_shapes, to=onnx.TensorProto.INT32),
                     op.Cast(level_start_index, to=onnx.TensorProto.INT32),
                     op.CastLike(sampling_locations, value), op.CastLike(attention_weights, value),
                     plugin_version=PLUGIN_VERSION, plugin_namespace="")
    # The plugin's output type and shape, for readers of the graph (ONNX cannot infer a foreign node's).
    output.dtype = value.dtype
    if value.shape is not None and sampling_locations.shape is not None:
        output.shape = ir.Shape([value.shape[0], sampling_locations.shape[1], value.shape[2], value.shape[3]])
    return op.Reshape(output, op.Constant(value_ints=[0, 0, -1]))  # (N, Lq, M * D)


def translation_table() -> dict:
    """torch.onnx.export's custom_translation_table for msda_node=tensorrt."""
    import torch

    import msda  # noqa: F401  (registers msda::attention)

    return {torch.ops.msda.attention.default: translate_attention}
