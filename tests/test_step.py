"""engine.step.TrainStep: one optimizer step, a non-finite one skipped on the device, and no host syncs.

Also torch.compile of the tiny model's forward and backward (fullgraph, aot_eager) with model.msda=triton
(under the interpreter without a GPU) and pytorch: no graph break, the outputs and gradients of eager.
"""

from __future__ import annotations

import copy

import pytest
import torch

from engine.compile import RECOMPILE_LIMIT
from engine.optim import build_optimizer
from engine.precision import Precision
from engine.step import TrainStep
from models import build_model
from models.deformable_attention import MSDeformAttn
from test_models import _batch, _targets, tiny_cfg

SMALL = dict(backbone="resnet18", enc_layers=1, dec_layers=2)  # compile traces every layer: keep it short


@pytest.fixture
def seeded():
    torch.manual_seed(0)


def make_step(variant="base", msda="pytorch", device="cpu", **overrides):
    model, criterion, _ = build_model(tiny_cfg(variant, msda=msda, **SMALL, **overrides))
    model.to(device)
    criterion.to(device)
    optimizer = build_optimizer(model, _optim_cfg())
    return TrainStep(model=model, criterion=criterion, optimizer=optimizer,
                     precision=Precision(amp="none", device=torch.device(device)), clip_max_norm=0.1)


def _optim_cfg():
    from omegaconf import OmegaConf

    return OmegaConf.create(dict(lr=1e-3, lr_backbone=1e-4, lr_linear_proj_mult=0.1, weight_decay=1e-4,
                                 lr_backbone_names=["backbone.0"],
                                 lr_linear_proj_names=["reference_points", "sampling_offsets"]))


def _state(step: TrainStep):
    params = {n: p.detach().clone() for n, p in step.model.named_parameters()}
    moments = [{k: v.clone() for k, v in s.items()} for s in step.optimizer.state.values()]
    return params, moments


def test_the_box_count_average_starts_before_the_forward_and_is_read_after_the_matching(seeded):
    """A multi-process run's all-reduce of the box count has the whole forward to finish, and the matching's
    host sync does not wait for it (engine.distributed.average_over_processes)."""
    step = make_step()
    events = []
    step.model.register_forward_pre_hook(lambda module, args: events.append("forward"))
    match_groups = step.criterion.matcher.match_groups
    step.criterion.matcher.match_groups = lambda groups: events.append("matching") or match_groups(groups)

    def average_num_boxes(count):
        events.append("average started")
        return lambda: events.append("average read") or max(1.0, count)

    step.average_num_boxes = average_num_boxes
    step(*_batch(), _targets())
    assert events == ["average started", "forward", "matching", "average read"]


def test_a_step_returns_its_losses_and_updates_the_weights(seeded):
    step = make_step()
    before, _ = _state(step)
    values = step(*_batch(), _targets())
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
    step(*_batch(), _targets())  # one good step, so that the optimizer has moments to protect
    before, moments_before = _state(step)
    counts_before = [s["step"].clone() for s in step.optimizer.state.values()]
    images, mask = _batch()
    images[0, 0, 0, 0] = float("nan")
    values = step(images, mask, _targets())
    assert not torch.isfinite(values[0]) and not torch.isfinite(values[1])
    after, moments_after = _state(step)
    assert all(torch.equal(before[n], after[n]) for n in before)
    for m_before, m_after in zip(moments_before, moments_after):
        assert all(torch.equal(m_before[k], m_after[k]) for k in m_before)
    assert all(torch.equal(c, s["step"]) for c, s in zip(counts_before, step.optimizer.state.values()))
    assert torch.isfinite(step(*_batch(), _targets())).all()  # and training goes on


def test_the_step_needs_a_non_negative_clip_norm():
    model, criterion, _ = build_model(tiny_cfg(msda="pytorch", **SMALL))
    with pytest.raises(ValueError, match="clip_max_norm must be >= 0"):
        TrainStep(model=model, criterion=criterion, optimizer=build_optimizer(model, _optim_cfg()),
                  precision=Precision(amp="none", device=torch.device("cpu")), clip_max_norm=-1.0)


def _loss(out):
    loss = out["pred_logits"].sigmoid().square().sum() + out["pred_boxes"].square().sum()
    for aux in out.get("aux_outputs", []):
        loss = loss + aux["pred_logits"].sigmoid().square().sum() + aux["pred_boxes"].square().sum()
    return loss


