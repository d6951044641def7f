"""Random number generators: seeding per run and per epoch, and saving/restoring their states. Each epoch re-seeds
from (seed, epoch, rank), so a resume at an epoch boundary draws what an uninterrupted run draws; a mid-epoch resume
restores the saved states.
"""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # seeds every CUDA device as well


def epoch_seed(seed: int, *, epoch: int, rank: int) -> int:
    """A seed per (run seed, epoch, rank); ranks differ so their augmentations are independent."""
    return seed + 100_003 * (epoch + 1) + 1_009 * rank


def capture_rng_state() -> dict:
    """Generator states of python, numpy, torch and every CUDA device, in weights_only-loadable types."""
    np_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))  # setstate needs tuples, a reader may give lists
    n = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": n["bit_generator"],
            "has_gauss": n["has_gauss"],
            "gauss": n["gauss"],
            "state": {"key": n["key"].numpy().astype(np.uint32), "pos": n["pos"]},
        }
    )
    torch.set_rng_state(state["torch"])
    # CUDA states only when the device count matches: on another machine a resume gets fresh CUDA generators.
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextlib.contextmanager
def rng_preserved():
    """Run a block (evaluation, whose transforms draw from ``random``) without moving the generators training draws
    from, so that evaluating never changes the training batches."""
    state = capture_rng_state()
    try:
        yield
    finally:
        restore_rng_state(state)
