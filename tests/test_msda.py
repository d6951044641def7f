"""msda: Triton kernels (CPU interpreter without a GPU, real kernels on CUDA) against the grid_sample reference.

Forward and all three gradients are compared; inputs are drawn fresh from a seeded generator per test.
"""

import pytest
import torch
from helpers import MSDA_DEVICES, ORIGINAL_LEVELS, msda_inputs, rel_err

import msda
from msda.layout import level_start_index_from_shapes


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def run(impl, value, shapes, loc, weights, grad_out=None):
    """Output and (grad_value, grad_loc, grad_weight) of one implementation on leaf copies of the inputs."""
    leaves = [t.detach().clone().requires_grad_() for t in (value, loc, weights)]
    out = msda.multi_scale_deformable_attention(leaves[0], shapes, None, leaves[1], leaves[2], impl=impl)
    if grad_out is None:
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    grads = torch.autograd.grad(out, leaves, grad_out.to(out.device, out.dtype))
    return out.detach(), grads


def assert_matches_reference(inputs, rtol):
    out_t, grads_t = run("triton", *inputs)
    out_r, grads_r = run("pytorch", *inputs)
    for name, a, b in zip(("output", "grad_value", "grad_loc", "grad_weight"), (out_t, *grads_t), (out_r, *grads_r)):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.isfinite(a).all(), name
        assert rel_err(a, b) < rtol, f"{name}: relative error {rel_err(a, b):.3e} >= {rtol}"


# ------------------------------------------------------------------------------------------------
# forward and gradients against the reference, fp64 and fp32
# ------------------------------------------------------------------------------------------------
SHAPES = [
    pytest.param(dict(D=2), id="original-D2"),
    pytest.param(dict(D=30), id="original-D30"),
    pytest.param(dict(D=32), id="original-D32"),
    pytest.param(dict(D=48), id="original-D48"),
    pytest.param(dict(D=64), id="original-D64"),
    pytest.param(dict(D=71), id="original-D71"),
    pytest.param(dict(D=128, M=1, Lq=3), id="original-D128"),
    pytest.param(dict(levels=[(1, 1)], D=4, P=3), id="single-1x1-level"),
    pytest.param(dict(levels=[(7, 5)], D=8), id="L1"),
    pytest.param(dict(levels=[(5, 7), (3, 4), (2, 2), (1, 3), (1, 1)], D=8, P=2), id="L5"),
    pytest.param(dict(P=1, D=8), id="P1"),
    pytest.param(dict(P=8, D=8, M=1), id="P8"),
    pytest.param(dict(levels=[(4, 5), (2, 3), (1, 1)], P=3, D=8), id="L3-P3-not-power-of-2"),
    pytest.param(dict(Lq=67, N=2, D=16, M=3), id="ragged-query-block"),
    pytest.param(dict(Lq=9, loc_low=-0.6, loc_high=1.6, D=8), id="outside-unit-square"),
    pytest.param(dict(Lq=9, loc_low=-50.0, loc_high=50.0, D=8), id="far-outside"),
]


