"""End to end through generate(): sampled output follows the target's exact distribution.

For each configuration we draw S = 3,000 two-token generations with distinct seeds
and compare the joint distribution of (first, second) token with the target's exact
joint distribution, enumerated on the tiny 300-token vocabulary (one batched forward
over every possible first token). Chi-square at significance 0.001 with cells of
expected count < 5 merged. A draft that is the target itself, a perturbed copy and an
unrelated model are each tried at T = 1.0 and at T = 0.7 with top-p 0.9, under modified
rejection sampling; coupled sampling (the default) with the perturbed draft and with
prompt lookup (trees of drafts: test_tree_lossless.py). The control tests show the
same check rejects a sampler, of either kind, that emits the draft's tokens unchecked.

Power: with 3,000 samples the test rejects at 0.001 a sampler off by a total
variation of ~0.1 on the main cells with probability > 0.99 (the control's deviation
is far larger). One-layer models and a shared Session keep 21,000 runs near a minute;
sharing the Session also checks that one call's sampling never leaks into the next.
"""

from itertools import islice

import mlx.core as mx
import numpy as np
import pytest
import stats_util
from stats_util import ALPHA, chi_square_pvalue

import specmlx
from specmlx import verify
from specmlx.tiny import build_tiny_model

S = 3000
PROMPT = [5, 17, 42, 99]
SETTINGS = {"T=1.0": dict(temperature=1.0), "T=0.7,top-p=0.9": dict(temperature=0.7, top_p=0.9)}


def exact_joint(target, settings, prompt=PROMPT) -> np.ndarray:
    return stats_util.exact_joint(target, settings, prompt)


def sampled_pairs(
    target, draft, settings, gamma=2, prompt=PROMPT, max_tokens=2, **kw
) -> np.ndarray:
    """Counts of the first two tokens over S seeded generations of up to `max_tokens`."""
    counts = np.zeros((target.vocab_size, target.vocab_size))
    session = specmlx.Session(target, draft)
    for seed in range(S):
        gen = specmlx.generate(
            target,
            prompt,
            draft=draft,
            num_draft=gamma,
            max_tokens=max_tokens,
            seed=seed,
            session=session,
            **settings,
            **kw,
        )
        a, b = (step.token for step in islice(gen, 2))
        gen.close()  # rounds after the second token tell the test nothing
        counts[a, b] += 1
    return counts


@pytest.fixture(scope="module")
def no_eos(tmp_path_factory):
    """One-layer qwen2 models (the sampler is what is tested; depth only costs time)."""
    root = tmp_path_factory.mktemp("lossless")
    target = build_tiny_model(root / "target", seed=0, layers=1)
    paths = {
        "target": target,
        "perturbed": build_tiny_model(
            root / "perturbed", seed=1, layers=1, perturb_from=target, noise=0.1
        ),
        "unrelated": build_tiny_model(root / "unrelated", seed=2, layers=1),
    }
    models = {name: specmlx.load(path) for name, path in paths.items()}
    for m in models.values():
        m.tokenizer.eos_token_ids = set()
    return models


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("draft", ["target", "perturbed", "unrelated"])
def test_first_two_tokens_follow_the_target_distribution(no_eos, draft, setting):
    target = no_eos["target"]
    counts = sampled_pairs(target, no_eos[draft], SETTINGS[setting], sampling="rejection")
    assert chi_square_pvalue(counts, exact_joint(target, SETTINGS[setting])) > ALPHA


@pytest.mark.parametrize("setting", SETTINGS)
def test_coupled_sampling_follows_the_target_distribution(no_eos, setting):
    target = no_eos["target"]
    counts = sampled_pairs(target, no_eos["perturbed"], SETTINGS[setting], sampling="coupled")
    assert chi_square_pvalue(counts, exact_joint(target, SETTINGS[setting])) > ALPHA


@pytest.mark.parametrize("sampling", ["rejection", "coupled"])
def test_prompt_lookup_drafts_keep_the_target_distribution(no_eos, sampling):
    # [5, 17] recurs, so lookup proposes [42, 5, ...] as point-mass drafts each round.
    target, settings, prompt = no_eos["target"], SETTINGS["T=1.0"], [5, 17, 42, 5, 17]
    counts = sampled_pairs(
        target, None, settings, prompt=prompt, draft_mode="lookup", sampling=sampling
    )
    assert chi_square_pvalue(counts, exact_joint(target, settings, prompt)) > ALPHA


def test_rounds_the_drafts_confidence_ends_early_keep_the_target_distribution(no_eos, monkeypatch):
    # auto's stop rule ends a proposal where the draft turns unsure, so its length
    # depends on the draft's own samples. Forced here: every round asks for 3 drafts and
    # stops after the second whenever the draft's top probability there (which depends
    # on the first draft's sample) is below 0.18, about half the time on this pair.
    from specmlx.policy.choice import Choice, Scheduler

    stops = []

    def keep_drafting(s, tops):
        if len(tops) == 2:
            stops.append(tops[-1] < 0.18)
        return len(tops) < 2 or tops[-1] >= 0.18

    monkeypatch.setattr(Scheduler, "choose", lambda s, remaining=None, behind=None: Choice(3))
    monkeypatch.setattr(Scheduler, "keep_drafting", keep_drafting)
    target, settings = no_eos["target"], SETTINGS["T=1.0"]
    counts = sampled_pairs(
        target, no_eos["perturbed"], settings, gamma="auto", max_tokens=4, sampling="rejection"
    )
    assert 0.2 < np.mean(stops) < 0.8  # both lengths were verified, many times each
    assert chi_square_pvalue(counts, exact_joint(target, settings)) > ALPHA


def test_the_check_rejects_a_sampler_that_trusts_the_draft(no_eos, monkeypatch):
    def accept_everything(p, q, draft_tokens, key):
        g = draft_tokens.shape[0]
        return mx.array(g), verify.sample(p[g], key)

    monkeypatch.setattr(verify, "accept_reject", accept_everything)
    verify.make_verifier.cache_clear()
    try:
        target, settings = no_eos["target"], SETTINGS["T=1.0"]
        counts = sampled_pairs(target, no_eos["unrelated"], settings, sampling="rejection")
    finally:
        verify.make_verifier.cache_clear()
    assert chi_square_pvalue(counts, exact_joint(target, settings)) < ALPHA


def test_the_check_rejects_a_coupled_sampler_that_trusts_the_draft(no_eos, monkeypatch):
    def accept_everything(p, draft_tokens, keys):
        g = draft_tokens.shape[0]
        return mx.array(g), verify.sample(p[g : g + 1], keys[g])

    monkeypatch.setattr(verify, "accept_coupled", accept_everything)
    verify.make_verifier.cache_clear()
    try:
        target, settings = no_eos["target"], SETTINGS["T=1.0"]
        counts = sampled_pairs(target, no_eos["unrelated"], settings, sampling="coupled")
    finally:
        verify.make_verifier.cache_clear()
    assert chi_square_pvalue(counts, exact_joint(target, settings)) < ALPHA
