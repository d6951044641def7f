"""What predict.py writes into its output folder:

    detections.json   COCO results [{"image_id", "category_id", "bbox" [x, y, w, h] in the image's pixels, cut at its
                      edges, "score"}] of the detections with score >= score_threshold
    images.json       "images" (id, file_name, width, height) and "categories", so that
                      ``COCO("images.json").loadRes("detections.json")`` works
    images/           each image with its detections drawn, labelled "name score" (draw=true), small ones enlarged

Both json files are written atomically at the end; pictures as each batch is done.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torchvision.ops import clip_boxes_to_image
from torchvision.transforms.v2 import functional as F

from datasets.evaluation import coco_results
from datasets.json_file import write_json
from engine.evaluation.detection_images import display_scale, draw_detections
from engine.evaluation.label_font import label_font

PICTURES = "images"


class Predictions:
    """Collects one run's detections (``add``) and writes them (``write``) under ``output_dir``; image paths are
    given relative to ``root``; ``categories``: id -> name; ``draw``: write the pictures."""

    def __init__(self, output_dir: Path, *, root: Path, categories: dict[int, str], score_threshold: float, draw: bool):
        self.output_dir, self.root = Path(output_dir), Path(root)
        self.categories, self.score_threshold, self.draw = categories, float(score_threshold), draw
        self.images: list[dict] = []
        self.detections: list[dict] = []
        self.all_detections: dict[int, dict[str, torch.Tensor]] = {}  # image id -> every kept detection

    def add(
        self,
        *,
        image_id: int,
        path: str,
        orig_size: tuple[int, int],
        result: dict[str, torch.Tensor],
        pixels: torch.Tensor | None = None,
    ) -> None:
        """One image's post-processed detections: {"scores" (k,), "labels" (k,), "boxes" (k, 4) xyxy pixels};
        ``pixels``, the picture as read ((3, H, W) uint8), to draw them on (needed when drawing)."""
        if self.draw and pixels is None:
            raise ValueError(f"Predictions.add: drawing needs the pixels of {path} (ImageFolder(keep_pixels=True))")
        height, width = orig_size
        file_name = Path(path).resolve().relative_to(self.root).as_posix()
        self.images.append({"id": image_id, "file_name": file_name, "width": width, "height": height})
        result = {k: v.detach().float().cpu() if k != "labels" else v.detach().cpu() for k, v in result.items()}
        # A predicted box may reach past the image's edge, where there is nothing to detect.
        result["boxes"] = clip_boxes_to_image(result["boxes"], (height, width))
        self.all_detections[image_id] = result
        keep = result["scores"] >= self.score_threshold
        for detection in coco_results(image_id, {k: v[keep] for k, v in result.items()}):
            self.detections.append(
                {**detection, "bbox": [round(v, 2) for v in detection["bbox"]], "score": round(detection["score"], 5)}
            )
        if self.draw:
            self._draw(file_name, pixels, result["boxes"][keep], result["labels"][keep], result["scores"][keep])

    def _draw(
        self, file_name: str, image: torch.Tensor, boxes: torch.Tensor, labels: torch.Tensor, scores: torch.Tensor
    ) -> None:
        height, width = image.shape[-2:]
        scale = max(1.0, display_scale(height=height, width=width))  # small images enlarged: readable labels
        if scale > 1:
            image = F.resize(image, [round(height * scale), round(width * scale)], antialias=True)
            boxes = boxes * scale
        font = label_font()
        names = [
            f"{font.label(self.categories.get(c, f'class {c}'), c)} {s:.2f}"
            for c, s in zip(labels.tolist(), scores.tolist())
        ]
        picture = draw_detections(image, ground_truth=torch.zeros(0, 4), boxes=boxes, labels=names)
        # The file's own name and format: x.png and x.jpg in one folder are two pictures.
        destination = self.output_dir / PICTURES / file_name
        destination.parent.mkdir(parents=True, exist_ok=True)
        jpeg = destination.suffix.lower() in (".jpg", ".jpeg")
        F.to_pil_image(picture).save(destination, **({"quality": 90} if jpeg else {}))

    def write(self) -> tuple[Path, Path]:
        """detections.json and images.json, each written whole or not at all."""
        images = {
            "images": sorted(self.images, key=lambda i: i["id"]),
            "annotations": [],
            "categories": [{"id": i, "name": name} for i, name in sorted(self.categories.items())],
        }
        return (
            write_json(self.output_dir / "detections.json", self.detections),
            write_json(self.output_dir / "images.json", images),
        )
