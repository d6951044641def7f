"""Checkpoints: files written atomically, in the background; their contents; weights for new runs and inference."""
