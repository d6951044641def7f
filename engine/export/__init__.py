"""A trained model exported to ONNX or an AOTInductor package, checked against PyTorch (export.py)."""
