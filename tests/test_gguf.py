"""GGUF input: tiny models written the way llama.cpp's converter writes them, read back.

The writer below mirrors convert_hf_to_gguf.py's choices (names, llama q/k permutation,
llama 3's rope scaling as a rope_freqs tensor, Gemma 3's norms stored as 1 + w, 1-D
tensors kept F32, vocabulary padded with unused [PAD] tokens), so reading its output
back tests what a real GGUF exercises.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import specmlx
from specmlx.convert import quantize
from specmlx.convert.gguf import _unpermute, hf_name
from specmlx.errors import SpecmlxError
from specmlx.tiny import build_tiny_model

GGUF_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
GEMMA3_GGUF_NAMES = {
    **GGUF_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
GGUF_ARCHITECTURES = {"gemma3_text": "gemma3"}
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
MIXED_TEXT = (
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n"
    "Écrire du code 数据 🙂 Ünïcödé\t\ttabs    and   runs   of spaces\n\n\n  x = 12345"
)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, restated."""
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_freqs(scaling: dict, head_dim: int, base: float) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel rope_freqs for a "llama3" rope_scaling, restated."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * base ** (i / head_dim)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def gguf_name(hf: str, model_type: str = "llama") -> str:
    names = GEMMA3_GGUF_NAMES if model_type == "gemma3_text" else GGUF_NAMES
    stem, kind = hf.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, layer, module = stem.split(".", 3)
        return f"blk.{layer}.{names[module]}.{kind}"
    return f"{names[stem]}.{kind}"


def write_gguf(
    model_dir: Path,
    path: Path,
    qtype: str = "F16",
    arch: str | None = None,
    tokenizer_model: str = "gpt2",
    extra_tensor: tuple[str, str] | None = None,
) -> Path:
    """Write the tiny HF model at `model_dir` as a GGUF file of type `qtype` (F16, Q8_0)."""
    import gguf

    config = json.loads((model_dir / "config.json").read_text())
    model_type = config["model_type"]
    writer = gguf.GGUFWriter(str(path), arch or GGUF_ARCHITECTURES.get(model_type, model_type))
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    if "head_dim" in config:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if model_type == "gemma3_text":
        writer.add_sliding_window(config["sliding_window"])
        # llama.cpp hard-codes gemma3's 6; the tiny model's 2 must travel as metadata
        writer.add_sliding_window_pattern(config["sliding_window_pattern"])

    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in tokenizer["added_tokens"] if t["special"]}
    types = [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    for i in range(len(tokens), config["vocab_size"]):  # llama.cpp pads to the embedding rows
        tokens.append(f"[PAD{i}]")
        types.append(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(
        json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    )

    weights = mx.load(str(model_dir / "model.safetensors"))
    for name, w in sorted(weights.items()):
        array = np.array(w.astype(mx.float32))
        if model_type == "llama" and ".self_attn.q_proj." in name:
            array = llama_cpp_permute(array, config["num_attention_heads"])
        elif model_type == "llama" and ".self_attn.k_proj." in name:
            array = llama_cpp_permute(array, config["num_key_value_heads"])
        elif model_type == "gemma3_text" and name.endswith("norm.weight"):
            array = array + 1  # Gemma3Model.modify_tensors: norm_shift
        target = gguf_name(name, model_type)
        if array.ndim == 1:
            writer.add_tensor(target, array)
        elif qtype == "F16":
            writer.add_tensor(target, array.astype(np.float16))
        else:
            kind = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(target, gguf.quants.quantize(array, kind), raw_dtype=kind)
    if (config.get("rope_scaling") or {}).get("rope_type") == "llama3":
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        scaling = config["rope_scaling"]
        writer.add_tensor(
            "rope_freqs.weight", llama3_rope_freqs(scaling, head_dim, config["rope_theta"])
        )
    if extra_tensor is not None:
        name, type_name = extra_tensor
        kind = gguf.GGMLQuantizationType[type_name]
        block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
        writer.add_tensor(name, np.zeros((1, block_bytes), np.uint8), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def edit_model(
    source: Path, dest: Path, config_changes: dict, drop: tuple[str, ...] = (), zero: str = "\0"
) -> Path:
    """A copy of the tiny model at `source` with its config changed, tensors dropped and
    those whose names end with `zero` zeroed."""
    shutil.copytree(source, dest)
    config = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, **config_changes}, indent=2))
    weights = {
        k: mx.zeros_like(v) if k.endswith(zero) else v
        for k, v in mx.load(str(dest / "model.safetensors")).items()
        if k not in drop
    }
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    return dest


