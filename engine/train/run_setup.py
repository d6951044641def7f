"""What a train.py run sets up before its work, the same for training and ``eval_only``: the run directory
and its lock, compilation's caches and log, the data checked and loaded in size buckets."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

from omegaconf import DictConfig

from datasets import build_data_loader, build_dataset, build_size_buckets
from engine.compile.cache import use_compile_cache
from engine.compile.clock import CompileClock
from engine.compile.recompile_log import log_recompiles_to_file
from engine.errors import SettingsError
from engine.runtime.distributed import DistContext, barrier, broadcast_object, init_distributed, shutdown_distributed
from engine.runtime.msda_device import check_msda_device
from engine.runtime.output_paths import job_directory
from engine.runtime.run_lock import RunLock
from engine.runtime.stop_request import ignore_stop_signals
from models.deformable_detr import encoder_tokens

log = logging.getLogger(__name__)


def resolve_output_dir(cfg: DictConfig, ctx: DistContext) -> Path:
    """The run directory: ``output_dir`` if set, else Hydra's, and in a multirun always Hydra's (the job's own
    folder under output_dir); rank 0 decides and every rank uses it."""
    chosen = str(job_directory(cfg.output_dir, script="train.py")) if ctx.is_main else None
    return Path(broadcast_object(chosen, ctx))


@contextlib.contextmanager
def in_run_directory(cfg: DictConfig) -> Iterator[tuple[DistContext, Path]]:
    """(ctx, output_dir): the job's processes, shut down on the way out, and its run directory, whose lock rank 0
    holds meanwhile (engine/runtime/run_lock.py). The attention model.msda names must run on the device, checked
    before anything is read or built."""
    ctx = init_distributed(device=cfg.device, timeout_s=cfg.dist_timeout_s)
    try:
        check_msda_device(cfg.model.msda, ctx.device)
        output_dir = resolve_output_dir(cfg, ctx)
        with RunLock(output_dir) if ctx.is_main else contextlib.nullcontext():
            yield ctx, output_dir
    finally:
        shutdown_distributed(ctx)


def prepare_compilation(cfg: DictConfig) -> None:
    """Compiled graphs and kernels kept in compile.cache_dir; recompilations logged to train.log."""
    use_compile_cache(cfg.compile.cache_dir)
    CompileClock.get()
    log_recompiles_to_file()


def build_datasets(cfg: DictConfig, ctx: DistContext, splits: tuple[str, ...]) -> dict:
    """Rank 0 first (it may write the synthetic set to disk), then the others read what it wrote."""
    datasets = {}
    if ctx.is_main:  # checks the data (opens the validation images) and reports dropped annotations
        datasets = {s: build_dataset(s, cfg.dataset, check=True) for s in splits}
    barrier(ctx)
    if not ctx.is_main:
        datasets = {s: build_dataset(s, cfg.dataset, check=False) for s in splits}
    return datasets


def size_buckets(cfg: DictConfig, ctx: DistContext, train_set, val_set, *, batch_size: int):
    """The run's size buckets (datasets/size_buckets.py; train_set None: evaluation's only) for batches of
    ``batch_size`` images, the same on every rank; rank 0 logs them."""
    buckets = build_size_buckets(train_set, val_set, cfg.dataset, batch_size=batch_size, seed=cfg.seed)
    if ctx.is_main:
        log.info(
            "size buckets: %s",
            buckets.describe()
            if buckets is not None
            else f"off (dataset.size_buckets=0): each batch is padded to its largest image, rounded up to a multiple "
            f"of {cfg.dataset.pad_to_multiple}",
        )
    return buckets


def build_loader(dataset, cfg: DictConfig, ctx: DistContext, *, train: bool, buckets, batch_size: int):
    """This process's loader of ``dataset``, ``batch_size`` images a batch."""
    return build_data_loader(
        dataset,
        batch_size=batch_size,
        num_workers=cfg.num_workers,
        train=train,
        buckets=buckets,
        seed=cfg.seed,
        rank=ctx.rank,
        world_size=ctx.world_size,
        pad_to_multiple=cfg.dataset.pad_to_multiple,
        worker_init_fn=ignore_stop_signals,
        pin_memory=ctx.device.type == "cuda",
    )


def warn_unbounded_sizes(cfg: DictConfig, buckets, plan, *, training: bool) -> None:
    """Without size buckets, a plan that builds graphs per input size builds them for every padded size met."""
    work = plan.per_size_work(training=training) if plan is not None and buckets is None else None
    if work:
        log.warning(
            "dataset.size_buckets=0 with compile.mode=%s: each new padded batch size %s again (every multiple "
            "of dataset.pad_to_multiple=%d up to the largest image); the size buckets bound that to a few "
            "sizes, compile.mode=eager builds nothing",
            cfg.compile.mode,
            work,
            cfg.dataset.pad_to_multiple,
        )


def check_two_stage_queries(cfg_model, buckets) -> None:
    """Two-stage selects its queries among the encoder's tokens: refused before the first step when the smallest size
    bucket's images have fewer tokens than the queries to select (hybrid matching's one-to-many ones included in
    training), rather than failing at that bucket's first batch, mid-epoch."""
    if buckets is None or not cfg_model.two_stage:
        return
    one_to_one = ("model.num_queries", cfg_model.num_queries)
    hybrid = cfg_model.one_to_many == "hybrid"
    one_to_many = ("model.num_queries_one2many", cfg_model.num_queries_one2many if hybrid else 0)
    checks = [("training", buckets.train, [one_to_one, one_to_many]), ("evaluation", buckets.val, [one_to_one])]
    for what, sizes, counts in checks:
        counts = [(key, n) for key, n in counts if n]
        queries = sum(n for _, n in counts)
        tokens = {
            size: encoder_tokens(*size, num_feature_levels=cfg_model.num_feature_levels, dilation=cfg_model.dilation)
            for size in sizes
        }
        smallest = min(tokens, key=tokens.get)
        if tokens[smallest] < queries:
            keys = " + ".join(f"{key}={n}" for key, n in counts)
            raise SettingsError(
                f"model.two_stage=true selects {queries} queries ({keys}) among the encoder's tokens, but the smallest "
                f"{what} size bucket, {smallest[0]}x{smallest[1]}, has only {tokens[smallest]}: lower "
                f"{' or '.join(key for key, _ in reversed(counts))}, or use larger images (dataset.train_scales, "
                "dataset.val_size)"
            )
