"""mlx-lm's model classes and caches without its package __init__, and a model builder.

`import mlx_lm.models.qwen2` normally runs mlx_lm/__init__.py first, which imports
mlx-lm's generate, convert and utils modules and through them transformers: most of a
cold start, for code that needs only `mlx_lm.models`. `install()` (run by specmlx's
__init__) puts a package module for mlx_lm in sys.modules whose __init__ runs at the
first access of one of its names (`mlx_lm.load`, `mlx_lm.__version__`, ...), so
`import mlx_lm; mlx_lm.load(...)` still works, and submodules import without it.

`build_model` is what mlx_lm.utils.load_model does for the checkpoints specmlx loads
(MLX's own affine quantization, or dense weights), from mlx_lm.models' classes; any
other layout goes to mlx-lm's own loader, imported only then.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import sys
import threading
from pathlib import Path
from typing import Any

# mlx_lm.utils' tables, copied so that finding a model's class does not import it (and
# transformers); tests/test_tokenizer.py checks them against the installed mlx-lm, and a
# model_type found in neither is looked up by mlx-lm's own _get_classes.
MODEL_REMAPPING = {
    "mistral": "llama",
    "llava": "mistral3",
    "phi-msft": "phixtral",
    "falcon_mamba": "mamba",
    "joyai_llm_flash": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
    "qwen2_5_vl": "qwen2_vl",
    "minimax_m2": "minimax",
    "iquestcoder": "llama",
    "xverse": "llama",
    "gemma4_unified": "gemma4",
    "deepseek_v41_text": "deepseek_v41",
}
MODEL_ARCHITECTURE_REMAPPING = {
    ("bailing_hybrid", "BailingMoeV3ForCausalLM"): "bailing_moe_v3",
}


def install() -> None:
    """Make `import mlx_lm.<submodule>` skip mlx-lm's package __init__ until one of the
    package's own names is used. A no-op when mlx_lm is already imported (or absent)."""
    if "mlx_lm" in sys.modules:
        return
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or spec.loader is None:
        return  # not installed: the ImportError comes where it is first needed
    module = importlib.util.module_from_spec(spec)
    lock = threading.RLock()  # other threads wait for the one running the __init__
    running = []

    def __getattr__(name: str) -> Any:
        # The first name looked up on the package itself: run the real __init__ now, in
        # this module (its submodules already imported stay as they are).
        with lock:
            if running:  # the __init__ itself, looking up a name it has not set yet
                raise AttributeError(f"module 'mlx_lm' has no attribute {name!r}")
            if module.__dict__.get("__getattr__") is __getattr__:
                running.append(True)
                try:
                    spec.loader.exec_module(module)
                    del module.__getattr__  # from now on, the package as mlx-lm made it
                finally:
                    running.clear()
        return getattr(module, name)

    module.__getattr__ = __getattr__
    # What mlx-lm's __init__ sets before anything imports transformers, so that its
    # submodules (mlx_lm.utils for quantize, the fallback tokenizer) behave as they would.
    os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
    sys.modules["mlx_lm"] = module


def mlx_lm_version() -> str:
    """The installed mlx-lm's version, without running its package __init__."""
    from mlx_lm._version import __version__

    return __version__


def model_module(config: dict):
    """mlx-lm's module for config's architecture (mlx_lm.utils._get_classes' lookup);
    ValueError("Model type X not supported.") as mlx-lm raises it when there is none."""
    model_type = config["model_type"]
    architectures = config.get("architectures") or ()
    if isinstance(architectures, str):
        architectures = (architectures,)
    for architecture in architectures:
        remapped = MODEL_ARCHITECTURE_REMAPPING.get((model_type, architecture))
        if remapped is not None:
            model_type = remapped
            break
    else:
        model_type = MODEL_REMAPPING.get(model_type, model_type)
    try:
        return importlib.import_module(f"mlx_lm.models.{model_type}")
    except ImportError:
        # A remapping newer than the table above lives only in the installed mlx-lm.
        from mlx_lm.utils import _get_classes

        return sys.modules[_get_classes(config)[0].__module__]


def model_classes(config: dict) -> tuple[type, type]:
    """(Model, ModelArgs) of mlx-lm for config's architecture."""
    module = model_module(config)
    return module.Model, module.ModelArgs


# transformers writes non-finite floats in config.json as {"__float__": "Infinity"}.
_FLOAT_TAGS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def _untag_floats(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__float__"} and value["__float__"] in _FLOAT_TAGS:
            return _FLOAT_TAGS[value["__float__"]]
        return {k: _untag_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_untag_floats(v) for v in value]
    return value


def load_config(path: Path) -> dict:
    """config.json as mlx_lm.utils.load_config reads it: tagged floats restored, and
    generation_config.json's eos_token_id (when it has one) in place of the config's."""
    config = _untag_floats(json.loads((path / "config.json").read_bytes()))
    generation = path / "generation_config.json"
    if generation.exists():
        try:
            eos = json.loads(generation.read_bytes()).get("eos_token_id", False)
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            eos = False
        if eos:
            config["eos_token_id"] = eos
    return config


def buildable(config: dict, weights: dict) -> bool:
    """Whether build_model builds this checkpoint as mlx_lm.utils.load_model would: MLX's
    own (affine) quantization or none, and no custom code or activation quantization.
    Everything else (AWQ/GPTQ, FP4/FP8 modes, ModelOpt, BitNet) is mlx-lm's to convert."""
    import mlx.core as mx

    text_config = config.get("text_config", {})
    if "model_file" in config or config.get("quantize_activations", False):
        return False
    if "quantization" not in config and (
        config.get("quantization_config") or text_config.get("quantization_config")
    ):
        return False
    quantization = config.get("quantization")
    if quantization is not None and quantization.get("mode", "affine") != "affine":
        return False
    # Only affine keeps its scales in a float dtype; a global scale is an NVFP4 one.
    return not any(
        (name.endswith(".scales") and weights[name].dtype == mx.uint8)
        or name.endswith(".global_scale")
        for name in weights
    )


def build_model(config: dict, weights: dict, classes=model_classes):
    """mlx-lm's model for `config` with `weights` loaded (lazily), as load_model builds
    one for a checkpoint `buildable` accepts: sanitize, quantize the layers that have
    scales (bits and group size read off each weight), load strictly."""
    import mlx.nn as nn

    model_class, args_class = classes(config)
    model = model_class(args_class.from_dict(config))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    quantization = config.get("quantization")
    if quantization is not None:

        def per_layer(path: str, module) -> bool | dict:
            if path in quantization:  # per-layer settings
                return quantization[path]
            return stored_quantization(path, module, weights)

        nn.quantize(
            model,
            group_size=quantization["group_size"],
            bits=quantization["bits"],
            mode="affine",
            class_predicate=per_layer,
        )
    model.eval()
    model.load_weights(list(weights.items()), strict=True)
    return model


def stored_quantization(path: str, layer, weights: dict) -> bool | dict:
    """nn.quantize's class_predicate for a layer whose weights come quantized: its group
    size and bits read off the stored shapes (False where it has no .scales)."""
    if not hasattr(layer, "to_quantized") or f"{path}.scales" not in weights:
        return False
    in_dims = layer.weight.shape[-1]
    return {
        "group_size": in_dims // weights[f"{path}.scales"].shape[-1],
        "bits": weights[f"{path}.weight"].shape[-1] * 32 // in_dims,
        "mode": "affine",
    }
