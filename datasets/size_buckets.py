"""Size buckets: a few canonical batch sizes that every augmented image is padded to.

The multi-scale recipe gives almost every image its own size (short side drawn from ``train_scales``, long
side up to ``max_size``, crops in between), and a batch padded to its largest image gives thousands of
distinct batch sizes per epoch. Each new size costs a compiled model a compilation (and a CUDA-graph
recording) and an eager one a cuDNN plan. Buckets bound that: each image goes to the smallest bucket that
holds it, and a batch is made of images of one bucket (datasets/batch_plan.py), so a run meets at most
``len(train) + len(val)`` sizes, training and evaluation together.

How the buckets are chosen (``plan_size_buckets``), deterministic for a data set and recipe, so that a second
run meets the same sizes and finds their compiled graphs in the cache:

- Two *family* buckets hold every possible output: (largest short side, largest long side) for images wider
  than tall, and its transpose for taller ones (only the families the data can produce). They are also where
  an epoch's leftover images are batched.
- The other training buckets are picked greedily from the sides that augmented training images really have
  (the recipe's random choices drawn a few times per image): each addition is the one that saves the most
  padded pixels. A bucket must hold, on average, a few batches per epoch, or its images would mostly be left
  over; small sets get few buckets.
- Evaluation gets the validation families only: its sizes are fixed, it runs forward only, and each of its
  buckets is a graph of its own.

Sides are multiples of ``multiple`` (``dataset.pad_to_multiple``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

Size = tuple[int, int]  # (height, width)

# Plans drawn per training image to estimate the output sizes (at most MAX_SAMPLED images are drawn).
DRAWS_PER_IMAGE = 4
MAX_SAMPLED = 8192
# A bucket beyond the families must hold at least this many batches per epoch on average.
MIN_BATCHES_PER_BUCKET = 2


def round_up(value: int, multiple: int) -> int:
    return -(-int(value) // multiple) * multiple


def smallest_holding(size: Size, buckets: Sequence[Size]) -> Size | None:
    """The bucket of least area with both sides at least ``size``'s, or None."""
    holding = [b for b in buckets if b[0] >= size[0] and b[1] >= size[1]]
    return min(holding, key=lambda b: (b[0] * b[1], b)) if holding else None


@dataclass(frozen=True)
class SizeBuckets:
    """The canonical sizes of a run. ``families`` are the training buckets that hold every possible
    training output (one for wide images, one for tall ones, where the data has both)."""

    train: tuple[Size, ...]
    val: tuple[Size, ...]
    families: tuple[Size, ...]
    multiple: int
    expected_waste: float = 0.0  # padded pixels / all pixels of training batches, estimated from drawn sizes
    unbucketed_waste: float = 0.0  # the same for batches of random images padded to their largest (size_buckets=0)

    def describe(self) -> str:
        def sizes(buckets):
            return ", ".join(f"{h}x{w}" for h, w in buckets)

        evaluation = f"{len(self.val)} evaluation sizes ({sizes(self.val)})"
        if not self.train:
            return evaluation
        return (
            f"{len(self.train)} training sizes ({sizes(self.train)}), {evaluation}; padding "
            f"{100 * self.expected_waste:.0f}% of training pixels (without buckets: "
            f"{100 * self.unbucketed_waste:.0f}%)"
        )


def train_families(
    *, sizes: Sequence[Size], longest_short: int, longest_long: int, multiple: int, can_turn: bool
) -> tuple[Size, ...]:
    """The buckets that hold every output of a training augmentation whose outputs have their short side at
    most ``longest_short`` and long side at most ``longest_long``: the wide one where the data has wide images
    (or the augmentation may turn an image's orientation, ``can_turn``: crops), the tall one likewise."""
    wide = (round_up(longest_short, multiple), round_up(longest_long, multiple))
    tall = (wide[1], wide[0])
    has_wide = can_turn or any(h < w for h, w in sizes)
    has_tall = can_turn or any(h > w for h, w in sizes)
    return tuple(dict.fromkeys(([wide] if has_wide or not has_tall else []) + ([tall] if has_tall else [])))


def val_families(outputs: Sequence[Size], multiple: int) -> tuple[Size, ...]:
    """Evaluation's sizes are known exactly: the smallest bucket holding all its wide (h <= w) outputs, and
    the one holding all its tall ones."""
    families = []
    for group in ([s for s in outputs if s[0] <= s[1]], [s for s in outputs if s[0] > s[1]]):
        if group:
            families.append(tuple(round_up(max(s[d] for s in group), multiple) for d in (0, 1)))
    return tuple(dict.fromkeys(families))


def _padded_areas(sizes: np.ndarray, buckets: list[Size]) -> np.ndarray:
    """(S,) area of each size's smallest holding bucket, inf where none holds it."""
    padded = np.full(len(sizes), np.inf)
    for h, w in buckets:
        holds = (h >= sizes[:, 0]) & (w >= sizes[:, 1])
        padded = np.where(holds, np.minimum(padded, float(h * w)), padded)
    return padded


