"""engine/compile/plan.py: the compile settings resolved per device, the regions the model declares, compiled as
train.py compiles them (aot_eager on the CPU traces as Inductor does, without codegen; Inductor on the GPU)."""

from __future__ import annotations

import copy
import io
import os

import pytest
import torch
from helpers import assert_same_detections, image_batch, make_step, output_loss, rand_targets, tiny_cfg
from omegaconf import OmegaConf
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend
from torch._dynamo.utils import counters

from engine.compile.plan import (
    EVALUATION_BATCHES_TO_COMPILE,
    LAYERS_FROM_BATCH,
    RECOMPILE_LIMIT,
    STATIC_BACKBONE_GRAPHS,
    STEPS_TO_COMPILE,
    CompilePlan,
    compile_model,
    resolve_compile,
)
from engine.config.train_schema import CompileConfig
from models import build_model
from models.deformable_attention import MSDeformAttn

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)


@pytest.fixture
def seeded():
    torch.manual_seed(0)
    torch._dynamo.reset()


def settings(**keys):
    return OmegaConf.structured(CompileConfig(**keys))


def plan(backend, **keys) -> CompilePlan:
    return CompilePlan(**{"mode": "default", "backbone": "eager", "backend": backend, **keys})


# ------------------------------------------------------------------------------------------- the settings
def test_auto_compiles_a_long_run_with_cuda_graphs_on_a_gpu_and_not_on_the_cpu():
    assert resolve_compile(settings(), device=CPU, training_steps=STEPS_TO_COMPILE) is None
    on_gpu = resolve_compile(settings(), device=GPU, training_steps=STEPS_TO_COMPILE)
    assert on_gpu == CompilePlan(
        mode="reduce-overhead", regions="transformer", backbone="dynamic", backend="inductor", evaluation=False
    )
    assert resolve_compile(settings(mode="eager"), device=GPU) is None
    compiled_cpu = resolve_compile(settings(mode="default", backbone="eager"), device=CPU)
    assert compiled_cpu.mode == "default" and compiled_cpu.backbone == "eager" and not compiled_cpu.cuda_graphs


def test_what_a_plan_builds_again_for_each_input_size():
    assert CompilePlan(mode="graphs").per_size_work(training=True) == "records CUDA graphs"
    assert CompilePlan(mode="graphs", evaluation=True).per_size_work(training=False) == "records CUDA graphs"
    assert CompilePlan(mode="graphs", evaluation=False).per_size_work(training=False) is None
    static = CompilePlan(mode="reduce-overhead", backbone="static", evaluation=True)
    assert static.per_size_work(training=True) == "compiles the backbone and evaluation's graph and records CUDA graphs"
    assert static.per_size_work(training=False) == "compiles evaluation's graph and records CUDA graphs"
    assert CompilePlan(mode="default", backbone="eager", evaluation=False).per_size_work(training=True) is None
    assert CompilePlan(mode="default", backbone="static").per_size_work(training=True) == "compiles the backbone"
    dynamic = CompilePlan(mode="reduce-overhead", backbone="dynamic")
    assert dynamic.per_size_work(training=True) == "records CUDA graphs" and not dynamic.compiled_per_size()
    assert dynamic.per_size_work(training=False) is None  # evaluation runs eagerly


def test_the_transformer_is_compiled_a_layer_at_a_time_from_a_large_pass_unless_the_regions_are_set():
    long = dict(device=GPU, training_steps=STEPS_TO_COMPILE)
    assert resolve_compile(settings(), pass_batch=LAYERS_FROM_BATCH - 1, **long).regions == "transformer"
    assert resolve_compile(settings(), pass_batch=LAYERS_FROM_BATCH, **long).regions == "layers"
    assert resolve_compile(settings(), **long).regions == "transformer"  # evaluation only: no training pass
    chosen = settings(regions="transformer")
    assert resolve_compile(chosen, pass_batch=LAYERS_FROM_BATCH, **long).regions == "transformer"
    assert resolve_compile(settings(regions="layers"), pass_batch=2, **long).regions == "layers"


