"""Speculation is exact on every architecture specmlx accepts, and a cache it cannot roll
back is refused before decoding, in one line.

The reference is mlx-lm's own `generate_step` (greedy) on the same tiny random model.
Prompts are longer than the tiny models' sliding windows (16 positions), so a rotating
cache has wrapped before the first draft. The drafts are the target with 5% noise: most
drafts pass, enough are rejected that every round kind (all accepted, some, none) runs.
"""

from __future__ import annotations

from itertools import islice

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import _BaseCache
from stats_util import ALPHA, chi_square_pvalue, exact_joint

import specmlx
from specmlx.caches import layers
from specmlx.convert.quantize import SUPPORTED_ARCHS, quantize
from specmlx.cpu import native, quantized
from specmlx.exactness import RECURRENT_EXACT
from specmlx.tiny import ARCHITECTURES

# How each architecture's caches are rolled back: by trimming (every layer keeps every
# position), or by rewinding a checkpoint (sliding windows, recurrent state).
ROLLBACK = {
    "llama": "trim",
    "qwen2": "trim",
    "qwen3": "trim",
    "qwen3_moe": "trim",
    "phi3": "trim",
    "olmo2": "trim",
    "smollm3": "trim",
    "gemma2": "trim",  # mlx-lm gives every gemma2 layer a full KVCache
    "gemma3_text": "rewind",  # RotatingKVCache: sliding windows beside full attention
    "gpt_oss": "rewind",  # RotatingKVCache
    "mamba2": "rewind",  # ArraysCache: recurrent and conv state
    "qwen3_next": "rewind",  # ArraysCache (gated delta) beside KVCache
    "qwen3_5": "rewind",
    "lfm2": "rewind",  # ArraysCache (short conv) beside KVCache
    "granitemoehybrid": "rewind",
    "falcon_h1": "rewind",  # a CacheList of an ArraysCache and a KVCache per layer
}
PROMPT = (
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\nThe quick brown fox jumps over the lazy dog."
)
N = 32
# Tiny random lfm2 emits one token over and over whatever its draft: every draft passes.
NOTHING_REJECTED = {"lfm2"}


class FutureCache(_BaseCache):
    """A cache kind specmlx has never seen: it must refuse to speculate over it."""


def test_every_tiny_architecture_is_classified():
    assert set(ROLLBACK) == set(ARCHITECTURES)


@pytest.fixture(scope="module")
def build(tiny_pair):
    built: dict[str, tuple] = {}

    def pair(arch: str):
        if arch not in built:
            target, draft = tiny_pair(arch)
            models = specmlx.load(target), specmlx.load(draft)
            for m in models:
                m.tokenizer.eos_token_ids = set()  # every run decodes N tokens
            built[arch] = (target, draft, *models)
        return built[arch]

    return pair


def reference(target: specmlx.Model, ids: list[int], n: int = N) -> list[int]:
    steps = generate_step(mx.array(ids), target.module, max_tokens=n)
    return [int(token) for token, _ in steps]


@pytest.mark.parametrize("arch", list(ROLLBACK))
def test_the_cache_kind_decides_trim_or_rewind(arch, build):
    _, _, target, _ = build(arch)
    caches = layers(target.module.make_cache()) if hasattr(target.module, "make_cache") else []
    kinds = {type(c).__name__ for c in caches} or {"KVCache"}
    assert (kinds <= {"KVCache"}) == (ROLLBACK[arch] == "trim")


@pytest.mark.parametrize("arch", list(ROLLBACK))
def test_target_alone_equals_mlx_lm(arch, build):
    _, _, target, _ = build(arch)
    ids = target.tokenizer.encode(PROMPT)
    assert len(ids) > 16  # past the sliding window
    out = specmlx.generate(target, ids, max_tokens=N, num_draft=0).run().tokens
    assert out == reference(target, ids)


