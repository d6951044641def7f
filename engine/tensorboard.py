"""TensorBoard scalars, written by rank 0 only (other ranks get a writer that does nothing)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path


class ScalarWriter:
    """``add(prefix, {name: value}, step)`` -> scalars ``prefix/name`` in ``log_dir`` (rank 0)."""

    def __init__(self, *, log_dir: str | Path | None, enabled: bool):
        self._writer = None
        if enabled and log_dir is not None:
            # Imported here: torch.utils.tensorboard pulls in tensorboard, which ranks > 0 never need.
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(log_dir))

    def add(self, prefix: str, scalars: Mapping[str, float], step: int) -> None:
        if self._writer is None:
            return
        for name, value in scalars.items():
            self._writer.add_scalar(f"{prefix}/{name}", float(value), global_step=step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
