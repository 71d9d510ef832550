"""Checkpoint conversion: GGUF and safetensors in, MLX quantized directories out."""

from .quantize import Progress, Summary, quantize

__all__ = ["Progress", "Summary", "quantize"]