@pytest.mark.parametrize("arch", list(ROLLBACK))
def test_greedy_speculation_equals_mlx_lm_at_every_gamma(arch, build):
    _, _, target, draft = build(arch)
    ids = target.tokenizer.encode(PROMPT)
    expected = reference(target, ids)
    drafted = accepted = rewinds = 0
    for gamma in (1, 2, 3, 4):
        gen = specmlx.generate(target, ids, draft=draft, max_tokens=N, num_draft=gamma).run()
        assert gen.tokens == expected, f"gamma {gamma}"
        drafted, accepted = drafted + gen.stats.drafted, accepted + gen.stats.accepted
        rewinds += gen.stats.rewinds
    assert 0 < accepted <= drafted
    if arch not in NOTHING_REJECTED:
        assert accepted < drafted  # some drafts were rolled back
        assert (rewinds > 0) == (ROLLBACK[arch] == "rewind")  # a re-run only where trims can't


@pytest.mark.parametrize("arch", [a for a in ROLLBACK if a in SUPPORTED_ARCHS])
def test_greedy_speculation_on_int4_and_int8_activations_equals_the_target_alone(
    arch, build, int8_activations, tmp_path
):
    # The tiny models above are float. Quantized by `specmlx quantize` (INT4 g32, what
    # the kernel takes at K = 64; the architectures it converts) they run on the native
    # kernel, which quantizes each row of x on its own: a verify pass over γ + 1 rows
    # gives each row what a one-row step gives it.
    target_dir, draft_dir, _, _ = build(arch)
    models = []
    for name, source in (("target", target_dir), ("draft", draft_dir)):
        quantize(source, tmp_path / name, group_size=32, dtype="float32")
        models.append(specmlx.load(tmp_path / name))
        models[-1].tokenizer.eos_token_ids = set()
    target, draft = models
    assert quantized.runs_int4(target.module)
    # Where a multi-token pass is not bit-exact, int8 x would decode near-ties apart.
    # Sliding windows are exact on the native attention op (specmlx.cpu.attention), and
    # the recurrent layers exactness.RECURRENT_EXACT names give a step's bits in a pass.
    exact = ROLLBACK[arch] == "trim" or arch in {"gemma3_text", "gpt_oss", *RECURRENT_EXACT}
    assert native.activations() == ("int8" if exact else "float32")
    assert exact or "not bit-exact" in native.describe()
    ids = target.tokenizer.encode(PROMPT)
    alone = specmlx.generate(target, ids, max_tokens=N, num_draft=0).run().tokens
    for gamma in (1, 3, "auto"):
        gen = specmlx.generate(target, ids, draft=draft, max_tokens=N, num_draft=gamma).run()
        assert gen.tokens == alone, f"gamma {gamma}"


