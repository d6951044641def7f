"""The loader's batches on the training device, each copied there while the step before it runs."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from datasets.loader import BatchTargets


def _tensors(batch) -> list[torch.Tensor]:
    images, masks, targets = batch
    if isinstance(targets, BatchTargets):
        return [images, masks, *targets.tensors()]
    return [images, masks, *(v for t in targets for v in t.values() if torch.is_tensor(v))]


def _to(batch, device: torch.device):
    images, masks, targets = batch
    if isinstance(targets, BatchTargets):  # the loader's: a copy per key, not per image and key
        targets = targets.to(device, non_blocking=True)
    else:
        targets = [
            {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in t.items()} for t in targets
        ]
    return images.to(device, non_blocking=True), masks.to(device, non_blocking=True), targets


class DeviceBatches:
    """(images, masks, targets) batches of ``batches`` (the loader's, pinned on a GPU run) moved to ``device``, one
    batch ahead, in the loader's order. On a GPU, handing out batch k starts batch k+1's copy on a stream of its own,
    so it runs during step k; the training stream waits for it on the GPU and marks its tensors as in use there. A
    failure while fetching ahead (a damaged image, a dead worker) is raised when that batch is asked for, so the step
    before it still finishes."""

    def __init__(self, batches: Iterator, device: torch.device):
        self._batches = batches
        self._device = device
        self._copies = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._ahead = None
        self._failed: Exception | None = None  # fetching the batch ahead failed: raised in its turn

    def __iter__(self) -> DeviceBatches:
        return self

    def __next__(self):
        if self._failed is not None:
            failed, self._failed = self._failed, None
            raise failed
        batch = self._ahead if self._ahead is not None else self._copy(next(self._batches))
        self._ahead = None
        if self._copies is not None:
            training = torch.cuda.current_stream(self._device)
            training.wait_stream(self._copies)
            for t in _tensors(batch):
                t.record_stream(training)
        try:
            self._ahead = self._copy(next(self._batches))
        except StopIteration:  # the last batch of a finite iterator is still handed out
            pass
        except Exception as error:  # not this batch's: raised when the next one is asked for
            self._failed = error
        return batch

    def _copy(self, batch):
        if self._copies is None:
            return _to(batch, self._device)
        with torch.cuda.stream(self._copies):
            return _to(batch, self._device)
