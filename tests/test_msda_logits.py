"""msda with the attention weights' softmax inside the kernels (weights_are_logits=True, msda/logits_op.py).

Ground truth: torch.softmax over each query's L*P logits, then the grid_sample reference, in fp64; the logits'
gradient through autograd. Every grad_value scheme of both kernel families on the shapes every kernel is checked
on (KERNEL_SHAPES), through the launchers; then the public op: fp32, reduced precision, empty batches, gradcheck,
the deterministic mode, opcheck and torch.compile.
"""

import pytest
import torch
from helpers import KERNEL_SHAPES, MSDA_DEVICES, kernel_inputs, kernel_reference, rel_err

import msda
from msda import launch
from msda.reference import multi_scale_deformable_attention_reference

# (forward's kernel family, backward keyword arguments of launch.backward)
BACKWARDS = [
    pytest.param("classic", dict(scheme="fused"), id="fused"),
    pytest.param("classic", dict(scheme="split"), id="split"),
    pytest.param("classic", dict(scheme="gather"), id="gather"),
    pytest.param("classic", dict(scheme="hybrid", configs={"hybrid_split": 10}), id="hybrid"),
    pytest.param("classic", dict(deterministic=True), id="deterministic-gather"),
    pytest.param("grouped", dict(kernels="grouped", scheme="fused"), id="grouped-fused"),
    pytest.param("grouped", dict(kernels="grouped", scheme="cells", deterministic=True), id="grouped-cells-sorted"),
]
NAMES = ("output", "grad_value", "grad_loc", "grad_logits")


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(91)


def softmax_lp(logits: torch.Tensor) -> torch.Tensor:
    """(N, Lq, M, L, P) logits -> weights softmaxed over each (query, head)'s L*P samples."""
    return torch.softmax(logits.flatten(-2), -1).view_as(logits)


def logits_inputs(gen, scale=2.0, **shape):
    """kernel_inputs with the weights replaced by logits (normal, times ``scale``) in the weights' dtype."""
    levels, value, loc, weights, grad_out = kernel_inputs(gen, **shape)
    logits = torch.randn(weights.shape, generator=gen, dtype=torch.float64) * scale
    return levels, value, loc, logits.to(weights.device, weights.dtype), grad_out


def logits_reference(levels, value, loc, logits, grad_out):
    """Output and gradients (value, locations, logits) of softmax + the grid_sample reference, in fp64."""
    leaves = [t.detach().double().requires_grad_() for t in (value, loc, logits)]
    out = multi_scale_deformable_attention_reference(leaves[0], list(levels), leaves[1], softmax_lp(leaves[2]))
    return (out.detach(), *torch.autograd.grad(out, leaves, grad_out.double()))


def launcher_results(inputs, family, backward_kwargs):
    levels, value, loc, logits, grad_out = inputs
    stats = launch.softmax_stats_buffer(value, loc)
    out = launch.forward(value, levels, loc, logits, kernels=family, softmax_stats=stats)
    grads = launch.backward(grad_out, value, levels, loc, logits, softmax_stats=stats, output=out, **backward_kwargs)
    return (out, *grads)


def assert_close(results, expected, rtol, inputs):
    like = (inputs[1], inputs[1], inputs[2], inputs[3])  # output in value's dtype, each gradient in its input's
    for name, a, b, t in zip(NAMES, results, expected, like):
        assert a.dtype == t.dtype and a.shape == (b.shape if name == "output" else t.shape), name
        assert torch.isfinite(a).all(), name
        assert rel_err(a, b) < rtol, f"{name}: relative error {rel_err(a, b):.3e} >= {rtol}"


# ------------------------------------------------------------------------------------------------
# the launchers: every scheme and family against softmax + the reference
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", MSDA_DEVICES)
@pytest.mark.parametrize("shape", KERNEL_SHAPES)
@pytest.mark.parametrize("family,kwargs", BACKWARDS)
def test_launchers_match_softmax_and_reference_fp64(gen, device, shape, family, kwargs):
    inputs = logits_inputs(gen, device=device, **shape)
    assert_close(launcher_results(inputs, family, kwargs), logits_reference(*inputs), 1e-10, inputs)


@pytest.mark.parametrize("device", MSDA_DEVICES)
@pytest.mark.parametrize("family,kwargs", BACKWARDS)
def test_launchers_match_softmax_and_reference_fp32(gen, device, family, kwargs):
    inputs = logits_inputs(gen, N=2, Lq=20, D=24, dtype=torch.float32, loc_low=-0.1, loc_high=1.1, device=device)
    assert_close(launcher_results(inputs, family, kwargs), logits_reference(*inputs), 1e-5, inputs)


