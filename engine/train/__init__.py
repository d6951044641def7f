"""A training run: what it builds, the optimizer step, the loop over epochs and the parts it delegates to."""
