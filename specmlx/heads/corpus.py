"""The data a head trains on (steps 1 and 2 of specmlx.heads.train): documents of the
target's tokens (text files, and JSONL prompts the target answers itself), a held-out
slice of them by document, both cut into sequences, and the target's features over every
sequence, all kept in the run's work dir (HEAD.partial/) so that a run resumes.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..caches import make_cache, prefill
from ..errors import SpecmlxError
from ..lm_head import body, head_layer
from ..loading import Model
from .feature import text_args

ANSWER_TOKENS = 256  # a reply's bound, per turn of a JSONL prompt
CACHE_CAP_BYTES = 4 << 30  # the feature cache's bound on disk: 2 bytes x hidden a token
SNIFF_BYTES = 8192  # read of a file to tell text from binary
BYTES_PER_TOKEN = 16  # of a text file read for the tokens still wanted: ample for any BPE

ANSWERS = "answers.jsonl"
SEQUENCES = "sequences.npz"
FEATURES = "features.f16"
GREEDY = "greedy.i32"
CACHED = "cached.json"


def quiet(*_args, **_kwargs) -> None:
    pass


@dataclass
class Report:
    """What a run says as it goes; the CLI draws it, the defaults say nothing.
    `progress(stage, done, total, **fields)`: stage is "answering" (prompts), "caching"
    (sequences) or "training" (steps; fields loss, alpha: the latest held-out estimate
    per draft position, alpha_step: the step it was taken at)."""

    note: Callable[[str], None] = quiet
    progress: Callable[..., None] = quiet


# -- the documents and their sequences ----------------------------------------------------


@dataclass
class Sources:
    """What --data names: ("text", path) and ("prompt", key, turns) in the order given."""

    items: list[tuple] = field(default_factory=list)
    files: int = 0
    prompts: int = 0
    skipped: int = 0  # binary or empty files
    signature: list = field(default_factory=list)  # (path, size, mtime) of every file read

    def describe(self) -> str:
        parts = [f"{self.files} text file" + ("s" * (self.files != 1))] if self.files else []
        if self.prompts:
            parts.append(f"{self.prompts} prompt" + "s" * (self.prompts != 1))
        skipped = f" ({self.skipped} binary or empty skipped)" if self.skipped else ""
        return " and ".join(parts) + skipped


def find_sources(data: list[str], out: Path | None = None) -> Sources:
    """Every file --data names: folders walked (hidden ones skipped), globs expanded,
    binary and empty files skipped; a .jsonl whose first line holds "prompt" or "turns"
    is prompts. Refused in one line where nothing usable is found. Nothing under `out`
    or its work dir is data: a folder holding them would change as the run writes."""
    if not data:
        raise SpecmlxError("no --data given: name text files, folders, globs or a JSONL of prompts")
    sources, seen = Sources(), set()
    own = [] if out is None else [out.resolve(), work_dir(out).resolve()]
    for spec in data:
        for path in expand(spec):
            resolved = path.resolve()
            if resolved in seen or any(resolved.is_relative_to(d) for d in own):
                continue
            seen.add(resolved)
            kind = file_kind(path)
            if kind is None:
                sources.skipped += 1
                continue
            stat = path.stat()
            sources.signature.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
            if kind == "prompts":
                for key, turns in read_prompts(path):
                    sources.items.append(("prompt", key, turns))
                    sources.prompts += 1
            else:
                sources.items.append(("text", path))
                sources.files += 1
    if not sources.items:
        named = ", ".join(data)
        raise SpecmlxError(
            f"no text found in --data {named}: {sources.skipped} file"
            f"{'s' * (sources.skipped != 1)}, none of them text; give text or code files, "
            "folders of them, or a JSONL of prompts"
        )
    return sources


def expand(spec: str) -> list[Path]:
    path = Path(spec).expanduser()
    if path.is_dir():
        return walk(path)
    if path.is_file():
        return [path]
    if glob.has_magic(spec):
        matches = sorted(glob.glob(os.path.expanduser(spec), recursive=True))
        found = [f for m in matches for f in (walk(Path(m)) if Path(m).is_dir() else [Path(m)])]
        if not found:
            raise SpecmlxError(f"--data {spec} matches no file")
        return found
    raise SpecmlxError(f"--data {spec}: no such file or folder")


def walk(folder: Path) -> list[Path]:
    """The files under folder, sorted, hidden folders and files (.git, .venv) left out."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [Path(root) / f for f in sorted(files) if not f.startswith(".")]
    return found


def file_kind(path: Path) -> str | None:
    """ "prompts", "text", or None (binary, empty or unreadable)."""
    try:
        with open(path, "rb") as f:
            head = f.read(SNIFF_BYTES)
    except OSError:
        return None
    if not head.strip() or b"\0" in head:
        return None
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return None
    if path.suffix == ".jsonl":
        with open(path, "rb") as f:
            first = f.readline()
        try:
            row = json.loads(first)
        except ValueError:
            return "text"
        if isinstance(row, dict) and ("prompt" in row or "turns" in row):
            return "prompts"
    return "text"


