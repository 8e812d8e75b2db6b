"""Quantized weights: which scheme a model runs with (config.py, plain data) and FP8 linear layers
(fp8.py)."""
