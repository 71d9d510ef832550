"""What a JSON schema's token masks cost per library on a model's vocabulary.

The schema's compile time and each token's mask, stepping through a valid answer:

    python -m bench json_masks [--model DIR]

Measures llguidance and outlines-core, whichever are installed (xgrammar needs torch and
CUDA's wheels, which a CPU server should not pull in). The answer is tokenized as the
model would write it; the mask is computed before each of its tokens, as the server does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "languages": {"type": "array", "items": {"type": "string"}},
        "level": {"enum": ["junior", "senior", "staff"]},
        "remote": {"type": "boolean"},
    },
    "required": ["name", "age", "languages", "level", "remote"],
    "additionalProperties": False,
}
ANSWER = (
    '{"name": "Ada Lovelace", "age": 36, "languages": ["English", "French", "Analytical'
    ' Engine"], "level": "staff", "remote": false}'
)
DEFAULT_MODEL = Path.home() / ".cache/specmlx/models/qwen2.5-coder-1.5b-instruct-int4"


def llguidance_masks(path: Path, tokens: list[int], eos: int) -> tuple[float, list[float]]:
    import llguidance
    import llguidance.numpy

    tokenizer = llguidance.LLTokenizer((path / "tokenizer.json").read_text(), eos_token=eos)
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    compile_s = time.perf_counter() - start
    mask = llguidance.numpy.allocate_token_bitmask(1, tokenizer.vocab_size)
    times = []
    for token in tokens:
        t = time.perf_counter()
        llguidance.numpy.fill_next_token_bitmask(matcher, mask)
        times.append(time.perf_counter() - t)
        assert matcher.consume_token(token), matcher.get_error()
    return compile_s, times


def outlines_masks(path: Path, tokens: list[int], eos: int) -> tuple[float, list[float]]:
    import outlines_core

    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    decode = {c: b for b, c in byte_level().items()}
    vocabulary: dict[bytes, list[int]] = {}
    for text, token in raw.get_vocab().items():
        if token != eos:
            data = bytes(decode[c] for c in text) if all(c in decode for c in text) else None
            vocabulary.setdefault(data or text.encode(), []).append(token)
    start = time.perf_counter()
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
    index = outlines_core.Index(regex, outlines_core.Vocabulary(eos, vocabulary))
    compile_s = time.perf_counter() - start
    guide = outlines_core.Guide(index)
    mask = np.zeros((raw.get_vocab_size() + 31) // 32, np.int32)
    times = []
    for token in tokens:
        t = time.perf_counter()
        guide.write_mask_into(mask.ctypes.data, mask.size, 4)
        times.append(time.perf_counter() - t)
        guide.advance(token)
    return compile_s, times


def byte_level() -> dict[int, str]:
    """GPT-2's byte-level BPE alphabet: each byte's character in a token's text."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = list(kept), 0
    for b in range(256):
        if b not in kept:
            kept.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(kept, chars, strict=True)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    args = parser.parse_args(argv)
    raw = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    eos = raw.token_to_id("<|im_end|>")
    tokens = raw.encode(ANSWER, add_special_tokens=False).ids
    print(f"vocabulary {raw.get_vocab_size()}, answer {len(tokens)} tokens")
    for name, measure in (("llguidance", llguidance_masks), ("outlines-core", outlines_masks)):
        try:
            compile_s, times = measure(args.model, tokens, eos)
        except ImportError as e:
            print(f"{name}: not installed ({e})")
            continue
        ms = [t * 1e3 for t in times]
        print(
            f"{name}: compile {compile_s * 1e3:.1f} ms; mask per token median "
            f"{statistics.median(ms):.3f} ms, mean {statistics.mean(ms):.3f} ms, "
            f"max {max(ms):.3f} ms"
        )


if __name__ == "__main__":
    main()