def read_prompts(path: Path) -> list[tuple[str, list[str]]]:
    """(key, turns) of each line: {"prompt": TEXT} or {"turns": [TEXT, ...]} (Spec-Bench's
    question.jsonl); a line of neither is refused by its number."""
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        turns = None
        if isinstance(row, dict):
            turns = [row["prompt"]] if "prompt" in row else row.get("turns")
        if not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
            raise SpecmlxError(
                f'{path} line {n}: expected {{"prompt": "..."}} or {{"turns": ["...", ...]}}'
            )
        out.append((f"{path.resolve()}:{n}", turns))
    return out


def token_budget(max_tokens: int, hidden: int) -> tuple[int, str]:
    """Tokens to collect at most, and what bounds them."""
    cap = CACHE_CAP_BYTES // (2 * hidden)
    if max_tokens <= cap:
        return max_tokens, "--max-tokens"
    return cap, f"the feature cache's cap of {CACHE_CAP_BYTES >> 30} GiB"


def collect(
    target: Model, sources: Sources, max_tokens: int, work: Path, report: Report
) -> list[list[int]]:
    """The documents, as token lists, up to the token budget; prompts' answers are kept
    in the work dir as they come, so an interrupted run does not answer them again."""
    budget, bound = token_budget(max_tokens, text_args(target)[1].hidden_size)
    answers = read_answers(work / ANSWERS)
    docs, total, truncated = [], 0, False
    prompts = [item for item in sources.items if item[0] == "prompt"]
    answered = 0
    for item in sources.items:
        if total >= budget:
            truncated = True
            break
        if item[0] == "text":
            tokens, cut = text_tokens(target, item[1], budget - total)
        else:
            key, turns = item[1], item[2]
            if key not in answers:
                answers[key] = answer(target, turns)
                with open(work / ANSWERS, "a") as f:
                    f.write(json.dumps({"key": key, "tokens": answers[key]}) + "\n")
            answered += 1
            report.progress("answering", answered, len(prompts))
            tokens, cut = answers[key], False
        truncated |= cut or len(tokens) > budget - total
        tokens = tokens[: budget - total]
        if len(tokens) >= 2:
            docs.append(tokens)
            total += len(tokens)
    if truncated:
        report.note(
            f"the data holds more than {budget:,} tokens: only the first {budget:,} are used "
            f"({bound})"
        )
    return docs


def read_answers(path: Path) -> dict[str, list[int]]:
    answers = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut by an interruption: answered again
            answers[row["key"]] = row["tokens"]
    return answers


def text_tokens(target: Model, path: Path, wanted: int) -> tuple[list[int], bool]:
    """The file's tokens (no special ones), reading only as much as `wanted` tokens can
    take; whether it was cut."""
    limit = wanted * BYTES_PER_TOKEN
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    cut = len(data) > limit
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(data[:limit], final=not cut)
    except UnicodeDecodeError:  # text at its start, not further on: read what decodes
        text = data[:limit].decode("utf-8", errors="ignore")
    # transformers warns of a text longer than the model's context: it is cut into
    # sequences, so that warning would only be noise
    quiet = logging.getLogger("transformers")
    level, quiet.level = quiet.level, logging.ERROR
    try:
        return target.tokenizer.encode(text, add_special_tokens=False), cut
    finally:
        quiet.setLevel(level)


def answer(target: Model, turns: list[str]) -> list[int]:
    """The conversation's tokens with the target's own greedy replies: the last turn's
    prompt (earlier turns and replies in it) and its reply, ended by EOS where the
    target ended it."""
    from ..engine import Session, encode_prompt, generate

    tokenizer = target.tokenizer
    session = Session(target)
    messages, text, ids, reply = [], "", [], []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        if getattr(tokenizer, "has_chat_template", False):
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        else:
            text += turn + "\n\n"
            ids = encode_prompt(target, text)
        gen = generate(target, ids, max_tokens=ANSWER_TOKENS, session=session).run()
        eos = sorted(tokenizer.eos_token_ids)
        reply = gen.tokens + (eos[:1] if gen.stats.finish_reason == "eos" else [])
        messages.append({"role": "assistant", "content": gen.text})
        text += gen.text + "\n\n"
    return list(ids) + reply


def doc_hash(tokens: list[int]) -> str:
    return hashlib.sha256(np.asarray(tokens, np.int32).tobytes()).hexdigest()


def split(docs: list[list[int]], fraction: float) -> tuple[list[list[int]], list[list[int]]]:
    """(train, held-out): whole documents, taken in the order of a hash of their tokens
    (so not by where they were listed) while they fit in `fraction` of the tokens; where
    none fits (one document, or few large ones), the first one's end is held out instead."""
    total = sum(len(d) for d in docs)
    want = max(2, round(fraction * total))
    held, train, room = [], [], want
    for doc in sorted(docs, key=doc_hash):
        if len(doc) <= room and len(docs) - len(held) > 1:
            held.append(doc)
            room -= len(doc)
        else:
            train.append(doc)
    if not held:
        first = train.pop(0)
        train.insert(0, first[:-want])
        held.append(first[-want:])
    return train, held


