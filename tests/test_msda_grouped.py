"""msda's channel-grouped kernels and the cell-partials scheme of grad_value, through the launchers.

The grouped forward, the grouped query-side backward under every grad_value scheme (fused atomics, gather,
hybrid, cells; sorted for the deterministic mode) and the classic keys with the cells scheme: output and all
three gradients against the grid_sample reference in fp64, on ragged query blocks, non-power-of-2 head dims,
points outside [0, 1], 1x1 levels and empty batches; then block shapes, reduced precision, bitwise
repeatability and the errors a bad configuration raises.
"""

import itertools

import pytest
import torch
from helpers import (
    KERNEL_SHAPES,
    MSDA_DEVICES,
    assert_kernel_close,
    kernel_inputs,
    kernel_reference,
    kernel_results,
    rel_err,
)

from msda import launch, launch_grouped, launch_table
from msda.reference import off_cell_edges

# (kernel family of the backward, backward keyword arguments)
BACKWARDS = [
    pytest.param("grouped", dict(scheme="fused"), id="grouped-fused"),
    pytest.param("grouped", dict(scheme="gather"), id="grouped-gather"),
    pytest.param("grouped", dict(scheme="hybrid", configs={"hybrid_split": 10}), id="grouped-hybrid"),
    pytest.param("grouped", dict(scheme="cells"), id="grouped-cells"),
    pytest.param("grouped", dict(deterministic=True, scheme="gather"), id="grouped-deterministic-gather"),
    pytest.param("grouped", dict(deterministic=True, scheme="cells"), id="grouped-deterministic-cells"),
    pytest.param("classic", dict(deterministic=True, scheme="cells"), id="classic-deterministic-cells"),
]


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(58)


def grouped_results(inputs, family, backward_kwargs, forward_config=None):
    return kernel_results(
        *inputs, forward_config=forward_config, forward_kernels="grouped", kernels=family, **backward_kwargs
    )


# ------------------------------------------------------------------------------------------------
# every backward against the reference
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", MSDA_DEVICES)
@pytest.mark.parametrize("shape", KERNEL_SHAPES)
@pytest.mark.parametrize("family,kwargs", BACKWARDS)
def test_matches_reference_fp64(gen, device, shape, family, kwargs):
    inputs = kernel_inputs(gen, device=device, **shape)
    assert_kernel_close(grouped_results(inputs, family, kwargs), kernel_reference(*inputs), 1e-10, inputs)


@pytest.mark.parametrize("device", MSDA_DEVICES)
@pytest.mark.parametrize("family,kwargs", BACKWARDS)
def test_matches_reference_fp32(gen, device, family, kwargs):
    inputs = kernel_inputs(gen, N=2, Lq=20, D=32, dtype=torch.float32, loc_low=-0.1, loc_high=1.1, device=device)
    assert_kernel_close(grouped_results(inputs, family, kwargs), kernel_reference(*inputs), 1e-5, inputs)


@pytest.mark.parametrize("device", MSDA_DEVICES)
@pytest.mark.parametrize("family,kwargs", BACKWARDS)
def test_points_on_pixel_centres_and_borders(gen, device, family, kwargs):
    """Exact pixel centres, 0, 1 and half a pixel outside: the floor, corner validity and cell-key edge cases."""
    levels, value, _, weights, grad_out = kernel_inputs(gen, Lq=8, P=4, levels=((6, 4), (3, 2)), device=device)
    H, W = levels[0]
    edges = torch.tensor(
        [0.0, 1.0, 0.5 / W, 1 - 0.5 / W, -0.5 / W, 1 + 0.5 / W, 1.0 / W, 1.5 / H, 0.25], dtype=torch.float64
    )
    xs = edges[torch.randint(len(edges), (1, 8, 2, 2, 4), generator=gen)]
    ys = edges.flip(0)[torch.randint(len(edges), (1, 8, 2, 2, 4), generator=gen)]
    inputs = (levels, value, torch.stack([xs, ys], dim=-1).to(device), weights, grad_out)
    assert_kernel_close(grouped_results(inputs, family, kwargs), kernel_reference(*inputs), 1e-10, inputs)


@pytest.mark.parametrize("device", MSDA_DEVICES)
@pytest.mark.parametrize("family,kwargs", BACKWARDS[3:], ids=[p.id for p in BACKWARDS[3:]])
def test_clustered_samples(gen, device, family, kwargs):
    """Every query samples near one point: long cells, which the cell pass walks many steps and many lanes."""
    levels, value, loc, weights, grad_out = kernel_inputs(gen, N=2, Lq=40, P=4, device=device)
    inputs = (levels, value, 0.5 + (loc - 0.5) * 0.05, weights, grad_out)
    assert_kernel_close(grouped_results(inputs, family, kwargs), kernel_reference(*inputs), 1e-10, inputs)


