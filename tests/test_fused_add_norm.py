"""LayerNorm(x + y) as one Triton kernel (models/fused/add_norm.py) against F.layer_norm(x + y): the output and the
gradients of x, y, weight and bias, fresh random inputs per test, on odd row counts, hidden sizes that are not powers of
2, mixed and reduced precision, empty batches; and the encoder's residual norm choosing it only where its dropout does
nothing. Without a GPU the kernel runs under Triton's interpreter (tests/conftest.py)."""

import pytest
import torch
import torch.nn.functional as F
from helpers import MSDA_DEVICES, rel_err
from torch import nn

from models.fused import add_layer_norm, fusion, residual_norm
from models.fused import add_norm as add_norm_module

# (leading shape, C): odd row counts, C a power of 2 or not, more row blocks than the backward's programs
SHAPES = [
    pytest.param((2, 37), 48, id="74x48"),
    pytest.param((3,), 200, id="3x200"),
    pytest.param((1, 5), 7, id="5x7"),
    pytest.param((300,), 32, id="300x32-persistent"),
    pytest.param((2, 9), 256, id="18x256"),
]


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(77)


def inputs(gen, lead, C, dtype=torch.float64, y_dtype=None, device="cpu"):
    """x, y (*lead, C); weight, bias (C,) away from 1 and 0; the output's gradient."""
    x = torch.randn(*lead, C, generator=gen, dtype=torch.float64) * 2 + 0.5
    y = torch.randn(*lead, C, generator=gen, dtype=torch.float64)
    weight = 1 + 0.3 * torch.randn(C, generator=gen, dtype=torch.float64)
    bias = 0.2 * torch.randn(C, generator=gen, dtype=torch.float64)
    grad = torch.randn(*lead, C, generator=gen, dtype=torch.float64)
    x, weight, bias, grad = (t.to(device, dtype) for t in (x, weight, bias, grad))
    return x, y.to(device, y_dtype or dtype), weight, bias, grad


def results(fn, x, y, weight, bias, grad):
    leaves = [t.detach().clone().requires_grad_() for t in (x, y, weight, bias)]
    out = fn(*leaves)
    return (out.detach(), *torch.autograd.grad(out, leaves, grad.to(out.dtype)))


def fused_fn(x, y, weight, bias):
    return add_layer_norm(x, y, weight, bias, 1e-5)


def plain_fn(x, y, weight, bias):
    return F.layer_norm(x + y, (x.shape[-1],), weight, bias, 1e-5)


NAMES = ("output", "grad_x", "grad_y", "grad_weight", "grad_bias")


@pytest.mark.parametrize("device", MSDA_DEVICES)
@pytest.mark.parametrize("lead,C", SHAPES)
@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_matches_layer_norm_of_the_sum(gen, device, lead, C, dtype, rtol):
    args = inputs(gen, lead, C, dtype, device=device)
    got, expected = results(fused_fn, *args), results(plain_fn, *args)
    for name, a, b in zip(NAMES, got, expected):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert rel_err(a, b) < rtol, f"{name}: {rel_err(a, b):.2e}"


@pytest.mark.parametrize("device", MSDA_DEVICES)
def test_float32_and_bfloat16_inputs(gen, device):
    """The encoder under autocast: the layer's float32 input plus a bf16 attention or FFN output. The sum is float32,
    as torch's; each gradient comes back in its input's dtype."""
    args = inputs(gen, (2, 11), 48, torch.float32, y_dtype=torch.bfloat16, device=device)
    got, expected = results(fused_fn, *args), results(plain_fn, *args)
    assert [t.dtype for t in got] == [torch.float32, torch.float32, torch.bfloat16, torch.float32, torch.float32]
    for name, a, b in zip(NAMES, got, expected):
        assert a.dtype == b.dtype, name
        assert rel_err(a, b) < (1e-2 if name == "grad_y" else 1e-5), f"{name}: {rel_err(a, b):.2e}"


