"""Tiny random models of real architectures, written in the hub's on-disk layout.

They exist so that tests, CI and a fresh machine without weights can run the whole
engine offline: config.json + model.safetensors + a byte-level BPE tokenizer trained on
the spot, loaded through the same code path as a real checkpoint. Their text is noise;
their logits are real forward passes of mlx-lm's `llama` / `qwen2` classes.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, as Qwen uses it: enough for chat to exercise a real template.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = """\
def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

The quick brown fox jumps over the lazy dog. Speculative decoding lets a small draft
model guess several tokens which the large target model then checks in one pass.
Accept with probability min(1, p/q); on rejection, resample from the residual.
Écrire du code, c'est penser deux fois. 数据 和 模型. Ünïcödé and emoji 🙂 stay intact.
    indented    text   with   runs   of   spaces\tand\ttabs
"""


def train_tokenizer(vocab_size: int = 300):
    """Train a byte-level BPE tokenizer (GPT-2 / Qwen style) on a small fixed corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return tokenizer


# Per architecture, what a small config of it needs beside the shared fields below: a
# few layers of each kind the family mixes (sliding and full attention, recurrent and
# attention layers), windows short enough that a test's prompt wraps them.
_WINDOW = 16
# Qwen3-Next / Qwen3.5: gated-delta (recurrent) layers, full attention every second layer.
_GATED_DELTA = {
    "num_hidden_layers": 4,
    "head_dim": 16,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 2,
}
ARCHITECTURES: dict[str, dict] = {
    "llama": {"architectures": ["LlamaForCausalLM"], "head_dim": 16},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"]},
    "qwen3": {"head_dim": 16},
    "qwen3_moe": {
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
    },
    "phi3": {},
    "olmo2": {"head_dim": 16},
    "smollm3": {"head_dim": 16, "no_rope_layer_interval": 2},
    "gemma2": {"head_dim": 16, "query_pre_attn_scalar": 16},
    "gemma3_text": {
        "num_hidden_layers": 4,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": _WINDOW,
        "sliding_window_pattern": 2,
    },
    "gpt_oss": {
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": _WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "mamba2": {
        "num_heads": 8,  # num_heads * head_dim = 2 * hidden_size
        "head_dim": 16,
        "state_size": 16,
        "layer_norm_epsilon": 1e-5,
        "conv_kernel": 4,
        "n_groups": 1,
        "use_bias": False,
        "use_conv_bias": True,
        "time_step_limit": [0.0, float("inf")],
        "time_step_rank": "auto",
    },
    "qwen3_next": {
        **_GATED_DELTA,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 64,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "partial_rotary_factor": 0.25,
    },
    "qwen3_5": _GATED_DELTA,
    "lfm2": {
        "num_hidden_layers": 3,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 64,
        "block_ff_dim": 128,
        "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "full_attn_idxs": [1],
    },
    "granitemoehybrid": {
        "num_hidden_layers": 3,
        "attention_bias": False,
        "embedding_multiplier": 1.0,
        "attention_multiplier": 0.25,
        "logits_scaling": 1.0,
        "residual_multiplier": 1.0,
        "layer_types": ["mamba", "attention", "mamba"],
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "shared_intermediate_size": 64,
        "mamba_n_heads": 8,  # mamba_n_heads * mamba_d_head = 2 * hidden_size
        "mamba_d_head": 16,
        "mamba_proj_bias": False,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_n_groups": 1,
        "mamba_conv_bias": True,
        "tie_word_embeddings": False,
    },
    "falcon_h1": {
        "head_dim": 16,
        "mamba_d_conv": 4,
        "mamba_d_head": 16,
        "mamba_d_ssm": 64,
        "mamba_d_state": 16,
        "mamba_n_heads": 4,
        "mamba_chunk_size": 16,
        "tie_word_embeddings": False,
    },
}


# Architectures built only with MTP layers (tests/test_mtp.py), apart from ARCHITECTURES so
# that the tests over every tiny architecture do not pick them up. DeepSeek-V3 has 61 layers
# because mlx-lm's deepseek_v3 sanitize drops the NextN layer by that index (the real
# models'), not by num_hidden_layers; all dense but the last, to keep it cheap.
MTP_ARCHITECTURES: dict[str, dict] = {
    "deepseek_v3": {
        "num_hidden_layers": 61,
        "first_k_dense_replace": 60,
        "num_key_value_heads": 4,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "n_group": 1,
        "topk_group": 1,
        "kv_lora_rank": 32,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "num_nextn_predict_layers": 1,
    },
    "glm4_moe": {
        "head_dim": 16,
        "first_k_dense_replace": 1,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "n_group": 1,
        "topk_group": 1,
        "rope_scaling": None,
        "use_qk_norm": True,
        "attention_bias": True,
        "partial_rotary_factor": 0.5,
        "num_nextn_predict_layers": 1,
    },
    "mimo": {"num_nextn_predict_layers": 1},
}
# Qwen3-Next's RMSNorms scale by 1 + weight: these are stored as weight - 1 upstream.
_OFFSET_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
    "mtp.pre_fc_norm_embedding.weight",
    "mtp.pre_fc_norm_hidden.weight",
    "mtp.norm.weight",
)
# What a NextN layer's copies of the target's tensors copy.
_COPIES = {"embed_tokens.": "model.embed_tokens.weight", "shared_head.head.": "lm_head.weight"}