@pytest.mark.parametrize("device", MSDA_DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_matches_reference(gen, device, shape, dtype, rtol):
    assert_matches_reference(msda_inputs(gen, dtype=dtype, device=device, **shape), rtol)


@pytest.mark.parametrize("device", MSDA_DEVICES)
def test_points_on_borders_and_pixel_centres(gen, device):
    """Locations exactly on 0, 1, pixel centres and half a pixel outside: the floor/validity edge cases."""
    value, shapes, _, weights = msda_inputs(gen, Lq=8, P=4, D=8, device=device)
    _H, W = ORIGINAL_LEVELS[0]
    edges = torch.tensor([0.0, 1.0, 0.5 / W, 1 - 0.5 / W, -0.5 / W, 1 + 0.5 / W, 1.0 / W, 0.25], dtype=torch.float64)
    xs = edges[torch.randint(len(edges), (1, 8, 2, 2, 4), generator=gen)]
    ys = edges.flip(0)[torch.randint(len(edges), (1, 8, 2, 2, 4), generator=gen)]
    loc = torch.stack([xs, ys], dim=-1).to(device)
    assert_matches_reference((value, shapes, loc, weights), 1e-10)


@pytest.mark.parametrize("device", MSDA_DEVICES)
def test_a_nan_location_turns_only_its_query_and_head_nan(gen, device):
    """Triton: the head of the query with a NaN location turns NaN, nothing else is touched. The reference
    inherits grid_sample's handling, which differs by device: NaN on the CPU, a finite value on CUDA."""
    value, shapes, loc, weights = msda_inputs(gen, D=4, Lq=3, dtype=torch.float32, device=device)
    loc[0, 1, 0, 0, 0, 0] = float("nan")
    outs = {
        impl: msda.multi_scale_deformable_attention(value, shapes, None, loc, weights, impl=impl)
        for impl in ("triton", "pytorch")
    }
    head = slice(0, 4)  # query 1's NaN sample belongs to head 0
    untouched = torch.ones_like(outs["triton"], dtype=torch.bool)
    untouched[0, 1, head] = False
    assert torch.isnan(outs["triton"][0, 1, head]).all()
    if device == "cpu":
        assert torch.isnan(outs["pytorch"][0, 1, head]).all()
    for impl, out in outs.items():
        assert torch.isfinite(out[untouched]).all(), impl
    torch.testing.assert_close(outs["triton"][untouched], outs["pytorch"][untouched], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", MSDA_DEVICES)
def test_non_contiguous_inputs(gen, device):
    value, shapes, loc, weights = msda_inputs(gen, N=2, Lq=6, D=8, device=device)
    value_nc = value.transpose(0, 1).contiguous().transpose(0, 1)  # same values, permuted strides
    loc_nc = torch.stack([loc, torch.zeros_like(loc)], dim=-1)[..., 0]  # every other element of a buffer
    weights_nc = weights.permute(1, 0, 2, 3, 4).contiguous().permute(1, 0, 2, 3, 4)
    assert not (value_nc.is_contiguous() or loc_nc.is_contiguous() or weights_nc.is_contiguous())
    out_t, grads_t = run("triton", value_nc, shapes, loc_nc, weights_nc)
    out_r, grads_r = run("pytorch", value, shapes, loc, weights)
    assert rel_err(out_t, out_r) < 1e-10
    for a, b in zip(grads_t, grads_r):
        assert rel_err(a, b) < 1e-10


@pytest.mark.parametrize("device", MSDA_DEVICES)
def test_explicit_level_start_index_and_int32_shapes(gen, device):
    value, shapes, loc, weights = msda_inputs(gen, D=8, device=device)
    start = level_start_index_from_shapes(shapes)
    out_a = msda.multi_scale_deformable_attention(value, shapes.int(), start, loc, weights, impl="triton")
    out_b = msda.multi_scale_deformable_attention(value, shapes, None, loc, weights, impl="pytorch")
    assert rel_err(out_a, out_b) < 1e-10


@pytest.mark.parametrize("device", MSDA_DEVICES)
@pytest.mark.parametrize("N,Lq", [(0, 5), (2, 0)])
def test_empty_batch_or_queries(gen, device, N, Lq):
    value, shapes, loc, weights = msda_inputs(gen, N=max(N, 1), Lq=max(Lq, 1), D=8, device=device)
    value, loc, weights = value[:N], loc[:N, :Lq], weights[:N, :Lq]
    for impl in ("triton", "pytorch"):
        out, grads = run(impl, value, shapes, loc, weights)
        assert out.shape == (N, Lq, 2 * 8)
        for grad, inp in zip(grads, (value, loc, weights)):
            assert grad.shape == inp.shape and not grad.any()


# ------------------------------------------------------------------------------------------------
# reduced precision: the kernel's error (vs fp64) at most twice the reference's own error at that dtype
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", MSDA_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("loc_fp32", [True, False], ids=["loc-fp32", "loc-same-dtype"])
def test_reduced_precision(gen, device, dtype, loc_fp32):
    exact = msda_inputs(gen, N=2, Lq=40, D=32, M=2, dtype=torch.float64, device=device)
    value, shapes, loc, weights = exact
    loc_dtype = torch.float32 if loc_fp32 else dtype
    low = (value.to(dtype), shapes, loc.to(loc_dtype), weights.to(loc_dtype))
    grad_out = torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    # Ground truth: fp64 on exactly the rounded inputs both implementations see.
    out_64, grads_64 = run(
        "pytorch", *(t.double() if t.is_floating_point() else t for t in low), grad_out=grad_out.to(dtype).double()
    )
    out_t, grads_t = run("triton", *low, grad_out=grad_out)
    out_r, grads_r = run("pytorch", *low, grad_out=grad_out)
    assert out_t.dtype == dtype
    assert [g.dtype for g in grads_t] == [dtype, loc_dtype, loc_dtype]
    atol = {torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    for name, t, r, x in zip(
        ("output", "grad_value", "grad_loc", "grad_weight"), (out_t, *grads_t), (out_r, *grads_r), (out_64, *grads_64)
    ):
        err_t = (t.double().cpu() - x.cpu()).abs().max().item()
        err_r = (r.double().cpu() - x.cpu()).abs().max().item()
        scale = x.abs().max().item()
        assert err_t <= 2 * err_r + atol * scale, f"{name}: kernel {err_t:.3e} vs reference {err_r:.3e}"


# ------------------------------------------------------------------------------------------------
# gradcheck (fp64, tiny)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", MSDA_DEVICES)
def test_gradcheck(gen, device):
    # Tiny on purpose: every input element costs two interpreted launches.
    value, shapes, loc, weights = msda_inputs(
        gen, N=1, M=1, D=2, Lq=2, P=2, levels=[(3, 2), (2, 2)], loc_low=-0.1, loc_high=1.1, device=device
    )
    inputs = [t.requires_grad_() for t in (value, loc, weights)]

    def fn(v, l, w):
        return msda.multi_scale_deformable_attention(v, shapes, None, l, w, impl="triton")

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, nondet_tol=1e-12)


# ------------------------------------------------------------------------------------------------
# bad input: each raises with a message naming the argument, the expected and the actual
# ------------------------------------------------------------------------------------------------
def _bad(gen, **replace):
    value, shapes, loc, weights = msda_inputs(gen, D=8, dtype=torch.float32)
    args = dict(
        value=value, spatial_shapes=shapes, level_start_index=None, sampling_locations=loc, attention_weights=weights
    )
    args.update({k: (v(args) if callable(v) else v) for k, v in replace.items()})
    return args


BAD_INPUTS = [
    (dict(value=lambda a: a["value"][0]), ValueError, r"value must have 4 dimensions \(N, S, M, D\)"),
    (
        dict(sampling_locations=lambda a: a["sampling_locations"][..., 0]),
        ValueError,
        r"sampling_locations must have 6 dimensions",
    ),
    (
        dict(attention_weights=lambda a: a["attention_weights"][0]),
        ValueError,
        r"attention_weights must have 5 dimensions",
    ),
    (
        dict(spatial_shapes=lambda a: a["spatial_shapes"].flatten()),
        ValueError,
        r"spatial_shapes must have 2 dimensions",
    ),
    (dict(value=lambda a: a["value"][:, :-1]), ValueError, r"S dimension must equal sum\(H\*W\).* = 30, got S = 29"),
    (
        dict(level_start_index=torch.tensor([0, 20])),
        ValueError,
        r"level_start_index must be the cumulative sizes of spatial_shapes, \[0, 24\], got \[0, 20\]",
    ),
    (dict(level_start_index=torch.tensor([0])), ValueError, r"level_start_index must be the cumulative"),
    (
        dict(sampling_locations=lambda a: a["sampling_locations"][:, :, :1]),
        ValueError,
        r"sampling_locations must be \(N=1, Lq, M=2, L=2, P, 2\)",
    ),
    (
        dict(attention_weights=lambda a: a["attention_weights"][..., :1]),
        ValueError,
        r"attention_weights must be \(N, Lq, M, L, P\) = \(1, 5, 2, 2, 2\)",
    ),
    (dict(value=lambda a: a["value"].long()), TypeError, r"value must be float32, float16, bfloat16.*got torch.int64"),
    (
        dict(value=lambda a: a["value"].bfloat16(), sampling_locations=lambda a: a["sampling_locations"].half()),
        TypeError,
        r"sampling_locations must be float32 or value's dtype \(torch.bfloat16\), got torch.float16",
    ),
    (
        dict(attention_weights=lambda a: a["attention_weights"].double()),
        TypeError,
        r"attention_weights must be float32 or value's dtype",
    ),
    (dict(spatial_shapes=lambda a: a["spatial_shapes"].float()), TypeError, r"spatial_shapes must be an integer"),
    (dict(value=[1.0]), TypeError, r"value must be a torch.Tensor of shape \(N, S, M, D\), got list"),
    (dict(spatial_shapes=torch.tensor([[6, 4], [3, 0]])), ValueError, r"spatial_shapes must hold positive"),
    (
        dict(sampling_locations=lambda a: a["sampling_locations"].to("meta")),
        ValueError,
        r"all tensors must be on value's device \(cpu; .*\), got sampling_locations on meta",
    ),
    (
        dict(attention_weights=lambda a: a["attention_weights"].to("meta")),
        ValueError,
        r"all tensors must be on value's device \(cpu; .*\), got attention_weights on meta",
    ),
]


@pytest.mark.parametrize("replace,error,message", BAD_INPUTS)
@pytest.mark.parametrize("impl", ["triton", "pytorch"])
def test_bad_input_raises(gen, replace, error, message, impl):
    with pytest.raises(error, match=message):
        msda.multi_scale_deformable_attention(**_bad(gen, **replace), impl=impl)


def test_bad_impl_raises(gen):
    with pytest.raises(ValueError, match=r"impl must be one of \('triton', 'pytorch', 'auto'\), got 'cuda'"):
        msda.multi_scale_deformable_attention(**_bad(gen), impl="cuda")


def test_triton_on_cpu_without_interpreter_says_what_to_do(gen, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"impl='triton' needs CUDA tensors, got tensors on cpu.*TRITON_INTERPRET=1"):
        msda.multi_scale_deformable_attention(**_bad(gen), impl="triton")


def test_auto_picks_reference_on_cpu(gen, monkeypatch):
    args = _bad(gen)
    calls = []
    monkeypatch.setattr(
        msda.ops,
        "multi_scale_deformable_attention_reference",
        lambda *a: calls.append("reference") or msda.multi_scale_deformable_attention_reference(*a),
    )
    msda.multi_scale_deformable_attention(**args, impl="auto")
    assert calls == ["reference"]


# ------------------------------------------------------------------------------------------------
# CUDA only: a flat value index past 2^31
# ------------------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")
def test_int64_flat_index_beyond_2_31():
    """N*S*M*D > 2^31: the last batch element's rows sit past the int32 range; checked on that slice."""
    N, M, D, H, W = 2, 8, 32, 2048, 2048  # 2*4M*8*32 = 2^31 elements, 8 GiB in fp32
    gen = torch.Generator(device="cuda").manual_seed(0)
    value = torch.randn(N, H * W, M, D, device="cuda", generator=gen)
    assert value.numel() >= 2**31
    shapes = torch.tensor([[H, W]], device="cuda")
    Lq, P = 64, 4
    loc = torch.rand(N, Lq, M, 1, P, 2, device="cuda", generator=gen)
    loc[:, :, :, :, 0] = 1.0 - 0.5 / W  # the last pixel centre: the largest row index of each image
    weights = torch.rand(N, Lq, M, 1, P, device="cuda", generator=gen)
    out = msda.multi_scale_deformable_attention(value, shapes, None, loc, weights, impl="triton")
    ref = msda.multi_scale_deformable_attention(value[1:], shapes, None, loc[1:], weights[1:], impl="pytorch")
    # fp32 pixel coordinates on a 2048-wide level round at ~1e-4 px, differently in grid_sample; a wrong
    # int64 offset would read another row entirely and miss by O(1).
    assert rel_err(out[1:], ref) < 1e-4
    value.requires_grad_()
    out = msda.multi_scale_deformable_attention(value, shapes, None, loc, weights, impl="triton")
    (grad_value,) = torch.autograd.grad(out, value, torch.ones_like(out))
    sampled_rows = grad_value[1].abs().sum((1, 2)).nonzero()
    assert sampled_rows.max().item() == H * W - 1  # the scatter reached the last row of the last image


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")
def test_level_layout_read_once_but_never_stale(gen):
    """The host copy of a CUDA spatial_shapes is reused across calls, and dropped once it is modified."""
    value, shapes, loc, weights = msda_inputs(gen, D=8, dtype=torch.float32, device="cuda")
    first = msda.multi_scale_deformable_attention(value, shapes, None, loc, weights, impl="triton")
    assert id(shapes) in msda.layout._HOST_COPIES
    again = msda.multi_scale_deformable_attention(value, shapes, None, loc, weights, impl="triton")
    assert torch.equal(first, again)
    shapes[0, 0] = 5  # in place: S no longer matches, and the cached layout must not hide it
    with pytest.raises(ValueError, match=r"sum\(H\*W\) over spatial_shapes = 26, got S = 30"):
        msda.multi_scale_deformable_attention(value, shapes, None, loc, weights, impl="triton")
    key = id(shapes)
    del shapes
    assert key not in msda.layout._HOST_COPIES
