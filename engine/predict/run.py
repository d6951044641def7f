"""``python predict.py``: a trained model's detections on image files (engine/predict/predictions.py says what is
written), and their COCO AP when annotations are given."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from omegaconf import DictConfig
from pycocotools.coco import COCO
from torch.utils.data import DataLoader

from datasets.annotations import clean_annotations, load_annotation_file
from datasets.coco import coco_index
from datasets.evaluation import CocoEvaluator
from datasets.image_files import ImageReadError
from datasets.image_folder import ImageFolder, find_images
from datasets.loader import collate_fn
from datasets.per_class_ap import category_names
from engine.checkpoint.trained_model import load_trained_model
from engine.config.predict_schema import PredictConfig
from engine.config.registry import check_config
from engine.evaluation.record import write_eval_json
from engine.reporting.cocoeval_log import log_cocoeval_output
from engine.reporting.progress import format_duration
from engine.runtime.distributed import resolve_device
from engine.runtime.msda_device import check_msda_device
from engine.runtime.output_paths import job_directory
from engine.runtime.precision import Precision
from models.postprocess import PostProcess

from .predictions import Predictions

log = logging.getLogger(__name__)
PROGRESS_EVERY_S = 10.0
# Batches padded to multiples of the backbone's largest stride: no partial cells at the edges.
PAD_TO_MULTIPLE = 32


def predict(cfg: DictConfig) -> dict:
    """Run ``cfg.checkpoint`` on ``cfg.images``; returns {"output_dir", "images", "detections", "eval", "skipped"}."""
    cfg = check_config(cfg, PredictConfig)
    output_dir = job_directory(cfg.output_dir, script="predict.py")
    paths = find_images(cfg.images)
    root = (paths[0].parent if Path(cfg.images).is_file() else Path(cfg.images).expanduser()).resolve()
    gt = read_ground_truth(cfg.annotations) if cfg.annotations else None
    ids = image_ids(paths, root=root, gt=gt)

    device = resolve_device(cfg.device)
    check_msda_device(cfg.model.msda, device)
    names = category_names(gt, gt.getCatIds()) if gt is not None else None
    trained = load_trained_model(
        cfg.checkpoint, cfg.model, device=device, categories=names, weights=cfg.checkpoint_weights
    )
    postprocess = PostProcess(num_select=cfg.max_detections)
    val_size, max_size = cfg.image_size or trained.val_size, cfg.max_size or trained.max_size
    log.info(
        "%d images from %s | %s (step %d, %d classes, attention %s) on %s | short side %d, long side at most %d",
        len(paths),
        cfg.images,
        trained.checkpoint,
        trained.step,
        trained.model_config["num_classes"],
        trained.model_config["msda"],
        device,
        val_size,
        max_size,
    )

    folder = ImageFolder(paths, val_size=val_size, max_size=max_size, keep_pixels=cfg.draw, image_ids=ids)
    loader = DataLoader(
        folder,
        batch_size=cfg.batch_size,
        num_workers=cfg.num_workers,
        collate_fn=_collate,
        pin_memory=device.type == "cuda",
    )
    predictions = Predictions(
        output_dir, root=root, categories=trained.categories, score_threshold=cfg.score_threshold, draw=cfg.draw
    )
    precision = Precision(amp=cfg.amp, device=device)
    started = last_report = time.perf_counter()
    done, skipped = 0, []
    with torch.no_grad():
        for images, masks, infos, unreadable in loader:
            for info in unreadable:  # one warning each; the others' detections are still written
                log.warning("skipped %s", info["error"])
                skipped.append(info["path"])
            done += len(unreadable)
            if not infos:
                continue
            with precision.autocast():
                outputs = trained.model.detect(
                    images.to(device, non_blocking=True), masks.to(device, non_blocking=True)
                )
            outputs = {k: outputs[k].float() for k in ("pred_logits", "pred_boxes")}
            sizes = torch.tensor([info["orig_size"] for info in infos], device=device)
            for info, result in zip(infos, postprocess(outputs, sizes)):
                predictions.add(
                    image_id=ids[info["index"]],
                    path=info["path"],
                    orig_size=info["orig_size"],
                    result=result,
                    pixels=info.get("pixels"),
                )
            done += len(infos)
            now = time.perf_counter()
            if now - last_report >= PROGRESS_EVERY_S or done == len(paths):
                rate = done / (now - started)
                log.info(
                    "%d/%d images [%3.0f%%] %.1f img/s | ETA %s",
                    done,
                    len(paths),
                    100 * done / len(paths),
                    rate,
                    format_duration((len(paths) - done) / rate),
                )
                last_report = now
    if len(skipped) == len(paths):
        raise ImageReadError(f"none of the {len(paths)} images of images={cfg.images} could be read (each named above)")
    if skipped:
        log.warning(
            "%d of %d images could not be read and were skipped (each named above); the detections of the "
            "others are written",
            len(skipped),
            len(paths),
        )
    detections_json, images_json = predictions.write()
    log.info(
        "%d detections with score >= %g in %s (images: %s)%s",
        len(predictions.detections),
        cfg.score_threshold,
        detections_json,
        images_json,
        f"; pictures in {output_dir / 'images'}" if cfg.draw else "",
    )
    stats = None
    if gt is not None:
        weights = trained.source.loaded_weights
        stats = evaluate_predictions(predictions, gt, output_dir=output_dir, cfg=cfg, weights=weights)
    return {
        "output_dir": output_dir,
        "images": len(paths),
        "detections": predictions.detections,
        "eval": stats,
        "skipped": skipped,
    }


def read_ground_truth(annotations: str) -> COCO:
    """The COCO index of ``annotations`` (checked and cleaned as training data is)."""
    data, report = clean_annotations(load_annotation_file(annotations))
    if report.num_dropped:
        log.warning(report.message(Path(annotations)))
    return coco_index(data)


def image_ids(paths: list[Path], *, root: Path, gt: COCO | None) -> list[int]:
    """An id per image: its id in ``gt`` (matched by file_name: the path under ``root``, else the file's name),
    else 1, 2, ... after the largest id of ``gt``."""
    by_name: dict[str, int] = {}
    for image_id, image in gt.imgs.items() if gt is not None else ():
        by_name.setdefault(Path(image["file_name"]).as_posix(), image_id)
        by_name.setdefault(Path(image["file_name"]).name, image_id)
    next_id = max(gt.imgs, default=0) + 1 if gt is not None else 1
    ids, unmatched = [], 0
    for path in paths:
        found = by_name.get(path.resolve().relative_to(root).as_posix(), by_name.get(path.name))
        if found is None:
            found, next_id, unmatched = next_id, next_id + 1, unmatched + 1
        ids.append(found)
    if gt is not None and unmatched:
        log.warning(
            "%d of %d images are not in the annotation file (matched by file_name): they are predicted, not evaluated",
            unmatched,
            len(paths),
        )
    return ids


def evaluate_predictions(
    predictions: Predictions, gt: COCO, *, output_dir: Path, cfg: DictConfig, weights: str
) -> dict[str, float]:
    """COCO bbox AP of every detection kept (all max_detections, whatever score_threshold) on the images that
    the annotation file has; written to eval.json."""
    scored = {i: r for i, r in predictions.all_detections.items() if i in gt.imgs}
    if not scored:
        raise ValueError(
            f"annotations={cfg.annotations}: none of the images is in it (images are matched by "
            "file_name, as a path under the images folder or as the file's name)"
        )
    evaluator = CocoEvaluator(gt, backend=cfg.eval_backend)
    evaluator.update(scored)
    stats = evaluator.summarize()
    log_cocoeval_output(evaluator.cocoeval_output, log)
    write_eval_json(
        output_dir / "eval.json",
        stats=stats,
        per_class=evaluator.per_class,
        num_images=len(scored),
        checkpoint=str(Path(cfg.checkpoint).resolve()),
        weights=weights,
        annotations=str(Path(cfg.annotations).resolve()),
    )
    log.info(
        "evaluation on %s (%d images): %s",
        cfg.annotations,
        len(scored),
        " ".join(f"{k} {v:.4f}" for k, v in stats.items()),
    )
    return stats


def _collate(batch: list):
    """(images padded into one batch, masks, their infos, the infos of the items that could not be read); images
    and masks None when none could."""
    good = [item for item in batch if "error" not in item[1]]
    unreadable = [info for _, info in batch if "error" in info]
    if not good:
        return None, None, [], unreadable
    images, masks, _ = collate_fn(good, pad_to_multiple=PAD_TO_MULTIPLE)
    return images, masks, [info for _, info in good], unreadable
