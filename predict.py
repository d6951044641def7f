"""Detect objects in new images with a trained model: ``python predict.py checkpoint=PATH images=DIR_OR_FILE``.

    python predict.py checkpoint=outputs/run/checkpoint.pth images=photos/
    python predict.py checkpoint=r50_deformable_detr-checkpoint.pth images=street.jpg score_threshold=0.5
    python predict.py checkpoint=PATH images=val2017/ annotations=instances_val2017.json   # and its COCO AP

Writes detections.json, images.json and images/ into the run directory (engine/predict/run.py says what each
holds). ``predict(cfg)`` takes a composed config and is what the tests call.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from engine.config.registry import register_configs
from engine.predict.run import predict
from engine.reporting.log_filter import keep_file_only_off_console
from engine.runtime.console import refused_before_hydra, run_reporting_faults
from engine.runtime.run_lock import held_before_hydra

log = logging.getLogger("predict")
register_configs()

__all__ = ["predict"]


@hydra.main(version_base="1.3", config_path="configs", config_name="predict")
def main(cfg: DictConfig) -> None:
    keep_file_only_off_console()
    run_reporting_faults(
        lambda: predict(cfg),
        run_dir=Path(HydraConfig.get().runtime.output_dir),
        log=log,
        interrupted="stopped by Ctrl-C: detections.json and images.json are written at the end, so "
        "there are none; the pictures drawn so far are kept",
        dated=not cfg.output_dir,
    )


if __name__ == "__main__":
    # Before Hydra makes the run directory and opens predict.log there: refused while a run lives in it.
    claimed = refused_before_hydra(lambda: held_before_hydra(sys.argv))
    try:
        main()
    finally:
        if claimed is not None:
            claimed.release()
