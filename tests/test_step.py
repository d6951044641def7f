"""engine.train.step.OptimizerStep: one optimizer step, a non-finite one skipped on the device, and no host syncs.

Also torch.compile of the tiny model's forward and backward (fullgraph, aot_eager) with model.msda=triton
(under the interpreter without a GPU) and pytorch: no graph break, the outputs and gradients of eager.
engine/compile/plan.py's regions are tested in tests/test_compile.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import image_batch, make_step, optim_cfg, output_loss, tiny_cfg, two_box_targets

from engine.runtime.precision import Precision
from engine.train.optim import build_optimizer
from engine.train.step import OptimizerStep
from models import build_model
from models.deformable_attention import MSDeformAttn


@pytest.fixture
def seeded():
    torch.manual_seed(0)


def _state(step: OptimizerStep):
    params = {n: p.detach().clone() for n, p in step.model.named_parameters()}
    moments = [{k: v.clone() for k, v in s.items()} for s in step.optimizer.state.values()]
    return params, moments


def test_the_box_count_average_starts_before_the_forward_and_is_read_after_the_matching(seeded):
    """A multi-process run's all-reduce of the box count has the whole forward to finish, and the matching's
    host sync does not wait for it (engine.runtime.distributed.average_over_processes)."""
    step = make_step()
    events = []
    step.model.register_forward_pre_hook(lambda module, args: events.append("forward"))
    match_groups = step.criterion.matcher.match_groups
    step.criterion.matcher.match_groups = lambda groups: events.append("matching") or match_groups(groups)

    def average_num_boxes(count):
        events.append("average started")
        return lambda: events.append("average read") or max(1.0, count)

    step.average_num_boxes = average_num_boxes
    step(*image_batch(), two_box_targets())
    assert events == ["average started", "forward", "matching", "average read"]


def test_a_step_returns_its_losses_and_updates_the_weights(seeded):
    step = make_step()
    before, _ = _state(step)
    values = step(*image_batch(), two_box_targets())
    names = step.value_names
    assert names[:2] == ("loss", "grad_norm") and "loss_ce" in names and values.shape == (len(names),)
    assert values.dtype == torch.float32 and torch.isfinite(values).all()
    weights = step.criterion.weight_dict
    row = dict(zip(names, values.tolist()))
    assert row["loss"] == pytest.approx(sum(row[k] * w for k, w in weights.items()), rel=1e-5)
    after, _ = _state(step)
    assert any(not torch.equal(before[n], after[n]) for n in before)


def test_a_non_finite_step_is_skipped_without_touching_weights_or_moments(seeded):
    step = make_step()
    step(*image_batch(), two_box_targets())  # one good step, so that the optimizer has moments to protect
    before, moments_before = _state(step)
    counts_before = [s["step"].clone() for s in step.optimizer.state.values()]
    images, mask = image_batch()
    images[0, 0, 0, 0] = float("nan")
    values = step(images, mask, two_box_targets())
    assert not torch.isfinite(values[0]) and not torch.isfinite(values[1])
    after, moments_after = _state(step)
    assert all(torch.equal(before[n], after[n]) for n in before)
    for m_before, m_after in zip(moments_before, moments_after):
        assert all(torch.equal(m_before[k], m_after[k]) for k in m_before)
    assert all(torch.equal(c, s["step"]) for c, s in zip(counts_before, step.optimizer.state.values()))
    assert torch.isfinite(step(*image_batch(), two_box_targets())).all()  # and training goes on


def test_the_step_needs_a_non_negative_clip_norm():
    model, criterion, _ = build_model(tiny_cfg(msda="pytorch"))
    with pytest.raises(ValueError, match="clip_max_norm must be >= 0"):
        OptimizerStep(
            model=model,
            criterion=criterion,
            optimizer=build_optimizer(model, optim_cfg()),
            precision=Precision(amp="none", device=torch.device("cpu")),
            clip_max_norm=-1.0,
        )


# Tracing a whole model takes a while on a CPU: the two implementations, each on one variant (two-stage
# covers box refinement, box reference points and the encoder proposals).
@pytest.mark.parametrize("msda,variant", [("pytorch", "base"), ("triton", "two_stage")])
def test_compiled_model_has_no_graph_break_and_matches_eager(seeded, msda, variant, full_fp32):
    torch._dynamo.reset()
    device = "cuda" if torch.cuda.is_available() else "cpu"  # triton on the CPU runs under the interpreter
    # cuDNN runs float32 convolutions in TF32 by default, and the two graphs may pick different algorithms
    # (one weight gradient element of 73,728 differed by 0.4% on a GPU): compare in full float32 (full_fp32).
    eager, _, _ = build_model(tiny_cfg(variant, msda=msda))
    eager.to(device)
    with torch.no_grad():  # non-trivial offsets and weights, so that the attention gradients are not all zero
        for m in eager.modules():
            if isinstance(m, MSDeformAttn):
                m.sampling_offsets.weight.normal_(0, 0.05)
                m.attention_weights.weight.normal_(0, 0.05)
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, fullgraph=True, backend="aot_eager", dynamic=True)
    images, mask = (t.to(device) for t in image_batch(pad_w=16))
    out_eager, out_compiled = eager(images, mask), compiled(images, mask)
    torch.testing.assert_close(out_compiled["pred_logits"], out_eager["pred_logits"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_compiled["pred_boxes"], out_eager["pred_boxes"], rtol=1e-5, atol=1e-5)
    output_loss(out_eager).backward()
    output_loss(out_compiled).backward()
    grads = dict(twin.named_parameters())
    # On a GPU the convolutions' weight gradients and the attention backward sum with atomics, in an order
    # that changes run to run: on the H200, 2 of 294,912 elements of input_proj.3.0.weight (gradients that
    # mostly cancel) differed by 1.2e-5 of the largest, in both implementations. A traced model that
    # computed something else would differ by orders of magnitude more.
    atol = 1e-4 if device == "cuda" else 1e-5
    for name, p in eager.named_parameters():
        if p.grad is not None:
            scale = p.grad.abs().max().clamp(min=1e-3)
            torch.testing.assert_close(
                grads[name].grad / scale, p.grad / scale, rtol=1e-4, atol=atol, msg=lambda m, name=name: f"{name}: {m}"
            )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")
@pytest.mark.parametrize("variant", ["base", "box_refine", "two_stage"])
def test_model_forward_and_backward_never_sync_with_the_host(seeded, variant):
    model, _, _ = build_model(tiny_cfg(variant, msda="triton"))
    model.cuda()
    images, mask = (t.cuda() for t in image_batch(pad_w=16, pixels=True))
    model(images, mask)  # warm-up: Triton compiles its kernels, the allocator fills
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(images, mask)
        output_loss(out).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
