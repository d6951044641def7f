"""msda as a PyTorch operator: torch.library.opcheck, and torch.compile tracing through it with no graph break.

Without a GPU the Triton kernels run under the interpreter (tests/conftest.py), so this is what CI checks
of the registration: schema, fake (meta) implementation, autograd registration, dynamic shapes.
"""

import os

import pytest
import torch
from helpers import MSDA_DEVICES, msda_inputs, rel_err

import msda

OPCHECK_SHAPES = [
    pytest.param(dict(D=8), id="two-levels"),
    pytest.param(dict(Lq=67, N=2, D=5, M=3, P=3), id="ragged-odd-D"),
    pytest.param(dict(levels=[(5, 7), (3, 4), (1, 1)], D=4, loc_low=-0.3, loc_high=1.3), id="L3-outside"),
]


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(4321)


def _op_args(gen, device, dtype, **shape):
    value, shapes, loc, weights = msda_inputs(gen, dtype=dtype, device=device, **shape)
    flat_levels = [int(v) for v in shapes.flatten()]
    return value, loc, weights, flat_levels


@pytest.mark.parametrize("device", MSDA_DEVICES)
@pytest.mark.parametrize("shape", OPCHECK_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck_forward_and_backward(gen, device, shape, dtype):
    value, loc, weights, flat_levels = _op_args(gen, device, dtype, **shape)
    args = (value.requires_grad_(), loc.requires_grad_(), weights.requires_grad_(), flat_levels, False)
    torch.library.opcheck(msda.attention_op, args)
    grad_output = torch.randn(
        value.shape[0], loc.shape[1], value.shape[2] * value.shape[3], generator=gen, dtype=torch.float64
    ).to(device, dtype)
    backward_args = (grad_output, value.detach(), loc.detach(), weights.detach(), flat_levels, False)
    torch.library.opcheck(torch.ops.msda.attention_backward.default, backward_args)


@pytest.mark.parametrize("device", MSDA_DEVICES)
def test_opcheck_empty_batch(gen, device):
    value, loc, weights, flat_levels = _op_args(gen, device, torch.float32, D=4)
    args = (value[:0].requires_grad_(), loc[:0].requires_grad_(), weights[:0].requires_grad_(), flat_levels, False)
    torch.library.opcheck(msda.attention_op, args)


def _compiled_matches_eager(fn, inputs, *, fullgraph):
    """fn compiled (aot_eager) gives eager's output and gradients."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=fullgraph, backend="aot_eager")
    results = []
    for f in (fn, compiled):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        out = f(*leaves)
        grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
        results.append((out, *grads))
    for name, a, b in zip(("output", "grad_value", "grad_loc", "grad_weight"), *results):
        assert rel_err(b, a) < 1e-12, name


@pytest.mark.parametrize("impl", ["triton", "pytorch"])
@pytest.mark.parametrize("layout", ["tensor", "host ints"])
def test_compile_traces_the_op(gen, impl, layout):
    if impl == "triton" and os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("Triton needs a GPU or the interpreter")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    value, shapes, loc, weights = msda_inputs(gen, D=6, Lq=7, device=device)
    # A sequence of ints (what the model passes) gives one graph; a tensor's values are data, so reading
    # them is a graph break, after which the op is traced with the layout as constants.
    spatial_shapes = shapes.cpu() if layout == "tensor" else [tuple(int(v) for v in hw) for hw in shapes]

    def fn(v, l, w):
        return msda.multi_scale_deformable_attention(v, spatial_shapes, None, l, w, impl=impl)

    _compiled_matches_eager(fn, (value, loc, weights), fullgraph=layout == "host ints")


def test_dynamic_shapes_propagate_through_the_op(gen):
    """Compiled once with dynamic shapes, a second level layout of other sizes reuses the graph."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    impl = "triton" if (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1") else "pytorch"

    def fn(v, l, w, levels):
        return msda.multi_scale_deformable_attention(v, levels, None, l, w, impl=impl)

    compiled = torch.compile(fn, fullgraph=True, backend=counter, dynamic=True)
    for levels in ([(6, 4), (3, 2)], [(9, 7), (5, 4)], [(12, 10), (6, 5)]):
        value, _shapes, loc, weights = msda_inputs(gen, D=4, Lq=5, levels=levels, device=device)
        leaves = [t.requires_grad_() for t in (value, loc, weights)]
        out = compiled(*leaves, levels)
        expected = msda.multi_scale_deformable_attention(value, levels, None, loc, weights, impl="pytorch")
        assert out.shape == expected.shape and rel_err(out, expected) < 1e-12
        out.sum().backward()
    assert counter.frame_count == 1, f"recompiled {counter.frame_count - 1} times for new level sizes"


@pytest.mark.parametrize("device", MSDA_DEVICES)
def test_deterministic_follows_the_global_switch(gen, device, monkeypatch):
    """deterministic=None reads torch.are_deterministic_algorithms_enabled(); the flag reaches the backward."""
    seen = []
    real_backward = msda.ops._backward_impl  # what the eager Function and the registered op both call

    def spy(*args):
        seen.append(args[-1])
        return real_backward(*args[:-1], False)  # the atomic kernel: only the flag's route is checked here

    monkeypatch.setattr(msda.ops, "_backward_impl", spy)
    value, shapes, loc, weights = msda_inputs(gen, D=4, device=device)
    for switch, explicit in ((False, None), (True, None), (False, True), (True, False)):
        torch.use_deterministic_algorithms(switch)
        try:
            leaves = [t.detach().clone().requires_grad_() for t in (value, loc, weights)]
            out = msda.multi_scale_deformable_attention(
                leaves[0], shapes, None, leaves[1], leaves[2], impl="triton", deterministic=explicit
            )
            out.sum().backward()
        finally:
            torch.use_deterministic_algorithms(False)
    assert seen == [False, True, True, False]
