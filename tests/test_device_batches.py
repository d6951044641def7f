"""engine.runtime.device_batches.py: the loader's batches on the device, in the loader's order, none lost."""

from __future__ import annotations

import pytest
import torch

from datasets.loader import BatchTargets
from engine.runtime.device_batches import DeviceBatches


def _batches(count: int, *, pin: bool = False, packed: bool = False):
    generator = torch.Generator().manual_seed(0)
    for k in range(count):
        images = torch.randn(2, 3, 8, 8, generator=generator)
        masks = torch.rand(2, 8, 8, generator=generator) > 0.5
        targets = [
            {"boxes": torch.rand(3, 4, generator=generator), "labels": torch.tensor([k, 1, 2]), "image_id": k}
            for _ in range(2)
        ]
        if packed:  # as the loader's collate hands them over
            targets = BatchTargets(targets)
        if pin:
            images, masks = images.pin_memory(), masks.pin_memory()
            targets = (
                targets.pin_memory()
                if packed
                else [{key: v.pin_memory() if torch.is_tensor(v) else v for key, v in t.items()} for t in targets]
            )
        yield images, masks, targets


def _same(batch, expected) -> None:
    assert torch.equal(batch[0].cpu(), expected[0]) and torch.equal(batch[1].cpu(), expected[1])
    for got, want in zip(batch[2], expected[2]):
        assert got["image_id"] == want["image_id"]
        assert torch.equal(got["boxes"].cpu(), want["boxes"]) and torch.equal(got["labels"].cpu(), want["labels"])


def _check(device: torch.device, *, pin: bool, packed: bool) -> None:
    expected = list(_batches(5))
    got = list(DeviceBatches(_batches(5, pin=pin, packed=packed), device))
    assert len(got) == 5  # the last one too, although nothing follows it to be fetched ahead
    for batch, want in zip(got, expected):
        assert batch[0].device.type == device.type and batch[2][0]["boxes"].device.type == device.type
        assert isinstance(batch[2], BatchTargets) == packed
        _same(batch, want)


@pytest.mark.parametrize("packed", [False, True], ids=["dicts", "packed"])
def test_batches_come_in_the_loaders_order_on_the_cpu(packed):
    _check(torch.device("cpu"), pin=False, packed=packed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("packed", [False, True], ids=["dicts", "packed"])
def test_batches_copied_ahead_on_a_side_stream_reach_the_gpu_intact_and_in_order(packed):
    _check(torch.device("cuda"), pin=True, packed=packed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_step_reads_its_batch_only_once_its_slow_copy_has_arrived(monkeypatch):
    """The training stream waits for the side stream's copy: with every copy held back on the GPU (a sleep queued
    in front of it) and nothing in front of the step, a step that did not wait would read memory not yet written."""
    batches = DeviceBatches(_batches(4, pin=True), torch.device("cuda"))
    copy = batches._copy

    def slow_copy(batch):
        with torch.cuda.stream(batches._copies):
            torch.cuda._sleep(200_000_000)  # about 0.1 s of the copy stream
        return copy(batch)

    monkeypatch.setattr(batches, "_copy", slow_copy)
    sums = [batch[0].sum() for batch in batches]  # queued on the training stream at once
    torch.cuda.synchronize()
    torch.testing.assert_close(torch.stack(sums).cpu(), torch.stack([b[0].sum() for b in _batches(4)]))


def _failing_at(index: int, error: Exception):
    for k, batch in enumerate(_batches(5)):
        if k == index:
            raise error
        yield batch


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))],
)
def test_a_failure_fetching_ahead_is_raised_in_its_turn_not_before_the_batch_in_front(device):
    """A damaged image in batch 3 must not stop the step of batch 2 (the last of an epoch, or of the run)."""
    batches = DeviceBatches(_failing_at(3, OSError("damaged image")), torch.device(device))
    for want in list(_batches(3)):
        _same(next(batches), want)
    with pytest.raises(OSError, match="damaged image"):
        next(batches)