def sequences(docs: list[list[int]], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """The documents end to end, cut into (n, seq_len) tokens, the last zero-padded;
    and each sequence's length."""
    stream = np.concatenate([np.asarray(d, np.int32) for d in docs]) if docs else np.zeros(0)
    n = -(-len(stream) // seq_len)
    tokens = np.zeros((n, seq_len), np.int32)
    tokens.reshape(-1)[: len(stream)] = stream
    lengths = np.full(n, seq_len, np.int32)
    if n:
        lengths[-1] = len(stream) - (n - 1) * seq_len
    keep = lengths >= 2  # a lone token has no next one to learn
    return tokens[keep], lengths[keep]


@dataclass
class Data:
    tokens: np.ndarray  # (n, L) int32: the training sequences, then the held-out ones
    lengths: np.ndarray  # (n,)
    n_train: int
    description: dict

    @property
    def n_held(self) -> int:
        return len(self.lengths) - self.n_train

    @property
    def tokens_in(self) -> dict[str, int]:
        train = int(self.lengths[: self.n_train].sum())
        return {"train": train, "held_out": int(self.lengths.sum()) - train}


def prepare(
    target: Model,
    sources: Sources,
    work: Path,
    seq_len: int,
    held_out: float,
    max_tokens: int,
    report: Report,
) -> Data:
    """The sequences of `seq_len` tokens, `held_out` of the tokens held out (by
    document), from at most `max_tokens` tokens; read from the work dir where an earlier
    run made them."""
    if (work / SEQUENCES).is_file():
        with np.load(work / SEQUENCES) as saved:
            description = json.loads(str(saved["description"]))
            return Data(saved["tokens"], saved["lengths"], int(saved["n_train"]), description)
    docs = collect(target, sources, max_tokens, work, report)
    train, held = split(docs, held_out)
    t_tokens, t_lengths = sequences(train, seq_len)
    h_tokens, h_lengths = sequences(held, seq_len)
    if not len(t_lengths) or h_lengths.sum() < 3:
        total = sum(len(d) for d in docs)
        raise SpecmlxError(
            f"too little data: {total} tokens from {sources.describe()}; give more text "
            "(at least a few sequences of --seq-len tokens)"
        )
    description = {
        "sources": sources.describe(),
        "documents": {"train": len(train), "held_out": len(held)},
    }
    data = Data(
        np.concatenate([t_tokens, h_tokens]),
        np.concatenate([t_lengths, h_lengths]),
        len(t_lengths),
        description,
    )
    tmp = work / f"{SEQUENCES}.tmp"
    with open(tmp, "wb") as f:
        np.savez(
            f,
            tokens=data.tokens,
            lengths=data.lengths,
            n_train=data.n_train,
            description=json.dumps(description),
        )
    os.replace(tmp, work / SEQUENCES)
    return data


# -- the target's features over them -------------------------------------------------------


def cache_features(target: Model, data: Data, work: Path, report: Report) -> tuple:
    """(features (n, L, D) float16, held-out greedy tokens (n_held, L) int32), memory-
    mapped from the work dir; the sequences not cached yet are run through the target
    (one pass each, from an empty cache), their progress kept after each."""
    n, length = data.tokens.shape
    hidden = text_args(target)[1].hidden_size
    done = json.loads((work / CACHED).read_text())["done"] if (work / CACHED).is_file() else 0
    mode = "r+" if done else "w+"
    features = np.memmap(work / FEATURES, np.float16, mode, shape=(n, length, hidden))
    greedy = np.memmap(work / GREEDY, np.int32, mode, shape=(data.n_held, length))
    layer, tied = head_layer(target)

    def forward(x: mx.array, cache: list) -> mx.array:
        return body(target, x, cache)[1]

    for k in range(done, n):
        report.progress("caching", k, n)
        size = int(data.lengths[k])
        chunks = prefill(
            target, make_cache(target.module), data.tokens[k, :size].tolist(), forward=forward
        )
        rows = mx.concatenate(chunks, axis=1)[0]
        features[k, :size] = np.array(rows.astype(mx.float16))
        if k >= data.n_train:  # the target's own next token, which acceptance is judged by
            logits = layer.as_linear(rows) if tied else layer(rows)
            greedy[k - data.n_train, :size] = np.array(
                mx.argmax(logits[:, : target.vocab_size], axis=-1)
            )
            greedy.flush()
        features.flush()
        write_json(work / CACHED, {"done": k + 1})
    report.progress("caching", n, n)
    return features, greedy


def work_dir(out: Path) -> Path:
    """Where a run for head directory `out` keeps what it has done, until it is done."""
    return out.parent / f"{out.name}.partial"


def write_json(path: Path, value) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)
