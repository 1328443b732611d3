"""Compute kernels (CPU torch paths; accelerator paths where they exist)."""
from .int4 import PackedKeys, dequantize, fake_quantize, pack, quantize, unpack

__all__ = ["PackedKeys", "dequantize", "fake_quantize", "pack", "quantize", "unpack"]
