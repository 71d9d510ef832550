"""`specmlx head train` on a tiny target: training raises held-out acceptance, a resumed
run ends where an uninterrupted one does, the head it writes drafts for the target's
exact greedy text, the held-out slice is never trained on, and bad input is one line."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import specmlx
from specmlx.cli import head as head_cli
from specmlx.cli import main
from specmlx.engine import Session, generate
from specmlx.heads import corpus, train
from specmlx.heads.store import load_head
from specmlx.tiny import build_tiny_model

WORDS = ["stack", "push", "pop", "items", "fibonacci", "range", "return", "self"]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("head-train") / "target", seed=0)


@pytest.fixture(scope="module")
def target(target_dir):
    return specmlx.load(target_dir, lazy=False)


@pytest.fixture(scope="module")
def code_folder(tmp_path_factory) -> Path:
    """40 small files of two-line functions over 8 words: every pattern of a held-out file
    recurs in the training files."""
    folder = tmp_path_factory.mktemp("code")
    rng = np.random.default_rng(0)
    for k in range(40):
        pairs = [rng.choice(WORDS, 2) for _ in range(12)]
        text = "".join(f"def {a}_{b}(self, n):\n    return self.{a}.{b}(n)\n" for a, b in pairs)
        (folder / f"doc{k:02d}.py").write_text(text)
    (folder / "blob.bin").write_bytes(bytes(range(256)) * 4)  # skipped: binary
    return folder


def test_training_raises_held_out_alpha_and_the_head_decodes_greedy_text(
    target_dir, target, code_folder, tmp_path, capsys
):
    out = tmp_path / "head"
    args = ["--data", str(code_folder), "-o", str(out), "--steps", "40", "--seq-len", "64"]
    args += ["--batch", "8", "--lr", "3e-3", "--max-tokens", "20000", "--held-out", "0.1"]
    main(["head", "train", str(target_dir), *args])

    trained = json.loads((out / "config.json").read_text())["trained"]
    untrained = trained["alpha_curve"][0]  # step 0: the randomly initialised head
    alpha = trained["held_out_alpha"]
    # A random head's argmax matches the target's greedy token about once in its ~300
    # tokens. The tiny random target's greedy token is set mostly by the last few tokens,
    # and every pattern of the held-out files recurs in the training files, so a head that
    # learns (feature at i, token i + 1) -> the target's next feature drafts most of the
    # held-out positions right: measured 0.57 at position 1 after 40 steps; 0.4 leaves room
    # for other BLAS builds' rounding.
    assert untrained[0] == 0 and untrained[1] < 0.05
    assert alpha["1"] >= 0.4 and alpha["1"] >= untrained[1] + 0.35, trained
    assert alpha["2"] >= 0.3, trained  # the fed-back feature holds up at position 2
    assert trained["steps"] == 40 and trained["stopped_by"] == "steps"
    assert trained["data"]["sources"] == "40 text files (1 binary or empty skipped)"
    assert trained["tokens"]["train"] > 9 * trained["tokens"]["held_out"] > 0
    assert trained["settings"]["seq_len"] == 64 and trained["loss_curve"][-1][0] == 40
    assert trained["loss_curve"][-1][1] < trained["loss_curve"][0][1]
    assert trained["alpha_curve"][-1] == [40, alpha["1"], alpha["2"]]
    curve = (out / "training_curve.csv").read_text().splitlines()
    assert curve[:2] == ["step,loss,alpha_1,alpha_2", f"0,,{untrained[1]:.4f},{untrained[2]:.4f}"]
    assert curve[-1].startswith("40,") and len(curve) == 42
    assert not corpus.work_dir(out).exists()  # the features go once the head is written
    assert "greedy α, held out" in capsys.readouterr().out

    head = load_head(out, target)
    prompt = "def push_items(self, n):\n"
    plain = generate(target, prompt, max_tokens=48).run()
    session = Session(target, head=head)
    drafted = generate(
        target, prompt, max_tokens=48, session=session, draft_mode="head", num_draft=3
    ).run()
    assert drafted.tokens == plain.tokens
    assert drafted.stats.drafted > 0 and drafted.stats.accepted > 0


def small(**changes) -> train.Settings:
    settings = dict(steps=8, seq_len=32, batch=4, lr=3e-3, max_tokens=3000, held_out=0.1)
    return train.Settings(**{**settings, "checkpoint_every": 3, **changes})


def test_an_interrupted_and_resumed_run_ends_with_the_uninterrupted_weights(
    target, code_folder, tmp_path
):
    sources = corpus.find_sources([str(code_folder)])
    whole = train.run(target, sources, tmp_path / "whole", small())

    class Stop(Exception):
        pass

    def stop_caching(stage: str, done: int, total: int, **_) -> None:
        if stage == "caching" and done == 2:
            raise Stop  # as a Ctrl-C while the features are cached

    out = tmp_path / "resumed"
    with pytest.raises(Stop):
        train.run(target, sources, out, small(), report=corpus.Report(progress=stop_caching))
    assert json.loads((corpus.work_dir(out) / corpus.CACHED).read_text()) == {"done": 2}
    # a Ctrl-C while training: the step ends, its checkpoint is saved, no head is written
    stopped = train.run(target, sources, out, small(), stop=lambda step: step == 4)
    assert (stopped.outcome.stopped, stopped.outcome.step) == ("interrupted", 4)
    assert not out.exists() and (corpus.work_dir(out) / train.CHECKPOINT).is_file()
    notes = []
    resumed = train.run(target, sources, out, small(), report=corpus.Report(note=notes.append))
    assert notes == [f"resuming from {corpus.work_dir(out)}"]
    assert resumed.outcome.step == 8

    a, b = mx.load(str(whole.out / "head.safetensors")), mx.load(str(out / "head.safetensors"))
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)
    assert resumed.trained["loss_curve"] == whole.trained["loss_curve"]
    assert resumed.trained["held_out_alpha"] == whole.trained["held_out_alpha"]


def test_changed_settings_start_over_and_no_resume_forgets(target, code_folder, tmp_path):
    sources = corpus.find_sources([str(code_folder)])
    out = tmp_path / "head"
    train.run(target, sources, out, small(), stop=lambda step: step == 2)
    notes = []
    report = corpus.Report(note=notes.append)
    train.run(target, sources, out, small(lr=1e-3), report=report, stop=lambda step: step == 1)
    assert notes == ["training settings changed: training starts over on the cached features"]
    notes.clear()
    train.run(target, sources, out, small(seq_len=16), report=report, stop=lambda s: s == 1)
    assert notes == [
        f"the target, data or settings changed: {corpus.work_dir(out)} started anew",
        "the data holds more than 3,000 tokens: only the first 3,000 are used (--max-tokens)",
    ]
    with pytest.raises(specmlx.SpecmlxError, match="nothing to resume"):
        train.run(target, sources, out, small(), resume=True)


def test_the_held_out_slice_is_disjoint_from_training_and_independent_of_order():
    rng = np.random.default_rng(1)
    docs = [list(rng.integers(0, 300, int(rng.integers(20, 200)))) for _ in range(30)]
    trained, held = corpus.split(docs, 0.1)
    key = lambda ds: sorted(corpus.doc_hash(d) for d in ds)  # noqa: E731
    assert not set(key(trained)) & set(key(held)) and key(trained + held) == key(docs)
    total = sum(map(len, docs))
    assert 0 < sum(map(len, held)) <= round(0.1 * total)
    shuffled = [docs[i] for i in rng.permutation(len(docs))]
    assert [key(part) for part in corpus.split(shuffled, 0.1)] == [key(trained), key(held)]

    # one document: its end is held out, the rest trains
    (start,), (end,) = corpus.split([list(range(100))], 0.1)
    assert start == list(range(90)) and end == list(range(90, 100))

    # the sequences keep the two slices apart: training rows first, then held-out ones
    tokens, lengths = corpus.sequences(held, 32)
    rows = np.concatenate([row[:n] for row, n in zip(tokens, lengths, strict=True)])
    assert rows.tolist() == sum(held, []) and (lengths[:-1] == 32).all()


def test_the_output_and_its_work_dir_are_not_data(tmp_path):
    (tmp_path / "notes.txt").write_text("some text")
    for made in ("head", "head.partial"):
        (tmp_path / made).mkdir()
        (tmp_path / made / "answers.jsonl").write_text('{"key": "k", "tokens": [1, 2]}\n')
    sources = corpus.find_sources([str(tmp_path)], tmp_path / "head")
    assert sources.items == [("text", tmp_path / "notes.txt")]


def test_prompts_are_answered_by_the_target_itself(target, tmp_path):
    prompts = tmp_path / "questions.jsonl"
    rows = [{"turns": ["Write a stack.", "Now a queue."]}, {"prompt": "def fibonacci(n):"}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sources = corpus.find_sources([str(prompts)])
    assert (sources.prompts, sources.files) == (2, 0)
    docs = corpus.collect(target, sources, 100_000, tmp_path, corpus.Report())

    assert docs == [conversation(target, row.get("turns", [row.get("prompt")])) for row in rows]
    # answered once: a second collection reads the answers kept in the work dir
    kept = (tmp_path / corpus.ANSWERS).read_text().splitlines()
    assert len(kept) == 2
    assert corpus.collect(target, sources, 100_000, tmp_path, corpus.Report()) == docs


def conversation(target, turns: list[str]) -> list[int]:
    """The last turn's prompt (earlier turns and greedy replies in it), its greedy reply
    and the EOS that ended it, if one did."""
    messages = []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        ids = target.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        reply = generate(target, ids, max_tokens=corpus.ANSWER_TOKENS).run()
        messages.append({"role": "assistant", "content": reply.text})
    ended = reply.stats.finish_reason == "eos"
    return ids + reply.tokens + ([min(target.tokenizer.eos_token_ids)] if ended else [])


def cli_error(args: list[str], capsys) -> str:
    """The one line `specmlx head train ARGS` says on stderr, having exited 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(["head", "train", *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: ") and "Traceback" not in err, err
    return err.strip()


def test_bad_input_is_one_line(target_dir, code_folder, tmp_path, capsys):
    out = str(tmp_path / "head")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "zeros.bin").write_bytes(b"\0" * 100)
    said = cli_error([str(target_dir), "--data", str(empty), "-o", out], capsys)
    assert said == (
        f"error: no text found in --data {empty}: 1 file, none of them text; give text or "
        "code files, folders of them, or a JSONL of prompts"
    )
    missing = tmp_path / "nowhere" / "*.py"
    said = cli_error([str(target_dir), "--data", str(missing), "-o", out], capsys)
    assert said == f"error: --data {missing} matches no file"
    said = cli_error([str(target_dir), "-o", out], capsys)
    assert said.startswith("error: no --data given")

    (tmp_path / "file").write_text("not a directory")
    under = tmp_path / "file" / "head"
    said = cli_error([str(target_dir), "--data", str(code_folder), "-o", str(under)], capsys)
    assert said == (
        f"error: cannot write {under}: {tmp_path / 'file'} is a file, not a directory; "
        "pick an OUT that is not under a file"
    )
    zero = [str(target_dir), "--data", str(code_folder), "-o", out, "--steps", "0"]
    said = cli_error(zero, capsys)
    assert said == "error: --steps must be at least 1, got 0"

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"turns": "not a list"}\n')
    said = cli_error([str(target_dir), "--data", str(bad), "-o", out], capsys)
    assert said == f'error: {bad} line 2: expected {{"prompt": "..."}} or {{"turns": ["...", ...]}}'
    assert not (tmp_path / "head").exists() and not corpus.work_dir(tmp_path / "head").exists()


def test_the_cli_defaults_are_the_settings_defaults():
    flags = inspect.signature(head_cli.train).parameters
    defaults = train.Settings()
    for name in ("steps", "minutes", "seq_len", "batch", "lr", "held_out", "max_tokens", "seed"):
        assert flags[name].default.default == getattr(defaults, name), name
