"""Which images make each batch, with what augmentation, padded to what size: the loaders' batch sampler.

``BatchPlan`` draws every image's augmentation choices itself (``transform.plan``, seeded by the run's seed,
the epoch and the image's index), so it knows the size each image will have before a worker reads it. With
size buckets (datasets/size_buckets.py) it then batches images of one bucket together, padded to that
bucket's size; without, it batches images in sampling order, padded to the batch's largest image (rounded up
to ``multiple``), as the original does. Either way the batches and their augmentation depend only on the seed
and the epoch: not on the number of workers, and a resumed run can start in the middle of an epoch without
reading the batches before it.

Training is one endless stream over the epochs (``steps_per_epoch`` batches each), so that the loader's
workers prefetch across an epoch's end and the next epoch starts with its batches ready. An epoch's batches are
planned over a permutation of the whole set, each of the step's images over all processes (``batch_size`` x
``world_size``), and each process takes its slice of every batch: N processes train the batches, padded to the
sizes, that one process holding the whole step would. With buckets, the images an epoch leaves in part-filled
buckets are batched in the family buckets that hold them, and the few left after that wait for no one: every
epoch has ``steps_per_epoch`` batches, the same on every process. Evaluation is one pass over this process's
share in file order; a bucket's last batch is filled up with copies of one of its images (their detections replace
identical ones), so every batch has the same shape.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Sampler

from .size_buckets import Size, SizeBuckets, round_up, smallest_holding


@dataclass(frozen=True)
class PlannedSample:
    """What a worker needs to produce one image of a batch: its index, augmentation choices, the batch's size."""

    index: int
    plan: Any  # params for the transform's ``apply``
    size: Size  # (h, w) the image has after the transform
    canvas: Size  # (H, W) the batch is padded to


