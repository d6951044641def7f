"""engine/compile/cuda_graphs.py: the eager model recorded as CUDA graphs (compile.mode=graphs, auto's choice on a GPU
for a short run). The settings are checked on the CPU; recording and replaying run on the device machine."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import (
    assert_same_detections,
    image_batch,
    make_criterion,
    make_step,
    rand_outputs,
    rand_targets,
    tiny_cfg,
    two_box_targets,
)
from omegaconf import OmegaConf

from engine.compile.clock import CompileClock, CompileTotals, describe_work
from engine.compile.cuda_graphs import graph_regions
from engine.compile.plan import STEPS_TO_COMPILE, CompilePlan, compile_model, resolve_compile
from engine.config.train_schema import CompileConfig
from engine.runtime.precision import Precision
from engine.train.step import OptimizerStep
from models import build_model
from models.deformable_attention import level_sizes_xy

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")
# Sizes in the order the tests meet them: each new one recorded, each repeated one replayed, and sizes
# alternate, so that a replay follows another size's graphs in the shared memory pool.
SIZES = ((128, 160), (128, 160), (160, 136), (128, 160), (141, 163), (160, 136))


def settings(**keys):
    return OmegaConf.structured(CompileConfig(**keys))


# ------------------------------------------------------------------------------------------- the settings
def test_auto_records_cuda_graphs_for_a_short_run_on_a_gpu_and_compiles_a_long_one():
    short = resolve_compile(settings(), device=GPU, training_steps=STEPS_TO_COMPILE - 1)
    assert short == CompilePlan(mode="graphs", evaluation=True) and short.cuda_graphs and not short.inductor
    assert resolve_compile(settings(), device=GPU, training_steps=STEPS_TO_COMPILE).mode == "reduce-overhead"
    assert resolve_compile(settings(), device=GPU).mode == "graphs"  # evaluation only
    assert resolve_compile(settings(), device=CPU, training_steps=1) is None


def test_auto_compiles_when_a_key_asks_for_inductor_and_graphs_keep_evaluation_optional():
    for key in (dict(regions="layers"), dict(backbone="eager"), dict(backend="inductor")):
        assert resolve_compile(settings(**key), device=GPU, training_steps=10).mode == "reduce-overhead", key
    assert not resolve_compile(settings(mode="graphs", evaluation=False), device=GPU).evaluation
    assert "nothing compiled" in resolve_compile(settings(mode="graphs"), device=GPU).describe()


@pytest.mark.parametrize(
    "keys,message",
    [
        (dict(mode="graphs", regions="layers"), r"compile\.regions=layers does nothing with compile\.mode=graphs"),
        (dict(mode="graphs", backbone="static"), r"compile\.backbone=static does nothing with compile\.mode=graphs"),
    ],
)
def test_graphs_refuse_the_keys_of_inductor_naming_them(keys, message):
    with pytest.raises(ValueError, match=message):
        settings(**keys)


def test_graphs_need_a_gpu():
    with pytest.raises(ValueError, match=r"compile\.mode=graphs replays CUDA graphs and needs a GPU"):
        resolve_compile(settings(mode="graphs"), device=CPU)


def test_the_level_sizes_are_made_once_per_sizes_so_that_a_graph_can_read_them_at_every_replay():
    levels = ((13, 17), (7, 9))
    first = level_sizes_xy(levels, dtype=torch.float32, device=CPU)
    assert first is level_sizes_xy([[13, 17], [7, 9]], dtype=torch.float32, device=CPU)
    assert first.tolist() == [[17.0, 13.0], [9.0, 7.0]]
    with torch.inference_mode():
        other = level_sizes_xy(((5, 3),), dtype=torch.float64, device=CPU)
    assert not other.is_inference()  # still usable by a training step that saves it for backward


def test_captures_count_as_compilation_with_their_method_name():
    clock = CompileClock.get()
    before = clock.totals()
    clock.record_capture("forward", 1.5)
    since = clock.totals().since(before)
    assert since.graphs == 1 and since.by_function == {"forward": 1} and since.seconds >= 1.5


def test_a_steps_log_line_says_what_it_recorded_and_what_it_compiled():
    assert (
        describe_work(CompileTotals(1.0, 2, {"graphed_forward": 1, "graphed_stacked_losses": 1}))
        == "recorded 2 CUDA graphs"
    )
    assert describe_work(CompileTotals(1.0, 2, {"features": 1, "predict": 1})) == "compiled 2 graphs"
    assert (
        describe_work(CompileTotals(1.0, 2, {"predict": 1, "graphed_detect": 1}))
        == "compiled 1 graphs and recorded 1 CUDA graph"
    )


# ------------------------------------------------------------------------------------------- on the GPU
def _graphed_pair(variant, *, amp="none", **overrides):
    eager = make_step(variant, msda="triton", device="cuda", dropout=0.0, **overrides)  # replays draw their own RNG
    graphed = make_step(variant, msda="triton", device="cuda", dropout=0.0, **overrides)
    graphed.model.load_state_dict(eager.model.state_dict())
    for step in (eager, graphed):
        step.precision = Precision(amp=amp, device=GPU)
    compile_model(graphed.model, CompilePlan(mode="graphs", evaluation=True), criterion=graphed.criterion)
    return eager, graphed


def assert_same_step(eager, graphed, batch, targets, *, gradients: bool, what: str) -> None:
    """One step of each gives the same values (and gradients); then the graphed model takes eager's weights, in
    place (the graphs read the parameters where they are), so that the next comparison does not depend on how
    the two optimizers' steps diverge."""
    expected, got = eager(*batch, targets), graphed(*batch, targets)
    torch.testing.assert_close(got, expected, rtol=5e-3, atol=1e-4, msg=lambda m: f"{what}: {m}")
    if gradients:
        for (name, e), g in zip(eager.model.named_parameters(), graphed.model.parameters()):
            assert (e.grad is None) == (g.grad is None), name
            if e.grad is not None:
                error = float((g.grad - e.grad).norm())
                assert error <= 1e-2 * float(e.grad.norm()) + 1e-8, f"{what}, {name}: |difference| {error}"
    with torch.no_grad():
        for e, g in zip(eager.model.parameters(), graphed.model.parameters()):
            g.copy_(e)


