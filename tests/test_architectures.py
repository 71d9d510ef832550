"""Every architecture specmlx accepts decodes exactly; every one it cannot roll back is
refused before decoding, in one line, and still runs exactly as the target alone.

The reference is mlx-lm's own `generate_step` (greedy) on the same tiny random model.
Prompts are longer than the tiny models' sliding windows (16 positions), so a rotating
cache has wrapped before the first draft.
"""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

import specmlx
from specmlx.tiny import ARCHITECTURES, build_tiny_model

# What each architecture's caches allow today: None (speculation is exact), or the cache
# kind that makes specmlx refuse to speculate on it.
EXPECTED = {
    "llama": None,
    "qwen2": None,
    "qwen3": None,
    "qwen3_moe": None,
    "phi3": None,
    "olmo2": None,
    "smollm3": None,
    "gemma2": None,  # mlx-lm gives every gemma2 layer a full KVCache
    "gemma3_text": "RotatingKVCache",
    "gpt_oss": "RotatingKVCache",
    "mamba2": "ArraysCache",
    "qwen3_next": "ArraysCache",
    "qwen3_5": "ArraysCache",
    "lfm2": "ArraysCache",
    "granitemoehybrid": "ArraysCache",
    "falcon_h1": "ArraysCache",  # a CacheList of an ArraysCache and a KVCache per layer
}
PROMPT = (
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\nThe quick brown fox jumps over the lazy dog."
)
N = 20


def test_every_tiny_architecture_is_classified():
    assert set(EXPECTED) == set(ARCHITECTURES)


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    root = tmp_path_factory.mktemp("architectures")
    dirs: dict[str, tuple] = {}

    def pair(arch: str):
        if arch not in dirs:
            target = build_tiny_model(root / f"{arch}-target", arch=arch, seed=0)
            draft = build_tiny_model(
                root / f"{arch}-draft", arch=arch, seed=1, perturb_from=target, noise=0.1
            )
            dirs[arch] = (target, draft, specmlx.load(target), specmlx.load(draft))
        return dirs[arch]

    return pair


def reference(target: specmlx.Model, ids: list[int], n: int = N) -> list[int]:
    steps = generate_step(mx.array(ids), target.module, max_tokens=n)
    return [int(token) for token, _ in steps]


@pytest.mark.parametrize("arch", list(EXPECTED))
def test_target_alone_equals_mlx_lm(arch, build):
    _, _, target, _ = build(arch)
    ids = target.tokenizer.encode(PROMPT)
    assert len(ids) > 16  # past the sliding window
    out = specmlx.generate(target, ids, max_tokens=N, num_draft=0).run().tokens
    assert out == reference(target, ids)


@pytest.mark.parametrize("arch", [a for a, kind in EXPECTED.items() if kind is None])
@pytest.mark.parametrize("gamma,mode", [(1, "model"), (3, "model"), (4, "lookup")])
def test_greedy_speculation_equals_mlx_lm(arch, gamma, mode, build):
    _, _, target, draft = build(arch)
    ids = target.tokenizer.encode(PROMPT)
    gen = specmlx.generate(
        target,
        ids,
        draft=draft if mode == "model" else None,
        max_tokens=N,
        num_draft=gamma,
        draft_mode=mode,
    ).run()
    assert gen.tokens == reference(target, ids)


@pytest.mark.parametrize("arch", [a for a, kind in EXPECTED.items() if kind is not None])
@pytest.mark.parametrize("mode", ["model", "lookup", "auto"])
def test_speculation_without_exact_rollback_is_refused(arch, mode, build):
    _, _, target, draft = build(arch)
    with pytest.raises(specmlx.SpecmlxError) as refused:
        specmlx.generate(target, PROMPT, draft=draft, num_draft="auto", draft_mode=mode)
    message = str(refused.value)
    assert "\n" not in message
    assert arch in message and EXPECTED[arch] in message and "--no-draft" in message


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3_next", "mamba2"])
def test_session_reuse_without_exact_rollback_stays_exact(arch, build):
    """A second call whose prompt does not extend the first must not reuse a window or
    a recurrent state that holds the first call's tokens."""
    _, _, target, _ = build(arch)
    session = specmlx.Session(target)
    first = target.tokenizer.encode(PROMPT)
    second = first[:-5] + target.tokenizer.encode(" Accept with probability")
    specmlx.generate(target, first, max_tokens=6, num_draft=0, session=session).run()
    out = specmlx.generate(target, second, max_tokens=N, num_draft=0, session=session).run()
    assert out.tokens == reference(target, second)
    extended = second + out.tokens
    again = specmlx.generate(target, extended, max_tokens=8, num_draft=0, session=session)
    assert again.run().tokens == reference(target, extended, 8)
    assert again.stats.prefill_tokens == 0  # the reply was in the caches already


def test_cli_refuses_in_one_line_before_decoding(build, tmp_path):
    target_dir, draft_dir, _, _ = build("gemma3_text")
    env = {**os.environ, "SPECMLX_HOME": str(tmp_path)}
    for command in ("generate", "chat"):
        extra = ["-p", "hello"] if command == "generate" else []
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "specmlx",
                command,
                "-m",
                str(target_dir),
                "-d",
                str(draft_dir),
                *extra,
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            input="",
        )
        assert run.returncode == 2, run.stderr
        errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "gemma3_text" in errors[0] and "--no-draft" in errors[0]
        assert "Traceback" not in run.stderr and run.stdout == ""
