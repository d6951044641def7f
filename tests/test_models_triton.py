"""model.msda=triton against model.msda=pytorch: same outputs and gradients on a tiny model.

Without CUDA the Triton kernels run under the interpreter, which must be on before triton is imported
(tests/conftest.py sets it too; repeated here so this file also runs on its own).
"""

from __future__ import annotations

import copy
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from models.deformable_attention import MSDeformAttn  # noqa: E402
from models.deformable_detr import build_deformable_detr  # noqa: E402
from test_models import _batch, tiny_cfg  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _loss(out):
    # Touch every output (and every point of the boxes) so all gradients flow through the attention.
    loss = out["pred_logits"].sigmoid().square().sum() + out["pred_boxes"].square().sum()
    for aux in out.get("aux_outputs", []):
        loss = loss + aux["pred_logits"].sigmoid().square().sum() + aux["pred_boxes"].square().sum()
    return loss


@pytest.mark.parametrize("variant", ["box_refine", "two_stage"])  # 2-d and 4-d reference points
def test_triton_and_pytorch_give_the_same_outputs_and_gradients(variant):
    torch.manual_seed(0)
    reference = build_deformable_detr(tiny_cfg(variant, msda="pytorch")).to(DEVICE).train()  # dropout is 0
    # Non-trivial offsets and attention weights (the init has zero weights): points fall between pixels.
    with torch.no_grad():
        for m in reference.modules():
            if isinstance(m, MSDeformAttn):
                m.sampling_offsets.weight.normal_(0, 0.05)
                m.attention_weights.weight.normal_(0, 0.05)
    triton_model = copy.deepcopy(reference)
    for m in triton_model.modules():
        if isinstance(m, MSDeformAttn):
            m.msda = "triton"

    images, mask = _batch(pad_w=16)
    images, mask = images.to(DEVICE), mask.to(DEVICE)
    out_ref, out_tri = reference(images, mask), triton_model(images, mask)
    torch.testing.assert_close(out_tri["pred_logits"], out_ref["pred_logits"], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out_tri["pred_boxes"], out_ref["pred_boxes"], atol=1e-4, rtol=1e-4)

    _loss(out_ref).backward()
    _loss(out_tri).backward()
    params_tri = dict(triton_model.named_parameters())
    for name, p in reference.named_parameters():
        if p.grad is None:
            continue
        scale = p.grad.abs().max().clamp(min=1e-3)  # compare relative to each tensor's gradient size
        torch.testing.assert_close(params_tri[name].grad / scale, p.grad / scale, atol=2e-4, rtol=1e-3,
                                   msg=lambda m, name=name: f"{name}: {m}")