@pytest.mark.parametrize("arch", list(ROLLBACK))
@pytest.mark.parametrize("mode", ["lookup", "auto"])
def test_greedy_lookup_and_auto_equal_mlx_lm(arch, mode, build):
    _, _, target, draft = build(arch)
    ids = target.tokenizer.encode(PROMPT)
    gamma = 4 if mode == "lookup" else "auto"
    gen = specmlx.generate(
        target, ids, draft=draft, max_tokens=N, num_draft=gamma, draft_mode=mode
    ).run()
    assert gen.tokens == reference(target, ids)


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3_next", "mamba2", "falcon_h1"])
def test_a_session_reused_across_calls_stays_exact(arch, build):
    """A second call whose prompt does not extend the first (a window or a recurrent
    state holding the first call's tokens must not be reused), then one that does (only
    its new token is prefilled)."""
    _, _, target, draft = build(arch)
    session = specmlx.Session(target, draft)
    first = target.tokenizer.encode(PROMPT)
    second = first[:-5] + target.tokenizer.encode(" Accept with probability")
    specmlx.generate(target, first, draft, max_tokens=6, num_draft=3, session=session).run()
    out = specmlx.generate(target, second, draft, max_tokens=N, num_draft=3, session=session)
    assert out.run().tokens == reference(target, second)
    extended = second + out.tokens
    again = specmlx.generate(target, extended, draft, max_tokens=8, num_draft=3, session=session)
    assert again.run().tokens == reference(target, extended, 8)
    assert again.stats.prefill_tokens == 0  # the reply was in the caches already


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3_next", "mamba2", "falcon_h1"])
def test_the_same_prompt_again_restores_its_caches_instead_of_prefilling(arch, build):
    """A retry (same prompt, any seed) on caches that cannot be trimmed back: the caches
    as they were at the end of the prompt come back, for both models, and the text
    is the target's again."""
    _, _, target, draft = build(arch)
    session = specmlx.Session(target, draft)
    ids = target.tokenizer.encode(PROMPT)
    for _ in range(2):
        gen = specmlx.generate(target, ids, draft, max_tokens=N, num_draft=3, session=session)
        assert gen.run().tokens == reference(target, ids)
    assert gen.stats.prefill_tokens == 0
    assert session.made["model"].prompt_snapshot.tokens == ids[:-1]


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3_next"])
def test_an_interrupted_pass_leaves_the_session_exact(arch, build, monkeypatch):
    """Chat's Ctrl-C: KeyboardInterrupt arrives in the middle of a target pass; the next
    call on the same Session decodes exactly."""
    _, _, target, draft = build(arch)
    session = specmlx.Session(target, draft)
    ids = target.tokenizer.encode(PROMPT)
    module_class = type(target.module)
    forward, calls = module_class.__call__, []

    def interrupting(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 4:  # the prefill, then the third round's verify
            raise KeyboardInterrupt
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(module_class, "__call__", interrupting)
    gen = specmlx.generate(target, ids, draft, max_tokens=N, num_draft=2, session=session)
    with pytest.raises(KeyboardInterrupt):
        gen.run()
    monkeypatch.setattr(module_class, "__call__", forward)
    again = specmlx.generate(target, ids, draft, max_tokens=N, num_draft=2, session=session)
    assert again.run().tokens == reference(target, ids)


def test_an_unknown_cache_kind_is_refused_in_one_line(build, monkeypatch):
    _, _, target, draft = build("qwen3")
    monkeypatch.setattr(target.module, "make_cache", lambda: [FutureCache()], raising=False)
    with pytest.raises(specmlx.SpecmlxError) as refused:
        specmlx.generate(target, PROMPT, draft=draft, num_draft=3)
    message = str(refused.value)
    assert "\n" not in message
    assert "qwen3" in message and "FutureCache" in message and "--no-draft" in message


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_the_cli_refuses_an_unknown_cache_kind_before_decoding(command, build, monkeypatch, capsys):
    from mlx_lm.models import qwen3

    from specmlx.cli import main

    target_dir, draft_dir, _, _ = build("qwen3")
    monkeypatch.setattr(qwen3.Model, "make_cache", lambda self: [FutureCache()], raising=False)
    monkeypatch.setattr("sys.stdin", open("/dev/null"))
    extra = ["-p", "hello"] if command == "generate" else []
    with pytest.raises(SystemExit) as exited:
        main([command, "-m", str(target_dir), "-d", str(draft_dir), *extra])
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "FutureCache" in errors[0] and "--no-draft" in errors[0]
    assert "Traceback" not in err and out == ""


# Sampled exactness where the rollback is a rewind: the first two tokens of generations
# with γ = 1 (a rejected first draft is rewound in both models before the second token
# is drafted and judged; only a rejection at the first draft lets a rewind reach the
# second token, whatever γ), S seeds, against the target's exact joint distribution, chi-square at
# ALPHA as in test_lossless.py (same power statement: 3,000 samples reject a sampler off
# by a total variation of ~0.1 on the main cells with probability > 0.99).
S = 3000


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3_next"])
def test_sampled_speculation_follows_the_target_distribution(arch, build):
    _, _, target, draft = build(arch)
    prompt = target.tokenizer.encode(PROMPT)[:20]  # past the window of 16
    counts = np.zeros((target.vocab_size, target.vocab_size))
    session = specmlx.Session(target, draft)
    drafted = accepted = 0
    for seed in range(S):
        gen = specmlx.generate(
            target,
            prompt,
            draft,
            max_tokens=4,
            num_draft=1,
            temperature=1.0,
            seed=seed,
            session=session,
        )
        a, b = (step.token for step in islice(gen, 2))
        gen.close()  # the rounds after the second token tell this test nothing
        counts[a, b] += 1
        drafted, accepted = drafted + gen.stats.drafted, accepted + gen.stats.accepted
    assert 0.1 < accepted / drafted < 0.9  # rejections were rewound, many times
    assert chi_square_pvalue(counts, exact_joint(target, {"temperature": 1.0}, prompt)) > ALPHA
