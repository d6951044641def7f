"""Detections of a trained model on image files (predict.py)."""
