"""The parts of a training run that are not the step: each a hook the loop calls (base.py says when)."""