# Tracing a whole model takes a while on a CPU: the two implementations, each on one variant (two-stage
# covers box refinement, box reference points and the encoder proposals).
@pytest.mark.parametrize("msda,variant", [("pytorch", "base"), ("triton", "two_stage")])
def test_compiled_model_has_no_graph_break_and_matches_eager(seeded, msda, variant, monkeypatch):
    torch._dynamo.reset()
    device = "cuda" if torch.cuda.is_available() else "cpu"  # triton on the CPU runs under the interpreter
    # cuDNN runs float32 convolutions in TF32 by default, and the two graphs may pick different algorithms
    # (on the H200 one weight gradient element of 73,728 differed by 0.4%): compare in full float32.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    eager, _, _ = build_model(tiny_cfg(variant, msda=msda, **SMALL))
    eager.to(device)
    with torch.no_grad():  # non-trivial offsets and weights, so that the attention gradients are not all zero
        for m in eager.modules():
            if isinstance(m, MSDeformAttn):
                m.sampling_offsets.weight.normal_(0, 0.05)
                m.attention_weights.weight.normal_(0, 0.05)
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, fullgraph=True, backend="aot_eager", dynamic=True)
    images, mask = (t.to(device) for t in _batch(pad_w=16))
    out_eager, out_compiled = eager(images, mask), compiled(images, mask)
    torch.testing.assert_close(out_compiled["pred_logits"], out_eager["pred_logits"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_compiled["pred_boxes"], out_eager["pred_boxes"], rtol=1e-5, atol=1e-5)
    _loss(out_eager).backward()
    _loss(out_compiled).backward()
    grads = dict(twin.named_parameters())
    # On a GPU the convolutions' weight gradients and the attention backward sum with atomics, in an order
    # that changes run to run: on the H200, 2 of 294,912 elements of input_proj.3.0.weight (gradients that
    # mostly cancel) differed by 1.2e-5 of the largest, in both implementations. A traced model that
    # computed something else would differ by orders of magnitude more.
    atol = 1e-4 if device == "cuda" else 1e-5
    for name, p in eager.named_parameters():
        if p.grad is not None:
            scale = p.grad.abs().max().clamp(min=1e-3)
            torch.testing.assert_close(grads[name].grad / scale, p.grad / scale, rtol=1e-4, atol=atol,
                                       msg=lambda m, name=name: f"{name}: {m}")


# Graphs with nodes, per choice of regions: the encoder layers, the decoder layers (the first decoder layer's
# reference points need a gradient, the refined ones of later layers do not) and the heads; or the transformer
# with its heads, and the position encoding.
REGION_GRAPHS = {"layers": (3, 4), "transformer": (2, 2)}


@pytest.mark.parametrize("regions", sorted(REGION_GRAPHS))
def test_compiled_regions_match_eager_and_serve_new_sizes_without_recompiling(seeded, regions):
    """compile=true (engine.compile.compile_regions): the graphs serve every image size. The first is square:
    its levels' equal heights and widths must not become one symbol, or the next size recompiles."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from engine.compile import compile_regions

    torch._dynamo.reset()
    eager, _, _ = build_model(tiny_cfg("box_refine", msda="pytorch", **SMALL))
    compiled = copy.deepcopy(eager)
    counter = CompileCounterWithBackend("aot_eager")
    compile_regions(compiled, backend=counter, regions=regions)
    assert set(compiled.state_dict()) == set(eager.state_dict())  # checkpoints keep their names
    graphs = []
    # No level of size 1, which torch.compile specializes.
    for H, W in ((136, 136), (128, 160), (160, 136)):
        images, mask = _batch(H=H, W=W, pad_w=8)
        out_eager, out_compiled = eager(images, mask), compiled(images, mask)
        torch.testing.assert_close(out_compiled["pred_boxes"], out_eager["pred_boxes"], rtol=1e-5, atol=1e-5)
        _loss(out_compiled).backward()
        graphs.append(sum(1 for g in counter.graphs if len(g.graph.nodes)))
    low, high = REGION_GRAPHS[regions]
    assert low <= graphs[0] <= high and graphs[1:] == graphs[:1] * 2, graphs  # later sizes compile nothing new


@pytest.mark.parametrize("regions", sorted(REGION_GRAPHS))
def test_compiled_regions_give_the_detections_of_eager_in_evaluation(seeded, regions):
    """Evaluation runs the compiled model under inference mode and postprocesses its outputs."""
    from engine.compile import compile_regions

    torch._dynamo.reset()
    eager, _, postprocess = build_model(tiny_cfg("box_refine", msda="pytorch", **SMALL))
    with torch.no_grad():  # non-trivial offsets and weights, as a trained model has
        for m in eager.modules():
            if isinstance(m, MSDeformAttn):
                m.sampling_offsets.weight.normal_(0, 0.05)
                m.attention_weights.weight.normal_(0, 0.05)
    compiled = copy.deepcopy(eager)
    compile_regions(compiled, backend="aot_eager", regions=regions)
    eager.eval()
    compiled.eval()
    images, mask = _batch(pad_w=8)
    sizes = torch.tensor([[images.shape[-2], images.shape[-1] - 8]] * images.shape[0])
    with torch.inference_mode():
        expected = postprocess(eager(images, mask), sizes)
        got = postprocess(compiled(images, mask), sizes)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g["labels"], e["labels"])
        torch.testing.assert_close(g["scores"], e["scores"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g["boxes"], e["boxes"], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("regions", sorted(REGION_GRAPHS))
def test_a_copy_of_a_compiled_model_and_criterion_runs_its_own_weights_and_pickles(seeded, regions):
    """compile_regions shadows methods per instance (models.compiled_methods): copies drop them."""
    import io

    from engine.compile import compile_regions

    torch._dynamo.reset()
    model, criterion, _ = build_model(tiny_cfg("base", msda="pytorch", **SMALL))
    compile_regions(model, criterion=criterion, backend="aot_eager", regions=regions)
    assert ("predict" in vars(model)) == (regions == "transformer")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.class_embed[-1].bias.add_(1.0)  # the copy's own weights, not the original's
    images, mask = _batch(pad_w=8)
    model.eval()
    twin.eval()
    with torch.no_grad():
        expected = model(images, mask)["pred_logits"] + 1.0
        got = twin(images, mask)["pred_logits"]
    torch.testing.assert_close(got, expected)
    assert "stacked_losses" not in copy.deepcopy(criterion).__dict__
    buffer = io.BytesIO()
    torch.save({"model": model, "criterion": criterion}, buffer)  # a compiled function would not pickle
    assert buffer.tell() > 0


def test_compile_regions_refuses_an_unknown_mode_and_a_mode_without_inductor():
    from engine.compile import compile_regions

    model, _, _ = build_model(tiny_cfg("base", msda="pytorch", **SMALL))
    with pytest.raises(ValueError, match="compile mode must be one of"):
        compile_regions(model, mode="max-speed")
    with pytest.raises(ValueError, match="needs the inductor backend"):
        compile_regions(model, backend="aot_eager", mode="reduce-overhead")
    with pytest.raises(ValueError, match=r"backbone must be one of \('eager', 'static', 'dynamic'\), got 'cuda'"):
        compile_regions(model, backbone="cuda")
    with pytest.raises(ValueError, match=r"regions must be one of \('layers', 'transformer'\), got 'model'"):
        compile_regions(model, regions="model")


# Sizes fed to a compiled backbone in turn, and the most graphs compiled once each has been met, per choice:
# "static" compiles one per size and none for a size met before; "dynamic" one for sizes whose halvings through
# the stem have the first size's parities, and may compile one more for another parity (torch 2.11's max-pool
# guards on the parity of its input size; torch 2.14's does not).
BACKBONE_SIZES = ((136, 136), (128, 160), (141, 163), (128, 160))
BACKBONE_GRAPHS = {"static": (1, 2, 3, 3), "dynamic": (1, 1, 2, 2)}


@pytest.mark.parametrize("backbone", sorted(BACKBONE_GRAPHS))
def test_a_compiled_backbone_gives_the_features_and_gradients_of_eager_at_every_size(seeded, backbone):
    """compile_backbone (DeformableDETR.features as compiled graphs): the same maps and gradients as eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from engine.compile import compile_regions

    torch._dynamo.reset()
    eager, _, _ = build_model(tiny_cfg("base", msda="pytorch", **SMALL))
    twin = copy.deepcopy(eager)
    counter = CompileCounterWithBackend("aot_eager")
    compile_regions(twin, backend=counter, backbone=backbone)  # only features() is called: nothing else traced
    assert "features" in vars(twin) and "features" not in vars(copy.deepcopy(twin))
    for (H, W), most_graphs in zip(BACKBONE_SIZES, BACKBONE_GRAPHS[backbone]):
        images, mask = _batch(H=H, W=W, pad_w=8)
        expected, got = eager.features(images, mask), twin.features(images, mask)
        for name, e_maps, g_maps in zip(("srcs", "masks", "pos"), expected, got):
            for level, (e, g) in enumerate(zip(e_maps, g_maps)):
                torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5, msg=lambda m: f"{H}x{W} {name}[{level}]: {m}")
        sum(s.square().mean() for s in expected[0]).backward()
        sum(s.square().mean() for s in got[0]).backward()
        graphs = sum(1 for g in counter.graphs if len(g.graph.nodes))
        low = most_graphs if backbone == "static" else 1
        assert low <= graphs <= most_graphs, f"{H}x{W}: {graphs} graphs"  # compiled, and not again for a known size
    params = dict(twin.named_parameters())
    checked = 0
    for name, p in eager.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(params[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
            checked += 1
    assert checked > 20  # the trained ResNet stages and the input projections


def test_a_static_backbone_compiles_past_torchs_default_limit_and_warns_of_unpadded_sizes(monkeypatch):
    """Nine image sizes, one more than Dynamo's default recompile limit, each get a graph of their own."""
    from torch._dynamo.testing import CompileCounter

    from engine.compile import STATIC_BACKBONE_GRAPHS, compile_regions, size_warning

    torch._dynamo.reset()
    monkeypatch.setattr(torch._dynamo.config, RECOMPILE_LIMIT, 8)  # torch's default
    model, _, _ = build_model(tiny_cfg("base", msda="pytorch", **SMALL))
    counter = CompileCounter()  # traces only, runs the traced graph as it is
    compile_regions(model, backend=counter, backbone="static")
    assert STATIC_BACKBONE_GRAPHS > 24  # the COCO recipe's training sizes padded to 128, and evaluation's
    with torch.no_grad():
        for H in range(128, 128 + 9 * 8, 8):
            model.features(*_batch(H=H, W=160, pad_w=8))
    assert counter.frame_count == 9
    warning = size_warning("default", 64, "static")
    assert "compile_backbone=static" in warning and "dataset.pad_to_multiple=128" in warning
    both = size_warning("reduce-overhead", 16, "static")
    assert "compile_backbone=static" in both and "compile_mode=reduce-overhead" in both
    assert "compile_mode=reduce-overhead" in size_warning("reduce-overhead", 16, "eager")
    for mode, pad, backbone in (("default", 1, "eager"), ("reduce-overhead", 128, "static"), ("reduce-overhead", 32, "eager")):
        assert size_warning(mode, pad, backbone) is None, (mode, pad, backbone)


# Inductor on the GPU: CUDA graphs for each choice of regions, with the backbone eager, and with it compiled for
# each size (replayed as CUDA graphs too) or with symbolic sizes (not replayed); and train.py's default regions
# without CUDA graphs.
GPU_COMPILE_CASES = [("reduce-overhead", "layers", "eager"), ("reduce-overhead", "transformer", "eager"),
                     ("reduce-overhead", "transformer", "static"), ("reduce-overhead", "transformer", "dynamic"),
                     ("default", "transformer", "eager")]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")
@pytest.mark.parametrize("mode,regions,backbone", GPU_COMPILE_CASES)
def test_steps_compiled_by_inductor_give_the_losses_of_eager_steps(seeded, mode, regions, backbone):
    """compile=true on the GPU, several steps and three sizes; with compile_mode=reduce-overhead the regions are
    replayed as CUDA graphs (a size is run, recorded, then replayed)."""
    from engine.compile import compile_regions

    torch._dynamo.reset()
    eager = make_step("box_refine", msda="triton", device="cuda", dropout=0.0)  # Inductor draws its own RNG
    graphed = make_step("box_refine", msda="triton", device="cuda", dropout=0.0)
    graphed.model.load_state_dict(eager.model.state_dict())
    compile_regions(graphed.model, mode=mode, regions=regions, backbone=backbone)
    for H, W in ((128, 160), (128, 160), (160, 136), (128, 160), (141, 163)):
        batch = [t.cuda() for t in _batch(H=H, W=W, pad_w=8)]
        targets = [{k: v.cuda() for k, v in t.items()} for t in _targets()]
        expected, got = eager(*batch, targets), graphed(*batch, targets)
        torch.testing.assert_close(got, expected, rtol=2e-3, atol=1e-4, msg=lambda m: f"size {H}x{W}: {m}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")
@pytest.mark.parametrize("variant", ["base", "box_refine", "two_stage"])
def test_model_forward_and_backward_never_sync_with_the_host(seeded, variant):
    model, _, _ = build_model(tiny_cfg(variant, msda="triton"))
    model.cuda()
    images, mask = (t.cuda() for t in _batch(pad_w=16))
    model(images, mask)  # warm-up: Triton compiles its kernels, the allocator fills
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(images, mask)
        _loss(out).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
