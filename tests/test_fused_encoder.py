"""The encoder layer and the whole tiny detector with every fused piece (models/fused/policy.py) against the same model
with none: the same outputs and gradients of every parameter. On the CPU the pieces are forced (Triton under its
interpreter); the default CPU path is the unfused one, bit for bit (tests/test_hybrid_matching.py's training
fingerprint checks that)."""

import pytest
import torch
from helpers import gradient_errors, image_batch, output_loss, rel_err, tiny_cfg

from models.deformable_detr import build_deformable_detr
from models.deformable_transformer import DeformableTransformerEncoder, DeformableTransformerEncoderLayer
from models.fused import PIECES, add_norm, fusion

ALL, NONE = dict.fromkeys(PIECES, True), dict.fromkeys(PIECES, False)
LEVELS = ((6, 5), (3, 3))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(11)


def encoder_layer(dropout):
    torch.manual_seed(0)
    layer = DeformableTransformerEncoderLayer(
        d_model=32, d_ffn=72, dropout=dropout, n_levels=2, nheads=4, n_points=2, msda="triton"
    ).to(DEVICE, torch.float64)
    with torch.no_grad():
        for p in layer.parameters():  # away from the init's zeros and ones: every term of every gradient counts
            p.add_(0.1 * torch.randn_like(p))
    return layer


def layer_results(layer, gen, seed=0):
    S = sum(h * w for h, w in LEVELS)
    src = torch.randn(2, S, 32, generator=gen, dtype=torch.float64).to(DEVICE).requires_grad_()
    pos = torch.randn(2, S, 32, generator=gen, dtype=torch.float64).to(DEVICE)
    valid = torch.ones(2, 2, 2, dtype=torch.float64, device=DEVICE)
    reference = DeformableTransformerEncoder.get_reference_points(LEVELS, valid, DEVICE)
    padding = torch.zeros(2, S, dtype=torch.bool, device=DEVICE)
    torch.manual_seed(seed)  # the dropouts' masks
    out = layer(src, pos, reference, LEVELS, padding)
    layer.zero_grad()
    out.backward(torch.randn(out.shape, generator=gen, dtype=torch.float64).to(DEVICE))
    return out.detach(), {"src": src.grad, **{name: p.grad.clone() for name, p in layer.named_parameters()}}


@pytest.mark.parametrize("dropout,training", [(0.0, True), (0.1, False), (0.1, True)], ids=["p0", "eval", "dropout"])
def test_encoder_layer_with_every_piece(gen, monkeypatch, dropout, training):
    """Every piece but the residual norms where a dropout runs; the dropouts draw the same masks either way."""
    calls = []
    real = add_norm.AddLayerNorm.apply
    monkeypatch.setattr(add_norm.AddLayerNorm, "apply", lambda *a: calls.append(1) or real(*a))
    layer = encoder_layer(dropout).train(training)
    state = gen.get_state()
    with fusion(**NONE):
        expected_out, expected = layer_results(layer, gen)
    assert calls == []
    gen.set_state(state)
    with fusion(**ALL):
        out, grads = layer_results(layer, gen)
    assert len(calls) == (0 if training and dropout else 2)
    assert rel_err(out, expected_out) < 1e-10
    for name, g in grads.items():
        assert rel_err(g, expected[name]) < 1e-10, f"{name}: {rel_err(g, expected[name]):.2e}"


def test_detector_with_every_piece(full_fp32):
    """The tiny two-stage detector (encoder, decoder cross-attention, proposals) in float64 through the Triton kernels:
    every output and every parameter's gradient as without the pieces."""
    torch.manual_seed(0)
    model = build_deformable_detr(tiny_cfg("two_stage", msda="triton")).to(DEVICE, torch.float64).train()  # dropout 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "sampling_offsets.weight" in name or "attention_weights.weight" in name:
                p.normal_(0, 0.05)  # points between pixels, unequal weights
    images, mask = (t.to(DEVICE) for t in image_batch(B=2, H=64, W=64, pad_w=16))
    results = []
    for pieces in (NONE, ALL):
        model.zero_grad()
        with fusion(**pieces):
            out = model(images.double(), mask)
            output_loss(out).backward()
        results.append((out, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}))
    (expected_out, expected), (out, grads) = results
    for key in ("pred_logits", "pred_boxes"):
        assert rel_err(out[key], expected_out[key]) < 1e-9, key
    assert grads.keys() == expected.keys()
    for name, error in gradient_errors(grads, expected, floor=1e-6).items():
        assert error < 1e-8, name
