"""What the test modules share: the repository's root, the one tiny model and its batches, random outputs and targets
for the criterion, the optimizer step on the tiny model, the msda operator's random inputs, the tiny training run's
overrides, a trained model's checkpoint, process helpers and a run's state for calling hooks. Test modules import
from here, never from one another."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]

# -- the model -------------------------------------------------------------------------------------------------------

VARIANTS = {
    "base": {},
    "box_refine": {"with_box_refine": True},
    "two_stage": {"with_box_refine": True, "two_stage": True},
}
# The tests' one tiny model: the paper's architecture with a ResNet-18, narrow, one encoder and two decoder layers,
# ten queries on three feature levels, no dropout, no pretrained weights, the attention through the PyTorch
# reference. Direct builds (tiny_cfg), the tiny training run (tiny_overrides) and the trained checkpoint
# (write_checkpoint) all use it.
TINY_MODEL = dict(
    backbone="resnet18",
    pretrained="none",
    hidden_dim=32,
    nheads=2,
    enc_layers=1,
    dec_layers=2,
    dim_feedforward=64,
    dropout=0.0,
    num_feature_levels=3,
    num_queries=10,
    msda="pytorch",
)
TINY_CLASSES = 5  # a direct build's classes (the run's come from its data)


def model_cfg(**overrides):
    """The shipped model config with ``overrides`` (pretrained weights off)."""
    cfg = OmegaConf.load(ROOT / "configs" / "model" / "deformable_detr.yaml")
    cfg.pretrained = "none"
    return OmegaConf.merge(cfg, overrides)


def tiny_cfg(variant="base", **overrides):
    """The tiny model's config, of ``variant`` (VARIANTS), with ``overrides``."""
    return model_cfg(**{**TINY_MODEL, "num_classes": TINY_CLASSES, **VARIANTS[variant], **overrides})


def tiny_model_overrides() -> list[str]:
    """The tiny model as command-line overrides."""
    return [f"model.{key}={value}" for key, value in TINY_MODEL.items()]


def image_batch(B=2, H=64, W=64, pad_w=0, pixels=False):
    """Images (B, 3, H, W) and masks; the last image's right ``pad_w`` columns are padding (zeros). pixels: uint8
    images as the loaders give them (the model normalizes them); otherwise normalized float ones."""
    images = torch.randint(0, 256, (B, 3, H, W), dtype=torch.uint8) if pixels else torch.randn(B, 3, H, W)
    mask = torch.zeros(B, H, W, dtype=torch.bool)
    if pad_w:
        mask[-1, :, W - pad_w :] = True
        images[-1, :, :, W - pad_w :] = 0
    return images, mask


def two_box_targets(B=2):
    """The same two boxes (classes 1 and 3) for each of ``B`` images."""
    return [
        {"labels": torch.tensor([1, 3]), "boxes": torch.tensor([[0.5, 0.5, 0.2, 0.3], [0.3, 0.6, 0.1, 0.1]])}
        for _ in range(B)
    ]


def output_loss(out):
    """A loss that touches every output (and every coordinate of the boxes), so every gradient flows."""
    loss = out["pred_logits"].sigmoid().square().sum() + out["pred_boxes"].square().sum()
    for aux in out.get("aux_outputs", []):
        loss = loss + aux["pred_logits"].sigmoid().square().sum() + aux["pred_boxes"].square().sum()
    return loss


def gradient_errors(grads: dict, expected: dict, *, floor: float) -> dict[str, float]:
    """Each gradient's largest difference from ``expected``'s, relative to that tensor's largest entry, or to ``floor``
    times the largest entry of all gradients where its own is smaller: a tensor whose true gradient is zero (a conv
    bias before its GroupNorm) holds rounding alone, which no relative bound of its own would pass."""
    overall = max(e.abs().max() for e in expected.values())
    return {
        name: ((g - expected[name]).abs().max() / torch.maximum(expected[name].abs().max(), floor * overall)).item()
        for name, g in grads.items()
    }