def _config(arch: str, vocab_size: int, hidden: int, layers: int) -> dict:
    config = {
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": hidden * 2,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,  # tied random embeddings just echo the input token
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": None,
    }
    config.update({**ARCHITECTURES, **MTP_ARCHITECTURES}[arch])
    if arch == "qwen3_5":  # a multimodal wrapper: the language model's config is nested
        config = {"model_type": arch, "text_config": config, "tie_word_embeddings": False}
    return config


def build_tiny_model(
    path: str | Path,
    arch: str = "qwen2",
    seed: int = 0,
    hidden: int = 64,
    layers: int = 2,
    pad_vocab_to: int = 64,
    logit_scale: float = 4.0,
    perturb_from: str | Path | None = None,
    noise: float = 0.0,
    mtp: bool = False,
) -> Path:
    """Write a random `arch` model with a trained tokenizer to `path`; return the path.

    `pad_vocab_to` rounds the embedding table up the way real checkpoints do (Qwen pads
    151,665 tokens to 151,936 or 152,064), so vocab-mismatch handling is exercised.
    `logit_scale` sharpens the output distribution so acceptance is neither 0 nor 1.
    With `perturb_from`, the weights are a copy of that model plus Gaussian `noise`
    times each tensor's standard deviation: a draft that is close to, not equal to, it.
    With `mtp`, new weights come with an MTP layer (specmlx.heads.mtp's layouts), all in the
    hub's layout (experts one by one, Qwen3-Next's norms as weight - 1): the one in which
    mlx-lm's sanitize drops the MTP layer as the model loads.
    """
    known = {**ARCHITECTURES, **MTP_ARCHITECTURES}
    if arch not in known:
        raise ValueError(f"no tiny config for {arch!r}; known: {', '.join(known)}")
    if mtp:
        from .heads.mtp import LAYOUTS

        if arch not in LAYOUTS:
            raise ValueError(f"no MTP layout for {arch!r}; known: {', '.join(LAYOUTS)}")
    from .mlxlm import model_classes

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    n_tokens = tokenizer.get_vocab_size()
    vocab_size = -(-n_tokens // pad_vocab_to) * pad_vocab_to
    config = _config(arch, vocab_size, hidden, layers)
    eos_id = tokenizer.token_to_id("<|im_end|>")
    config["eos_token_id"] = eos_id

    mx.random.seed(seed)
    if perturb_from is not None:
        weights = mx.load(str(Path(perturb_from) / "model.safetensors"))
        for name, w in sorted(weights.items()):
            weights[name] = w + noise * mx.std(w) * mx.random.normal(w.shape)
    else:
        model_class, args_class = model_classes(config)
        model = model_class(args_class.from_dict(config))
        weights = dict(tree_flatten(model.parameters()))
        # Families that always tie (Gemma) have no head of their own to sharpen.
        for name in [k for k in weights if k.endswith("lm_head.weight")]:
            head = weights[name] * logit_scale
            head[n_tokens:] = 0  # padding rows are never trained in real checkpoints either
            weights[name] = head
        if mtp:
            weights = _upstream(arch, {**weights, **_mtp_weights(model, config, weights)})
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})

    (path / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "add_bos_token": False,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(tokenizer.token_to_id(t)): {"content": t, "special": True} for t in SPECIAL_TOKENS
        },
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos_id]}))
    return path


def _mtp_weights(model, config: dict, weights: dict) -> dict:
    """A random MTP layer for `model` under its upstream names (MLX's layout), its norms
    away from 1 so that a reader missing an offset is caught; a NextN layer's copies of the
    target's embedding and head beside it, as the hub's checkpoints ship them."""
    from .heads import mtp

    layer = {}
    for name, value in tree_flatten(mtp.skeleton(model, config).parameters()):
        if value.ndim == 1 and name.endswith("norm.weight"):
            value = 1.0 + 0.1 * mx.random.normal(value.shape)
        layer[mtp.stored_name(config, name)] = value
    layout = mtp.layout_of(config)
    prefix = mtp.layer_prefix(layout, config)
    for copy in layout.copies:
        layer[f"{prefix}{copy}weight"] = weights[_COPIES[copy]]
    return layer


def _upstream(arch: str, weights: dict) -> dict:
    """MLX's layout back to the hub's, as mlx-lm's sanitize reads it: experts one by one,
    DeepSeek's kv_b_proj whole, Qwen3-Next's norms as weight - 1 and its convolutions
    (channels, 1, kernel)."""
    out = {}
    for name, value in weights.items():
        if ".switch_mlp." in name:
            for e in range(value.shape[0]):
                out[name.replace(".switch_mlp.", f".experts.{e}.")] = value[e]
        elif name.endswith("self_attn.embed_q.weight"):  # with unembed_out, kv_b_proj's halves
            values = weights[name.replace("embed_q", "unembed_out")]
            whole = mx.concatenate([value.swapaxes(-1, -2), values], axis=1)
            out[name.replace("embed_q", "kv_b_proj")] = whole.reshape(-1, value.shape[1])
        elif name.endswith("self_attn.unembed_out.weight"):
            continue
        elif arch == "qwen3_next" and value.ndim == 1 and name.endswith(_OFFSET_NORMS):
            out[name] = value - 1.0
        elif arch == "qwen3_next" and "conv1d.weight" in name:
            out[name] = value.swapaxes(1, 2)
        else:
            out[name] = value
    return out
