"""The trainer, evaluator and exporter around the model: packages by concern, in layers.

A package imports only from packages of a lower layer (tests/test_layers.py enforces it), lowest first: errors and
reporting; config; runtime; compile; checkpoint; evaluation; train; predict and export. Each package's docstring
says what it holds. msda/, models/ and datasets/ never import engine.
"""