def epoch_share(*, num_images: int, epoch: int, seed: int, shuffle: bool, rank: int, world_size: int) -> list[int]:
    """This process's indices for ``epoch``: DistributedSampler's split (a permutation seeded with seed +
    epoch, padded with repeats to a multiple of ``world_size``, every world_size-th from ``rank``)."""
    if shuffle:
        order = torch.randperm(num_images, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    else:
        order = list(range(num_images))
    total = -(-num_images // world_size) * world_size
    while len(order) < total:
        order += order[: total - len(order)]
    return order[rank:total:world_size]


class BatchPlan(Sampler[list[PlannedSample]]):
    """A DataLoader's ``batch_sampler``: lists of PlannedSample (see the module docstring).

    sizes      (h, w) of each image of the dataset as read from disk, by index
    transform  a datasets.transforms.Planned (the dataset's own transforms)
    buckets    SizeBuckets, or None to pad each batch to its largest image rounded up to ``multiple``
    train      an endless, shuffled stream of epochs of ``steps_per_epoch`` full batches; else one pass
    """

    def __init__(
        self,
        *,
        sizes: Sequence[Size],
        transform,
        batch_size: int,
        buckets: SizeBuckets | None,
        train: bool,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        multiple: int = 1,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.sizes = [tuple(map(int, s)) for s in sizes]
        self.transform, self.batch_size, self.buckets, self.train = transform, batch_size, buckets, train
        self.seed, self.rank, self.world_size, self.multiple = seed, rank, world_size, multiple
        families = len(buckets.families) if buckets is not None else 1
        # A step's batch over all processes; with buckets, up to one step's images but one per family can be left
        # over at an epoch's end.
        step_images = batch_size * world_size
        self.steps_per_epoch = max(0, len(self.sizes) // step_images - (families - 1)) if train else None
        self._start = (0, 0)
        self.image_pixels = 0  # of the batches yielded so far (copies that fill evaluation batches excluded)
        self.padded_pixels = 0

    # -- where the stream starts ------------------------------------------------------------------------
    def start_at(self, epoch: int, step_in_epoch: int = 0) -> None:
        """Training: the next iteration starts at batch ``step_in_epoch`` of ``epoch`` (a resumed run)."""
        self._start = (epoch, step_in_epoch)

    @property
    def padding_waste(self) -> float:
        """Padded pixels / all pixels of the batches yielded so far."""
        return 1.0 - self.image_pixels / self.padded_pixels if self.padded_pixels else 0.0

    def __len__(self) -> int:
        """Batches per epoch (training) or in the pass (evaluation)."""
        if self.train:
            return self.steps_per_epoch
        return sum(1 for _ in self._epoch_batches(0, count=False))

    def __iter__(self) -> Iterator[list[PlannedSample]]:
        if not self.train:
            yield from self._epoch_batches(0)
            return
        epoch, skip = self._start
        while True:
            for i, batch in enumerate(self._epoch_batches(epoch)):
                if i >= skip:
                    yield batch
            epoch, skip = epoch + 1, 0

    # -- one epoch --------------------------------------------------------------------------------------
    def _planned(self, index: int, epoch: int) -> tuple[Any, Size]:
        # Each image's choices depend on (seed, epoch, index) only: not on the split over processes.
        rng = random.Random(f"{self.seed}:{epoch}:{index}")
        return self.transform.plan(self.sizes[index], rng)

    def _epoch_batches(self, epoch: int, *, count: bool = True) -> Iterator[list[PlannedSample]]:
        # Training plans the steps' batches over every process's images, evaluation this process's share alone.
        ranks = (0, 1) if self.train else (self.rank, self.world_size)
        indices = epoch_share(
            num_images=len(self.sizes),
            epoch=epoch,
            seed=self.seed,
            shuffle=self.train,
            rank=ranks[0],
            world_size=ranks[1],
        )
        samples = ((i, *self._planned(i, epoch)) for i in indices)
        size = self.batch_size * (self.world_size if self.train else 1)
        batches = self._bucketed(samples, size) if self.buckets is not None else self._in_order(samples, size)
        for n, batch in enumerate(batches):
            if self.train and n >= self.steps_per_epoch:
                return
            if self.train:
                batch = batch[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]  # this process's part
            if count:
                self._count(batch)
            yield batch

    def _in_order(self, samples, batch_size: int) -> Iterator[list[PlannedSample]]:
        pending = []
        for index, plan, size in samples:
            pending.append((index, plan, size))
            if len(pending) == batch_size:
                yield self._batch(pending, self._covering(pending))
                pending = []
        if pending and not self.train:
            yield self._batch(pending, self._covering(pending))

    def _covering(self, pending) -> Size:
        return tuple(round_up(max(size[d] for _, _, size in pending), self.multiple) for d in (0, 1))

    def _bucketed(self, samples, batch_size: int) -> Iterator[list[PlannedSample]]:
        buckets = self.buckets.train if self.train else self.buckets.val
        queues: dict[Size, list] = {}
        for index, plan, size in samples:
            bucket = smallest_holding(size, buckets)
            if bucket is None:
                # The buckets hold every size the recipe can produce (datasets/size_buckets.py); this is a bug.
                raise RuntimeError(
                    f"image {index} is {size[0]}x{size[1]} after augmentation, which no size bucket "
                    f"{buckets} holds; set dataset.size_buckets=0 to batch without buckets"
                )
            queue = queues.setdefault(bucket, [])
            queue.append((index, plan, size))
            if len(queue) == batch_size:
                yield self._batch(queue, bucket)
                queue.clear()
        if not self.train:
            for bucket, queue in queues.items():  # last batches filled up with copies: one shape per bucket
                if queue:
                    yield self._batch(queue + [queue[0]] * (batch_size - len(queue)), bucket)
            return
        families: dict[Size, list] = {}
        for queue in queues.values():
            for index, plan, size in queue:
                family = smallest_holding(size, self.buckets.families)
                pending = families.setdefault(family, [])
                pending.append((index, plan, size))
                if len(pending) == batch_size:
                    yield self._batch(pending, family)
                    pending.clear()

    @staticmethod
    def _batch(pending, canvas: Size) -> list[PlannedSample]:
        return [PlannedSample(index=i, plan=p, size=s, canvas=canvas) for i, p, s in pending]

    def _count(self, batch: list[PlannedSample]) -> None:
        seen = set()
        for sample in batch:
            if sample.index in seen:
                continue  # a copy filling an evaluation batch
            seen.add(sample.index)
            self.image_pixels += sample.size[0] * sample.size[1]
            self.padded_pixels += sample.canvas[0] * sample.canvas[1]