def _greedy(
    sizes: np.ndarray, counts: np.ndarray, forced: list[Size], candidates: list[Size], budget: int, min_count: int
) -> list[Size]:
    """Add up to ``budget`` candidates to ``forced``, each time the one that most lowers the padded area of
    ``sizes`` (S, 2), each of weight ``counts`` (S,), in its smallest holding bucket, and that would hold at
    least ``min_count`` of them."""
    chosen = list(forced)
    cand = np.asarray(candidates, dtype=np.int64).reshape(-1, 2)  # (C, 2)
    current = _padded_areas(sizes, chosen)  # (S,)
    for _ in range(max(0, budget)):
        best, best_gain = None, 0.0
        for start in range(0, len(cand), 64):  # (64, S) at a time: the full (C, S) table can be large
            block = cand[start : start + 64]
            fits = (block[:, None, 0] >= sizes[None, :, 0]) & (block[:, None, 1] >= sizes[None, :, 1])
            area = (block[:, 0] * block[:, 1]).astype(np.float64)[:, None]  # (c, 1)
            takes = fits & (area < current[None, :])  # (c, S) sizes that would move to the candidate
            gain = (np.where(takes, current[None, :] - area, 0.0) * counts[None, :]).sum(axis=1)  # (c,)
            gain[(takes * counts[None, :]).sum(axis=1) < min_count] = 0.0
            i = int(np.argmax(gain))
            if gain[i] > best_gain:
                best, best_gain = (int(block[i, 0]), int(block[i, 1])), float(gain[i])
        if best is None:
            break
        chosen.append(best)
        current = np.minimum(current, _padded_areas(sizes, [best]))
    return chosen


def _waste(sizes: np.ndarray, counts: np.ndarray, buckets: list[Size]) -> float:
    area = (sizes[:, 0] * sizes[:, 1]).astype(np.float64)
    padded = _padded_areas(sizes, buckets)
    padded = np.where(np.isfinite(padded), padded, area)  # a size no bucket holds is padded to itself
    return float(1.0 - (area * counts).sum() / (padded * counts).sum())


def unbucketed_waste(samples: np.ndarray, batch_size: int, multiple: int, rng: random.Random) -> float:
    """Padding of batches of ``batch_size`` random ``samples`` (S, 2), each padded to its largest sides rounded
    up to ``multiple``."""
    order = list(range(len(samples)))
    rng.shuffle(order)
    used = padded = 0
    for start in range(0, len(order) - batch_size + 1, batch_size):
        batch = samples[order[start : start + batch_size]]
        h, w = (round_up(batch[:, d].max(), multiple) for d in (0, 1))
        used += int((batch[:, 0] * batch[:, 1]).sum())
        padded += h * w * batch_size
    return 1.0 - used / padded if padded else 0.0


def plan_size_buckets(
    *,
    train_sizes: Sequence[Size],
    plan_train: Callable[[Size, random.Random], Size],
    train_limits: tuple[int, int],
    train_can_turn: bool,
    val_outputs: Sequence[Size],
    batch_size: int,
    max_buckets: int,
    multiple: int,
    seed: int = 0,
) -> SizeBuckets:
    """Choose the buckets of a run (see the module docstring).

    train_sizes    (h, w) of the training images as read from disk
    plan_train     (size, rng) -> the size after the training augmentation's random choices
    train_limits   (largest short side, largest long side) an augmented training image can have
    train_can_turn whether the augmentation can make a wide image tall or a tall one wide (crops)
    val_outputs    (h, w) of every validation image after its (deterministic) resize
    max_buckets    sizes in all, training and evaluation together (at least the families)
    """
    val = val_families(val_outputs, multiple)
    families = train_families(
        sizes=train_sizes,
        longest_short=train_limits[0],
        longest_long=train_limits[1],
        multiple=multiple,
        can_turn=train_can_turn,
    )
    if max_buckets < len(val) + len(families):
        raise ValueError(
            f"dataset.size_buckets={max_buckets} is too few for this data: it needs {len(families)} "
            f"training and {len(val)} evaluation sizes at least (one per orientation), so at least "
            f"{len(val) + len(families)}; or 0 to batch images of any size together"
        )
    rng = random.Random(seed)
    picked = list(range(len(train_sizes)))
    if len(picked) > MAX_SAMPLED:
        picked = sorted(rng.sample(picked, MAX_SAMPLED))
    drawn = [plan_train(tuple(train_sizes[i]), rng) for i in picked for _ in range(DRAWS_PER_IMAGE)]
    samples = np.asarray(drawn, dtype=np.int64).reshape(-1, 2)  # (S, 2)
    sizes, counts = np.unique(samples, axis=0, return_counts=True)  # distinct sizes and how often each came
    heights, widths = (np.unique((sizes[:, d] + multiple - 1) // multiple * multiple) for d in (0, 1))
    candidates = [
        (int(h), int(w))
        for h in heights
        for w in widths
        if (int(h), int(w)) not in families and smallest_holding((int(h), int(w)), families)
    ]
    # A bucket earns its place with MIN_BATCHES_PER_BUCKET batches per epoch, counted in samples of this draw.
    samples_per_image = len(samples) / max(1, len(train_sizes))
    min_count = max(1, int(MIN_BATCHES_PER_BUCKET * batch_size * samples_per_image))
    train = _greedy(sizes, counts, list(families), candidates, max_buckets - len(val) - len(families), min_count)
    return SizeBuckets(
        train=tuple(sorted(train)),
        val=val,
        families=families,
        multiple=multiple,
        expected_waste=_waste(sizes, counts, train),
        unbucketed_waste=unbucketed_waste(samples, batch_size, multiple, random.Random(seed + 1)),
    )
