"""logit_bias, presence and frequency penalties (specmlx/processors.py) and logprobs: the
target's processed logits decide every token, so speculation keeps the output the
processed target's (greedy equal, the distribution at T = 1 by chi-square), whatever
the drafter (a draft model's chains and trees, a head) and whatever the drafts' q."""

from __future__ import annotations

from itertools import islice

import mlx.core as mx
import numpy as np
import pytest
from stats_util import ALPHA, chi_square_pvalue

import specmlx
from specmlx.errors import SpecmlxError
from specmlx.sampling import SamplingParams, probabilities
from specmlx.tiny import build_tiny_model

PROMPT = "def fibonacci(n):\n    if n < 2:"
N = 40
SETTINGS = {
    "bias": dict(logit_bias={5: 8.0, 17: -100.0}),
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=2.0),
    "all": dict(logit_bias={42: 4.0}, presence_penalty=0.5, frequency_penalty=0.7),
}


@pytest.fixture(scope="module")
def pair(tiny_pair):
    target, draft = tiny_pair("qwen2")
    return specmlx.load(target), specmlx.load(draft)


@pytest.mark.parametrize("name", SETTINGS)
@pytest.mark.parametrize("drafting", [dict(num_draft=3), dict(num_draft=3, tree=5)])
def test_speculation_under_a_processor_decodes_the_processed_targets_greedy_text(
    pair, name, drafting
):
    target, draft = pair
    alone = specmlx.generate(target, PROMPT, max_tokens=N, num_draft=0, **SETTINGS[name]).run()
    plain = specmlx.generate(target, PROMPT, max_tokens=N, num_draft=0).run()
    gen = specmlx.generate(target, PROMPT, draft, max_tokens=N, **drafting, **SETTINGS[name])
    assert gen.run().tokens == alone.tokens != plain.tokens  # it changed the text
    assert gen.stats.accepted > 0


def test_a_bias_of_100_makes_a_token_the_only_choice(pair):
    target, draft = pair
    gen = specmlx.generate(target, PROMPT, draft, max_tokens=8, logit_bias={9: 100.0}).run()
    assert gen.tokens == [9] * 8


def test_logprobs_are_the_targets_own_log_softmax_at_each_emitted_token(pair):
    target, draft = pair
    steps = list(specmlx.generate(target, PROMPT, draft, max_tokens=12, num_draft=3, logprobs=3))
    assert any(s.from_draft for s in steps) and not all(s.from_draft for s in steps)
    ids = target.tokenizer.encode(PROMPT)
    logits = target.module(mx.array([ids + [s.token for s in steps]]))[0, :, : target.vocab_size]
    logits = logits.astype(mx.float32)
    expected = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    for i, step in enumerate(steps):
        row = expected[len(ids) - 1 + i]
        assert step.logprob == pytest.approx(row[step.token].item(), abs=1e-4)
        best = np.argsort(-np.array(row))[:3].tolist()
        assert [t for t, _ in step.top_logprobs] == best


@pytest.mark.parametrize(
    "bad, said",
    [
        (dict(logit_bias={10**6: 1.0}), "logit_bias keys"),
        (dict(logit_bias={5: 101.0}), "logit_bias values"),
        (dict(logit_bias={5: float("nan")}), "logit_bias values"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(logprobs=21), "logprobs"),
    ],
)
def test_settings_out_of_bounds_are_refused_in_one_line(pair, bad, said):
    with pytest.raises(SpecmlxError, match=said) as error:
        specmlx.generate(pair[0], PROMPT, max_tokens=4, **bad)
    assert "\n" not in str(error.value)


S = 3000  # as tests/test_lossless.py: power > 0.99 against a total variation of ~0.1


def processed_joint(target, prompt: list[int], bias: dict, presence: float, frequency: float):
    """P(first = a, second = b) of the processed target at T = 1: the bias on both rows,
    the penalties on the second (the first token is the only one generated before it)."""
    v = target.vocab_size
    add = np.zeros(v, np.float32)
    for t, value in bias.items():
        add[t] = value
    params = SamplingParams(temperature=1.0)
    first = np.array(target.module(mx.array([prompt]))[0, -1, :v]) + add
    p1 = np.array(probabilities(mx.array(first[None]), params))[0]
    batch = np.concatenate([np.broadcast_to(prompt, (v, len(prompt))), np.arange(v)[:, None]], 1)
    second = np.array(target.module(mx.array(batch))[:, -1, :v]) + add
    second[np.arange(v), np.arange(v)] -= presence + frequency  # token a, generated once
    p2 = np.array(probabilities(mx.array(second), params))
    return p1[:, None] * p2


def test_a_processed_distribution_is_kept_by_speculation_at_t1(tmp_path):
    made = build_tiny_model(tmp_path / "t", seed=0, layers=1)
    target = specmlx.load(made)
    draft = build_tiny_model(tmp_path / "d", seed=1, layers=1, perturb_from=made, noise=0.1)
    draft = specmlx.load(draft)
    target.tokenizer.eos_token_ids = set()
    prompt, bias, presence, frequency = [5, 17, 42, 99], {7: 3.0, 8: -2.0}, 1.0, 1.5
    counts = np.zeros((target.vocab_size, target.vocab_size))
    session = specmlx.Session(target, draft)
    for seed in range(S):
        gen = specmlx.generate(
            target, prompt, draft, num_draft=2, max_tokens=2, seed=seed, session=session,
            temperature=1.0, sampling="rejection", logit_bias=bias,
            presence_penalty=presence, frequency_penalty=frequency,
        )  # fmt: skip
        a, b = (step.token for step in islice(gen, 2))
        gen.close()
        counts[a, b] += 1
    exact = processed_joint(target, prompt, bias, presence, frequency)
    assert chi_square_pvalue(counts, exact) > ALPHA
    # and the check tells the processed distribution from the target's own
    assert chi_square_pvalue(counts, processed_joint(target, prompt, {}, 0.0, 0.0)) < ALPHA
