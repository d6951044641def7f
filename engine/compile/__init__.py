"""How the model is compiled: the plan for a run, CUDA graphs of the eager model, caches and compile time."""
