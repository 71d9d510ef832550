"""A Hugging Face fast tokenizer rebuilt from GGUF tokenizer metadata.

GGUF keeps the BPE vocabulary, merges, token types, special ids and chat template, but
not the pre-tokenizer: only its name (`tokenizer.ggml.pre`), which llama.cpp maps to a
split regex. The same names are mapped here back to the `tokenizers` pipelines the
original checkpoints ship, so the rebuilt tokenizer encodes text as the original did.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import SpecmlxError

# llama.cpp's token types (gguf.TokenType)
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5

# Split regexes of the originals' tokenizer.json (Qwen2 and Llama 3 differ in digits).
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPLIT = QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
PRE_TOKENIZERS = ("gpt-2", "qwen2", "llama-bpe", "smollm")


def _pipeline(pre: str):
    """(normalizer, pre_tokenizer) of the byte-level BPE family named `pre`."""
    from tokenizers import Regex, normalizers, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre == "gpt-2":
        return None, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return None, pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    split = QWEN2_SPLIT if pre == "qwen2" else LLAMA3_SPLIT
    sequence = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False), byte_level]
    )
    return (normalizers.NFC() if pre == "qwen2" else None), sequence


def build_tokenizer(fields: dict[str, Any], config: dict) -> Callable[[Path], None]:
    """Check the GGUF tokenizer is one we can rebuild; return a function writing its files."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = fields.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise SpecmlxError(
            f"GGUF tokenizer type {kind!r} is not supported (supported: 'gpt2', byte-level BPE)"
        )
    pre = fields.get("tokenizer.ggml.pre", "gpt-2")
    pre = "gpt-2" if pre == "gpt2" else pre
    if pre not in PRE_TOKENIZERS:
        raise SpecmlxError(
            f"GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(PRE_TOKENIZERS)})"
        )
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    types: list[int] = fields.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    merges: list[str] = fields.get("tokenizer.ggml.merges") or []
    # llama.cpp pads the vocabulary to the embedding rows with unused [PAD] tokens;
    # the original tokenizer does not have them.
    count = len(tokens)
    while count and types[count - 1] == UNUSED:
        count -= 1
    vocab = {token: i for i, token in enumerate(tokens[:count])}
    if len(vocab) != count:
        raise SpecmlxError("GGUF tokenizer has duplicate tokens; it cannot be rebuilt")

    def token(key: str) -> str | None:
        index = fields.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[index] if index is not None and index < count else None

    def write(out: Path) -> None:
        tokenizer = Tokenizer(
            models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges])
        )
        normalizer, pre_tokenizer = _pipeline(pre)
        if normalizer is not None:
            tokenizer.normalizer = normalizer
        tokenizer.pre_tokenizer = pre_tokenizer
        tokenizer.decoder = decoders.ByteLevel()
        post = processors.ByteLevel(trim_offsets=False)
        bos = token("bos")
        if fields.get("tokenizer.ggml.add_bos_token") and bos is not None:
            template = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
            )
            post = processors.Sequence([post, template])
        tokenizer.post_processor = post
        added = [
            AddedToken(tokens[i], special=types[i] == CONTROL, normalized=False)
            for i in range(count)
            if types[i] in (CONTROL, USER_DEFINED)
        ]
        tokenizer.add_special_tokens([t for t in added if t.special])
        tokenizer.add_tokens([t for t in added if not t.special])
        tokenizer.save(str(out / "tokenizer.json"))

        tokenizer_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": bos,
            "eos_token": token("eos"),
            "pad_token": token("padding"),
            "unk_token": token("unknown"),
            "add_bos_token": bool(fields.get("tokenizer.ggml.add_bos_token", False)),
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": config.get("max_position_embeddings", 2048),
            "added_tokens_decoder": {
                str(vocab[t.content]): {
                    "content": t.content,
                    "special": t.special,
                    "normalized": False,
                    "lstrip": False,
                    "rstrip": False,
                    "single_word": False,
                }
                for t in added
            },
        }
        if template := fields.get("tokenizer.chat_template"):
            tokenizer_config["chat_template"] = template
        (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
        eos = {fields.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot")}
        generation = {"eos_token_id": sorted(eos - {None})}
        if (bos_id := fields.get("tokenizer.ggml.bos_token_id")) is not None:
            generation["bos_token_id"] = bos_id
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2))

    return write
