"""TensorBoard scalars (and a few images), written by rank 0 only (other ranks get a writer that does nothing)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch


class ScalarWriter:
    """``add(prefix, {name: value}, step)`` -> scalars ``prefix/name`` in ``log_dir`` (rank 0). The event file is made
    at the first write: a run that fails before it leaves no empty TensorBoard folder."""

    def __init__(self, *, log_dir: str | Path | None, enabled: bool):
        self._log_dir = str(log_dir) if enabled and log_dir is not None else None
        self._writer = None

    def _summary_writer(self):
        if self._writer is None and self._log_dir is not None:
            # Imported here: torch.utils.tensorboard pulls in tensorboard, which ranks > 0 never need.
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=self._log_dir)
        return self._writer

    def add(self, prefix: str, scalars: Mapping[str, float], step: int) -> None:
        writer = self._summary_writer()
        if writer is None:
            return
        for name, value in scalars.items():
            writer.add_scalar(f"{prefix}/{name}", float(value), global_step=step)

    def add_image(self, tag: str, image: torch.Tensor, step: int) -> None:
        """``image`` (3, H, W) uint8 RGB under ``tag`` (one tag per picture: the slider steps through time)."""
        if image.dim() != 3 or image.shape[0] != 3 or image.dtype != torch.uint8:
            raise ValueError(
                f"add_image({tag!r}): expected a (3, H, W) uint8 image, got {tuple(image.shape)} {image.dtype}"
            )
        writer = self._summary_writer()
        if writer is not None:
            writer.add_image(tag, image, global_step=step, dataformats="CHW")

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._writer = self._log_dir = None
