"""specmlx: quantized speculative decoding on MLX.

target = specmlx.load("mlx-community/Qwen2.5-1.5B-Instruct-4bit")
draft = specmlx.load("mlx-community/Qwen2.5-0.5B-Instruct-4bit")
for step in specmlx.generate(target, "Write quicksort in Python.", draft=draft):
    print(step.text, end="")
"""

from .errors import SpecmlxError
from .loading import Model, load
from .speculative import Generation, Session, Stats, Step, generate

__version__ = "0.1.0"
__all__ = ["Generation", "Model", "Session", "SpecmlxError", "Stats", "Step", "generate", "load"]