@pytest.mark.parametrize("device", MSDA_DEVICES)
def test_large_and_equal_logits(gen, device):
    """Logits far from 0 (the max is subtracted before exp), nearly one-hot weights, and all equal (uniform weights).

    A logit's gradient a * (dL/da - sum_j a_j dL/da_j) takes that sum from the output (msda/kernels.py), which rounds
    otherwise than the reference's sum of the weight gradients: where the weights are nearly one-hot the two terms
    cancel, so the logits' gradient is compared to the size of the weights' gradient, which is what both round."""
    levels, value, loc, logits, grad_out = logits_inputs(gen, Lq=6, device=device)
    for case in (logits * 40 + 300, torch.full_like(logits, -7.5)):
        inputs = (levels, value, loc, case, grad_out)
        results = launcher_results(inputs, "classic", dict(scheme="fused"))
        expected = logits_reference(*inputs)
        assert_close(results[:3], expected[:3], 1e-10, inputs)
        grad_weights = kernel_reference(levels, value, loc, softmax_lp(case), grad_out)[3]
        assert (results[3] - expected[3]).abs().max() <= 1e-12 * grad_weights.abs().max()


@pytest.mark.parametrize("device", MSDA_DEVICES)
def test_softmax_stats_are_the_max_and_the_sum(gen, device):
    levels, value, loc, logits, _ = logits_inputs(gen, N=2, Lq=5, device=device)
    for family in ("classic", "grouped"):
        stats = launch.softmax_stats_buffer(value, loc)
        launch.forward(value, levels, loc, logits, kernels=family, softmax_stats=stats)
        flat = logits.flatten(-2)
        top = flat.max(-1).values
        torch.testing.assert_close(stats[..., 0], top, rtol=0, atol=0)
        torch.testing.assert_close(stats[..., 1], (flat - top[..., None]).exp().sum(-1), rtol=1e-12, atol=0)


@pytest.mark.parametrize("device", MSDA_DEVICES)
def test_backward_of_logits_needs_the_output(gen, device):
    levels, value, loc, logits, grad_out = logits_inputs(gen, device=device)
    stats = launch.softmax_stats_buffer(value, loc)
    with pytest.raises(ValueError, match="a backward of logits takes the forward's output"):
        launch.backward(grad_out, value, levels, loc, logits, softmax_stats=stats)


# ------------------------------------------------------------------------------------------------
# the public op
# ------------------------------------------------------------------------------------------------
def op_results(impl, levels, value, loc, logits, grad_out, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in (value, loc, logits)]
    out = msda.multi_scale_deformable_attention(
        leaves[0], levels, None, leaves[1], leaves[2], impl=impl, weights_are_logits=True, **kwargs
    )
    return (out.detach(), *torch.autograd.grad(out, leaves, grad_out.to(out.dtype)))


@pytest.mark.parametrize("device", MSDA_DEVICES)
@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize(
    "shape",
    [
        pytest.param(dict(D=30, Lq=9, P=3), id="D30-P3"),
        pytest.param(dict(levels=((5, 7), (3, 4), (1, 1)), D=12, N=2, M=3, Lq=11), id="L3-ragged"),
    ],
)
def test_op_matches_softmax_and_reference(gen, device, dtype, rtol, shape):
    inputs = logits_inputs(gen, dtype=dtype, device=device, loc_low=-0.2, loc_high=1.2, **shape)
    assert_close(op_results("triton", *inputs), logits_reference(*inputs), rtol, inputs)


@pytest.mark.parametrize("device", MSDA_DEVICES)
def test_reference_impl_softmaxes_then_runs_the_reference(gen, device):
    """impl="pytorch" with logits computes exactly what the caller's softmax then the reference computed."""
    levels, value, loc, logits, _ = logits_inputs(gen, dtype=torch.float32, device=device)
    got = msda.multi_scale_deformable_attention(
        value, levels, None, loc, logits, impl="pytorch", weights_are_logits=True
    )
    expected = msda.multi_scale_deformable_attention(value, levels, None, loc, softmax_lp(logits), impl="pytorch")
    assert torch.equal(got, expected)


