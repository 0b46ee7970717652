"""quantize-moe: FP8 quantization of Mixture-of-Experts checkpoints."""

__version__ = "0.1.0"