@pytest.mark.parametrize("device", MSDA_DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_sum_is_rounded_as_torch_rounds_it(gen, device, dtype):
    """Both inputs 2-byte: the sum is rounded to that dtype before it is normalized, as x + y is; the output in it."""
    x, y, weight, bias, grad = inputs(gen, (4, 5), 40, torch.float32, device=device)
    x, y = x.to(dtype), y.to(dtype)
    got = fused_fn(x, y, weight, bias)
    assert got.dtype == dtype
    expected = F.layer_norm((x + y).float(), (40,), weight, bias, 1e-5)  # the rounded sum, normalized in float32
    assert (got.float() - expected).abs().max() <= 2**-7 * expected.abs().max()
    grads = torch.autograd.grad(
        add_layer_norm(*(t.requires_grad_() for t in (x, y, weight, bias)), 1e-5), (x, y, weight, bias), grad.to(dtype)
    )
    assert [g.dtype for g in grads] == [dtype, dtype, torch.float32, torch.float32]


@pytest.mark.parametrize("device", MSDA_DEVICES)
def test_output_dtype_under_autocast_is_layer_norms(gen, device):
    """Under the CPU's autocast layer_norm keeps bf16; CUDA's runs it in float32."""
    x, y, weight, bias, _ = inputs(gen, (2, 3), 16, torch.float32, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        for a, b in ((x, y.bfloat16()), (x.bfloat16(), y.bfloat16())):
            assert fused_fn(a, b, weight, bias).dtype == plain_fn(a, b, weight, bias).dtype


@pytest.mark.parametrize("device", MSDA_DEVICES)
@pytest.mark.parametrize("lead", [(0, 5), (0,)], ids=["empty-batch", "no-rows"])
def test_empty(gen, device, lead):
    args = inputs(gen, lead, 24, torch.float32, device=device)
    out, *grads = results(fused_fn, *args)
    assert out.shape == (*lead, 24)
    for grad, t in zip(grads, args[:4]):
        assert grad.shape == t.shape and grad.dtype == t.dtype and not grad.any()


@pytest.mark.parametrize("device", MSDA_DEVICES)
def test_gradcheck(gen, device):
    args = [t.requires_grad_() for t in inputs(gen, (3,), 6, device=device)[:4]]
    assert torch.autograd.gradcheck(fused_fn, args, eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("device", MSDA_DEVICES)
def test_backward_is_bitwise_repeatable(gen, device):
    """The weight's and bias's gradients are summed per program in a fixed order, then over programs: no atomics."""
    args = inputs(gen, (300,), 32, torch.float32, device=device)
    first, second = results(fused_fn, *args), results(fused_fn, *args)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------
# the encoder's residual norm: which path runs
# ------------------------------------------------------------------------------------------------
def spy_fused(monkeypatch) -> list:
    calls = []
    real = add_norm_module.AddLayerNorm.apply
    monkeypatch.setattr(add_norm_module.AddLayerNorm, "apply", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("device", MSDA_DEVICES)
@pytest.mark.parametrize(
    "p,training,fuses", [(0.0, True, True), (0.1, False, True), (0.1, True, False)], ids=["p0", "eval", "dropout"]
)
def test_residual_norm_fuses_only_where_the_dropout_does_nothing(gen, device, monkeypatch, p, training, fuses):
    calls = spy_fused(monkeypatch)
    norm, dropout = nn.LayerNorm(48).to(device), nn.Dropout(p).train(training)
    x, y, *_ = inputs(gen, (2, 7), 48, torch.float32, device=device)
    with fusion(add_norm=True):
        got = residual_norm(norm, dropout, x, y)
    assert bool(calls) == fuses
    with fusion(add_norm=False):  # off: the plain modules, bit for bit
        assert torch.equal(residual_norm(norm, nn.Dropout(0.0), x, y), norm(x + y)) and len(calls) == fuses
    if not training or p == 0:
        assert rel_err(got, norm(x + y)) < 1e-6


def test_residual_norm_on_the_cpu_is_the_plain_modules(gen, monkeypatch):  # no kernel: runs anywhere
    """By default nothing is fused on the CPU: the result is the plain modules', bit for bit."""
    calls = spy_fused(monkeypatch)
    norm, dropout = nn.LayerNorm(48), nn.Dropout(0.0)
    x, y, *_ = inputs(gen, (2, 7), 48, torch.float32)
    assert torch.equal(residual_norm(norm, dropout, x, y), norm(x + dropout(y)))
    assert calls == []


# ------------------------------------------------------------------------------------------------
# CUDA only
# ------------------------------------------------------------------------------------------------
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")


@CUDA
def test_encoder_sized_under_cuda_autocast():
    """An encoder layer's rows (one COCO image, C = 256) under bf16 autocast: float32 output as CUDA's autocast gives
    layer_norm, and every gradient within float32 rounding of the unfused ops'."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 22223, 256, device="cuda", generator=gen)
    y = torch.randn(2, 22223, 256, device="cuda", generator=gen).bfloat16()
    norm = nn.LayerNorm(256).cuda()
    with torch.no_grad():
        norm.weight.normal_(1, 0.2, generator=gen)
        norm.bias.normal_(0, 0.2, generator=gen)
    grad = torch.randn(2, 22223, 256, device="cuda", generator=gen)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = results(fused_fn, x, y, norm.weight, norm.bias, grad)
        expected = results(plain_fn, x, y, norm.weight, norm.bias, grad)
    for name, a, b in zip(NAMES, got, expected):
        assert a.dtype == b.dtype, name
        assert rel_err(a, b) < (1e-2 if name == "grad_y" else 1e-5), f"{name}: {rel_err(a, b):.2e}"
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert fused_fn(x.bfloat16(), y, norm.weight, norm.bias).dtype == torch.float32