@pytest.mark.parametrize("device", MSDA_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reduced_precision_with_float32_logits(gen, device, dtype):
    """2-byte value, fp32 locations and logits (what the model passes under autocast): within the dtype's rounding of
    the exact result on the rounded inputs. The logits' gradient uses the output rounded to the dtype."""
    levels, value, loc, logits, grad_out = logits_inputs(gen, N=2, Lq=24, D=32, device=device)
    low = (levels, value.to(dtype), loc.float(), logits.float(), grad_out.to(dtype))
    exact = logits_reference(levels, *(t.double() for t in low[1:]))
    results = op_results("triton", *low)
    assert [r.dtype for r in results] == [dtype, dtype, torch.float32, torch.float32]
    atol = {torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    for name, r, x in zip(NAMES, results, exact):
        err = (r.double().cpu() - x.cpu()).abs().max().item()
        assert err <= atol * x.abs().max().item(), f"{name}: {err:.3e}"


@pytest.mark.parametrize("device", MSDA_DEVICES)
@pytest.mark.parametrize("N,Lq", [(0, 5), (2, 0)])
def test_empty_batch_or_queries(gen, device, N, Lq):
    levels, value, loc, logits, grad_out = logits_inputs(gen, N=2, Lq=5, device=device)
    value, loc, logits, grad_out = value[:N], loc[:N, :Lq], logits[:N, :Lq], grad_out[:N, :Lq]
    for impl in ("triton", "pytorch"):
        out, *grads = op_results(impl, levels, value, loc, logits, grad_out)
        assert out.shape == (N, Lq, 2 * 8)
        for grad, t in zip(grads, (value, loc, logits)):
            assert grad.shape == t.shape and grad.dtype == t.dtype and not grad.any()


@pytest.mark.parametrize("device", MSDA_DEVICES)
def test_gradcheck(gen, device):
    # Tiny on purpose: every input element costs two interpreted launches.
    levels, value, loc, logits, _ = logits_inputs(
        gen, N=1, M=1, D=2, Lq=2, P=2, levels=((3, 2), (2, 2)), loc_low=-0.1, loc_high=1.1, device=device
    )
    inputs = [t.requires_grad_() for t in (value, loc, logits)]

    def fn(v, l, w):
        return msda.multi_scale_deformable_attention(v, levels, None, l, w, impl="triton", weights_are_logits=True)

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, nondet_tol=1e-12)


@pytest.mark.parametrize("device", MSDA_DEVICES)
def test_deterministic_is_bitwise_repeatable(gen, device):
    inputs = logits_inputs(gen, N=2, Lq=30, D=16, P=4, dtype=torch.float32, loc_low=-0.1, loc_high=1.1, device=device)
    runs = [op_results("triton", *inputs, deterministic=True) for _ in range(3)]
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert torch.equal(a, b)
    atomic = op_results("triton", *inputs, deterministic=False)
    for a, b in zip(runs[0], atomic):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("device", MSDA_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck(gen, device, dtype):
    levels, value, loc, logits, grad_out = logits_inputs(gen, N=2, Lq=7, D=5, M=3, P=3, dtype=dtype, device=device)
    flat_levels = [size for hw in levels for size in hw]
    args = (value.requires_grad_(), loc.requires_grad_(), logits.requires_grad_(), flat_levels, False)
    torch.library.opcheck(msda.attention_from_logits_op, args)
    out, stats = msda.attention_from_logits_op(*(t.detach() for t in args[:3]), flat_levels, False)
    backward_args = (grad_out, value.detach(), loc.detach(), logits.detach(), stats, out, flat_levels, False)
    torch.library.opcheck(torch.ops.msda.attention_from_logits_backward.default, backward_args)


@pytest.mark.parametrize("device", MSDA_DEVICES)
def test_compile_traces_the_op_in_one_graph(gen, device):
    levels, value, loc, logits, _ = logits_inputs(gen, D=6, Lq=7, device=device)

    def fn(v, l, w):
        return msda.multi_scale_deformable_attention(v, levels, None, l, w, impl="triton", weights_are_logits=True)

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    results = []
    for f in (fn, compiled):
        leaves = [t.detach().clone().requires_grad_() for t in (value, loc, logits)]
        out = f(*leaves)
        results.append((out, *torch.autograd.grad(out, leaves, torch.ones_like(out))))
    for name, a, b in zip(NAMES, *results):
        assert rel_err(b, a) < 1e-12, name


# ------------------------------------------------------------------------------------------------
# CUDA only
# ------------------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encoder_shape_on_gpu(dtype):
    """COCO's level layout with fewer queries, samples clustered around each query, float32 logits: the table's
    kernels against softmax + the fp64 reference, and the deterministic backward bitwise over 3 runs."""
    from msda.reference import off_cell_edges

    gen = torch.Generator(device="cuda").manual_seed(0)
    levels = ((100, 167), (50, 84), (25, 42), (13, 21))
    S = sum(h * w for h, w in levels)
    N, Lq, M, D, P = 1, 4099, 8, 32, 4
    value = torch.randn(N, S, M, D, device="cuda", generator=gen).to(dtype)
    ref_points = torch.rand(N, Lq, 1, 1, 1, 2, device="cuda", generator=gen)
    loc = (ref_points + 0.02 * torch.randn(N, Lq, M, 4, P, 2, device="cuda", generator=gen)).contiguous()
    logits = 2 * torch.randn(N, Lq, M, 4, P, device="cuda", generator=gen)
    grad_out = torch.randn(N, Lq, M * D, device="cuda", generator=gen).to(dtype)
    exact = logits_reference(levels, value, loc, logits, grad_out)
    away = off_cell_edges(levels, loc)  # float32 and fp64 may sample either side of a cell edge
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    for deterministic in (False, True):
        results = op_results("triton", levels, value, loc, logits, grad_out, deterministic=deterministic)
        for name, r, x in zip(NAMES, results, exact):
            if name == "grad_loc":
                r, x = r * away, x * away
            assert rel_err(r, x) < tolerance, f"deterministic={deterministic} {name}: {rel_err(r, x):.2e}"
    runs = [op_results("triton", levels, value, loc, logits, grad_out, deterministic=True) for _ in range(3)]
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert torch.equal(a, b)
