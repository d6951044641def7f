"""model.msda=triton against model.msda=pytorch: same outputs and gradients on a tiny model.

Both fp32 models are compared with the same model in float64 (the reference implementation), which is
the ground truth: a parameter's gradient sums many terms, and where they cancel, any two fp32 summation
orders differ by more than a fixed tolerance of the gradient's size. So the Triton model's error must
stay within a small multiple of the reference's own fp32 error, element by element at the worst one.

Without CUDA the Triton kernels run under the interpreter, which must be on before triton is imported
(tests/conftest.py sets it too; repeated here so this file also runs on its own).
"""

from __future__ import annotations

import copy
import os

import torch
from helpers import image_batch, output_loss, tiny_cfg

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from models.deformable_attention import MSDeformAttn
from models.deformable_detr import build_deformable_detr

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _with_msda(model, msda):
    twin = copy.deepcopy(model)
    for m in twin.modules():
        if isinstance(m, MSDeformAttn):
            m.msda = msda
    return twin


def _run(model, images, mask):
    out = model(images.to(next(model.parameters()).dtype), mask)
    output_loss(out).backward()
    return out, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("variant", ["base", "box_refine", "two_stage"])  # 2-d and 4-d reference points
def test_triton_and_pytorch_give_the_same_outputs_and_gradients(variant, full_fp32):
    torch.manual_seed(0)
    reference = build_deformable_detr(tiny_cfg(variant, msda="pytorch")).to(DEVICE).train()  # dropout is 0
    # Non-trivial offsets and attention weights (the init has zero weights): points fall between pixels.
    with torch.no_grad():
        for m in reference.modules():
            if isinstance(m, MSDeformAttn):
                m.sampling_offsets.weight.normal_(0, 0.05)
                m.attention_weights.weight.normal_(0, 0.05)
    images, mask = image_batch(pad_w=16)
    images, mask = images.to(DEVICE), mask.to(DEVICE)

    _out_64, grads_64 = _run(_with_msda(reference, "pytorch").double(), images, mask)  # plain fp32 products: full_fp32
    out_ref, grads_ref = _run(_with_msda(reference, "pytorch"), images, mask)
    out_tri, grads_tri = _run(_with_msda(reference, "triton"), images, mask)

    torch.testing.assert_close(out_tri["pred_logits"], out_ref["pred_logits"], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out_tri["pred_boxes"], out_ref["pred_boxes"], atol=1e-4, rtol=1e-4)
    assert grads_tri.keys() == grads_ref.keys() == grads_64.keys()
    errors = {}
    for name, truth in grads_64.items():
        scale = truth.abs().max().clamp(min=1e-3)  # relative to each tensor's gradient size
        errors[name] = tuple(
            ((grads[name].double() - truth).abs().max() / scale).item() for grads in (grads_tri, grads_ref)
        )
    # Within 4x the reference's own fp32 error, or 2e-4 of the tensor's largest gradient (fp32 rounding of
    # a sum of thousands of terms); a wrong gradient misses by orders of magnitude more.
    worst = sorted(errors.items(), key=lambda kv: kv[1][0] / max(4 * kv[1][1], 2e-4), reverse=True)[:5]
    report = ", ".join(f"{n}: triton {t:.2e} / reference {r:.2e}" for n, (t, r) in worst)
    for name, (err_tri, err_ref) in errors.items():
        assert err_tri <= max(4 * err_ref, 2e-4), f"{name}; error from float64, worst first: {report}"
