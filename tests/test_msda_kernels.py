"""msda launchers and kernels directly: every backward scheme, block shape and the deterministic mode.

tests/test_msda.py checks the public op with the default launch configuration; here each grad_value scheme
(fused atomics, split atomics, gather by cell, deterministic gather), each query-kernel block shape and each
gather tile shape is checked against the grid_sample reference, output and all three gradients.
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

from msda import launch, launch_table

SCHEMES = [
    dict(scheme="fused"),
    dict(scheme="split"),
    dict(scheme="gather"),
    dict(scheme="hybrid"),
    dict(deterministic=True),
]
SCHEME_IDS = ["fused", "split", "gather", "hybrid", "deterministic"]


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(2024)


# ------------------------------------------------------------------------------------------------
# every scheme against the reference
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", MSDA_DEVICES)
@pytest.mark.parametrize("shape", KERNEL_SHAPES)
@pytest.mark.parametrize("kwargs", SCHEMES, ids=SCHEME_IDS)
def test_scheme_matches_reference_fp64(gen, device, shape, kwargs):
    inputs = kernel_inputs(gen, device=device, **shape)
    assert_kernel_close(kernel_results(*inputs, **kwargs), kernel_reference(*inputs), 1e-10, inputs)


@pytest.mark.parametrize("device", MSDA_DEVICES)
@pytest.mark.parametrize("kwargs", SCHEMES, ids=SCHEME_IDS)
def test_scheme_matches_reference_fp32(gen, device, kwargs):
    inputs = kernel_inputs(gen, N=2, Lq=20, D=32, dtype=torch.float32, loc_low=-0.1, loc_high=1.1, device=device)
    assert_kernel_close(kernel_results(*inputs, **kwargs), kernel_reference(*inputs), 1e-5, inputs)


@pytest.mark.parametrize("device", MSDA_DEVICES)
@pytest.mark.parametrize("kwargs", SCHEMES, ids=SCHEME_IDS)
def test_points_on_pixel_centres_and_borders(gen, device, kwargs):
    """Exact pixel centres, 0, 1 and half a pixel outside: the floor / validity / cell-key edge cases."""
    levels, value, _, weights, grad_out = kernel_inputs(gen, Lq=8, P=4, levels=((6, 4), (3, 2)), device=device)
    H, W = levels[0]
    edges = torch.tensor(
        [0.0, 1.0, 0.5 / W, 1 - 0.5 / W, -0.5 / W, 1 + 0.5 / W, 1.0 / W, 1.5 / H, 0.25], dtype=torch.float64
    )
    xs = edges[torch.randint(len(edges), (1, 8, 2, 2, 4), generator=gen)]
    ys = edges.flip(0)[torch.randint(len(edges), (1, 8, 2, 2, 4), generator=gen)]
    loc = torch.stack([xs, ys], dim=-1).to(device)
    inputs = (levels, value, loc, weights, grad_out)
    assert_kernel_close(kernel_results(*inputs, **kwargs), kernel_reference(*inputs), 1e-10, inputs)


@pytest.mark.parametrize("device", MSDA_DEVICES)
@pytest.mark.parametrize("kwargs", SCHEMES, ids=SCHEME_IDS)
def test_clustered_samples(gen, device, kwargs):
    """Every query samples near one point (long cells: the gather loop runs many steps per row)."""
    levels, value, loc, weights, grad_out = kernel_inputs(gen, N=2, Lq=40, P=4, device=device)
    loc = 0.5 + (loc - 0.5) * 0.05  # within a pixel or two of the centre on every level
    inputs = (levels, value, loc, weights, grad_out)
    assert_kernel_close(kernel_results(*inputs, **kwargs), kernel_reference(*inputs), 1e-10, inputs)


# ------------------------------------------------------------------------------------------------
# launch configurations: block shapes that cut the samples unevenly, one query per program, tiles
# ------------------------------------------------------------------------------------------------
# (BLOCK_Q, BLOCK_P, warps, the forward's UNROLL)
QUERY_CONFIGS = [(4, 1, 1, 3), (2, 2, 2, 2), (16, 4, 4, 2), (2, 16, 4, 1)]


@pytest.mark.parametrize("device", MSDA_DEVICES)
@pytest.mark.parametrize("config", QUERY_CONFIGS, ids=[f"{q}q-{p}p-{w}w-{u}u" for q, p, w, u in QUERY_CONFIGS])
def test_query_block_shapes(gen, device, config):
    """L*P = 9 samples: BLOCK_P 2, 4, 16 leave a partial last step; 5 queries leave a partial block; the
    forward's 5 and 3 steps unrolled twice leave a step after the unrolled ones (compiled on a GPU only: the
    interpreter runs the loop as written)."""
    inputs = kernel_inputs(
        gen, M=1, Lq=5, P=3, levels=((4, 5), (3, 3), (1, 2)), loc_low=-0.2, loc_high=1.2, device=device
    )
    expected = kernel_reference(*inputs)
    configs = {name: config[:3] for name in ("fused", "sample_grads", "scatter", "keys", "hybrid")}
    # fused, split (sample_grads + scatter), the bucket gather (keys) and hybrid: every query-kernel variant.
    for scheme in ("fused", "split", "gather", "hybrid"):
        results = kernel_results(*inputs, forward_config=config, configs=configs, scheme=scheme)
        assert_kernel_close(results, expected, 1e-10, inputs)


@pytest.mark.parametrize("device", MSDA_DEVICES)
def test_forward_config_without_unroll_raises(gen, device):
    levels, value, loc, weights, _ = kernel_inputs(gen, device=device)
    with pytest.raises(
        ValueError, match=r"a forward config is \(BLOCK_Q, BLOCK_P, num_warps, UNROLL\), got \(2, 16, 4\)"
    ):
        launch.forward(value, levels, loc, weights, config=(2, 16, 4))


@pytest.mark.parametrize("device", MSDA_DEVICES)
@pytest.mark.parametrize("lanes", [1, 4, 32])
@pytest.mark.parametrize("deterministic", [False, True], ids=["bucket", "sorted"])
def test_gather_tiles(gen, device, lanes, deterministic):
    """Gather tiles from one lane per program to many rows per program, with dense and sparse levels."""
    inputs = kernel_inputs(
        gen, M=1, Lq=20, P=2, levels=((5, 4), (2, 3), (1, 1)), loc_low=-0.1, loc_high=1.1, device=device
    )
    results = kernel_results(*inputs, scheme="gather", deterministic=deterministic, configs={"gather": (lanes, 4)})
    assert_kernel_close(results, kernel_reference(*inputs), 1e-10, inputs)


@pytest.mark.parametrize("device", MSDA_DEVICES)
@pytest.mark.parametrize("threshold", [0, 10, 30, 1e9], ids=["all-gathered", "coarse-gathered", "coarsest", "none"])
def test_hybrid_split_points(gen, device, threshold):
    """Hybrid with every split: all levels gathered, the coarse ones, the coarsest only, none (all scattered)."""
    inputs = kernel_inputs(
        gen, M=1, Lq=20, P=2, levels=((5, 4), (2, 3), (1, 1)), loc_low=-0.1, loc_high=1.1, device=device
    )
    results = kernel_results(*inputs, scheme="hybrid", configs={"hybrid_split": threshold})
    assert_kernel_close(results, kernel_reference(*inputs), 1e-10, inputs)


def test_gather_from_takes_the_dense_coarse_levels():
    levels = ((100, 167), (50, 84), (25, 42), (13, 21))
    S = sum(h * w for h, w in levels)
    assert launch.gather_from(levels, S, 4, 256) == 2  # expected entries per row: 21, 85, 339, 1302
    assert launch.gather_from(levels, S, 4, 64) == 1
    assert launch.gather_from(levels, S, 4, 1e9) == 4
    assert launch.gather_from(levels, 300, 4, 64) == 4  # decoder: every level sparse


def test_gather_groups_split_levels_by_density():
    levels = ((100, 167), (50, 84), (25, 42), (13, 21))
    S = sum(h * w for h, w in levels)
    groups = launch.gather_groups(levels, S, 4, 32)  # encoder: cells get denser level by level
    assert groups[0][0] == 0 and groups[-1][1] == S
    assert all(a[1] == b[0] for a, b in itertools.pairwise(groups))
    assert [g[2] for g in groups] == sorted(g[2] for g in groups) and len(groups) > 1
    assert all(32 % g[2] == 0 for g in groups)
    assert launch.gather_groups(levels, 300, 4, 32)[0][2] == 1  # decoder: sparse fine levels, one lane a row


# ------------------------------------------------------------------------------------------------
# deterministic mode
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", MSDA_DEVICES)
def test_deterministic_is_bitwise_repeatable_and_agrees_with_atomics(gen, device):
    inputs = kernel_inputs(gen, N=2, Lq=50, D=16, P=4, dtype=torch.float32, loc_low=-0.1, loc_high=1.1, device=device)
    levels, value, loc, weights, grad_out = inputs
    runs = [launch.backward(grad_out, value, levels, loc, weights, deterministic=True) for _ in range(3)]
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert torch.equal(a, b)
    atomic = launch.backward(grad_out, value, levels, loc, weights, scheme="fused")
    for a, b in zip(runs[0], atomic):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("device", MSDA_DEVICES)
def test_deterministic_under_torch_deterministic_algorithms(gen, device):
    """The deterministic path uses only torch ops that torch.use_deterministic_algorithms(True) allows."""
    levels, value, loc, weights, grad_out = kernel_inputs(gen, N=2, Lq=12, D=8, device=device)
    outside = launch.backward(grad_out, value, levels, loc, weights, deterministic=True)
    enabled = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        inside = launch.backward(grad_out, value, levels, loc, weights, deterministic=True)
    finally:
        torch.use_deterministic_algorithms(enabled)
    for a, b in zip(outside, inside):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", MSDA_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kwargs", SCHEMES, ids=SCHEME_IDS)
def test_reduced_precision_schemes(gen, device, dtype, kwargs):
    """2-byte value with fp32 locations: every gradient within the dtype's rounding of the exact result."""
    levels, value, loc, weights, grad_out = kernel_inputs(gen, N=2, Lq=24, D=32, dtype=torch.float64, device=device)
    low = (levels, value.to(dtype), loc.float(), weights.float(), grad_out.to(dtype))
    exact = kernel_reference(levels, *(t.double() for t in low[1:]))  # fp64 on exactly the rounded inputs
    results = kernel_results(*low, **kwargs)
    assert [r.dtype for r in results] == [dtype, dtype, torch.float32, torch.float32]
    atol = {torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    for name, r, x in zip(("output", "grad_value", "grad_loc", "grad_weight"), results, exact):
        err = (r.double().cpu() - x.cpu()).abs().max().item()
        assert err <= atol * x.abs().max().item(), f"{name}: {err:.3e}"


@pytest.mark.parametrize("device", MSDA_DEVICES)
@pytest.mark.parametrize("kwargs", SCHEMES, ids=SCHEME_IDS)
@pytest.mark.parametrize("N,Lq", [(0, 5), (2, 0)])
def test_empty_batch_or_queries(gen, device, kwargs, N, Lq):
    levels, value, loc, weights, grad_out = kernel_inputs(gen, N=2, Lq=5, device=device)
    value, loc, weights, grad_out = value[:N], loc[:N, :Lq], weights[:N, :Lq], grad_out[:N, :Lq]
    out = launch.forward(value, levels, loc, weights)
    assert out.shape == (N, Lq, 2 * 8)
    grads = launch.backward(grad_out, value, levels, loc, weights, **kwargs)
    for grad, t in zip(grads, (value, loc, weights)):
        assert grad.shape == t.shape and grad.dtype == t.dtype


# ------------------------------------------------------------------------------------------------
# level layout as kernel arguments
# ------------------------------------------------------------------------------------------------
def test_pack_levels_bounds():
    assert len(launch.pack_levels(((16383, 16383),))) == 4
    assert all(2**62 <= v < 2**63 for v in launch.pack_levels(((16383, 1), (2, 16383))))
    with pytest.raises(ValueError, match=r"1 to 8 levels with 1 <= H, W < 16384, got \(\(16384, 2\),\)"):
        launch.pack_levels(((16384, 2),))
    with pytest.raises(ValueError, match=r"1 to 8 levels"):
        launch.pack_levels(((2, 2),) * 9)


@pytest.mark.parametrize("device", MSDA_DEVICES)
def test_levels_as_list_and_eight_levels(gen, device):
    levels = [(3, 2), (2, 2), (1, 3), (2, 1), (1, 1), (2, 2), (1, 2), (3, 1)]
    inputs = kernel_inputs(gen, levels=levels, P=1, D=4, device=device)
    results = kernel_results([list(hw) for hw in levels], *inputs[1:], scheme="fused")
    assert_kernel_close(results, kernel_reference(*inputs), 1e-10, inputs)


@pytest.mark.parametrize("device", MSDA_DEVICES)
def test_table_entries_take_effect(gen, device, monkeypatch):
    """update_table (what bench/msda.py applies after its sweep) reaches the next call's plan."""
    levels, value, loc, weights, grad_out = kernel_inputs(gen, device=device)
    key = ("scheme", 8, 8, 2, 2, False)  # D=8, fp64, L=2, P=2, decoder-sized
    monkeypatch.setattr(launch_table, "TUNED", dict(launch_table.TUNED))
    gathered = []
    monkeypatch.setattr(launch, "gather_groups", lambda *args: gathered.append(args) or [])
    launch.backward(grad_out, value, levels, loc, weights)  # cached plans from the default table
    launch.update_table({key: "gather"})
    try:
        launch.backward(grad_out, value, levels, loc, weights)
        assert gathered  # the gather scheme ran
    finally:
        launch.launch_config.cache_clear()
        launch._plan.cache_clear()


@pytest.mark.parametrize("device", MSDA_DEVICES)
def test_bad_scheme_raises(gen, device):
    levels, value, loc, weights, grad_out = kernel_inputs(gen, device=device)
    expected = r"scheme must be one of \('fused', 'split', 'gather', 'hybrid', 'cells'\), got 'x'"
    with pytest.raises(ValueError, match=expected):
        launch.backward(grad_out, value, levels, loc, weights, scheme="x")


# ------------------------------------------------------------------------------------------------
# CUDA only
# ------------------------------------------------------------------------------------------------
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")
COCO_LEVELS = ((100, 167), (50, 84), (25, 42), (13, 21))
# Configurations that compile in about a second (one-sample-per-step kernels take tens): GPU time is scarce.
QUICK = {name: (2, 16, 4) for name in ("fused", "keys", "sample_grads", "scatter", "hybrid")}
QUICK_FORWARD = (2, 16, 4, 1)


@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deterministic_bitwise_on_gpu(dtype):
    """Encoder-sized call, samples clustered around each query (many per cell): 5 runs, one bitwise result."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    N, M, D, P = 1, 8, 32, 4
    S = sum(h * w for h, w in COCO_LEVELS)
    value = torch.randn(N, S, M, D, device="cuda", generator=gen).to(dtype)
    ref_points = torch.rand(N, S, 1, 1, 1, 2, device="cuda", generator=gen)
    loc = (ref_points + 0.01 * torch.randn(N, S, M, 4, P, 2, device="cuda", generator=gen)).contiguous()
    weights = torch.rand(N, S, M, 4 * P, device="cuda", generator=gen).softmax(-1).view(N, S, M, 4, P)
    grad_out = torch.randn(N, S, M * D, device="cuda", generator=gen).to(dtype)
    runs = [
        launch.backward(grad_out, value, COCO_LEVELS, loc, weights, deterministic=True, configs=QUICK) for _ in range(5)
    ]
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert torch.equal(a, b)
    atomic = launch.backward(grad_out, value, COCO_LEVELS, loc, weights, scheme="fused", configs=QUICK)
    for a, b in zip(runs[0], atomic):
        assert rel_err(a, b) < (1e-5 if dtype == torch.float32 else 1e-2)


def compiled_variants(kernel) -> int:
    """Number of compiled specializations a JITFunction holds (the cache's layout differs across Triton 3.x)."""
    if hasattr(kernel, "device_caches"):
        return sum(len(caches[0]) for caches in kernel.device_caches.values())
    return sum(len(cache) for cache in kernel.cache.values())


@CUDA
def test_new_image_size_neither_syncs_nor_recompiles(gen):
    """The level layout and Lq are unspecialized kernel arguments: a new layout reuses the compiled kernels."""
    first = kernel_inputs(gen, levels=((6, 4), (3, 2)), Lq=5, dtype=torch.float32, device="cuda")
    second = kernel_inputs(gen, levels=((17, 33), (9, 16)), Lq=32, dtype=torch.float32, device="cuda")
    kernel_results(*first, forward_config=QUICK_FORWARD, scheme="fused", configs=QUICK)
    torch.cuda.synchronize()
    kernels = (launch.msda_forward_kernel, launch.msda_backward_kernel)
    before = [compiled_variants(k) for k in kernels]
    torch.cuda.set_sync_debug_mode("error")
    try:
        results = kernel_results(*second, forward_config=QUICK_FORWARD, scheme="fused", configs=QUICK)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [compiled_variants(k) for k in kernels] == before
    assert_kernel_close(results, kernel_reference(*second), 1e-5, second)