def test_a_run_chooses_the_regions_by_the_images_of_one_pass_not_of_the_step(monkeypatch):
    """build_training hands resolve_compile the images of one forward and backward pass: a step of 32 images in
    passes of 8 (gradient accumulation) is compiled as a batch of 8 is."""
    from hydra import compose, initialize_config_dir

    import engine.compile.run_model as run_model
    import engine.train.build as build
    from engine.config.registry import check_config
    from engine.runtime.distributed import DistContext

    resolve, passes = run_model.resolve_compile, []
    monkeypatch.setattr(
        run_model, "resolve_compile", lambda *a, **k: passes.append(k["pass_batch"]) or resolve(*a, **k)
    )
    context = DistContext(rank=0, world_size=1, local_rank=0, device=CPU)
    configs = os.path.join(os.path.dirname(__file__), "..", "configs")
    for batch_size in (8, 32):
        with initialize_config_dir(config_dir=os.path.abspath(configs), version_base="1.3"):
            overrides = [
                "model=tiny",
                "model.pretrained=none",
                "device=cpu",
                "total_batch_size=32",
                f"batch_size={batch_size}",
            ]
            cfg = check_config(compose(config_name="train", overrides=overrides))
        build.build_training(cfg, ctx=context)
    assert passes == [8, 32]


def test_evaluation_is_compiled_when_the_run_evaluates_enough_batches():
    long = dict(device=GPU, training_steps=STEPS_TO_COMPILE)
    assert not resolve_compile(settings(), evaluation_batches=EVALUATION_BATCHES_TO_COMPILE - 1, **long).evaluation
    assert resolve_compile(settings(), evaluation_batches=EVALUATION_BATCHES_TO_COMPILE, **long).evaluation
    assert resolve_compile(settings(evaluation=True), **long).evaluation
    assert not resolve_compile(settings(evaluation=False), evaluation_batches=10**6, **long).evaluation


@pytest.mark.parametrize(
    "keys,device,message",
    [
        (dict(mode="eager", regions="layers"), CPU, r"compile\.regions=layers does nothing with compile\.mode=eager"),
        (dict(mode="eager", evaluation=True), GPU, r"compile\.evaluation=True does nothing with compile\.mode=eager"),
        (
            dict(backend="aot_eager"),
            GPU,
            r"compile\.mode=auto replays CUDA graphs, which need compile\.backend=inductor",
        ),
        (dict(mode="reduce-overhead", backend="aot_eager"), GPU, r"need compile\.backend=inductor"),
        (dict(mode="reduce-overhead"), CPU, r"compile\.mode=reduce-overhead replays CUDA graphs and needs a GPU"),
        (
            dict(backbone="eager"),
            CPU,
            r"compile\.backbone=eager does nothing here: compile\.mode=auto compiles on a GPU",
        ),
    ],
)
def test_settings_that_cannot_work_are_refused_naming_the_keys(keys, device, message):
    with pytest.raises(ValueError, match=message):
        resolve_compile(settings(**keys), device=device)


def test_compile_model_refuses_an_unknown_mode_and_a_mode_without_inductor():
    model, _, _ = build_model(tiny_cfg("base", msda="pytorch"))
    with pytest.raises(ValueError, match="compile mode must be one of"):
        compile_model(model, plan("aot_eager", mode="max-speed"))
    with pytest.raises(ValueError, match="needs the inductor backend"):
        compile_model(model, plan("aot_eager", mode="reduce-overhead"))
    with pytest.raises(ValueError, match=r"backbone must be one of \('dynamic', 'static', 'eager'\), got 'symbolic'"):
        compile_model(model, plan("aot_eager", backbone="symbolic"))
    with pytest.raises(ValueError, match=r"regions must be one of \('layers', 'transformer'\), got 'model'"):
        compile_model(model, plan("aot_eager", regions="model"))


# ------------------------------------------------------------------------------------------- the regions
# Graphs with nodes, per choice of regions: the encoder layers, the decoder layers (the first decoder layer's
# reference points need a gradient, the refined ones of later layers do not) and the heads; or the transformer
# with its heads, and the position encoding.
REGION_GRAPHS = {"layers": (3, 4), "transformer": (2, 2)}