def assert_same_detections(reference, model, postprocess, *, H: int, W: int, device: str) -> None:
    """``model.detect`` gives ``reference``'s detections (its eager forward, without gradients) on one batch of
    uint8 pixels, as evaluation's loader gives them."""
    images, mask = (t.to(device) for t in image_batch(H=H, W=W, pad_w=8, pixels=True))
    sizes = torch.tensor([[H, W - 8]] * images.shape[0], device=device)
    with torch.no_grad():
        expected = postprocess(reference(images, mask), sizes)
        got = postprocess(model.detect(images, mask), sizes)
    for image, (e, g) in enumerate(zip(expected, got)):
        torch.testing.assert_close(g["scores"], e["scores"], rtol=1e-3, atol=1e-4, msg=lambda m: f"{H}x{W}: {m}")
        # Two detections whose scores differ by less than the tolerance may come in either order: each detection
        # must have a counterpart of about its score, with its label and about its box.
        scores = (g["scores"][:, None] - e["scores"][None, :]).abs() <= 1e-3 * e["scores"].abs()[None, :] + 1e-4
        labels = g["labels"][:, None] == e["labels"][None, :]
        boxes = ((g["boxes"][:, None] - e["boxes"][None, :]).abs() <= 1e-3 * e["boxes"].abs()[None, :] + 1e-2).all(2)
        unmatched = (~(scores & labels & boxes).any(1)).nonzero().flatten().tolist()
        assert not unmatched, f"{H}x{W}, image {image}: detections {unmatched} have no counterpart in {e}"


class FixedDetector(torch.nn.Module):
    """Two queries per image over 3 classes: a box in the top-left quarter and one in the centre."""

    def detect(self, images, masks):  # what evaluation calls (DeformableDETR.detect)
        B = images.shape[0]
        logits = torch.tensor([[4.0, -4.0, 0.0], [-4.0, 2.0, -4.0]]).expand(B, 2, 3)  # (B, Q, K)
        boxes = torch.tensor([[0.25, 0.25, 0.2, 0.2], [0.5, 0.5, 0.3, 0.3]]).expand(B, 2, 4)  # (B, Q, 4) cxcywh
        return {"pred_logits": logits, "pred_boxes": boxes}


# -- the criterion ---------------------------------------------------------------------------------------------------

RAND_CLASSES = 5  # classes of the random outputs and targets


def rand_boxes(n, gen):
    """(n, 4) valid normalized cxcywh boxes."""
    centre = 0.2 + 0.6 * torch.rand(n, 2, generator=gen)
    size = 0.05 + 0.35 * torch.rand(n, 2, generator=gen)
    return torch.cat([centre, size], dim=1)


def rand_outputs(B, Q, gen, num_classes=RAND_CLASSES):
    return {
        "pred_logits": torch.randn(B, Q, num_classes, generator=gen),
        "pred_boxes": rand_boxes(B * Q, gen).view(B, Q, 4),
    }


def rand_targets(sizes, gen, num_classes=RAND_CLASSES):
    return [
        {"labels": torch.randint(0, num_classes, (n,), generator=gen), "boxes": rand_boxes(n, gen), "image_id": i}
        for i, n in enumerate(sizes)
    ]


def criterion_cfg(**overrides):
    """The keys build_criterion reads, at the published values, with ``overrides``."""
    cfg = dict(
        num_classes=RAND_CLASSES,
        dec_layers=6,
        aux_loss=True,
        two_stage=False,
        set_cost_class=2.0,
        set_cost_bbox=5.0,
        set_cost_giou=2.0,
        cls_loss_coef=2.0,
        bbox_loss_coef=5.0,
        giou_loss_coef=2.0,
        focal_alpha=0.25,
    )
    cfg.update(overrides)
    return OmegaConf.create(cfg)


def make_criterion(**overrides):
    from models.criterion import build_criterion

    criterion, _ = build_criterion(criterion_cfg(**overrides))
    return criterion


# -- the step --------------------------------------------------------------------------------------------------------


def optim_cfg():
    return OmegaConf.create(
        dict(
            lr=1e-3,
            lr_backbone=1e-4,
            lr_linear_proj_mult=0.1,
            weight_decay=1e-4,
            lr_backbone_names=["backbone.0"],
            lr_linear_proj_names=["reference_points", "sampling_offsets"],
        )
    )


def make_step(variant="base", msda="pytorch", device="cpu", **overrides):
    """An OptimizerStep of the tiny model of ``variant`` on ``device``, fp32."""
    from engine.runtime.precision import Precision
    from engine.train.optim import build_optimizer
    from engine.train.step import OptimizerStep
    from models import build_model

    model, criterion, _ = build_model(tiny_cfg(variant, msda=msda, **overrides))
    model.to(device)
    criterion.to(device)
    optimizer = build_optimizer(model, optim_cfg())
    return OptimizerStep(
        model=model,
        criterion=criterion,
        optimizer=optimizer,
        precision=Precision(amp="none", device=torch.device(device)),
        clip_max_norm=0.1,
    )


# -- the msda operator -----------------------------------------------------------------------------------------------