@pytest.fixture(scope="module")
def layout_dirs(model_dirs, tmp_path_factory):
    """One tiny model per GGUF layout: qwen2, llama, llama 3 (rope scaling), qwen3, gemma3."""
    root = tmp_path_factory.mktemp("layouts")
    gemma = build_tiny_model(root / "gemma3-untied", arch="gemma3_text", seed=6)
    return {
        "target": model_dirs["target"],
        "llama": model_dirs["llama"],
        "llama3": edit_model(
            model_dirs["llama"], root / "llama3", {"rope_scaling": LLAMA3_ROPE_SCALING}
        ),
        "qwen3": build_tiny_model(root / "qwen3", arch="qwen3", seed=5),
        # Gemma 3 ties its head (llama.cpp writes none); its norms start at 0 (x1, where
        # trained ones sit), not mlx-lm's random init of 1 (x2, four times per layer)
        "gemma3": edit_model(
            gemma,
            root / "gemma3",
            {"tie_word_embeddings": True},
            drop=("lm_head.weight",),
            zero="norm.weight",
        ),
    }


@pytest.fixture(scope="module")
def layout_models(layout_dirs):
    return {name: specmlx.load(path) for name, path in layout_dirs.items()}


@pytest.fixture(scope="module")
def gguf_files(layout_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return {
        (name, qtype): write_gguf(layout_dirs[name], root / f"{name}-{qtype}.gguf", qtype)
        for name in layout_dirs
        for qtype in ("F16", "Q8_0")
    }


LAYOUTS = ["target", "llama", "llama3", "qwen3", "gemma3"]


def load_all(path: Path) -> dict[str, mx.array]:
    return dict(mx.load(str(path / "model.safetensors")))


def greedy(module, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens by full re-forward (no cache: simple and exact)."""
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(mx.argmax(module(mx.array([tokens]))[0, -1]).item()))
    return tokens[len(prompt) :]


@pytest.mark.parametrize("name", LAYOUTS)
def test_f16_gguf_quantizes_bit_for_bit_like_its_safetensors_source(
    name, layout_dirs, gguf_files, tmp_path
):
    settings = dict(bits=4, embed_bits=4, dtype="float16")
    quantize(gguf_files[name, "F16"], tmp_path / "from-gguf", **settings)
    quantize(layout_dirs[name], tmp_path / "from-hf", **settings)
    ours, reference = load_all(tmp_path / "from-gguf"), load_all(tmp_path / "from-hf")
    assert sorted(ours) == sorted(reference)
    for key in reference:
        assert mx.array_equal(ours[key], reference[key]).item(), key


# Near-lossless settings (INT8 weights, float32 embedding and head) isolate what the GGUF
# round trip costs (measured: F16 ~0.5%, Q8_0 ~1% of the logit range). Along the
# original's greedy continuation, every position's logits must stay within `tolerance` x
# their range of the original's, and the greedy choice must be the same wherever the
# original's top two are further apart than that error bound.
@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("qtype, tolerance", [("F16", 0.01), ("Q8_0", 0.015)])
def test_gguf_round_trip_keeps_greedy_tokens_and_logits(
    name, qtype, tolerance, layout_models, gguf_files, tmp_path
):
    quantize(gguf_files[name, qtype], tmp_path / "q", bits=8, embed_bits=16, dtype="float32")
    original, converted = layout_models[name].module, specmlx.load(tmp_path / "q").module
    prompt = layout_models[name].tokenizer.encode("def fib(n):")
    expected = greedy(original, prompt, 16)
    sequence = mx.array([prompt + expected])
    reference = original(sequence)[0, len(prompt) - 1 : -1].astype(mx.float32)
    logits = converted(sequence)[0, len(prompt) - 1 : -1].astype(mx.float32)
    bound = tolerance * (reference.max(axis=-1) - reference.min(axis=-1))
    assert (mx.abs(logits - reference).max(axis=-1) < bound).all().item()
    top2 = mx.sort(reference, axis=-1)[:, -2:]
    decisive = np.array((top2[:, 1] - top2[:, 0]) > 2 * bound)
    chosen = np.array(mx.argmax(logits, axis=-1))
    assert decisive.sum() >= 8, "too few clear-cut positions for the check to mean anything"
    assert (chosen[decisive] == np.array(expected)[decisive]).all()


def test_gguf_tokenizer_encodes_and_decodes_like_the_original(models, gguf_files, tmp_path):
    quantize(gguf_files["target", "Q8_0"], tmp_path / "q")
    original, rebuilt = models["target"].tokenizer, specmlx.load(tmp_path / "q").tokenizer
    ids = original.encode(MIXED_TEXT)
    assert rebuilt.encode(MIXED_TEXT) == ids
    assert rebuilt.decode(ids) == original.decode(ids) == MIXED_TEXT
    assert rebuilt.get_vocab() == original.get_vocab()  # the [PAD] padding is dropped
    assert rebuilt.eos_token_id == original.eos_token_id
    messages = [{"role": "user", "content": "hi"}]
    assert rebuilt.apply_chat_template(
        messages, add_generation_prompt=True
    ) == original.apply_chat_template(messages, add_generation_prompt=True)


def test_gguf_model_is_accepted_as_draft_for_its_original(models, gguf_files, tmp_path):
    quantize(gguf_files["target", "F16"], tmp_path / "q")
    specmlx.loading.check_pair(models["target"], specmlx.load(tmp_path / "q"))


LAYOUT_KEYS = {
    "llama3": ("rope_scaling", "head_dim"),
    "qwen3": ("head_dim",),
    "gemma3": (
        "head_dim",
        "query_pre_attn_scalar",
        "sliding_window",
        "sliding_window_pattern",
    ),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_config_is_rebuilt_from_gguf_metadata(name, layout_dirs, gguf_files, tmp_path):
    quantize(gguf_files[name, "F16"], tmp_path / "q")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    original = json.loads((layout_dirs[name] / "config.json").read_text())
    for key in LAYOUT_KEYS.get(name, ()) + (
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "rms_norm_eps",
        "rope_theta",
        "vocab_size",
        "tie_word_embeddings",
        "eos_token_id",
    ):
        assert config[key] == original[key], key
    info = json.loads((tmp_path / "q" / "specmlx.json").read_text())
    assert info["source_format"] == "gguf" and info["source_sha256_of"] == "the GGUF file"


def test_gguf_names_map_to_hugging_face_names():
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("blk.11.attn_k.bias") == "model.layers.11.self_attn.k_proj.bias"
    assert hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_name("rope_freqs.weight") is None
    assert hf_name("blk.2.attn_q_norm.weight", "qwen3") == "model.layers.2.self_attn.q_norm.weight"
    # the same GGUF name is a different norm in Gemma 3
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    gemma = {
        "blk.0.ffn_norm.weight": "model.layers.0.pre_feedforward_layernorm.weight",
        "blk.0.post_attention_norm.weight": "model.layers.0.post_attention_layernorm.weight",
        "blk.0.post_ffw_norm.weight": "model.layers.0.post_feedforward_layernorm.weight",
    }
    assert {name: hf_name(name, "gemma3") for name in gemma} == gemma


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    permuted = llama_cpp_permute(w, n_head=8)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(_unpermute(permuted, head_dim=16), w)


def bad_gguf(path: Path, match: str) -> None:
    before = set(os.listdir(path.parent))
    with pytest.raises(SpecmlxError, match=match):
        quantize(path, path.parent / "q")
    assert set(os.listdir(path.parent)) == before, "a failed quantize left files behind"


def test_truncated_gguf_is_refused(gguf_files, tmp_path):
    path = tmp_path / "cut.gguf"
    path.write_bytes(gguf_files["target", "F16"].read_bytes()[:-5000])
    bad_gguf(path, "truncated")


def test_gguf_with_a_corrupt_header_is_refused(gguf_files, tmp_path):
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(b"NOPE" + gguf_files["target", "F16"].read_bytes()[4:])
    bad_gguf(path, "is not a GGUF file")


def test_unsupported_gguf_quant_type_is_named(model_dirs, tmp_path):
    path = write_gguf(model_dirs["target"], tmp_path / "iq.gguf", extra_tensor=("x", "IQ2_XXS"))
    bad_gguf(path, "uses GGUF type IQ2_XXS, which is not supported")


def test_unsupported_gguf_architecture_lists_the_supported_ones(model_dirs, tmp_path):
    path = write_gguf(model_dirs["target"], tmp_path / "gemma.gguf", arch="gemma")
    bad_gguf(path, r"unsupported GGUF architecture 'gemma'; supported: llama, qwen2, qwen3, gemma3")


def test_unsupported_gguf_tokenizer_type_is_named(model_dirs, tmp_path):
    path = write_gguf(model_dirs["target"], tmp_path / "bert.gguf", tokenizer_model="bert")
    bad_gguf(path, "GGUF tokenizer type 'bert' is not supported")


def test_llama3_rope_scaling_other_than_llama_3_s_band_is_refused(layout_dirs, tmp_path):
    scaling = {**LLAMA3_ROPE_SCALING, "high_freq_factor": 2.0}
    model = edit_model(layout_dirs["llama"], tmp_path / "odd", {"rope_scaling": scaling})
    bad_gguf(write_gguf(model, tmp_path / "odd.gguf"), "rope_freqs do not match")


def test_missing_gguf_file_is_refused(tmp_path):
    with pytest.raises(SpecmlxError, match="does not exist"):
        quantize(tmp_path / "absent.gguf", tmp_path / "q")
    assert os.listdir(tmp_path) == []
