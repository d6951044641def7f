"""Export a trained detector for other runtimes: ``python export.py checkpoint=PATH [format=onnx|aoti]``.

    python export.py checkpoint=outputs/run/checkpoint.pth                       # ONNX, any batch and image size
    python export.py checkpoint=PATH format=aoti device=cuda                       # AOTInductor package for the GPU
    python export.py checkpoint=PATH msda_node=tensorrt dtype=fp16 device=cuda     # ONNX for TensorRT's plugin
    python export.py checkpoint=PATH postprocess=true                              # with the top-k detections

Writes the file beside the checkpoint (configs/export.yaml, ``output``) and export.log beside it, then checks it
against the PyTorch model (engine/export/run.py). ``export(cfg)`` takes a composed config and is what the tests
call.
"""

from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig

from engine.config.registry import register_configs
from engine.export.run import export
from engine.reporting.log_filter import keep_file_only_off_console
from engine.runtime.command_line import check_named_files_folder
from engine.runtime.console import refused_before_hydra, run_reporting_faults
from engine.runtime.output_paths import remove_unused_folders

log = logging.getLogger("export")
register_configs()

__all__ = ["export"]


@hydra.main(version_base="1.3", config_path="configs", config_name="export")
def main(cfg: DictConfig) -> None:
    keep_file_only_off_console()
    run_reporting_faults(
        lambda: export(cfg),
        run_dir=None,
        log=log,
        interrupted="stopped by Ctrl-C: the export did not finish, and its parity was not checked",
    )


if __name__ == "__main__":
    # Before Hydra opens export.log in the output's folder; a folder made for it goes if the export writes nothing.
    made = refused_before_hydra(lambda: check_named_files_folder(sys.argv, "output"))
    try:
        main()
    finally:
        remove_unused_folders(made)
