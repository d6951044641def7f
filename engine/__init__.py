"""The trainer, evaluator and exporter around the model: packages by concern, in layers.

A package imports only from packages above it in this list (tests/test_layers.py enforces it):
1. errors (the user-fixable errors), reporting (console/file logging, progress, TensorBoard);
2. config (the typed schemas and their allowed values);
3. runtime (processes and devices, precision, random generators, the run lock, stop signals, the console);
4. compile (the compile plan, CUDA graphs of the eager model, what compiling costs);
5. checkpoint (files, the background writer, init_from, the trained model for inference);
6. evaluation (COCO AP over a loader, and its record);
7. train (the build, the optimizer step, the loop and what it delegates, resume);
8. predict and export.
msda/, models/ and datasets/ never import engine.
"""