@needs_gpu
@pytest.mark.parametrize("variant", ["base", "box_refine", "two_stage"])
def test_steps_replayed_as_cuda_graphs_give_the_losses_and_gradients_of_eager_steps(variant):
    """Each step starts both models from the same weights (eager's, copied in place: the graphs read the
    parameters where they are), so that the comparison does not depend on how the two optimizers' steps
    diverge: Adam divides by each gradient's own size, so the last-bit differences of the backward's atomics
    move a near-zero gradient's weight by up to lr per step."""
    torch.manual_seed(0)
    eager, graphed = _graphed_pair(variant)
    clock = CompileClock.get()
    before = clock.totals()
    for H, W in SIZES:
        batch = [t.cuda() for t in image_batch(H=H, W=W, pad_w=8, pixels=True)]
        targets = [{k: v.cuda() for k, v in t.items()} for t in two_box_targets()]
        # [loss, gradient norm, each loss]; two-stage's top-k of the encoder's proposals may flip on a near tie
        assert_same_step(eager, graphed, batch, targets, gradients=variant != "two_stage", what=f"size {H}x{W}")
    # One recording per size; the decoder's losses one per padded number of targets (4 here: 8 slots), and the
    # two-stage proposals' one per size too (one proposal per encoder token).
    sizes = len(set(SIZES))
    assert clock.totals().since(before).by_function == {
        "graphed_forward": sizes,
        "graphed_stacked_losses": 1,
        **({"graphed_stacked_proposal_losses": sizes} if variant == "two_stage" else {}),
    }


@needs_gpu
@pytest.mark.parametrize("variant,images_per_pass", [("base", None), ("two_stage", None), ("box_refine", 1)])
def test_hybrid_steps_replayed_as_cuda_graphs_give_the_losses_and_gradients_of_eager_steps(variant, images_per_pass):
    """Hybrid matching: the forward's recording holds both groups of queries; the one-to-many losses, which replay
    between the one-to-one losses' forward and backward, are recorded in a region and memory pool of their own (in
    the one-to-one losses' pool, their replay would overwrite what that backward reads). Also in passes."""
    torch.manual_seed(0)
    eager, graphed = _graphed_pair(variant, one_to_many="hybrid", num_queries_one2many=24, k_one2many=3)
    for step in (eager, graphed):
        step.images_per_pass = images_per_pass
    clock = CompileClock.get()
    before = clock.totals()
    for H, W in SIZES:
        batch = [t.cuda() for t in image_batch(H=H, W=W, pad_w=8, pixels=True)]
        targets = [{k: v.cuda() for k, v in t.items()} for t in two_box_targets()]
        assert_same_step(eager, graphed, batch, targets, gradients=variant != "two_stage", what=f"size {H}x{W}")
    # One padded number of targets each: the one-to-one queries' (8 slots) and the one-to-many ones' (3 x the
    # targets: 16 slots, or 8 in passes of one image).
    sizes = len(set(SIZES))
    assert clock.totals().since(before).by_function == {
        "graphed_forward": sizes,
        "graphed_stacked_losses": 1,
        "graphed_stacked_one2many_losses": 1,
        **({"graphed_stacked_proposal_losses": sizes} if variant == "two_stage" else {}),
    }


