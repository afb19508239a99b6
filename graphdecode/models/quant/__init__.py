"""Quantized weights: config.json's quantization_config (config.py), each checkpoint format's tensors (formats.py),
the engine's one form of a quantized weight (tensor.py) and the kernels that run it (linear.py)."""