@pytest.mark.parametrize("regions", sorted(REGION_GRAPHS))
def test_compiled_regions_match_eager_and_serve_new_sizes_without_recompiling(seeded, regions):
    """The graphs serve every image size. The first is square: its levels' equal heights and widths must not
    become one symbol, or the next size recompiles."""
    eager, _, _ = build_model(tiny_cfg("box_refine", msda="pytorch"))
    compiled = copy.deepcopy(eager)
    counter = CompileCounterWithBackend("aot_eager")
    compile_model(compiled, plan(counter, regions=regions))
    assert set(compiled.state_dict()) == set(eager.state_dict())  # checkpoints keep their names
    graphs = []
    for H, W in ((136, 136), (128, 160), (160, 136)):  # no level of size 1, which torch.compile specializes
        images, mask = image_batch(H=H, W=W, pad_w=8, pixels=True)
        out_eager, out_compiled = eager(images, mask), compiled(images, mask)
        torch.testing.assert_close(out_compiled["pred_boxes"], out_eager["pred_boxes"], rtol=1e-5, atol=1e-5)
        output_loss(out_compiled).backward()
        graphs.append(sum(1 for g in counter.graphs if len(g.graph.nodes)))
    low, high = REGION_GRAPHS[regions]
    assert low <= graphs[0] <= high and graphs[1:] == graphs[:1] * 2, graphs  # later sizes compile nothing new


def test_the_transformer_is_traced_once_into_graphs_its_compile_cache_can_keep(seeded):
    """A compile cache only helps a graph AOTAutograd agrees to cache: traced with symbolic sizes, a torch.tensor of
    the level sizes became a call it refuses, and every run compiled the transformer again, warm cache or not.
    And the floats the model reads (dropout rates, norm epsilons) must be constants: made symbolic inputs, they
    were specialized during the compilation, which started again and traced the whole transformer twice."""
    autograd_cache = pytest.importorskip("torch._functorch._aot_autograd.autograd_cache")
    if not hasattr(autograd_cache, "check_cacheable"):
        pytest.skip("this torch has no AOTAutograd cache check")
    model, _, _ = build_model(tiny_cfg("box_refine", msda="pytorch", dropout=0.1))
    counter = CompileCounterWithBackend("aot_eager")
    compile_model(model, plan(counter))
    model(*image_batch(H=136, W=136, pad_w=8))
    assert counter.frame_count == 2  # the transformer with its heads, and the position encoding: once each
    for graph in counter.graphs:
        autograd_cache.check_cacheable(graph)  # raises BypassAOTAutogradCache, naming the call


