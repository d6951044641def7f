"""relu(linear(x)) as one matmul with a ReLU epilogue (models/fused/linear_activation.py) against
torch.relu(F.linear(...)): the output and the gradients of x, weight and bias, fresh random inputs, widths that are not
powers of 2, empty batches, autocast, frozen weights; and the FFN choosing it only where the policy says."""

import pytest
import torch
import torch.nn.functional as F
from helpers import rel_err
from torch import nn

from models.fused import fusion, linear_activation, linear_relu
from models.fused.linear_activation import linear_relu_fused

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
NAMES = ("output", "grad_x", "grad_weight", "grad_bias")


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(5)


def inputs(gen, lead, K, N, dtype=torch.float64, device="cpu"):
    tensors = (
        torch.randn(*lead, K, generator=gen, dtype=torch.float64),
        torch.randn(N, K, generator=gen, dtype=torch.float64) / K**0.5,
        torch.randn(N, generator=gen, dtype=torch.float64) * 0.5,
        torch.randn(*lead, N, generator=gen, dtype=torch.float64),
    )
    return tuple(t.to(device, dtype) for t in tensors)


def results(fn, x, weight, bias, grad):
    leaves = [t.detach().clone().requires_grad_() for t in (x, weight, bias)]
    out = fn(*leaves)
    return (out.detach(), *torch.autograd.grad(out, leaves, grad.to(out.dtype)))


def plain(x, weight, bias):
    return torch.relu(F.linear(x, weight, bias))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lead,K,N", [((2, 37), 48, 200), ((5,), 7, 3), ((1, 3, 4), 64, 64)])
@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_matches_relu_of_linear(gen, device, lead, K, N, dtype, rtol):
    args = inputs(gen, lead, K, N, dtype, device)
    for name, a, b in zip(NAMES, results(linear_relu_fused, *args), results(plain, *args)):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert rel_err(a, b) < rtol, f"{name}: {rel_err(a, b):.2e}"


def test_zero_pre_activations_take_no_gradient(gen):
    """Where the pre-activation is exactly 0 the gradient is 0, as ReLU's backward gives it."""
    x, weight, bias, grad = inputs(gen, (4,), 8, 6)
    x, bias = torch.zeros_like(x), torch.zeros_like(bias)
    for a, b in zip(results(linear_relu_fused, x, weight, bias, grad), results(plain, x, weight, bias, grad)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch(gen, device):
    x, weight, bias, grad = inputs(gen, (0, 5), 16, 24, torch.float32, device)
    out, *grads = results(linear_relu_fused, x, weight, bias, grad)
    assert out.shape == (0, 5, 24)
    for g, t in zip(grads, (x, weight, bias)):
        assert g.shape == t.shape and not g.any()


def test_gradcheck(gen):
    args = [t.requires_grad_() for t in inputs(gen, (2, 3), 5, 7)[:3]]
    assert torch.autograd.gradcheck(linear_relu_fused, args)


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_casts_as_linear_does(gen, device):
    """Under autocast the matmul runs in the autocast dtype, as linear's would: same dtype, same values to its
    rounding; every gradient in its input's dtype."""
    dtype = torch.bfloat16
    args = inputs(gen, (3, 9), 32, 40, torch.float32, device)
    with torch.autocast(device, dtype=dtype):
        got, expected = results(linear_relu_fused, *args), results(plain, *args)
    for name, a, b in zip(NAMES, got, expected):
        assert a.dtype == b.dtype, name
        assert rel_err(a, b) < 1e-2, f"{name}: {rel_err(a, b):.2e}"


def test_frozen_weights(gen):
    x, weight, bias, grad = inputs(gen, (3,), 8, 6)
    x.requires_grad_()
    (grad_x,) = torch.autograd.grad(linear_relu_fused(x, weight, bias), x, grad)
    (expected,) = torch.autograd.grad(plain(x, weight, bias), x, grad)
    assert rel_err(grad_x, expected) < 1e-12


def test_linear_relu_follows_the_policy(gen, monkeypatch):
    calls = []
    real = linear_activation.LinearReLU.apply
    monkeypatch.setattr(linear_activation.LinearReLU, "apply", lambda *a: calls.append(1) or real(*a))
    linear = nn.Linear(8, 12)
    x = torch.randn(2, 3, 8, generator=gen)
    assert torch.equal(linear_relu(linear, x), F.relu(linear(x)))  # the CPU's default: the plain ops, bit for bit
    assert calls == []
    with fusion(linear_relu=True):
        assert rel_err(linear_relu(linear, x), F.relu(linear(x))) < 1e-6
    assert calls == [1]