@pytest.mark.parametrize("device", MSDA_DEVICES)
@pytest.mark.parametrize("family,kwargs", BACKWARDS)
@pytest.mark.parametrize("N,Lq", [(0, 5), (2, 0)])
def test_empty_batch_or_queries(gen, device, family, kwargs, N, Lq):
    levels, value, loc, weights, grad_out = kernel_inputs(gen, N=2, Lq=5, device=device)
    value, loc, weights, grad_out = value[:N], loc[:N, :Lq], weights[:N, :Lq], grad_out[:N, :Lq]
    out = launch.forward(value, levels, loc, weights, kernels="grouped")
    assert out.shape == (N, Lq, 2 * 8)
    grads = launch.backward(grad_out, value, levels, loc, weights, kernels=family, **kwargs)
    for grad, t in zip(grads, (value, loc, weights)):
        assert grad.shape == t.shape and grad.dtype == t.dtype
    assert not grads[0].any()  # no query samples value


@pytest.mark.parametrize("device", MSDA_DEVICES)
def test_a_nan_location_turns_only_its_query_and_head_nan(gen, device):
    """As the classic forward: no memory read for a NaN location, NaN output for its (query, head), nothing else."""
    levels, value, loc, weights, _ = kernel_inputs(gen, Lq=3, D=4, device=device)
    loc[0, 1, 0, 0, 0, 0] = float("nan")
    out = launch.forward(value, levels, loc, weights, kernels="grouped")
    expected = launch.forward(value, levels, loc, weights, kernels="classic")
    assert torch.isnan(out[0, 1, :4]).all()
    untouched = torch.ones_like(out, dtype=torch.bool)
    untouched[0, 1, :4] = False
    assert torch.isfinite(out[untouched]).all()
    torch.testing.assert_close(out[untouched], expected[untouched], rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------------
# launch configurations
# ------------------------------------------------------------------------------------------------
# (BLOCK_Q, CH, warps): one channel per group, one group, queries that leave a partial block, one query a program
GROUPED_CONFIGS = [(4, 16, 1), (2, 1, 2), (16, 4, 4), (1, 2, 1)]


@pytest.mark.parametrize("device", MSDA_DEVICES)
@pytest.mark.parametrize("config", GROUPED_CONFIGS, ids=[f"{q}q-{c}ch-{w}w" for q, c, w in GROUPED_CONFIGS])
def test_grouped_block_shapes(gen, device, config):
    """D = 10 in 16 padded channels cut in CH groups; P = 3 samples padded to 4; 5 queries in blocks of 2, 4, 16."""
    inputs = kernel_inputs(
        gen, M=2, D=10, Lq=5, P=3, levels=((4, 5), (3, 3), (1, 2)), loc_low=-0.2, loc_high=1.2, device=device
    )
    expected = kernel_reference(*inputs)
    configs = {f"grouped_{name}": config for name in ("fused", "keys", "hybrid")}
    for kwargs in (
        dict(scheme="fused"),
        dict(scheme="hybrid", configs={"hybrid_split": 0}),
        dict(scheme="cells"),
        dict(scheme="cells", deterministic=True),
    ):
        kwargs["configs"] = {**configs, **kwargs.get("configs", {})}
        results = grouped_results(inputs, "grouped", kwargs, forward_config=config)
        assert_kernel_close(results, expected, 1e-10, inputs)


# (lanes, CH, warps) of the cell pass: one lane (a program per cell, one entry a step), few, many
CELL_CONFIGS = [(1, 1, 1), (4, 2, 1), (32, 16, 2)]


@pytest.mark.parametrize("device", MSDA_DEVICES)
@pytest.mark.parametrize("config", CELL_CONFIGS, ids=[f"{n}lanes-{c}ch-{w}w" for n, c, w in CELL_CONFIGS])
@pytest.mark.parametrize("deterministic", [False, True], ids=["bucket", "sorted"])
def test_cell_tiles(gen, device, config, deterministic):
    """Cell tiles from one lane per program to many lanes per cell, on dense and sparse levels (D = 12)."""
    inputs = kernel_inputs(
        gen, M=1, D=12, Lq=20, P=2, levels=((5, 4), (2, 3), (1, 1)), loc_low=-0.1, loc_high=1.1, device=device
    )
    results = grouped_results(
        inputs, "grouped", dict(scheme="cells", deterministic=deterministic, configs={"cells": config})
    )
    assert_kernel_close(results, kernel_reference(*inputs), 1e-10, inputs)


def test_cell_groups_split_levels_by_density():
    levels = ((100, 167), (50, 84), (25, 42), (13, 21))
    S = sum(h * w for h, w in levels)
    groups = launch_grouped.cell_groups(levels, S, 4, 64)  # encoder: 5, 21, 80 and 289 samples a cell
    assert groups[0][0] == 0 and groups[-1][1] == sum((h + 1) * (w + 1) for h, w in levels)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(groups))
    assert [g[2] for g in groups] == [1, 4, 16, 64]  # lanes per cell grow with the density, >= 4 samples a lane
    assert launch_grouped.cell_groups(levels, 300, 4, 64) == [(0, groups[-1][1], 1)]  # decoder: all sparse
    assert [g[2] for g in launch_grouped.cell_groups(levels, S, 4, 16)] == [1, 4, 16]  # at most all lanes


