"""Does an exported model compute what the PyTorch model computes? The check every export ends with.

Both run on the same sample batch; the largest absolute differences of the class logits (or, post-processed, the
scores: a probability moves by at most a quarter of its logit's difference) and of the normalized boxes must be
within the tolerance, well above rounding differences and well below what an export bug causes. Post-processed
labels and boxes are compared only at ranks clear of their neighbours' scores (closer ranks may trade places).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.errors import ExportParityError


@dataclass(frozen=True)
class Tolerance:
    """The largest absolute differences accepted: class logits (or scores) and normalized boxes."""

    logits: float
    boxes: float


DEFAULT_TOLERANCES = {
    "fp32": Tolerance(logits=1e-3, boxes=1e-4),  # boxes: a tenth of a pixel at 1333 px
    "fp16": Tolerance(logits=5e-2, boxes=5e-3),  # the graph fuses and orders ops otherwise: roundings differ
    "bf16": Tolerance(logits=2.5e-1, boxes=2e-2),  # 8 bits of mantissa: 16 times fp16's rounding
}


def tolerance_for(dtype: str, *, logits: float | None = None, boxes: float | None = None) -> Tolerance:
    """The default tolerance of ``dtype`` (fp32 | fp16 | bf16) with the given values put in."""
    if str(dtype) not in DEFAULT_TOLERANCES:
        raise ValueError(f"dtype must be one of {sorted(DEFAULT_TOLERANCES)}, got {dtype!r}")
    default = DEFAULT_TOLERANCES[str(dtype)]
    return Tolerance(
        logits=default.logits if logits is None else logits, boxes=default.boxes if boxes is None else boxes
    )


@dataclass
class ParityReport:
    """The largest absolute difference per output (NaN or inf counts as infinite), the tolerance they were held to,
    how many images were compared; post-processed outputs only: labels that differ at the ranks compared, and how
    many of all ranks were."""

    differences: dict[str, float]
    tolerance: Tolerance
    images: int
    label_mismatches: int = 0
    ranks_compared: int | None = None
    ranks: int | None = None

    def limit(self, name: str) -> float:
        return self.tolerance.boxes if name == "boxes" else self.tolerance.logits

    @property
    def failures(self) -> list[str]:
        failed = [
            f"{name} differ by up to {value:.3g} (tolerance {self.limit(name):.3g})"
            for name, value in self.differences.items()
            if not value <= self.limit(name)
        ]
        if self.label_mismatches:
            failed.append(f"{self.label_mismatches} labels differ at ranks whose scores are clear of their neighbours")
        return failed

    def describe(self) -> str:
        parts = [
            f"{name} max |diff| {value:.3g} (tolerance {self.limit(name):.3g})"
            for name, value in self.differences.items()
        ]
        if self.ranks is not None:
            parts.append(
                f"labels and boxes compared at {self.ranks_compared} of {self.ranks} ranks, "
                f"{self.label_mismatches} labels differ"
            )
        return f"{self.images} images: " + ", ".join(parts)


def largest_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in float64; a NaN or infinite difference counts as infinite (an export must not produce them)."""
    difference = (a.detach().double().cpu() - b.detach().double().cpu()).abs()
    return float(difference.nan_to_num(nan=torch.inf, posinf=torch.inf).max()) if difference.numel() else 0.0


def compare_outputs(
    exported: tuple, reference: tuple, *, tolerance: Tolerance, target_sizes: torch.Tensor | None = None
) -> ParityReport:
    """A ParityReport of ``exported`` against ``reference``: (pred_logits, pred_boxes), or (scores, labels,
    boxes) with the ``target_sizes`` (B, 2) the boxes are scaled to."""
    if len(reference) != len(exported):
        raise ValueError(f"the exported model returned {len(exported)} outputs, the PyTorch model {len(reference)}")
    if len(reference) == 2:
        differences = {name: largest_difference(a, b) for name, a, b in zip(("logits", "boxes"), exported, reference)}
        return ParityReport(differences=differences, tolerance=tolerance, images=reference[0].shape[0])
    if target_sizes is None:
        raise ValueError("comparing post-processed outputs needs target_sizes (B, 2), the boxes' image sizes")
    scores, labels, boxes = (t.detach().cpu() for t in exported)
    ref_scores, ref_labels, ref_boxes = (t.detach().cpu() for t in reference)
    score_difference = largest_difference(scores, ref_scores)
    stable = clear_ranks(ref_scores.double(), margin=2 * score_difference + 1e-7)  # (B, k)
    h, w = target_sizes.detach().cpu().double().unbind(1)
    scale = torch.stack([w, h, w, h], dim=1)[:, None, :]  # (B, 1, 4)
    box_difference = largest_difference((boxes.double() / scale)[stable], (ref_boxes.double() / scale)[stable])
    return ParityReport(
        differences={"scores": score_difference, "boxes": box_difference},
        tolerance=tolerance,
        images=ref_scores.shape[0],
        label_mismatches=int((labels[stable] != ref_labels[stable]).sum()),
        ranks_compared=int(stable.sum()),
        ranks=stable.numel(),
    )


def clear_ranks(scores: torch.Tensor, *, margin: float) -> torch.Tensor:
    """(B, k) bool: the ranks of ``scores`` (rows sorted descending) differing from both neighbours by more than
    ``margin``; never the last rank (the candidate after it is not known)."""
    above = torch.full_like(scores, float("inf"))
    above[:, 1:] = scores[:, :-1] - scores[:, 1:]
    below = torch.full_like(scores, -1.0)
    below[:, :-1] = scores[:, :-1] - scores[:, 1:]
    return (above > margin) & (below > margin)


@contextlib.contextmanager
def exact_float32():
    """TF32 off for matmuls and cuDNN convolutions (else its rounding is the difference measured), restored after."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def check_parity(
    run_exported: Callable[..., tuple],
    reference: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    *,
    tolerance: Tolerance,
    what: str,
) -> ParityReport:
    """The ParityReport of ``run_exported`` against ``reference`` (the PyTorch detector) on ``inputs``;
    ExportParityError naming ``what`` (e.g. the file) when a difference exceeds ``tolerance``."""
    with torch.no_grad(), exact_float32():  # a package's convolutions are ATen's: they follow the flags too
        exported = tuple(run_exported(*inputs))
        expected = tuple(reference.eval()(*inputs))
    report = compare_outputs(
        exported, expected, tolerance=tolerance, target_sizes=inputs[2] if len(inputs) > 2 else None
    )
    if report.failures:
        raise ExportParityError(
            f"{what} does not match the PyTorch model on the sample batch: {'; '.join(report.failures)} "
            f"({report.describe()}). The export is kept for inspection; a wrong graph (a size fixed at the sample's, "
            f"an op the runtime computes otherwise) shows here. If the difference is only precision, set "
            f"tolerance.logits / tolerance.boxes (configs/export.yaml)"
        )
    return report