# Kernels run on the CPU only under the interpreter (set by conftest.py when there is no GPU).
MSDA_DEVICES = (["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else []) + (
    ["cuda"] if torch.cuda.is_available() else []
)
ORIGINAL_LEVELS = [(6, 4), (3, 2)]  # the original op's own test case


def msda_inputs(
    gen,
    *,
    N=1,
    M=2,
    D=8,
    Lq=5,
    P=2,
    levels=ORIGINAL_LEVELS,
    dtype=torch.float64,
    loc_dtype=None,
    weight_dtype=None,
    loc_low=0.0,
    loc_high=1.0,
    device="cpu",
):
    """Random value / spatial shapes / locations / softmaxed weights; locations uniform in [loc_low, loc_high)."""
    shapes = torch.tensor(levels, dtype=torch.int64)
    S = int(shapes.prod(1).sum())
    L = len(levels)
    value = torch.randn(N, S, M, D, generator=gen, dtype=torch.float64)
    loc = torch.rand(N, Lq, M, L, P, 2, generator=gen, dtype=torch.float64) * (loc_high - loc_low) + loc_low
    logits = torch.randn(N, Lq, M, L * P, generator=gen, dtype=torch.float64)
    weights = logits.softmax(-1).view(N, Lq, M, L, P)
    return (
        value.to(device, dtype),
        shapes.to(device),
        loc.to(device, loc_dtype or dtype),
        weights.to(device, weight_dtype or dtype),
    )


def rel_err(actual, expected):
    actual, expected = actual.double().cpu(), expected.double().cpu()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-300)).item()


def kernel_inputs(
    gen,
    *,
    N=1,
    M=2,
    D=8,
    Lq=5,
    P=2,
    levels=((6, 4), (3, 2)),
    dtype=torch.float64,
    loc_dtype=None,
    loc_low=0.0,
    loc_high=1.0,
    device="cpu",
):
    """(levels, value, locations, softmaxed weights, upstream gradient) for the launchers: locations uniform in
    [loc_low, loc_high), fresh from ``gen``."""
    S = sum(h * w for h, w in levels)
    L = len(levels)
    value = torch.randn(N, S, M, D, generator=gen, dtype=torch.float64)
    loc = torch.rand(N, Lq, M, L, P, 2, generator=gen, dtype=torch.float64) * (loc_high - loc_low) + loc_low
    weights = torch.randn(N, Lq, M, L * P, generator=gen, dtype=torch.float64).softmax(-1).view(N, Lq, M, L, P)
    grad_out = torch.randn(N, Lq, M * D, generator=gen, dtype=torch.float64)
    loc_dtype = loc_dtype or dtype
    return (
        tuple(levels),
        value.to(device, dtype),
        loc.to(device, loc_dtype),
        weights.to(device, loc_dtype),
        grad_out.to(device, dtype),
    )


def kernel_reference(levels, value, loc, weights, grad_out):
    """Output and gradients of the grid_sample reference, in fp64."""
    from msda.reference import multi_scale_deformable_attention_reference

    leaves = [t.detach().double().requires_grad_() for t in (value, loc, weights)]
    out = multi_scale_deformable_attention_reference(leaves[0], list(levels), leaves[1], leaves[2])
    return (out.detach(), *torch.autograd.grad(out, leaves, grad_out.double()))


def kernel_results(levels, value, loc, weights, grad_out, forward_config=None, forward_kernels=None, **backward_kwargs):
    """Output and the three gradients through the launchers (msda.launch), with the given kernels and schemes."""
    from msda import launch

    out = launch.forward(value, levels, loc, weights, config=forward_config, kernels=forward_kernels)
    grads = launch.backward(grad_out, value, levels, loc, weights, **backward_kwargs)
    return (out, *grads)


def assert_kernel_close(results, expected, rtol, inputs):
    """Each of output, grad_value, grad_loc, grad_weight: its input's dtype and shape, finite, within ``rtol``
    (relative L2) of the reference."""
    names = ("output", "grad_value", "grad_loc", "grad_weight")
    like = (inputs[1], inputs[1], inputs[2], inputs[3])  # output in value's dtype, each gradient in its input's
    for name, a, b, t in zip(names, results, expected, like):
        assert a.dtype == t.dtype and a.shape == (b.shape if name == "output" else t.shape), name
        assert torch.isfinite(a).all(), name
        assert rel_err(a, b) < rtol, f"{name}: relative error {rel_err(a, b):.3e} >= {rtol}"


# -- the tiny training run -------------------------------------------------------------------------------------------


