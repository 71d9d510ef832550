"""GGUF input: tiny models written the way llama.cpp's converter writes them, read back.

The writer below mirrors convert_hf_to_gguf.py's choices (names, llama q/k permutation,
1-D tensors kept F32, vocabulary padded with unused [PAD] tokens), so reading its output
back tests what a real GGUF exercises.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import specmlx
from specmlx.convert import quantize
from specmlx.convert.gguf import _unpermute, hf_name
from specmlx.errors import SpecmlxError

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
}
MIXED_TEXT = (
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n"
    "Écrire du code 数据 🙂 Ünïcödé\t\ttabs    and   runs   of spaces\n\n\n  x = 12345"
)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, restated."""
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    stem, kind = hf.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, layer, module = stem.split(".", 3)
        return f"blk.{layer}.{GGUF_NAMES[module]}.{kind}"
    return f"{GGUF_NAMES[stem]}.{kind}"


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
    writer = gguf.GGUFWriter(str(path), arch or model_type)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])

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
        if array.ndim == 1:
            writer.add_tensor(gguf_name(name), array)
        elif qtype == "F16":
            writer.add_tensor(gguf_name(name), array.astype(np.float16))
        else:
            kind = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(array, kind), raw_dtype=kind)
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


@pytest.fixture(scope="module")
def gguf_files(model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return {
        (name, qtype): write_gguf(model_dirs[name], root / f"{name}-{qtype}.gguf", qtype)
        for name in ("target", "llama")
        for qtype in ("F16", "Q8_0")
    }


def load_all(path: Path) -> dict[str, mx.array]:
    return dict(mx.load(str(path / "model.safetensors")))


def greedy(module, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens by full re-forward (no cache: simple and exact)."""
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(mx.argmax(module(mx.array([tokens]))[0, -1]).item()))
    return tokens[len(prompt) :]


@pytest.mark.parametrize("name", ["target", "llama"])
def test_f16_gguf_quantizes_bit_for_bit_like_its_safetensors_source(
    name, model_dirs, gguf_files, tmp_path
):
    settings = dict(bits=4, embed_bits=4, dtype="float16")
    quantize(gguf_files[name, "F16"], tmp_path / "from-gguf", **settings)
    quantize(model_dirs[name], tmp_path / "from-hf", **settings)
    ours, reference = load_all(tmp_path / "from-gguf"), load_all(tmp_path / "from-hf")
    assert sorted(ours) == sorted(reference)
    for key in reference:
        assert mx.array_equal(ours[key], reference[key]).item(), key


# Near-lossless settings (INT8 weights, float32 embedding and head) isolate what the GGUF
# round trip costs (measured: F16 ~0.5%, Q8_0 ~1% of the logit range). Along the
# original's greedy continuation, every position's logits must stay within `tolerance` x
# their range of the original's, and the greedy choice must be the same wherever the
# original's top two are further apart than that error bound.
@pytest.mark.parametrize("name", ["target", "llama"])
@pytest.mark.parametrize("qtype, tolerance", [("F16", 0.01), ("Q8_0", 0.015)])
def test_gguf_round_trip_keeps_greedy_tokens_and_logits(
    name, qtype, tolerance, models, gguf_files, tmp_path
):
    quantize(gguf_files[name, qtype], tmp_path / "q", bits=8, embed_bits=16, dtype="float32")
    original, converted = models[name].module, specmlx.load(tmp_path / "q").module
    prompt = models[name].tokenizer.encode("def fib(n):")
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


def test_config_is_rebuilt_from_gguf_metadata(model_dirs, gguf_files, tmp_path):
    quantize(gguf_files["llama", "F16"], tmp_path / "q")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    original = json.loads((model_dirs["llama"] / "config.json").read_text())
    for key in (
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
    bad_gguf(path, "not a valid GGUF file")


def test_unsupported_gguf_quant_type_is_named(model_dirs, tmp_path):
    path = write_gguf(model_dirs["target"], tmp_path / "iq.gguf", extra_tensor=("x", "IQ2_XXS"))
    bad_gguf(path, "uses GGUF type IQ2_XXS, which is not supported")


def test_unsupported_gguf_architecture_lists_the_supported_ones(model_dirs, tmp_path):
    path = write_gguf(model_dirs["target"], tmp_path / "gemma.gguf", arch="gemma")
    bad_gguf(path, r"unsupported GGUF architecture 'gemma'; supported: llama, qwen2")


def test_unsupported_gguf_tokenizer_type_is_named(model_dirs, tmp_path):
    path = write_gguf(model_dirs["target"], tmp_path / "spm.gguf", tokenizer_model="llama")
    bad_gguf(path, "GGUF tokenizer type 'llama' is not supported")


def test_missing_gguf_file_is_refused(tmp_path):
    with pytest.raises(SpecmlxError, match="does not exist"):
        quantize(tmp_path / "absent.gguf", tmp_path / "q")
    assert os.listdir(tmp_path) == []
