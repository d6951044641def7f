"""Batches for training and evaluation: size buckets, the batch plan, collation and the DataLoader."""

from __future__ import annotations

import math
import random
import re
from itertools import accumulate

import torch
from torch.utils.data import DataLoader

from .batch_plan import BatchPlan
from .coco import CocoDetection
from .dataset_config import read_dataset_config
from .size_buckets import SizeBuckets, plan_size_buckets, round_up, val_families


def padded_size(sizes, pad_to_multiple: int = 1) -> tuple[int, int]:
    """The (H, W) a batch of images of ``sizes`` [(h, w), ...] is padded to without buckets: the largest h and
    w, each rounded up to a multiple of ``pad_to_multiple``."""
    return tuple(round_up(max(size[d] for size in sizes), pad_to_multiple) for d in (0, 1))


class BatchTargets(list):
    """A batch's targets: the list of per-image dicts, whose tensors are views of one tensor per key.

    A loader's worker hands each batch to the run through shared memory, tensor by tensor, and a run on a GPU
    copies it there the same way: for 32 images of 7 keys, hundreds of hand-overs and copies per batch, which the
    run waits for. Packed, there is one per key. A key is packed when every image has it as a plain tensor of
    one dtype: 0-d tensors are stacked, the others joined along their first dimension (an image's boxes, labels,
    ...); other values stay per image. What crosses processes, is pinned or is copied by ``to`` is the packed
    tensors and those other values: a value replaced in one of the dicts afterwards is not carried along.
    """

    def __init__(self, targets=()):
        targets = list(targets)
        keys = tuple(targets[0]) if targets else ()
        if any(tuple(t) != keys for t in targets):
            keys = None  # dicts of different keys: none packed, each kept as it came
        packed, lengths = {}, {}
        for k in keys or ():
            values = [t[k] for t in targets]
            if any(type(v) is not torch.Tensor or v.dtype != values[0].dtype for v in values):
                continue
            if all(v.dim() == 0 for v in values):
                packed[k], lengths[k] = torch.stack(values), None
            elif all(v.dim() > 0 and v.shape[1:] == values[0].shape[1:] for v in values):
                packed[k], lengths[k] = torch.cat(values), [len(v) for v in values]
        loose = [{k: v for k, v in t.items() if k not in packed} for t in targets]
        self._set(keys, packed, lengths, loose)

    def _set(self, keys, packed: dict, lengths: dict, loose: list[dict]) -> None:
        self._keys, self._packed, self._lengths, self._loose = keys, packed, lengths, loose
        starts = {k: [0, *accumulate(n)] for k, n in lengths.items() if n is not None}
        views = []
        for i, rest in enumerate(loose):
            view = {
                k: packed[k][i] if lengths[k] is None else packed[k][starts[k][i] : starts[k][i + 1]] for k in packed
            }
            views.append({k: view[k] if k in view else rest[k] for k in self._keys} if self._keys else rest)
        self[:] = views

    @classmethod
    def _from_parts(cls, keys, packed: dict, lengths: dict, loose: list[dict]) -> BatchTargets:
        targets = cls.__new__(cls)
        targets._set(keys, packed, lengths, loose)
        return targets

    def __reduce__(self):
        return BatchTargets._from_parts, (self._keys, self._packed, self._lengths, self._loose)

    def _map(self, tensor_fn) -> BatchTargets:
        """The same targets with ``tensor_fn`` applied to every tensor (the packed ones and the others)."""
        loose = [{k: tensor_fn(v) if torch.is_tensor(v) else v for k, v in t.items()} for t in self._loose]
        return BatchTargets._from_parts(
            self._keys, {k: tensor_fn(v) for k, v in self._packed.items()}, self._lengths, loose
        )

    def to(self, device: torch.device, *, non_blocking: bool = False) -> BatchTargets:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> BatchTargets:
        """Called by the DataLoader's pin-memory thread."""
        return self._map(lambda t: t.pin_memory())

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the targets hold memory in: the packed ones and the others."""
        return [*self._packed.values(), *(v for t in self._loose for v in t.values() if torch.is_tensor(v))]


def _pins_through_the_method() -> bool:
    """Whether this torch's DataLoader pins a list subclass through its ``pin_memory`` method. Older releases look
    for a sequence first and pin it item by item: packed targets would then reach the GPU from unpinned memory."""
    try:
        from torch.utils.data._utils.pin_memory import pin_memory
    except ImportError:
        return False

    class Probe(list):
        def pin_memory(self, *args):
            return "method"

    try:
        return pin_memory(Probe()) == "method"
    except Exception:  # any other behaviour: the per-image dicts of before
        return False


# Whether collate_fn packs a batch's targets (BatchTargets) or leaves them per image, as on an older torch.
PACK_TARGETS = _pins_through_the_method()


def collate_fn(batch: list, pad_to_multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor, list[dict]]:
    """[(image (3, h_i, w_i), target[, canvas])] -> images (B, 3, H, W), masks (B, H, W), targets.

    (H, W) is the items' canvas (all the same: the batch plan's bucket), or without one the largest image's
    sides rounded up to a multiple of ``pad_to_multiple``. Images are zero padded at the bottom and right
    (boxes stay relative to the unpadded image, as the model's mask tells it where the image ends); masks
    are True on padding. ``targets`` is the items' dicts, their tensors packed (BatchTargets) where PACK_TARGETS.
    """
    images, targets = [item[0] for item in batch], [item[1] for item in batch]
    if PACK_TARGETS:
        targets = BatchTargets(targets)
    canvases = {tuple(item[2]) for item in batch if len(item) > 2}
    if len(canvases) > 1:
        raise ValueError(f"a batch's images were planned for different sizes {sorted(canvases)}")
    height, width = canvases.pop() if canvases else padded_size([image.shape[-2:] for image in images], pad_to_multiple)
    padded = images[0].new_zeros((len(images), images[0].shape[0], height, width))  # (B, 3, H, W)
    masks = torch.ones((len(images), height, width), dtype=torch.bool)  # (B, H, W)
    for i, image in enumerate(images):
        h, w = image.shape[-2:]
        if h > height or w > width:
            raise ValueError(f"image {tuple(image.shape[-2:])} is larger than its batch's size {(height, width)}")
        padded[i, :, :h, :w] = image
        masks[i, :h, :w] = False
    return padded, masks, targets


def image_sizes(dataset: CocoDetection) -> list[tuple[int, int]]:
    return [dataset.image_size(i) for i in range(len(dataset))]


def build_size_buckets(
    train_set: CocoDetection | None, val_set: CocoDetection, cfg_dataset, *, batch_size: int, seed: int = 0
) -> SizeBuckets | None:
    """The run's size buckets from its data and recipe (``dataset.size_buckets`` sizes in all, 0: none);
    ``train_set`` None: evaluation's only (eval_only)."""
    c = read_dataset_config(cfg_dataset)
    if c.size_buckets == 0:
        return None
    val_outputs = [val_set.transforms.plan(size, random.Random(0))[1] for size in image_sizes(val_set)]  # no draw
    if train_set is None:
        return SizeBuckets(
            train=(), val=val_families(val_outputs, c.pad_to_multiple), families=(), multiple=c.pad_to_multiple
        )
    train_sizes = image_sizes(train_set)
    # A capped long side can come out longer than max_size by the whole pixels in half the image's aspect ratio
    # (the original's rounding of the short side, datasets/transforms.py): none below an aspect of 2, so that the
    # families, and the buckets, stay within max_size for most sets.
    aspects = [max(h, w) / min(h, w) for h, w in train_sizes]
    if c.crop:
        aspects.append(c.crop_max_size / c.crop_min_size)  # the most elongated crop window
    longest_long = c.max_size + math.floor(max(aspects) / 2)
    return plan_size_buckets(
        train_sizes=train_sizes,
        plan_train=lambda size, rng: train_set.transforms.plan(size, rng)[1],
        train_limits=(max(c.train_scales), longest_long),
        train_can_turn=c.crop,
        val_outputs=val_outputs,
        batch_size=batch_size,
        max_buckets=c.size_buckets,
        multiple=c.pad_to_multiple,
        seed=seed,
    )


# The message of an error a loader worker raised, as the DataLoader re-raises it in this process: "Caught
# ImageReadError in DataLoader worker process 0.\nOriginal Traceback (most recent call last): ... <type>: <message>"
_WORKER_TRACEBACK = re.compile(r"^Caught \w+ in DataLoader worker process \d+\.\nOriginal Traceback", re.S)
# What the DataLoader says when a worker process died (killed, crashed, out of memory).
_WORKER_DIED = re.compile(r"DataLoader worker \(pid\(?s?\)? [\d, ]+\) (exited unexpectedly|is killed by signal)")


def worker_error_message(error: BaseException) -> str:
    """``error``'s own message, without the worker's traceback the DataLoader puts before it."""
    text = str(error)
    if not _WORKER_TRACEBACK.match(text):
        return text
    last = [line for line in text.splitlines() if line.strip()][-1]
    return re.sub(r"^[\w.]+: ", "", last.strip())


def is_worker_death(error: BaseException) -> bool:
    """Whether ``error`` is the DataLoader's report that one of its worker processes died."""
    return isinstance(error, RuntimeError) and bool(_WORKER_DIED.search(str(error)))


def stop_workers(loader: DataLoader) -> None:
    """End ``loader``'s worker processes now, as its iterator ends them when it is collected. A failing run must not
    leave them to the interpreter's exit: they ignore the stop signals (engine/runtime/stop_request.py), with one of
    which multiprocessing's exit handler ends them before it waits for them, forever."""
    iterator, loader._iterator = getattr(loader, "_iterator", None), None
    if iterator is None or not hasattr(iterator, "_shutdown_workers"):
        return
    try:
        iterator._shutdown_workers()
    except RuntimeError as error:  # another loader's dead worker, reported while this one waits for its own
        if not is_worker_death(error):
            raise


def build_data_loader(
    dataset: CocoDetection,
    *,
    batch_size: int,
    num_workers: int,
    train: bool,
    buckets: SizeBuckets | None = None,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    pad_to_multiple: int = 1,
    worker_init_fn=None,
    pin_memory: bool = False,
) -> DataLoader:
    """DataLoader of (images, masks, targets) batches, as ``loader.batch_sampler`` (a BatchPlan) plans them.

    train: an endless stream of epochs (``loader.batch_sampler.steps_per_epoch`` batches each; resume with
    ``loader.batch_sampler.start_at``); else one pass over this rank's share of the images. Workers stay alive
    between passes and prefetch across an epoch's end; ``worker_init_fn`` runs in each as it starts.
    ``pin_memory``: batches in page-locked memory, for a run on a GPU (a thread of the loader copies them there).
    """
    plan = BatchPlan(
        sizes=image_sizes(dataset),
        transform=dataset.transforms,
        batch_size=batch_size,
        buckets=buckets,
        train=train,
        seed=seed,
        rank=rank,
        world_size=world_size,
        multiple=pad_to_multiple,
    )
    return DataLoader(
        dataset,
        batch_sampler=plan,
        collate_fn=collate_fn,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        generator=torch.Generator().manual_seed(seed + rank),
        worker_init_fn=worker_init_fn,
    )