@needs_gpu
def test_accumulated_passes_replayed_as_cuda_graphs_add_up_their_gradients_without_a_stream_warning():
    """A step of 4 images in 2 passes of 2: the backward replay writes into the same buffers at each pass, and the
    gradients handed to the parameters must not be those buffers (the second pass would overwrite the first's).
    Nothing of the recording's autograd graph, made on its own stream, is kept: PyTorch warns when a step's
    backward meets a gradient accumulator of another stream (the warning a default GPU run printed)."""
    import warnings

    torch.manual_seed(0)
    eager, graphed = _graphed_pair("base")
    for step in (eager, graphed):
        step.images_per_pass = 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for H, W in SIZES[:3]:
            batch = [t.cuda() for t in image_batch(B=4, H=H, W=W, pad_w=8, pixels=True)]
            targets = [{k: v.cuda() for k, v in t.items()} for t in two_box_targets(B=4)]
            assert_same_step(eager, graphed, batch, targets, gradients=True, what=f"size {H}x{W}")
    assert not [w for w in caught if "AccumulateGrad" in str(w.message)]


@needs_gpu
def test_losses_replayed_as_cuda_graphs_equal_eager_losses_and_gradients_for_every_number_of_targets():
    """The losses are recorded per padded number of targets (models.criterion.target_slots), the decoder's and the
    two-stage proposals' (more of them than queries) apart; batches without targets, with more targets than
    queries, and back to an earlier size, whose graphs are replayed."""
    gen = torch.Generator().manual_seed(0)
    eager, graphed = make_criterion(dec_layers=3, two_stage=True), make_criterion(dec_layers=3, two_stage=True)
    regions = graphed.compile_regions(graphs=True)
    assert [(r.name, r.training) for r in regions] == [("stacked_losses", True), ("stacked_proposal_losses", True)]
    graph_regions(graphed, regions, pool_per_region=True)
    clock = CompileClock.get()
    before = clock.totals()
    sizes_seen = [[0, 0], [3, 1], [14, 2], [5, 3], [30, 1], [2, 2]]  # slots 8, 8, 32, 16, 32, 8
    for sizes in sizes_seen:
        layers = [rand_outputs(2, 12, gen) for _ in range(3)] + [rand_outputs(2, 20, gen)]  # 20 proposals
        leaves = [
            t.cuda().requires_grad_(True) for layer in layers for t in (layer["pred_logits"], layer["pred_boxes"])
        ]
        as_outputs = [{"pred_logits": leaves[2 * i], "pred_boxes": leaves[2 * i + 1]} for i in range(4)]
        outputs = {**as_outputs[2], "aux_outputs": as_outputs[:2], "enc_outputs": as_outputs[3]}
        targets = [{k: v.cuda() if torch.is_tensor(v) else v for k, v in t.items()} for t in rand_targets(sizes, gen)]
        expected, got = eager(outputs, targets), graphed(outputs, targets)
        assert set(got) == set(expected)
        for name in expected:
            torch.testing.assert_close(
                got[name], expected[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{sizes} {name}: {m}"
            )
        weights = {name: float(i + 1) for i, name in enumerate(sorted(eager.weight_dict))}

        def gradients(losses):
            return torch.autograd.grad(sum(weights[k] * v for k, v in losses.items() if k in weights), leaves)

        for g, e in zip(gradients(got), gradients(expected)):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6, msg=lambda m: f"{sizes}: {m}")
    recorded = {"graphed_stacked_losses": 3, "graphed_stacked_proposal_losses": 3}  # 8, 16 and 32 slots each
    assert clock.totals().since(before).by_function == recorded
    with torch.no_grad():  # nothing to differentiate: eager
        graphed(outputs, targets)
    assert clock.totals().since(before).by_function == recorded


