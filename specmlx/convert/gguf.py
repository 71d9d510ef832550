"""GGUF files (llama.cpp, Ollama) as a quantize source: tensors, names, config, tokenizer.

The `gguf` package parses the file; tensor data is then read straight from disk a range
of rows at a time and dequantized with `gguf.quants` (numpy), so a 1 GB GGUF is never
in memory at once. Names are mapped back to Hugging Face's, llama.cpp's q/k row
permutation is undone for `llama`, and config.json plus a tokenizer are rebuilt from
the metadata (see gguf_tokenizer.py).

Gemma 3 differs in three ways that matter: its norms have their own names (four per
layer), llama.cpp stores every norm weight as 1 + w where mlx-lm's class adds the 1
itself, and its sliding-window layout is partly hard-coded in llama.cpp, not in the file.
"""

from __future__ import annotations

import hashlib
import math
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..errors import SpecmlxError
from .source import Source, SourceTensor

# GGUF architecture → (mlx-lm model_type, Hugging Face class)
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}
# Architectures whose q/k rows llama.cpp's converter permutes (HF rotary → GGML rotary).
PERMUTED_QK = ("llama",)
# Architectures whose norm weights llama.cpp's converter stored as 1 + w (Gemma's
# RMSNorm multiplies by 1 + w; llama.cpp's multiplies by the stored weight).
SHIFTED_NORMS = ("gemma3",)
# llama.cpp hard-codes these for gemma3 (llama-model.cpp: set_swa_pattern(6), a local
# rope base of 10000, and query scaling by 1/sqrt(head_dim) except for the 27B's
# 1/sqrt(hidden / heads)); a file may carry the first two as metadata, which then wins.
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_27B_BLOCKS = 62

GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # qwen3, gemma3
    "attn_k_norm": "self_attn.k_norm",
}
# Gemma 3 norms around both attention and MLP: its ffn_norm is the pre-MLP one.
GEMMA3_LAYER_NAMES = {
    **LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# llama 3.1+ GGUFs carry their "llama3" rope scaling only as this tensor of per-frequency
# divisors; the scaling's parameters are recovered from it (see `llama3_rope_scaling`).
ROPE_FREQS = "rope_freqs.weight"
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL = re.compile(r"(\w+)\.(weight|bias)")


def _types() -> dict[str, Any]:
    from gguf import GGMLQuantizationType as T

    names = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
    names += ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
    return {name: T[name] for name in names}


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face / mlx-lm name of a GGUF tensor of `arch`, or None if it has none."""
    if m := _LAYER.fullmatch(gguf_name):
        layer, part, kind = m.groups()
        names = GEMMA3_LAYER_NAMES if arch == "gemma3" else LAYER_NAMES
        if part in names:
            return f"model.layers.{layer}.{names[part]}.{kind}"
        return None
    if (m := _GLOBAL.fullmatch(gguf_name)) and m.group(1) in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def read_fields(reader, path: Path) -> dict[str, Any]:
    fields = {}
    for key, field in reader.fields.items():
        try:
            fields[key] = field.contents()
        except UnicodeDecodeError as e:  # the reader decodes strings only when asked
            raise SpecmlxError(f"{path} is corrupt: metadata {key!r} is not UTF-8 text") from e
    return fields


def _eps(value: float) -> float:
    """GGUF stores float32: 9.999999747e-06 is the 1e-05 the checkpoint meant."""
    return float(f"{value:.7g}")


def gguf_architecture(fields: dict[str, Any]) -> str:
    arch = fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise SpecmlxError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}"
        )
    return arch


def llama3_rope_scaling(divisors: np.ndarray, head_dim: int, rope_theta: float) -> dict:
    """The "llama3" rope_scaling whose per-frequency divisors llama.cpp stored as rope_freqs.

    The file keeps only the divisors, so the parameters are recovered: `factor` is the
    largest divisor, and the band between original and scaled frequencies is checked
    against the one every Llama 3.1-3.3 checkpoint uses (low 1, high 4, 8192 positions).
    """
    scaling = {
        "rope_type": "llama3",
        "factor": float(f"{float(divisors.max()):.7g}"),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    if not np.allclose(llama3_rope_divisors(scaling, head_dim, rope_theta), divisors, rtol=1e-4):
        raise SpecmlxError(
            "GGUF rope_freqs do not match Llama 3's rope scaling with low_freq_factor 1, "
            "high_freq_factor 4 and 8192 original positions; this scaling is not supported"
        )
    return scaling


def llama3_rope_divisors(scaling: dict, head_dim: int, rope_theta: float) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for a "llama3" rope_scaling, restated."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelengths = 2 * math.pi * rope_theta ** (np.arange(0, head_dim, 2) / head_dim)
    smooth = np.clip((original / wavelengths - low) / (high - low), 0.0, 1.0)
    return (1 / ((1 - smooth) / factor + smooth)).astype(np.float32)


def _sliding_window_pattern(value: int | list[bool] | None, blocks: int) -> int:
    """mlx-lm's period of sliding layers (every Nth is global) from GGUF's int or per-layer
    flags (True = sliding)."""
    if value is None:
        return GEMMA3_SLIDING_WINDOW_PATTERN
    if isinstance(value, int):
        return value
    period = value.index(False) + 1 if False in value else blocks + 1
    if list(value) != [(i + 1) % period != 0 for i in range(blocks)]:
        raise SpecmlxError("GGUF sliding_window_pattern is not periodic; mlx-lm cannot express it")
    return period


def build_config(fields: dict[str, Any], tensor_names: set[str], vocab_rows: int) -> dict:
    arch = gguf_architecture(fields)
    model_type, hf_class = ARCHITECTURES[arch]

    def get(key: str, default: Any = None) -> Any:
        value = fields.get(f"{arch}.{key}", default)
        if value is None:
            raise SpecmlxError(f"GGUF metadata lacks {arch}.{key}: the file is incomplete")
        return value

    heads = get("attention.head_count")
    hidden = get("embedding_length")
    config = {
        "architectures": [hf_class],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "rms_norm_eps": _eps(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": get("context_length", 2048),
        "vocab_size": vocab_rows,
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    # qwen3 and gemma3 classes take head_dim whether or not it is hidden / heads
    config["head_dim"] = fields.get(f"{arch}.attention.key_length") or hidden // heads
    if arch == "gemma3":
        blocks = config["num_hidden_layers"]
        config["query_pre_attn_scalar"] = (
            hidden // heads if blocks == GEMMA3_27B_BLOCKS else config["head_dim"]
        )
        config["sliding_window"] = get("attention.sliding_window")
        config["sliding_window_pattern"] = _sliding_window_pattern(
            fields.get(f"{arch}.attention.sliding_window_pattern"), blocks
        )
        config["rope_local_base_freq"] = float(
            fields.get(f"{arch}.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE)
        )
    scaling = fields.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling not in ("linear", "yarn"):
            raise SpecmlxError(f"GGUF rope scaling {scaling!r} is not supported (linear, yarn)")
        config["rope_scaling"] = {"type": scaling, "factor": get("rope.scaling.factor")}
        if scaling == "yarn":
            original = get("rope.scaling.original_context_length")
            config["rope_scaling"]["original_max_position_embeddings"] = original
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos")):
        if (value := fields.get(f"tokenizer.ggml.{name}_token_id")) is not None:
            config[key] = value
    return config


def _unpermute(rows: np.ndarray, head_dim: int) -> np.ndarray:
    """Undo llama.cpp's `permute`: within each head it interleaved the two rotary halves."""
    shape = rows.shape
    return rows.reshape(-1, head_dim // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _tensor_reader(
    path: Path, info, qtype_name: str, shape: tuple[int, ...], head_dim: int, shift: float = 0.0
):
    """Read rows of `info`, undoing the q/k permutation (`head_dim`) or norm `shift`."""
    from gguf import GGML_QUANT_SIZES, quants

    qtype = info.tensor_type
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    row_elems = int(np.prod(shape[1:], dtype=np.int64))
    offset = int(info.data_offset)

    def read_rows(start: int, stop: int) -> mx.array:
        first, count = start * row_elems, (stop - start) * row_elems
        with open(path, "rb") as f:
            f.seek(offset + first // block * block_bytes)
            raw = np.fromfile(f, dtype=np.uint8, count=count // block * block_bytes)
        if qtype_name in ("F32", "F16"):
            values = raw.view(np.float32 if qtype_name == "F32" else np.float16)
        elif qtype_name == "BF16":
            values = raw.view(np.uint16)
        else:
            # one long "row": gguf.quants loops over rows in Python but is vectorised within
            values = quants.dequantize(raw.reshape(1, -1), qtype)
        values = values.reshape(stop - start, *shape[1:])
        if head_dim:
            values = _unpermute(values, head_dim)
        if shift:  # norms are F32 in llama.cpp's files: the subtraction is exact enough
            values = values.astype(np.float32) - shift
        array = mx.array(values)
        return array.view(mx.bfloat16) if qtype_name == "BF16" else array

    # reads must cover whole quant blocks and, when permuted, whole heads
    align = block // math.gcd(row_elems, block)
    if head_dim:
        align = math.lcm(align, head_dim)
    return read_rows, align


def gguf_damage(path: Path) -> str:
    """What is wrong with a file the GGUF reader could not read, in words."""
    with open(path, "rb") as f:
        magic = f.read(4)
    return "is truncated or corrupt" if magic == b"GGUF" else "is not a GGUF file"


def open_gguf(path: Path) -> Source:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, struct errors, IndexError…
        # Its message is numpy's or struct's (an index out of bounds): no help to a user.
        raise SpecmlxError(f"{path} {gguf_damage(path)}") from e
    fields = read_fields(reader, path)
    arch = gguf_architecture(fields)
    size = path.stat().st_size
    supported = _types()
    by_name = {}
    rope_freqs = None
    for info in reader.tensors:
        if int(info.data_offset) + int(info.n_bytes) > size:
            raise SpecmlxError(f"{path} is truncated: tensor {info.name} runs past the end")
        type_name = info.tensor_type.name
        if type_name not in supported:
            raise SpecmlxError(
                f"{path}: tensor {info.name} uses GGUF type {type_name}, which is not supported "
                f"(supported: {', '.join(supported)})"
            )
        if info.name == ROPE_FREQS and arch == "llama":
            rope_freqs = np.array(info.data, dtype=np.float32)
            continue
        name = hf_name(info.name, arch)
        if name is None:
            raise SpecmlxError(f"{path}: GGUF tensor {info.name} has no Hugging Face equivalent")
        by_name[name] = info
    if "model.embed_tokens.weight" not in by_name:
        raise SpecmlxError(f"{path} has no token_embd.weight tensor")
    vocab_rows = int(by_name["model.embed_tokens.weight"].shape[-1])
    config = build_config(fields, {info.name for info in reader.tensors}, vocab_rows)
    if rope_freqs is not None:
        config["rope_scaling"] = llama3_rope_scaling(
            rope_freqs, config["head_dim"], config["rope_theta"]
        )
    # Gemma's activations overflow float16 (mlx-lm clips its residuals for that): bfloat16,
    # the dtype Google ships, where the checkpoint's dtype is kept (Metal, CUDA).
    config["torch_dtype"] = "bfloat16" if arch == "gemma3" else "float16"

    from .gguf_tokenizer import build_tokenizer

    write_tokenizer = build_tokenizer(fields, config)
    tensors = {}
    for name, info in by_name.items():
        shape = tuple(int(n) for n in reversed(info.shape.tolist()))
        head_dim = 0
        if arch in PERMUTED_QK and ".self_attn.q_proj." in name:
            head_dim = shape[0] // config["num_attention_heads"]
        elif arch in PERMUTED_QK and ".self_attn.k_proj." in name:
            head_dim = shape[0] // config["num_key_value_heads"]
        shift = 1.0 if arch in SHIFTED_NORMS and name.endswith("norm.weight") else 0.0
        read_rows, align = _tensor_reader(path, info, info.tensor_type.name, shape, head_dim, shift)
        tensors[name] = SourceTensor(shape, int(info.n_bytes), read_rows, align)
    del reader  # its memory map of the whole file is not needed any more

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return Source(
        str(path),
        path,
        "gguf",
        config,
        tensors,
        digest.hexdigest(),
        "the GGUF file",
        write_tokenizer,
    )
