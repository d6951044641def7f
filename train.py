"""Train and evaluate Deformable DETR: ``python train.py [hydra overrides]`` (configs/train.yaml).

    python train.py                                   # synthetic set, CPU-sized, trains then evaluates
    python train.py dataset=coco dataset.root=PATH    # COCO 2017, the published recipe
    python train.py eval_only=true checkpoint=PATH    # evaluate ours or an official checkpoint
    python train.py resume=auto                       # continue the latest run of this model and data
    torchrun --nproc_per_node=N train.py ...          # data parallel over N processes, one run directory

``train(cfg)`` (engine/train/run.py) and ``evaluate_checkpoint(cfg)`` (engine/train/eval_only.py) take a
composed config and are what the tests call.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # before the imports below: the run's wall time counts them too

import itertools  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from engine.config.registry import register_configs  # noqa: E402
from engine.reporting.log_filter import keep_file_only_off_console  # noqa: E402
from engine.runtime.command_line import refuse_moved_settings  # noqa: E402
from engine.runtime.console import refused_before_hydra, run_reporting_faults  # noqa: E402
from engine.runtime.distributed import argv_for_rank, env_rank  # noqa: E402
from engine.runtime.run_lock import held_before_hydra  # noqa: E402
from engine.train.eval_only import evaluate_checkpoint  # noqa: E402
from engine.train.run import train  # noqa: E402

log = logging.getLogger("train")
register_configs()  # the typed schemas configs/*.yaml name (engine/config/), before Hydra composes
# Where each job's wall time counts from: the first job from the process's start (the imports included), each later
# job of a multirun (-m) from its own start (each next() reads the clock).
JOB_STARTS = itertools.chain([STARTED], iter(time.perf_counter, None))

__all__ = ["evaluate_checkpoint", "train"]


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    started = next(JOB_STARTS)
    if env_rank() != 0:
        logging.getLogger().setLevel(logging.WARNING)  # console and files belong to rank 0
    keep_file_only_off_console()
    run_dir = Path(HydraConfig.get().runtime.output_dir) if env_rank() == 0 else None
    if cfg.eval_only:
        run_reporting_faults(
            lambda: evaluate_checkpoint(cfg),
            run_dir=run_dir,
            log=log,
            dated=not cfg.output_dir,
            interrupted="stopped by Ctrl-C: the evaluation did not finish, and eval.json, written at its end, was "
            "not written",
        )
    else:
        run_reporting_faults(lambda: train(cfg, started=started), run_dir=run_dir, log=log, dated=not cfg.output_dir)


if __name__ == "__main__":
    sys.argv = argv_for_rank(sys.argv, env_rank())
    # Before Hydra writes anything into the directory: a live run's stays as it was, an unwritable one is named.
    refused_before_hydra(lambda: refuse_moved_settings(sys.argv))
    claimed = refused_before_hydra(lambda: held_before_hydra(sys.argv)) if env_rank() == 0 else None
    try:
        main()
    finally:
        if claimed is not None:
            claimed.release()
