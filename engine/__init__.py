"""The trainer, evaluator and exporter around the model, in packages by concern. A package imports only from packages
of a lower layer (tests/test_layers.py enforces it), lowest first: errors and reporting; config; runtime; compile;
checkpoint; evaluation; train; predict and export. msda/, models/ and datasets/ never import engine."""