def test_the_compile_cache_goes_to_compile_cache_dir_though_torch_wrote_its_default(tmp_path, monkeypatch):
    """Importing Inductor writes its default folder into TORCHINDUCTOR_CACHE_DIR: taken for the user's choice, it
    kept every run's cache there whatever compile.cache_dir said. A folder the user did choose still wins."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from engine.compile import cache

    monkeypatch.setattr(cache, "_set_here", {})
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.abspath(default_cache_dir()))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    root = cache.use_compile_cache(str(tmp_path / "cache"))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(root / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(root / "triton")
    monkeypatch.setattr(cache, "_set_here", {})
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    cache.use_compile_cache(str(tmp_path / "other"))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


def _trained_looking(model):
    with torch.no_grad():  # non-trivial offsets and weights, as a trained model has
        for m in model.modules():
            if isinstance(m, MSDeformAttn):
                m.sampling_offsets.weight.normal_(0, 0.05)
                m.attention_weights.weight.normal_(0, 0.05)
    return model


@pytest.mark.parametrize("regions", sorted(REGION_GRAPHS))
def test_evaluation_compiles_one_graph_per_size_once_and_gives_the_detections_of_eager(seeded, regions):
    """compile.evaluation: ``detect`` as one graph per evaluation size, none for a size met before, and no
    training region compiled again; its detections are eager's."""
    eager, _, postprocess = build_model(tiny_cfg("box_refine", msda="pytorch"))
    _trained_looking(eager)
    compiled = copy.deepcopy(eager)
    counter = CompileCounterWithBackend("aot_eager")
    compile_model(compiled, plan(counter, regions=regions, backbone="static", evaluation=True))
    eager.eval()
    compiled.eval()
    frames = []
    for H, W in ((136, 160), (160, 136), (136, 160), (160, 136)):
        images, mask = image_batch(H=H, W=W, pad_w=8, pixels=True)
        sizes = torch.tensor([[H, W - 8]] * images.shape[0])
        with torch.no_grad():
            expected = postprocess(eager(images, mask), sizes)
            got = postprocess(compiled.detect(images, mask), sizes)
        for e, g in zip(expected, got):
            torch.testing.assert_close(g["labels"], e["labels"])
            torch.testing.assert_close(g["scores"], e["scores"], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(g["boxes"], e["boxes"], rtol=1e-5, atol=1e-4)
        frames.append(counter.frame_count)
    assert frames == [1, 2, 2, 2], frames  # one graph per size, each the whole model (fullgraph)


def test_evaluation_without_its_graph_runs_eagerly_and_compiles_nothing(seeded):
    """engine.evaluation runs an uncompiled ``detect`` with Dynamo off: the compiled training regions inside it
    (the position encoding, the layers) are not compiled again without gradients."""
    from engine.evaluation.coco import evaluate_coco  # noqa: F401  (what runs it so; the switch is checked here)

    model, _, _ = build_model(tiny_cfg("box_refine", msda="pytorch"))
    counter = CompileCounterWithBackend("aot_eager")
    compile_model(model, plan(counter, regions="layers"))
    model.eval()
    images, mask = image_batch(H=136, W=160, pad_w=8)
    with torch.no_grad(), torch._dynamo.config.patch(disable=True):
        model.detect(images, mask)
    assert counter.frame_count == 0


@pytest.mark.parametrize("regions", sorted(REGION_GRAPHS))
def test_a_copy_of_a_compiled_model_and_criterion_runs_its_own_weights_and_pickles(seeded, regions):
    """compile_model shadows methods per instance (models/compiled_regions.py): copies drop them."""
    model, criterion, _ = build_model(tiny_cfg("base", msda="pytorch"))
    compile_model(model, plan("aot_eager", regions=regions, evaluation=True), criterion=criterion)
    assert ("predict" in vars(model)) == (regions == "transformer") and "detect" in vars(model)
    twin = copy.deepcopy(model)
    assert "detect" not in vars(twin)
    with torch.no_grad():
        twin.class_embed[-1].bias.add_(1.0)  # the copy's own weights, not the original's
    images, mask = image_batch(pad_w=8)
    model.eval()
    twin.eval()
    with torch.no_grad():
        expected = model(images, mask)["pred_logits"] + 1.0
        got = twin(images, mask)["pred_logits"]
    torch.testing.assert_close(got, expected)
    assert "stacked_losses" in criterion.__dict__ and "stacked_losses" not in copy.deepcopy(criterion).__dict__
    buffer = io.BytesIO()
    torch.save({"model": model, "criterion": criterion}, buffer)  # a compiled function would not pickle
    assert buffer.tell() > 0


def test_only_declared_methods_can_be_replaced():
    model, _, _ = build_model(tiny_cfg("base", msda="pytorch"))
    with pytest.raises(ValueError, match="is not a method that can be compiled"):
        model.use_compiled("class_embed", lambda *a: None)


@pytest.mark.parametrize("regions", sorted(REGION_GRAPHS))
def test_a_hybrid_step_compiles_both_groups_of_queries_and_gives_the_eager_step(seeded, regions):
    """Hybrid matching compiled: the one-to-one and one-to-many queries in the transformer's graphs (one with no
    break, or one per layer kind), the one-to-many losses in a region of their own; a step gives eager's values."""
    hybrid = {"dropout": 0.0, "one_to_many": "hybrid", "num_queries_one2many": 12, "k_one2many": 3}
    eager, compiled = make_step("two_stage", **hybrid), make_step("two_stage", **hybrid)
    compiled.model.load_state_dict(eager.model.state_dict())
    counter = CompileCounterWithBackend("aot_eager")
    compile_model(compiled.model, plan(counter, regions=regions), criterion=compiled.criterion)
    assert "stacked_one2many_losses" in vars(compiled.criterion)
    images, mask = image_batch(H=136, W=160, pad_w=8)  # no level of size 1, which torch.compile specializes
    targets = rand_targets([3, 1], torch.Generator().manual_seed(0))
    expected, got = eager(images, mask, targets), compiled(images, mask, targets)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    if regions == "transformer":  # the transformer, the position encoding and the three groups' losses
        assert counter.frame_count == 5


# (batch, height, width) fed to a compiled backbone in turn, and the graphs compiled once each has been met. Static:
# one per size and none for a size met before. Dynamic: one for every size and batch, the padded sizes being
# multiples of 32 (dataset.pad_to_multiple) whose quotient is odd or even, the first one square. With the
# transformer a layer at a time, torch's duck shapes are on (engine.compile.plan): the square first size makes
# height and width one symbol, and the first other size compiles the one graph for every size.
BACKBONE_SIZES = {
    ("static", "transformer"): (((2, 136, 136), 1), ((2, 128, 160), 2), ((2, 141, 163), 3), ((2, 128, 160), 3)),
    ("dynamic", "transformer"): (((2, 128, 128), 1), ((2, 128, 160), 1), ((3, 224, 96), 1), ((2, 160, 128), 1)),
    ("dynamic", "layers"): (((2, 128, 128), 1), ((2, 128, 160), 2), ((3, 224, 96), 2), ((2, 160, 128), 2)),
}


@pytest.mark.parametrize("backbone,regions", sorted(BACKBONE_SIZES))
def test_a_compiled_backbone_gives_the_features_and_gradients_of_eager_at_every_size(seeded, backbone, regions):
    """compile.backbone=static|dynamic (DeformableDETR.features): the maps and gradients of eager."""
    eager, _, _ = build_model(tiny_cfg("base", msda="pytorch"))
    twin = copy.deepcopy(eager)
    counter = CompileCounterWithBackend("aot_eager")
    compile_model(twin, plan(counter, backbone=backbone, regions=regions))  # only features() is called and traced
    assert "features" in vars(twin) and "features" not in vars(copy.deepcopy(twin))
    for (B, H, W), most_graphs in BACKBONE_SIZES[backbone, regions]:
        images, mask = image_batch(B=B, H=H, W=W, pad_w=8, pixels=True)
        expected, got = eager.features(images, mask), twin.features(images, mask)
        for name, e_maps, g_maps in zip(("srcs", "masks", "pos"), expected, got):
            for level, (e, g) in enumerate(zip(e_maps, g_maps)):
                torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5, msg=lambda m: f"{H}x{W} {name}[{level}]: {m}")
        sum(s.square().mean() for s in expected[0]).backward()
        sum(s.square().mean() for s in got[0]).backward()
        graphs = sum(1 for g in counter.graphs if len(g.graph.nodes))
        assert graphs == most_graphs, f"{B}x{H}x{W}: {graphs} graphs"  # compiled, and not again for a known size
    params = dict(twin.named_parameters())
    checked = 0
    for name, p in eager.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(params[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
            checked += 1
    assert checked > 20  # the trained ResNet stages and the input projections


def test_a_static_backbone_compiles_past_torchs_default_limit(monkeypatch):
    """Nine image sizes, one more than Dynamo's default recompile limit, each get a graph of their own."""
    torch._dynamo.reset()
    monkeypatch.setattr(torch._dynamo.config, RECOMPILE_LIMIT, 8)  # torch's default
    model, _, _ = build_model(tiny_cfg("base", msda="pytorch"))
    counter = CompileCounter()  # traces only, runs the traced graph as it is
    compile_model(model, plan(counter, backbone="static"))
    assert STATIC_BACKBONE_GRAPHS > 8
    with torch.no_grad():
        for H in range(128, 128 + 9 * 8, 8):
            model.features(*image_batch(H=H, W=160, pad_w=8))
    assert counter.frame_count == 9


# Inductor on the GPU: CUDA graphs for each choice of regions, with the backbone eager, compiled per size or with
# symbolic sizes (replayed as CUDA graphs too); and the default regions without CUDA graphs.
GPU_COMPILE_CASES = [
    ("reduce-overhead", "layers", "eager"),
    ("reduce-overhead", "transformer", "eager"),
    ("reduce-overhead", "transformer", "static"),
    ("default", "transformer", "static"),
    ("reduce-overhead", "layers", "dynamic"),
    ("reduce-overhead", "transformer", "dynamic"),
]
# Steps of those runs: (height, width, targets per image). A size or a padded target count (target_slots: 8, then
# 16) is met, recorded, then replayed.
GPU_STEPS = ((128, 160, 2), (128, 160, 2), (160, 136, 2), (128, 160, 6), (128, 160, 6), (141, 163, 2), (160, 136, 6))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")
@pytest.mark.parametrize("mode,regions,backbone", GPU_COMPILE_CASES)
def test_steps_compiled_by_inductor_give_the_losses_of_eager_steps(seeded, mode, regions, backbone, full_fp32):
    """Several steps, three sizes and two padded target counts; with reduce-overhead the regions and the losses are
    replayed as CUDA graphs. In full float32: with TF32, a graph per size picks its convolutions' algorithms apart
    from eager's, and one loss of 11 differed by 0.5% (an H100, backbone=static)."""
    assert_compiled_steps_give_the_losses_of_eager_steps(
        "box_refine", CompilePlan(mode=mode, regions=regions, backbone=backbone)
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")
@pytest.mark.parametrize("regions", sorted(REGION_GRAPHS))
def test_hybrid_steps_compiled_by_inductor_give_the_losses_of_eager_steps(seeded, regions, full_fp32):
    """Hybrid matching, replayed as CUDA graphs: the one-to-many losses replay between the one-to-one losses' forward
    and backward, in a region (and CUDA-graph tree) of their own."""
    chosen = CompilePlan(mode="reduce-overhead", regions=regions, backbone="dynamic")
    assert_compiled_steps_give_the_losses_of_eager_steps(
        "box_refine", chosen, one_to_many="hybrid", num_queries_one2many=24, k_one2many=3
    )


def assert_compiled_steps_give_the_losses_of_eager_steps(variant: str, chosen: CompilePlan, **overrides) -> None:
    eager = make_step(variant, msda="triton", device="cuda", dropout=0.0, **overrides)  # Inductor draws its own RNG
    graphed = make_step(variant, msda="triton", device="cuda", dropout=0.0, **overrides)
    graphed.model.load_state_dict(eager.model.state_dict())
    compile_model(graphed.model, chosen, criterion=graphed.criterion)
    counters.clear()
    for H, W, count in GPU_STEPS:
        batch = [t.cuda() for t in image_batch(H=H, W=W, pad_w=8, pixels=True)]
        drawn = rand_targets([count, count], torch.Generator().manual_seed(count))
        targets = [{k: t[k].cuda() for k in ("labels", "boxes")} for t in drawn]
        expected, got = eager(*batch, targets), graphed(*batch, targets)
        torch.testing.assert_close(got, expected, rtol=2e-3, atol=1e-4, msg=lambda m: f"{H}x{W}, {count} boxes: {m}")
    # Inductor runs a graph it cannot record without CUDA graphs, and counts it: every region, losses included, replays.
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")
def test_evaluation_replayed_as_cuda_graphs_gives_the_detections_of_eager(seeded):
    """compile.mode=auto's evaluation on the GPU: ``detect`` per size, recorded, then replayed; each call's
    outputs read before the next."""
    eager, _, postprocess = build_model(tiny_cfg("box_refine", msda="triton"))
    _trained_looking(eager).cuda().eval()
    compiled = copy.deepcopy(eager)
    compile_model(compiled, CompilePlan(mode="reduce-overhead", evaluation=True))
    for H, W in ((128, 160), (160, 136)) * 3:
        assert_same_detections(eager, compiled, postprocess, H=H, W=W, device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")
def test_a_graph_with_symbolic_sizes_serves_token_counts_on_both_sides_of_inductors_fusion_threshold(seeded):
    """Inductor fuses the two reductions of a layer norm's backward only above 5 x 2^20 elements, and guards on
    that: with torch's options, the first token count on the other side of it compiles the graph again (the
    control, which shows this torch has the threshold); with the regions' options it does not."""
    from torch._dynamo.utils import counters

    from engine.compile.plan import _options
    from models.compiled_regions import Region

    def graphs_for_token_counts(options):
        torch._dynamo.reset()
        counters.clear()
        norm = torch.nn.LayerNorm(256, device="cuda")
        compiled = torch.compile(lambda x: norm(x), **options)
        for tokens in (8000, 12000):  # 2 x 256 x tokens: 4.1M, then 6.1M
            x = torch.randn(2, tokens, 256, device="cuda", requires_grad=True)
            compiled(x).square().sum().backward()
            torch.testing.assert_close(x.grad, _layer_norm_grad(norm, x.detach()), rtol=1e-4, atol=1e-4)
        return counters["stats"]["unique_graphs"]

    region_options = _options(Region("predict", whole=True), CompilePlan(mode="default"))
    assert graphs_for_token_counts({"backend": "inductor", "dynamic": True, "fullgraph": True}) == 2
    assert graphs_for_token_counts(region_options) == 1


def _layer_norm_grad(norm, x):
    x = x.clone().requires_grad_(True)
    norm(x).square().sum().backward()
    return x.grad
