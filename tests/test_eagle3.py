"""EAGLE-3 checkpoints as published (specmlx/heads/eagle3.py): a tiny random checkpoint in
EAGLE's / SpecForge's layout (torch-style key names, d2t/t2d, a draft vocabulary smaller
than the target's, an embed_tokens of its own) loads as a head that computes what
EAGLE's reference computes and drafts exactly: the target alone's greedy and seeded
text, plain or quantized; one made for another target is refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

import specmlx
from specmlx.errors import SpecmlxError
from specmlx.heads import what_is
from specmlx.heads.eagle3 import load_eagle3, quantize_eagle3
from specmlx.heads.feature import text_args
from specmlx.loading import Model

PROMPT = "def fibonacci(n):\n    if n < 2:"
N = 40
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
# Which layers each tiny target's checkpoint names, in each convention the loader reads:
# SpecForge's outputs of layers (eagle_config), vLLM's hidden-state boundaries (top level),
# none (EAGLE's default, which needs the 4 layers of the tiny gemma3_text).
TAPS = {
    "llama": {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 0, 1]}},
    "qwen2": {"eagle_aux_hidden_state_layer_ids": [2, 1, 2]},
    "gemma3_text": {},
}


def write_eagle3(
    path: Path,
    target: Model,
    extra: dict | None = None,
    ids: np.ndarray | None = None,
    hidden: int | None = None,
    seed: int = 0,
) -> Path:
    """A random EAGLE-3 checkpoint for `target` in the published layout; its draft
    vocabulary: target token ids `ids` (draft row i is ids[i]), 48 random ones by default."""
    _, args = text_args(target)
    dim, vocab = hidden or args.hidden_size, args.vocab_size
    rng = np.random.default_rng(seed)
    if ids is None:
        ids = np.sort(rng.choice(target.vocab_size, 48, replace=False))

    def linear(rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
        return (gain * rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32)

    t2d = np.zeros(vocab, bool)
    t2d[ids] = True
    layer = "midlayer."
    weights = {
        "fc.weight": linear(dim, 3 * dim),
        f"{layer}self_attn.q_proj.weight": linear(HEADS * HEAD_DIM, 2 * dim),
        f"{layer}self_attn.k_proj.weight": linear(KV_HEADS * HEAD_DIM, 2 * dim),
        f"{layer}self_attn.v_proj.weight": linear(KV_HEADS * HEAD_DIM, 2 * dim),
        f"{layer}self_attn.o_proj.weight": linear(dim, HEADS * HEAD_DIM),
        f"{layer}mlp.gate_proj.weight": linear(2 * dim, dim),
        f"{layer}mlp.up_proj.weight": linear(2 * dim, dim),
        f"{layer}mlp.down_proj.weight": linear(dim, 2 * dim),
        f"{layer}input_layernorm.weight": norm(),
        f"{layer}hidden_norm.weight": norm(),
        f"{layer}post_attention_layernorm.weight": norm(),
        "norm.weight": norm(),
        "lm_head.weight": linear(len(ids), dim, gain=4.0),
        "d2t": (ids - np.arange(len(ids))).astype(np.int64),
        "t2d": t2d,
        "embed_tokens.weight": linear(vocab, dim),  # shipped by some; the target's is used
    }
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": dim,
        "intermediate_size": 2 * dim,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "vocab_size": vocab,
        "draft_vocab_size": len(ids),
        "torch_dtype": "float32",
        **(extra or {}),
    }
    path.mkdir(parents=True)
    tensors = {k: mx.array(v) for k, v in weights.items()}
    mx.save_safetensors(str(path / "model.safetensors"), tensors, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


@pytest.fixture(scope="module")
def eagle3(tiny_pair, tmp_path_factory):
    """arch -> (target, its EAGLE-3 checkpoint's directory, the head loaded from it)."""
    root = tmp_path_factory.mktemp("eagle3")
    made = {}

    def make(arch: str):
        if arch not in made:
            target = specmlx.load(tiny_pair(arch)[0])
            path = write_eagle3(root / arch, target, TAPS[arch])
            made[arch] = target, path, load_eagle3(path, target)
        return made[arch]

    return make


def test_an_eagle3_checkpoint_is_told_apart(eagle3):
    _, path, _ = eagle3("llama")
    assert what_is(path) == "eagle3"


@pytest.mark.parametrize("arch", list(TAPS))
@pytest.mark.parametrize("gamma", [3, "auto"])
def test_greedy_with_an_eagle3_head_equals_the_target_alone(eagle3, arch, gamma):
    target, _, head = eagle3(arch)
    plain = specmlx.generate(target, PROMPT, max_tokens=N, num_draft=0).run()
    gen = specmlx.generate(target, PROMPT, head, max_tokens=N, num_draft=gamma, draft_mode="head")
    assert gen.run().tokens == plain.tokens
    assert gamma == "auto" or gen.stats.rounds_by_source.get("head", 0) > N // 4


def test_coupled_sampling_with_an_eagle3_head_gives_the_target_alones_text(eagle3):
    target, _, head = eagle3("gemma3_text")
    kw = dict(max_tokens=N, temperature=1.0, seed=5, sampling="coupled")
    alone = specmlx.generate(target, PROMPT, num_draft=0, **kw).run()
    gen = specmlx.generate(target, PROMPT, head, num_draft=3, draft_mode="head", **kw).run()
    assert gen.tokens == alone.tokens


@pytest.mark.parametrize(
    "extra, taps",
    [
        ({}, (1, 1, 0)),  # EAGLE's: layers 1, N/2 - 1, N - 4 of N = 4
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}, (1, 2, 3)),
        ({"eagle_aux_hidden_state_layer_ids": [2, 3, 4]}, (1, 2, 3)),  # boundaries
    ],
)
def test_the_tapped_layers_are_read_from_the_config(eagle3, tmp_path, extra, taps):
    target, _, _ = eagle3("gemma3_text")
    assert load_eagle3(write_eagle3(tmp_path / "head", target, extra), target).taps == taps


