"""MSDeformAttn's fused pieces (models/fused/policy.py: "projections", "softmax") against its unfused ops, and the
policy that picks them.

With the pieces on (forced on the CPU, where the msda kernels run under Triton's interpreter) the module's output and
every gradient (its four layers' parameters, the query, the values, the reference points) match the module's with
them off; the locations stay float32 under autocast; the parameters are the same two nn.Linear layers.
"""

import pytest
import torch
from helpers import rel_err

import msda
from models.deformable_attention import MSDeformAttn
from models.fused import PIECES, fused, fusion

ATTENTION = ("projections", "softmax")
LEVELS = ((6, 5), (3, 3))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NONE = dict.fromkeys(PIECES, False)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(3)


def attention_inputs(gen, *, boxes=False, N=2, Lq=7, C=32, dtype=torch.float64):
    S = sum(h * w for h, w in LEVELS)
    query = torch.randn(N, Lq, C, generator=gen, dtype=dtype)
    if boxes:  # (cx, cy, w, h)
        reference = torch.cat(
            [torch.rand(N, Lq, 2, 2, generator=gen), 0.1 + 0.3 * torch.rand(N, Lq, 2, 2, generator=gen)], -1
        ).to(dtype)
    else:
        reference = torch.rand(N, Lq, 2, 2, generator=gen, dtype=dtype)
    values = torch.randn(N, S, C, generator=gen, dtype=dtype)
    padding = torch.zeros(N, S, dtype=torch.bool)
    padding[-1, -4:] = True
    return tuple(t.to(DEVICE) for t in (query, reference, values, padding))


def attention_module(msda_impl, dtype=torch.float64):
    torch.manual_seed(0)
    attn = MSDeformAttn(d_model=32, n_levels=2, nheads=4, n_points=3, msda=msda_impl).to(DEVICE, dtype)
    with torch.no_grad():  # points between pixels and unequal weights (the init's are zero)
        attn.sampling_offsets.weight.normal_(0, 0.2)
        attn.attention_weights.weight.normal_(0, 0.3)
        attn.attention_weights.bias.normal_(0, 0.5)
    return attn


def run(attn, inputs, grad):
    leaves = [t.detach().clone().requires_grad_() if t.is_floating_point() else t for t in inputs]
    attn.zero_grad()
    out = attn(leaves[0], leaves[1], leaves[2], LEVELS, None, leaves[3])
    out.backward(grad)
    grads = {name: p.grad.clone() for name, p in attn.named_parameters()}
    grads.update(query=leaves[0].grad, reference=leaves[1].grad, values=leaves[2].grad)
    return out.detach(), grads


@pytest.mark.parametrize("msda_impl", ["triton", "pytorch"])
@pytest.mark.parametrize("boxes", [False, True], ids=["points", "boxes"])
@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("pieces", [ATTENTION, ("projections",), ("softmax",)], ids=["both", "projections", "softmax"])
def test_fused_attention_matches_the_unfused_module(gen, msda_impl, boxes, dtype, rtol, pieces):
    attn = attention_module(msda_impl, dtype)
    inputs = attention_inputs(gen, boxes=boxes, dtype=dtype)
    grad = torch.randn(2, 7, 32, generator=gen, dtype=dtype).to(DEVICE)
    with fusion(**NONE):
        expected_out, expected = run(attn, inputs, grad)
    with fusion(**{**NONE, **dict.fromkeys(pieces, True)}):
        out, grads = run(attn, inputs, grad)
    assert rel_err(out, expected_out) < rtol
    assert grads.keys() == expected.keys()
    for name, g in grads.items():
        assert g.dtype == expected[name].dtype, name
        assert rel_err(g, expected[name]) < rtol, f"{name}: {rel_err(g, expected[name]):.2e}"


def test_empty_batch(gen):
    attn = attention_module("triton", torch.float32)
    query, reference, values, padding = (t[:0] for t in attention_inputs(gen, dtype=torch.float32))
    with fusion(projections=True, softmax=True):
        out = attn(query.requires_grad_(), reference, values.requires_grad_(), LEVELS, None, padding)
        out.sum().backward()
    assert out.shape == (0, 7, 32)
    assert all(p.grad is not None and not p.grad.any() for p in attn.parameters())