def tiny_overrides(data_root: Path) -> list[str]:
    """A tiny CPU run on the synthetic set at ``data_root``: 2 epochs of 3 steps of 4 images, 64-pixel images."""
    return [
        f"dataset.root={data_root}",
        "dataset.num_train=16",
        "dataset.num_val=8",
        "dataset.image_size=64",
        "dataset.train_scales=[64]",
        "dataset.max_size=80",
        "dataset.val_size=64",
        *tiny_model_overrides(),
        "epochs=2",
        "batch_size=4",
        "num_workers=0",
        "log_every=1",
        "eval_every=1",
        "checkpoint_every=1",
        "optim.lr=1e-3",
        "device=cpu",
    ]


def compose_train(*overrides: str):
    """configs/train.yaml composed with ``overrides``."""
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


# -- a trained model's checkpoint ------------------------------------------------------------------------------------
# What the tests of predict.py and export.py run: a checkpoint as train.py writes one, of the tiny model with
# non-trivial weights, made without training.

CATEGORIES = {1: "circle", 2: "square", 3: "triangle"}
TRAINED_MODEL = [
    "model=tiny",
    *tiny_model_overrides(),
    "model.num_classes=4",
    "dataset.val_size=96",
    "dataset.max_size=128",
]


def write_checkpoint(path: Path, *, seed: int = 0, extra: tuple[str, ...] = ()) -> Path:
    """A tiny model's checkpoint at ``path``: its config, CATEGORIES and weights drawn from ``seed`` with
    sampling offsets and class biases spread as in a trained model, so that detections vary between images."""
    from engine.config.registry import plain_config
    from models import build_model
    from models.deformable_attention import MSDeformAttn

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[*TRAINED_MODEL, *extra])
    torch.manual_seed(seed)
    model, _, _ = build_model(cfg.model)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, MSDeformAttn):
                module.sampling_offsets.weight.normal_(0, 0.05)
                module.attention_weights.weight.normal_(0, 0.05)
        for head in model.class_embed:
            head.bias.normal_(0, 1.0)
    torch.save(
        {
            "model": model.state_dict(),
            "config": plain_config(cfg),
            "categories": dict(CATEGORIES),
            "epoch": 1,
            "step": 10,
        },
        path,
    )
    return path