# ------------------------------------------------------------------------------------------------
# precision and determinism
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", MSDA_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("family,kwargs", BACKWARDS)
def test_reduced_precision(gen, device, dtype, family, kwargs):
    """2-byte value with fp32 locations: every gradient within the dtype's rounding of the exact result."""
    levels, value, loc, weights, grad_out = kernel_inputs(gen, N=2, Lq=24, D=32, device=device)
    low = (levels, value.to(dtype), loc.float(), weights.float(), grad_out.to(dtype))
    exact = kernel_reference(levels, *(t.double() for t in low[1:]))  # fp64 on exactly the rounded inputs
    results = grouped_results(low, family, kwargs)
    assert [r.dtype for r in results] == [dtype, dtype, torch.float32, torch.float32]
    atol = {torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    for name, r, x in zip(("output", "grad_value", "grad_loc", "grad_weight"), results, exact):
        err = (r.double().cpu() - x.cpu()).abs().max().item()
        assert err <= atol * x.abs().max().item(), f"{name}: {err:.3e}"


@pytest.mark.parametrize("device", MSDA_DEVICES)
@pytest.mark.parametrize("family", ["classic", "grouped"])
def test_deterministic_cells_are_bitwise_repeatable_and_agree_with_atomics(gen, device, family):
    levels, value, loc, weights, grad_out = kernel_inputs(
        gen, N=2, Lq=50, D=16, P=4, dtype=torch.float32, loc_low=-0.1, loc_high=1.1, device=device
    )
    runs = [
        launch.backward(grad_out, value, levels, loc, weights, deterministic=True, scheme="cells", kernels=family)
        for _ in range(3)
    ]
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert torch.equal(a, b)
    atomic = launch.backward(grad_out, value, levels, loc, weights, scheme="fused", kernels="grouped")
    for a, b in zip(runs[0], atomic):
        assert rel_err(a, b) < 1e-5


# ------------------------------------------------------------------------------------------------
# selection and errors
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", MSDA_DEVICES)
def test_table_picks_the_family_and_the_deterministic_scheme(gen, device, monkeypatch):
    """The table's kernel-family and deterministic-scheme entries reach the next call (as a pasted table sets
    them)."""
    levels, value, loc, weights, grad_out = kernel_inputs(gen, device=device)
    monkeypatch.setattr(launch_table, "TUNED", dict(launch_table.TUNED))
    calls = []
    monkeypatch.setattr(launch_grouped, "forward", lambda *args: calls.append("forward"))
    monkeypatch.setattr(launch_grouped, "cell_grad_value", lambda *args: calls.append("cells"))
    launch.forward(value, levels, loc, weights)
    launch.backward(grad_out, value, levels, loc, weights, deterministic=True)
    assert calls == []  # the defaults: classic kernels, the gather scheme
    key = (8, 8, 2, 2, False)  # D=8, fp64, L=2, P=2, decoder-sized
    launch.update_table({("forward_kernels", *key): "grouped", ("deterministic_scheme", *key): "cells"})
    try:
        launch.forward(value, levels, loc, weights)
        launch.backward(grad_out, value, levels, loc, weights, deterministic=True)
        assert calls == ["forward", "cells"]
    finally:
        launch.update_table({})


@pytest.mark.parametrize("device", MSDA_DEVICES)
@pytest.mark.parametrize(
    "call,message",
    [
        (
            lambda i: launch.forward(i[1], i[0], i[2], i[3], kernels="grouped", config=(4, 3, 4)),
            r"CH \(channel groups\) must be a power of 2 from 1 to 8 for D=8, got 3",
        ),
        (
            lambda i: launch.forward(i[1], i[0], i[2], i[3], kernels="grouped", config=(4, 16, 4)),
            r"CH \(channel groups\) must be a power of 2 from 1 to 8 for D=8, got 16",
        ),
        (
            lambda i: launch.forward(i[1], i[0], i[2], i[3], kernels="grouped", config=(16, 1, 4, 1)),
            r"a grouped config is \(BLOCK_Q, CH, num_warps\), got \(16, 1, 4, 1\)",
        ),
        (
            lambda i: launch.forward(i[1], i[0], i[2], i[3], kernels="fast"),
            r"kernels must be one of \('classic', 'grouped'\), got 'fast'",
        ),
        (
            lambda i: launch.backward(i[4], i[1], i[0], i[2], i[3], scheme="split", kernels="grouped"),
            r"the grouped kernels have no split scheme",
        ),
        (
            lambda i: launch.backward(i[4], i[1], i[0], i[2], i[3], scheme="fused", deterministic=True),
            r"a deterministic backward takes scheme gather or cells, got 'fused'",
        ),
        (
            lambda i: launch.backward(i[4], i[1], i[0], i[2], i[3], scheme="cells", configs={"cells": (8, 5, 4)}),
            r"CH \(channel groups\) must be a power of 2 from 1 to 8 for D=8, got 5",
        ),
        (
            lambda i: launch.forward(i[1], i[0], i[2], i[3], kernels="grouped", config=(6, 1, 4)),
            r"BLOCK_Q must be a power of 2, got 6",
        ),
        (
            lambda i: launch.backward(i[4], i[1], i[0], i[2], i[3], scheme="cells", configs={"cells": (48, 1, 4)}),
            r"LANES must be a power of 2, got 48",
        ),
    ],
    ids=[
        "CH-not-power-of-2",
        "CH-above-channels",
        "classic-config",
        "unknown-family",
        "grouped-split",
        "deterministic-fused",
        "cells-CH",
        "BLOCK_Q",
        "lanes",
    ],
)
def test_bad_configuration_raises(gen, device, call, message):
    with pytest.raises(ValueError, match=message):
        call(kernel_inputs(gen, device=device))


# ------------------------------------------------------------------------------------------------
# CUDA only
# ------------------------------------------------------------------------------------------------
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")


@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encoder_shape_on_gpu(dtype):
    """COCO's level layout with fewer queries, samples clustered around each query: every grouped path against
    the fp64 reference, and the deterministic cells bitwise over 3 runs."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    levels = ((100, 167), (50, 84), (25, 42), (13, 21))
    S = sum(h * w for h, w in levels)
    N, Lq, M, D, P = 1, 4099, 8, 32, 4
    value = torch.randn(N, S, M, D, device="cuda", generator=gen).to(dtype)
    ref_points = torch.rand(N, Lq, 1, 1, 1, 2, device="cuda", generator=gen)
    loc = (ref_points + 0.02 * torch.randn(N, Lq, M, 4, P, 2, device="cuda", generator=gen)).contiguous()
    weights = torch.rand(N, Lq, M, 4 * P, device="cuda", generator=gen).softmax(-1).view(N, Lq, M, 4, P)
    grad_out = torch.randn(N, Lq, M * D, device="cuda", generator=gen).to(dtype)
    inputs = (levels, value, loc, weights, grad_out)
    exact = kernel_reference(levels, *(t.double() for t in inputs[1:]))
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    for family, kwargs in [("grouped", dict(scheme="fused")), ("grouped", dict(deterministic=True, scheme="cells"))]:
        results = grouped_results(inputs, family, kwargs)
        away = off_cell_edges(levels, loc)
        assert away.float().mean() > 0.99
        for name, r, x in zip(("output", "grad_value", "grad_loc", "grad_weight"), results, exact):
            if name == "grad_loc":  # float32 and fp64 may sample either side of a cell edge: compared off them
                r, x = r * away, x * away.to(x.device)
            assert rel_err(r, x) < tolerance, f"{family} {kwargs} {name}: {rel_err(r, x):.2e}"
    runs = [
        launch.backward(grad_out, value, levels, loc, weights, deterministic=True, scheme="cells", kernels="grouped")
        for _ in range(3)
    ]
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert torch.equal(a, b)