def test_locations_and_logits_stay_float32_under_autocast(gen, monkeypatch):
    """With both pieces: float32 locations (as unfused) and float32 logits into the op, which softmaxes them."""
    seen = []
    original = msda.multi_scale_deformable_attention

    def spy(value, shapes, start, loc, weights, impl, **kwargs):
        seen.append((value.dtype, loc.dtype, weights.dtype, kwargs))
        return original(value, shapes, start, loc, weights, impl=impl, **kwargs)

    monkeypatch.setattr(msda, "multi_scale_deformable_attention", spy)
    attn = attention_module("triton", torch.float32)
    query, reference, values, padding = attention_inputs(gen, dtype=torch.float32)
    with torch.autocast(DEVICE, dtype=torch.bfloat16), fusion(projections=True, softmax=True):
        attn(query, reference, values, LEVELS, None, padding)
    with torch.autocast(DEVICE, dtype=torch.bfloat16), fusion(**NONE):
        attn(query, reference, values, LEVELS, None, padding)
    # Unfused: bf16 logits, softmaxed in float32 by CUDA's autocast, in bf16 by the CPU's.
    unfused_weights = torch.float32 if DEVICE == "cuda" else torch.bfloat16
    assert seen == [
        (torch.bfloat16, torch.float32, torch.float32, {"weights_are_logits": True}),
        (torch.bfloat16, torch.float32, unfused_weights, {}),
    ]


def test_the_parameters_are_the_two_linear_layers():
    attn = attention_module("triton")
    names = {name: tuple(p.shape) for name, p in attn.named_parameters()}
    assert names == {
        "sampling_offsets.weight": (48, 32),
        "sampling_offsets.bias": (48,),
        "attention_weights.weight": (24, 32),
        "attention_weights.bias": (24,),
        "value_proj.weight": (32, 32),
        "value_proj.bias": (32,),
        "output_proj.weight": (32, 32),
        "output_proj.bias": (32,),
    }


# ------------------------------------------------------------------------------------------------
# the policy
# ------------------------------------------------------------------------------------------------
def test_nothing_is_fused_on_the_cpu_by_default():
    t = torch.zeros(1)
    assert not any(fused(piece, t) for piece in PIECES)
    if torch.cuda.is_available():
        assert all(fused(piece, t.cuda()) for piece in PIECES)
    with fusion(add_norm=True, softmax=True):
        assert [fused(piece, t) for piece in PIECES] == [True, False, False, True]
        with fusion(add_norm=None, softmax=False):
            assert [fused(piece, t) for piece in PIECES] == [False, False, False, False]
        assert fused("add_norm", t)
    assert not any(fused(piece, t) for piece in PIECES)


def test_an_unknown_piece_is_refused():
    with (
        pytest.raises(ValueError, match=r"unknown fused pieces \['norm'\]; the pieces are \('add_norm',"),
        fusion(norm=True),
    ):
        pass


def test_under_torch_compile_nothing_runs_fused():
    """Inductor fuses the elementwise work itself: under torch.compile every piece stays unfused, eagerly each runs."""

    def pieces_on(t):
        return torch.stack([t + float(fused(piece, t)) for piece in PIECES])

    torch._dynamo.reset()
    compiled = torch.compile(pieces_on, backend="eager", fullgraph=True)
    with fusion(**dict.fromkeys(PIECES, True)):
        assert compiled(torch.zeros(1)).flatten().tolist() == [0.0, 0.0, 0.0, 0.0]
        assert pieces_on(torch.zeros(1)).flatten().tolist() == [1.0, 1.0, 1.0, 1.0]


def test_under_torch_export_nothing_runs_fused():
    """An exported graph keeps msda::attention (export.py's TensorRT node replaces it by name) and the plain ops."""

    class Pieces(torch.nn.Module):
        def forward(self, t):
            return torch.stack([t + float(fused(piece, t)) for piece in PIECES])

    with fusion(**dict.fromkeys(PIECES, True)):
        exported = torch.export.export(Pieces(), (torch.zeros(1),))
    assert exported.module()(torch.zeros(1)).flatten().tolist() == [0.0, 0.0, 0.0, 0.0]
