"""COCO evaluation of a model over a validation loader, and the record of its figures and pictures."""
