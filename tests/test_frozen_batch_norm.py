"""models.frozen_batch_norm: torchvision's FrozenBatchNorm2d function with a cached affine."""

import pytest
import torch
from torchvision.ops.misc import FrozenBatchNorm2d as TorchvisionFrozenBatchNorm2d

from models.frozen_batch_norm import FrozenBatchNorm2d

STATS = ("weight", "bias", "running_mean", "running_var")


def _pair(channels: int, seed: int):
    """Ours and torchvision's, with the same random statistics (variance > 0)."""
    gen = torch.Generator().manual_seed(seed)
    ours, theirs = FrozenBatchNorm2d(channels), TorchvisionFrozenBatchNorm2d(channels)
    for name in STATS:
        values = torch.rand(channels, generator=gen) * 2 + (0.1 if name == "running_var" else -1.0)
        getattr(ours, name).copy_(values)
        getattr(theirs, name).copy_(values)
    return ours, theirs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_it_computes_torchvisions_function_and_gradient(dtype):
    ours, theirs = _pair(13, seed=1)
    ours.to(dtype)
    theirs.to(dtype)
    x = torch.randn(3, 13, 5, 7, dtype=dtype, requires_grad=True)
    grad = torch.randn(3, 13, 5, 7, dtype=dtype)
    expected = theirs(x)
    (expected_grad,) = torch.autograd.grad(expected, x, grad)
    got = ours(x)
    (got_grad,) = torch.autograd.grad(got, x, grad)
    tol = 1e-6 if dtype == torch.float32 else 1e-13
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
    torch.testing.assert_close(got_grad, expected_grad, rtol=tol, atol=tol)


def test_new_statistics_are_used_after_load_and_in_place_change():
    ours, theirs = _pair(6, seed=2)
    x = torch.randn(2, 6, 4, 4)
    ours(x)  # fills the cache
    source, _ = _pair(6, seed=3)
    ours.load_state_dict(source.state_dict())
    theirs.load_state_dict(source.state_dict())
    torch.testing.assert_close(ours(x), theirs(x))
    ours.running_var.mul_(4)
    theirs.running_var.mul_(4)
    torch.testing.assert_close(ours(x), theirs(x))
    ours.double()  # new buffer tensors
    theirs.double()
    torch.testing.assert_close(ours(x.double()), theirs(x.double()))


def test_buffers_replaced_by_load_state_dict_with_assign_are_used():
    ours, theirs = _pair(5, seed=9)
    x = torch.randn(2, 5, 3, 3)
    ours(x)  # fills the cache
    source, _ = _pair(5, seed=10)
    # New tensors with the old ones' version (one in-place write each, as _pair made): only identity differs.
    state = {k: v.clone().mul_(1) for k, v in source.state_dict().items()}
    assert all(state[k]._version == getattr(ours, k)._version for k in STATS)
    ours.load_state_dict(state, assign=True)
    theirs.load_state_dict(state)
    assert ours.running_var is state["running_var"]
    torch.testing.assert_close(ours(x), theirs(x))


def test_state_dict_keys_are_torchvisions_and_num_batches_tracked_is_dropped():
    ours, theirs = _pair(4, seed=4)
    assert list(ours.state_dict()) == list(theirs.state_dict()) == list(STATS)
    state = {**theirs.state_dict(), "num_batches_tracked": torch.tensor(7)}
    ours.load_state_dict(state)
    torch.testing.assert_close(ours(torch.ones(1, 4, 2, 2)), theirs(torch.ones(1, 4, 2, 2)))


def test_a_cache_made_under_inference_mode_serves_a_later_backward():
    """Evaluation (inference mode) between training epochs must not leave inference tensors behind."""
    ours, theirs = _pair(5, seed=5)
    with torch.inference_mode():
        ours(torch.randn(1, 5, 3, 3))
    x = torch.randn(2, 5, 3, 3, requires_grad=True)
    (grad,) = torch.autograd.grad(ours(x).square().sum(), x)
    (expected,) = torch.autograd.grad(theirs(x).square().sum(), x)
    torch.testing.assert_close(grad, expected)


def test_a_module_made_under_inference_mode_works_in_and_out_of_it():
    """Its buffers are inference tensors, which keep no version counter to key a cache on."""
    with torch.inference_mode():
        ours, theirs = _pair(4, seed=8)
        x = torch.randn(1, 4, 3, 3)
        torch.testing.assert_close(ours(x), theirs(x))
        ours.running_var.mul_(3)
        theirs.running_var.mul_(3)
    torch.testing.assert_close(ours(x), theirs(x))


def test_under_autocast_the_output_keeps_the_inputs_half_precision():
    ours, theirs = _pair(8, seed=6)
    x = torch.randn(2, 8, 4, 4).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = ours(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), theirs(x.float()), rtol=2e-2, atol=2e-2)


def test_compiled_without_graph_break_equals_eager():
    ours, _ = _pair(6, seed=7)
    x = torch.randn(2, 6, 5, 5)
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), ours(x))