def test_the_heads_ids_are_the_d2t_mapping_in_ascending_order(eagle3, tmp_path):
    target, _, _ = eagle3("qwen2")
    ids = np.random.default_rng(3).permutation(target.vocab_size)[:40]  # not in order
    path = write_eagle3(tmp_path / "head", target, TAPS["qwen2"], ids=ids)
    head = load_eagle3(path, target)
    assert head.ids.tolist() == sorted(ids.tolist())
    x = mx.random.normal((1, text_args(target)[1].hidden_size), key=mx.random.key(0))
    rows = mx.load(str(path / "model.safetensors"))["lm_head.weight"]
    expected = (x @ rows.T)[:, mx.array(np.argsort(ids))]
    assert mx.allclose(head.logits(x), expected, atol=1e-4).item()


def reference(w: dict, emb: np.ndarray, features: np.ndarray, theta: float = 1e4) -> tuple:
    """(midlayer outputs, logits) of EAGLE's cnets.py Model over L rows from position 0, in
    NumPy: features 3 D wide are folded by fc, D wide ones (its own) are not."""

    def rms(x, weight):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6) * weight

    def rope(x):  # (L, heads, d): HF's rotate_half form
        half = HEAD_DIM // 2
        angles = np.arange(len(x))[:, None] * theta ** (-np.arange(half) / half)
        cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    m = "midlayer."
    dim = emb.shape[-1]
    h = np.stack([f @ w["fc.weight"].T if f.size != dim else f for f in features])
    normed = rms(emb, w[f"{m}input_layernorm.weight"]), rms(h, w[f"{m}hidden_norm.weight"])
    x = np.concatenate(normed, -1)
    q = rope((x @ w[f"{m}self_attn.q_proj.weight"].T).reshape(len(x), HEADS, HEAD_DIM))
    k = rope((x @ w[f"{m}self_attn.k_proj.weight"].T).reshape(len(x), KV_HEADS, HEAD_DIM))
    v = (x @ w[f"{m}self_attn.v_proj.weight"].T).reshape(len(x), KV_HEADS, HEAD_DIM)
    k, v = (np.repeat(a, HEADS // KV_HEADS, axis=1) for a in (k, v))
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(HEAD_DIM)
    scores += np.triu(np.full((len(x), len(x)), -np.inf), 1)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    out = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v).reshape(len(x), -1)
    h = h + out @ w[f"{m}self_attn.o_proj.weight"].T
    y = rms(h, w[f"{m}post_attention_layernorm.weight"])
    gate, up = y @ w[f"{m}mlp.gate_proj.weight"].T, y @ w[f"{m}mlp.up_proj.weight"].T
    h = h + (gate / (1 + np.exp(-gate)) * up) @ w[f"{m}mlp.down_proj.weight"].T
    return h, rms(h, w["norm.weight"]) @ w["lm_head.weight"].T


def test_the_head_computes_what_eagles_reference_computes(eagle3):
    # A prompt's rows (the target's 3 D features), then one draft step from its own output
    # feature at the next position: both against cnets.py's forward, row for row.
    target, path, head = eagle3("llama")
    w = {k: np.array(v) for k, v in mx.load(str(path / "model.safetensors")).items()}
    dim = text_args(target)[1].hidden_size
    tokens = mx.array([[5, 17, 42, 99, 7]])
    emb = head.embed(tokens)
    features = mx.random.normal((1, 4, 3 * dim), key=mx.random.key(1))
    cache = KVCache()
    fed, out = head.module(emb[:, :4], features, cache)
    _, out2 = head.module(emb[:, 4:], fed[:, -1:], cache)
    rows = [*np.array(features[0]), np.array(fed[0, -1])]
    h, logits = reference(w, np.array(emb[0]), rows)
    order = np.argsort(np.arange(len(w["d2t"])) + w["d2t"])
    np.testing.assert_allclose(np.array(fed[0]), h[:4], atol=1e-4)
    got = np.array(head.logits(mx.concatenate([out, out2], axis=1))[0])
    np.testing.assert_allclose(got, logits[:, order], atol=1e-3)


def test_a_quantized_copy_loads_and_decodes_the_targets_greedy_text(eagle3, tmp_path):
    target, path, _ = eagle3("llama")
    quantize_eagle3(path, tmp_path / "int4")
    stored = mx.load(str(tmp_path / "int4" / "model.safetensors"))
    assert "midlayer.self_attn.q_proj.scales" in stored and "embed_tokens.weight" not in stored
    head = load_eagle3(tmp_path / "int4", target)
    assert isinstance(head.module.midlayer.self_attn.q_proj, nn.QuantizedLinear)
    plain = specmlx.generate(target, PROMPT, max_tokens=N, num_draft=0).run()
    gen = specmlx.generate(target, PROMPT, head, max_tokens=N, num_draft=3, draft_mode="head")
    assert gen.run().tokens == plain.tokens


@pytest.mark.parametrize(
    "change, said",
    [
        (dict(hidden=32), "is 32 wide, but .* has hidden size 64"),
        (dict(extra={"eagle_aux_hidden_state_layer_ids": [2, 3, 9]}), "reads target layers"),
    ],
)
def test_a_checkpoint_for_another_target_is_refused_in_one_line(eagle3, tmp_path, change, said):
    target, _, _ = eagle3("gemma3_text")
    path = write_eagle3(tmp_path / "head", target, **change)
    with pytest.raises(SpecmlxError, match=said) as error:
        load_eagle3(path, target)
    assert "\n" not in str(error.value)


def test_weights_other_than_safetensors_are_refused_with_the_fix(eagle3, tmp_path):
    target, path, _ = eagle3("qwen2")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0")
    with pytest.raises(SpecmlxError, match=r"safetensors only\); convert") as error:
        load_eagle3(tmp_path, target)
    assert "\n" not in str(error.value)


def test_specmlx_quantize_writes_an_int4_copy_that_generate_takes_as_a_head(eagle3, tmp_path):
    target, path, _ = eagle3("llama")

    def specmlx_run(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "specmlx", *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    done = specmlx_run("quantize", str(path), "-o", str(tmp_path / "q"))
    assert done.returncode == 0, done.stderr
    again = specmlx_run("quantize", str(path), "-o", str(tmp_path / "q"))
    assert again.returncode == 2 and "--force" in again.stderr  # never replaced unasked
    done = specmlx_run("generate", "-m", str(target.path), "-d", str(tmp_path / "q"), "-p", "def")
    assert done.returncode == 0, done.stderr
    assert "EAGLE-3 head" in done.stderr and "int4" in done.stderr


def test_an_eagle3_head_grows_trees_that_keep_greedy_output_the_target_alones(eagle3):
    target, _, head = eagle3("qwen2")
    plain = specmlx.generate(target, PROMPT, max_tokens=N, num_draft=0).run()
    gen = specmlx.generate(
        target, PROMPT, head, max_tokens=N, num_draft=3, tree=6, draft_mode="head"
    )
    assert gen.run().tokens == plain.tokens and gen.stats.tree_rounds > 0