# -- processes -------------------------------------------------------------------------------------------------------


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment, with the repository root first on PYTHONPATH and ``extra`` added.

    The caller's PYTHONPATH stays behind the root: packages may be installed there (as on a machine that
    adds them with pip --target), and a child that lost it could not import them.
    """
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, **extra, "PYTHONPATH": pythonpath}


def child_pids(parent: int | None = None, *, expect_some: bool = True) -> list[int]:
    """The processes whose parent is ``parent`` (default: this one): a run's loader workers (``expect_some``: at
    least one)."""
    parent = os.getpid() if parent is None else parent
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:  # the parent's pid, after the name and the state
            children.append(int(stat.parent.name))
    assert children or not expect_some, "the run's loader workers were not found"
    return children


def signal_at_call(monkeypatch, signum: int, call: int) -> None:
    """Send this process ``signum`` from inside the ``call``-th training step, as a scheduler would."""
    from engine.train.step import OptimizerStep

    step_call, calls = OptimizerStep.__call__, {"n": 0}

    def stepping(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            os.kill(os.getpid(), signum)
        return step_call(self, *args, **kwargs)

    monkeypatch.setattr(OptimizerStep, "__call__", stepping)


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(child.stdout)


def hook_run_state(
    output_dir: Path, *, device: torch.device | None = None, start_step: int = 0, total_steps: int = 100, hooks=()
):
    """A RunState (engine/train/hooks/base.py) of a one-process run of ``total_steps`` steps in one epoch from
    ``start_step``, for calling hooks directly; its writer writes nothing."""
    from engine.reporting.tensorboard import ScalarWriter
    from engine.runtime.distributed import DistContext
    from engine.runtime.stop_request import StopRequest
    from engine.train.hooks.base import RunMetrics, RunState
    from engine.train.run_plan import Position, RunPlan, StepBatch
    from engine.train.run_stop import RunStop
    from engine.train.run_timing import RunTiming

    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=device or torch.device("cpu"))
    plan = RunPlan(
        batch=StepBatch(total=2, per_process=2, passes=1),
        steps_per_epoch=total_steps,
        epochs=1,
        total_steps=total_steps,
        evaluation_steps=(total_steps,),
        evaluations=1,
        start_step=start_step,
        eval_every=1,
        log_every=1,
        seed=0,
    )
    return RunState(
        position=Position(step=start_step, steps_in_epoch=start_step),
        plan=plan,
        timing=RunTiming(started=0.0),
        metrics=RunMetrics(),
        writer=ScalarWriter(log_dir=None, enabled=False),
        ctx=ctx,
        output_dir=Path(output_dir),
        stop=RunStop(StopRequest(), ctx),
        hooks=list(hooks),
    )


def tensorboard_scalars(run_dir: Path, tag: str) -> list[float]:
    """The values a run wrote to TensorBoard under ``tag`` (e.g. "train/loss"), in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(Path(run_dir) / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return [event.value for event in sorted(events.Scalars(tag), key=lambda e: e.step)]


def compose_run(data_root: Path, output_dir: Path, *extra: str):
    """The tiny run (``tiny_overrides``) into ``output_dir``, with ``extra`` overrides."""
    return compose_train(*tiny_overrides(data_root), f"output_dir={output_dir}", *extra)


# -- bit-identity references -----------------------------------------------------------------------------------------


def training_fingerprint(variant: str, **overrides) -> dict:
    """What one training forward, its losses and its backward compute for the tiny model of ``variant`` on the
    CPU, fp32, one thread, from fixed seeds: per part ("outputs", "losses", "gradients") a sha256 of every tensor's
    bytes (in a fixed order) and fp64 sums to compare by where the bytes cannot be (another torch or CPU).

    tests/data/training_fingerprints.json holds what the code computed before the one-to-many options existed
    (tests/test_hybrid_matching.py compares with it): made before hybrid matching, and made again for the one tiny
    model from the same computation (the code of then and of the commit that remade it give the same figures here,
    and the first reference's within rounding, its machine's bits not being this CPU's)."""
    import hashlib

    from torch.utils._pytree import keystr, tree_flatten_with_path

    from models import build_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a reduction split over threads rounds differently
    try:
        torch.manual_seed(0)
        model, criterion, _ = build_model(tiny_cfg(variant, **overrides))
        gen = torch.Generator().manual_seed(1)
        images = torch.randn(2, 3, 64, 64, generator=gen)
        mask = torch.zeros(2, 64, 64, dtype=torch.bool)
        mask[1, :, 48:] = True
        targets = rand_targets([3, 1], gen)
        model.train()
        outputs = model(images, mask)
        losses = criterion(outputs, targets)
        sum(losses[k] * w for k, w in criterion.weight_dict.items() if k in losses).backward()
    finally:
        torch.set_num_threads(threads)

    def part(named: dict) -> dict:
        digest = hashlib.sha256()
        for name, tensor in named.items():
            tensor = tensor.detach().contiguous()
            digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}".encode())
            digest.update(tensor.numpy().tobytes())
        return {
            "sha256": digest.hexdigest(),
            "sums": {
                name: [float(t.detach().double().sum()), float(t.detach().double().abs().sum())]
                for name, t in named.items()
            },
        }

    flat_outputs = {keystr(path): t for path, t in tree_flatten_with_path(outputs)[0]}
    by_module: dict[str, list[torch.Tensor]] = {}
    gradients = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            gradients[name] = p.grad
            by_module.setdefault(".".join(name.split(".")[:2]), []).append(p.grad.flatten())
    grads = part(gradients)
    # Per parameter would be hundreds of numbers: the fallback compares the sums of each module's gradients.
    grads["sums"] = {
        m: [float(torch.cat(g).double().sum()), float(torch.cat(g).double().abs().sum())] for m, g in by_module.items()
    }
    return {"outputs": part(flat_outputs), "losses": part({k: losses[k] for k in sorted(losses)}), "gradients": grads}


def fingerprint_environment() -> dict:
    """Where a fingerprint's bytes are reproducible: the same torch release and CPU instruction set."""
    return {"torch": ".".join(torch.__version__.split(".")[:2]), "cpu": torch.backends.cpu.get_cpu_capability()}


# Shapes every kernel is checked on: the original op's case, non-power-of-2 head dims, 1x1 and five levels, a
# ragged query block, points outside the unit square.
KERNEL_SHAPES = [
    pytest.param(dict(), id="original"),
    pytest.param(dict(D=30, Lq=9), id="D30"),
    pytest.param(dict(D=71, M=1), id="D71"),
    pytest.param(dict(D=64, M=1, Lq=3), id="D64"),
    pytest.param(dict(levels=((1, 1),), D=4, P=3), id="single-1x1-level"),
    pytest.param(dict(levels=((5, 7), (3, 4), (2, 2), (1, 3), (1, 1)), P=3, D=8), id="L5-P3-1x1"),
    pytest.param(dict(Lq=67, N=2, M=3, D=16), id="ragged-query-block"),
    pytest.param(dict(Lq=9, loc_low=-0.6, loc_high=1.6), id="outside-unit-square"),
    pytest.param(dict(Lq=9, loc_low=-50.0, loc_high=50.0), id="far-outside"),
]
