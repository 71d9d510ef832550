"""A Hugging Face fast tokenizer rebuilt from GGUF tokenizer metadata.

Two kinds exist. Byte-level BPE (`gpt2`: Qwen, Llama 3, SmolLM): GGUF keeps the
vocabulary, merges, token types, special ids and chat template, but not the
pre-tokenizer, only its name (`tokenizer.ggml.pre`), which llama.cpp maps to a split
regex; the same names are mapped here back to the `tokenizers` pipelines the original
checkpoints ship. SentencePiece BPE (`llama`: Gemma, Llama 2): GGUF keeps pieces with
scores instead of merges; SentencePiece merges the adjacent pair whose union has the
highest score, which is BPE with merges ranked by that score, so the merges are derived
from the scores as Hugging Face's own SentencePiece converter does.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import SpecmlxError

# llama.cpp's token types (gguf.TokenType)
NORMAL, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 3, 4, 5, 6
SPACE = "▁"  # SentencePiece's visible space

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


def _byte_level_bpe(vocab: dict[str, int], merges: list[str], pre: str):
    from tokenizers import Tokenizer, decoders, models, processors

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges]))
    normalizer, pre_tokenizer = _pipeline(pre)
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def sentencepiece_merges(
    vocab: dict[str, int], scores: list[float], types: list[int]
) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's scores: every split of a normal piece into
    two pieces, the highest-scoring union first (ties by the parts' ids, as HF's converter)."""
    normal = {piece: i for piece, i in vocab.items() if types[i] == NORMAL}
    merges = [
        (-scores[i], normal[piece[:k]], normal[piece[k:]], piece[:k], piece[k:])
        for piece, i in normal.items()
        for k in range(1, len(piece))
        if piece[:k] in normal and piece[k:] in normal
    ]
    merges.sort()
    return [(left, right) for *_, left, right in merges]


def _sentencepiece_bpe(
    vocab: dict[str, int],
    scores: list[float],
    types: list[int],
    unknown: str | None,
    fields: dict[str, Any],
):
    """Byte-fallback BPE with SentencePiece's space handling, laid out as HF's converter
    writes it (mlx-lm recognises that decoder and streams it with its SPM detokenizer)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    model = models.BPE(
        vocab=vocab,
        merges=sentencepiece_merges(vocab, scores, types),
        unk_token=unknown,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(model)
    # llama.cpp's default for SentencePiece vocabularies is to add the dummy prefix
    prefix = fields.get("tokenizer.ggml.add_space_prefix", True)
    replace = normalizers.Replace(" ", SPACE)
    tokenizer.normalizer = (
        normalizers.Sequence([normalizers.Prepend(SPACE), replace]) if prefix else replace
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def build_tokenizer(fields: dict[str, Any], config: dict) -> Callable[[Path], None]:
    """Check the GGUF tokenizer is one we can rebuild; return a function writing its files."""
    from tokenizers import AddedToken, processors

    kind = fields.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise SpecmlxError(
            f"GGUF tokenizer type {kind!r} is not supported (supported: 'gpt2', byte-level "
            "BPE, and 'llama', SentencePiece BPE)"
        )
    pre = fields.get("tokenizer.ggml.pre", "gpt-2")
    pre = "gpt-2" if pre == "gpt2" else pre
    if kind == "gpt2" and pre not in PRE_TOKENIZERS:
        raise SpecmlxError(
            f"GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(PRE_TOKENIZERS)})"
        )
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    types: list[int] = fields.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    merges: list[str] = fields.get("tokenizer.ggml.merges") or []
    scores: list[float] = fields.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    if kind == "llama" and len(scores) != len(tokens):
        raise SpecmlxError("GGUF SentencePiece tokenizer has no score per token")
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
        if kind == "gpt2":
            tokenizer = _byte_level_bpe(vocab, merges, pre)
        else:
            tokenizer = _sentencepiece_bpe(vocab, scores, types, token("unknown"), fields)
        bos = token("bos")
        if fields.get("tokenizer.ggml.add_bos_token") and bos is not None:
            template = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
            )
            post = tokenizer.post_processor
            tokenizer.post_processor = (
                processors.Sequence([post, template]) if post is not None else template
            )
        # llama.cpp wrote user-defined pieces with real spaces for "▁" (matched on raw text)
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