@needs_gpu
def test_bf16_steps_replayed_as_cuda_graphs_follow_the_weights_as_they_change():
    """autocast's casts are in the graph (no weight cache): a replay after an update uses the new weights."""
    torch.manual_seed(0)
    eager, graphed = _graphed_pair("box_refine", amp="bf16")
    for H, W in SIZES:
        batch = [t.cuda() for t in image_batch(H=H, W=W, pad_w=8)]
        targets = [{k: v.cuda() for k, v in t.items()} for t in two_box_targets()]
        expected, got = eager(*batch, targets), graphed(*batch, targets)
        torch.testing.assert_close(got, expected, rtol=3e-2, atol=3e-3, msg=lambda m: f"size {H}x{W}: {m}")


@needs_gpu
def test_evaluation_replayed_as_cuda_graphs_gives_the_detections_of_eager_after_training_steps():
    torch.manual_seed(0)
    model, criterion, postprocess = build_model(tiny_cfg("two_stage", msda="triton"))
    model.cuda()
    criterion.cuda()
    graphed = copy.deepcopy(model)
    compile_model(graphed, CompilePlan(mode="graphs", evaluation=True))
    optimizer = torch.optim.SGD(graphed.parameters(), lr=0.05)
    step = OptimizerStep(
        model=graphed,
        criterion=criterion,
        optimizer=optimizer,
        precision=Precision(amp="none", device=GPU),
        clip_max_norm=0.1,
    )
    for _ in range(2):
        graphed.eval()
        model.load_state_dict(graphed.state_dict())
        model.eval()
        for H, W in SIZES:
            assert_same_detections(model, graphed, postprocess, H=H, W=W, device="cuda")
        graphed.train()
        for H, W in SIZES[:3]:  # the weights move: the evaluation graphs must see the new ones
            step(
                *[t.cuda() for t in image_batch(H=H, W=W, pad_w=8, pixels=True)],
                [{k: v.cuda() for k, v in t.items()} for t in two_box_targets()],
            )


@needs_gpu
def test_a_graphed_model_without_gradients_or_in_eval_mode_runs_its_forward_eagerly():
    torch.manual_seed(0)
    model, _, _ = build_model(tiny_cfg("base", msda="triton"))
    model.cuda()
    reference = copy.deepcopy(model).eval()
    compile_model(model, CompilePlan(mode="graphs", evaluation=False))
    model.eval()
    images, mask = (t.cuda() for t in image_batch(H=128, W=160, pad_w=8, pixels=True))
    clock = CompileClock.get()
    before = clock.totals()
    with torch.no_grad():
        got, expected = model(images, mask), reference(images, mask)
        detected = model.detect(images, mask)  # evaluation=False: detect is the plain method
    torch.testing.assert_close(got["pred_logits"], expected["pred_logits"])
    torch.testing.assert_close(detected["pred_boxes"], expected["pred_boxes"])
    assert clock.totals().since(before).graphs == 0


def test_the_model_declares_what_is_recorded():
    model, _, _ = build_model(tiny_cfg("base", msda="pytorch"))
    training, evaluation = model.compile_regions(graphs=True, evaluation=True)
    assert (training.name, training.training, evaluation.name, evaluation.training) == (
        "forward",
        True,
        "detect",
        False,
    )
    assert [r.name for r in model.compile_regions(graphs=True, evaluation=False)] == ["forward"]


@needs_gpu
def test_sizes_past_the_memory_share_run_eagerly_with_one_warning(monkeypatch, caplog):
    """Each size's graphs keep their memory: once the GPU's memory is taken past GRAPH_MEMORY_SHARE, new sizes are
    not recorded (at batch 32 a few sizes took what the step needs), and the step runs them eagerly, the same."""
    import engine.compile.cuda_graphs as cuda_graphs

    torch.manual_seed(0)
    eager, graphed = _graphed_pair("base")
    monkeypatch.setattr(cuda_graphs, "GRAPH_MEMORY_SHARE", 0.0)
    clock = CompileClock.get()
    before = clock.totals()
    with caplog.at_level("WARNING"):
        for H, W in SIZES[:3]:
            batch = [t.cuda() for t in image_batch(H=H, W=W, pad_w=8, pixels=True)]
            targets = [{k: v.cuda() for k, v in t.items()} for t in two_box_targets()]
            assert_same_step(eager, graphed, batch, targets, gradients=True, what=f"size {H}x{W}")
    assert "graphed_forward" not in clock.totals().since(before).by_function
    assert sum("new sizes run eagerly" in r.getMessage() for r in caplog.records if "forward" in r.getMessage()) == 1
