"""``python train.py eval_only=true checkpoint=PATH``: a checkpoint (ours or an official one) evaluated on the
validation split, written to eval.json and TensorBoard."""

from __future__ import annotations

import contextlib

from omegaconf import DictConfig

from engine.checkpoint.trained_model import build_trained_model, checkpoint_model
from engine.evaluation.detection_images import build_detection_images
from engine.evaluation.validation import Validation
from engine.reporting.tensorboard import ScalarWriter
from engine.runtime.distributed import Ranks
from engine.runtime.precision import Precision

from .run_setup import (
    build_datasets,
    build_loader,
    in_run_directory,
    prepare_compilation,
    size_buckets,
    warn_unbounded_sizes,
)
from .settle import settle_evaluation


def evaluate_checkpoint(cfg: DictConfig) -> dict:
    """Evaluate ``cfg.checkpoint`` on the validation split; writes eval.json and returns {"output_dir", "eval"}. The
    model variant and sizes come from the checkpoint when it records them (our config, or the official checkpoints'
    args), otherwise from the config (e.g. experiment=two_stage)."""
    if not cfg.checkpoint:
        raise ValueError(
            "eval_only=true needs checkpoint=PATH (a checkpoint of this trainer or an official Deformable DETR one)"
        )
    with in_run_directory(cfg) as (ctx, output_dir):
        prepare_compilation(cfg)
        source = checkpoint_model(cfg.checkpoint, cfg.model, weights=cfg.checkpoint_weights)
        val_set = build_datasets(cfg, ctx, ("val",))["val"]
        cfg, checked = settle_evaluation(cfg, source, val_set)
        # batch_size: the most images one pass takes; evaluation needs less memory than training's passes.
        buckets = size_buckets(cfg, ctx, None, val_set, batch_size=cfg.batch_size)
        loader = build_loader(val_set, cfg, ctx, train=False, buckets=buckets, batch_size=cfg.batch_size)
        trained = build_trained_model(
            source,
            device=ctx.device,
            model_config=checked.model,
            cfg_compile=cfg.compile,
            evaluation_batches=len(loader.batch_sampler),
        )
        plan = trained.compile_plan
        if ctx.is_main:
            warn_unbounded_sizes(cfg, buckets, plan, training=False)
        validation = Validation(
            model=trained.model,
            postprocess=trained.postprocess,
            loader=loader,
            coco_gt=val_set.coco,
            precision=Precision(amp=cfg.amp, device=ctx.device),
            ranks=Ranks(ctx),
            compiled=plan is not None and plan.evaluation,
            backend=cfg.eval_backend,
            detection_images=build_detection_images(cfg, val_set, enabled=ctx.is_main),
        )
        with contextlib.closing(ScalarWriter(log_dir=output_dir / "tensorboard", enabled=ctx.is_main)) as writer:
            evaluation = validation.run(
                writer=writer,
                json_path=output_dir / "eval.json",
                step=source.step,
                what=f"of {source.path}",
                checkpoint=str(source.path.resolve()),
                weights=source.loaded_weights,
            )
        return {"output_dir": output_dir, "eval": evaluation.stats}
