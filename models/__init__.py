"""Deformable DETR models: ``build_model(cfg.model) -> (model, criterion, postprocess)``."""

from models.deformable_detr import DeformableDETR, build_deformable_detr, build_model

__all__ = ["DeformableDETR", "build_deformable_detr", "build_model"]
