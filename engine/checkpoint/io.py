"""Checkpoint files: atomic writes (stray temporaries cleaned up), room on the disk, loading with clear errors.
Ours is a dict whose keys engine/train/hooks/saving.py writes; an official one is {"model": state_dict, "args":
argparse.Namespace, ...}."""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import re
import shutil
from pathlib import Path

import torch

from engine.config.run_files import LATEST, named_checkpoint
from engine.errors import CheckpointError, CheckpointWriteError
from engine.runtime.run_lock import process_alive

log = logging.getLogger(__name__)


def epoch_checkpoint_name(epoch: int) -> str:
    return f"checkpoint_epoch{epoch:04d}.pth"


def save_checkpoint(state: dict, path: str | os.PathLike) -> Path:
    """Write ``state`` to ``path`` atomically (a temporary file beside it, fsynced, then renamed over it): a reader
    sees the old file or the whole new one. CheckpointWriteError naming the path and the free space on failure."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stray_temporaries(path.parent)
    tmp = _temporary_name(path)
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as error:  # torch.save reports a full disk as a RuntimeError of its writer
        try:
            free_mb = shutil.disk_usage(path.parent).free / 2**20
        except OSError:
            free_mb = float("nan")
        kept = (
            f"{path} still holds the previous checkpoint"
            if path.exists()
            else "no checkpoint had been written there yet"
        )
        raise CheckpointWriteError(
            f"could not write checkpoint {path} ({_write_failure(error)}; {free_mb:.0f} MB free on its "
            f"disk); {kept}. Free disk space or set output_dir to another disk, then resume"
        ) from None
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _write_failure(error: Exception) -> str:
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    text = str(error)
    if "unexpected pos" in text or "failed writing" in text:
        return "the write stopped short: the disk is probably full"
    return f"{type(error).__name__}: {text.splitlines()[0][:200] if text else ''}"


def checkpoint_bytes(model: torch.nn.Module) -> int:
    """About the bytes a checkpoint of ``model`` takes: weights, buffers and AdamW's two fp32 moments."""
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    moments = sum(2 * 4 * p.numel() for p in model.parameters() if p.requires_grad)
    return weights + moments + 2**20


def check_free_space(directory: str | os.PathLike, needed: int) -> None:
    """CheckpointWriteError when ``directory`` has less than ``needed`` bytes free (on top of the old checkpoint,
    which a save replaces only once the new file is written)."""
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise CheckpointWriteError(
            f"{directory} has {free / 2**20:.0f} MB free, and a checkpoint of this run takes about "
            f"{needed / 2**20:.0f} MB: free disk space or set output_dir to a disk with room"
        )


def _temporary_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


# .<name>.<pid>.tmp, as _temporary_name makes them
_TEMPORARY = re.compile(r"\..+\.(?P<pid>\d+)\.tmp")


def remove_stray_temporaries(directory: str | os.PathLike) -> list[Path]:
    """Delete the temporary files interrupted saves left in ``directory``: those of processes that no longer run, or
    of this one (whose saves are over), never a save in progress elsewhere."""
    removed = []
    for tmp in Path(directory).glob(".*.tmp"):
        match = _TEMPORARY.fullmatch(tmp.name)
        if match is None:
            continue
        pid = int(match["pid"])
        if pid == os.getpid() or not process_alive(pid):
            try:
                size = tmp.stat().st_size
                tmp.unlink()
            except FileNotFoundError:
                continue
            log.info("removed %s (%.0f MB), left by an interrupted save", tmp, size / 2**20)
            removed.append(tmp)
    return removed


def publish_as(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Make ``dst`` hold the bytes of the finished checkpoint ``src``, atomically: a hard link (a copy where links
    are not supported) renamed to ``dst``. CheckpointWriteError naming both files on failure."""
    src, dst = Path(src), Path(dst)
    tmp = _temporary_name(dst)
    try:
        tmp.unlink(missing_ok=True)
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except OSError as error:
        raise CheckpointWriteError(
            f"wrote checkpoint {src} but could not publish it as {dst} "
            f"({error.strerror or error}); {src} holds the latest state: resume={src}"
        ) from None
    return dst


def load_checkpoint(path: str | os.PathLike) -> dict:
    """Read a checkpoint (a file, or a run directory's latest) onto the CPU with weights_only=True, allowing the
    official checkpoints' argparse.Namespace; CheckpointError naming the path and what was expected."""
    given, path = Path(path), named_checkpoint(path)
    expected = (
        "a torch.save file holding a dict with a 'model' state_dict (a checkpoint of this trainer or an "
        f"official Deformable DETR checkpoint), or a run directory holding its {LATEST}"
    )
    if not path.is_file():
        if path != given:
            raise CheckpointError(f"checkpoint {given} is a directory without a {LATEST} (expected {expected})")
        folder = "" if path.parent.is_dir() else f", nor does its folder {path.parent}"
        raise CheckpointError(f"checkpoint {path} does not exist{folder} (expected {expected})")
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch.load fails in many ways on a foreign file (KeyError for text); name the file
        raise CheckpointError(
            f"could not read checkpoint {path} ({_load_failure(e)}); the file is truncated, corrupt or not {expected}"
        ) from e
    if not isinstance(obj, dict) or not isinstance(obj.get("model"), dict):
        got = type(obj).__name__ if not isinstance(obj, dict) else f"dict with keys {sorted(obj)[:10]}"
        raise CheckpointError(f"checkpoint {path} holds {got}; expected {expected}")
    return obj


def _load_failure(e: Exception) -> str:
    """The informative part of torch.load's error (its weights_only text is advice for trusted files)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if isinstance(e, pickle.UnpicklingError):
        unsupported = [ln for ln in lines if "Unsupported" in ln]
        return unsupported[0] if unsupported else "not a pickle of tensors and containers"
    if isinstance(e, EOFError) or not lines:
        return f"{type(e).__name__}: ended early"
    if isinstance(e, KeyError):  # the legacy unpickler meeting bytes that are no pickle opcode
        return "not a pickle: unknown opcode"
    return f"{type(e).__name__}: {lines[0].split('. ')[0]}"
