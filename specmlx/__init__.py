"""specmlx: quantized speculative decoding on MLX.

target = specmlx.load("mlx-community/Qwen2.5-1.5B-Instruct-4bit")
draft = specmlx.load("mlx-community/Qwen2.5-0.5B-Instruct-4bit")
for step in specmlx.generate(target, "Write quicksort in Python.", draft=draft):
    print(step.text, end="")
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from . import mlxlm
from .errors import SpecmlxError

if TYPE_CHECKING:
    from .engine import Generation, Session, Stats, Step, generate
    from .loading import Model, load

__version__ = "0.1.0"
__all__ = ["Generation", "Model", "Session", "SpecmlxError", "Stats", "Step", "generate", "load"]

# Before anything imports mlx-lm: its models and caches then import without its package
# __init__, which would import transformers (most of a cold start).
mlxlm.install()

# The engine imports mlx and mlx-lm's models: it is loaded on first use, so that
# `specmlx --help` and a bad flag answer at once.
_LAZY = {
    "Model": "loading",
    "load": "loading",
    "Generation": "engine",
    "Session": "engine",
    "Stats": "engine",
    "Step": "engine",
    "generate": "engine",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'specmlx' has no attribute {name!r}")
    value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value
