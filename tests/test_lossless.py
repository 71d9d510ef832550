"""End to end through generate(): sampled output follows the target's exact distribution.

For each configuration we draw S = 3,000 two-token generations with distinct seeds
and compare the joint distribution of (first, second) token with the target's exact
joint distribution, enumerated on the tiny 300-token vocabulary (one batched forward
over every possible first token). Chi-square at significance 0.001 with cells of
expected count < 5 merged. A draft that is the target itself, a perturbed copy and an
unrelated model are each tried at T = 1.0 and at T = 0.7 with top-p 0.9, under modified
rejection sampling; coupled sampling (the default) with the perturbed draft and with
prompt lookup; trees of drafts judged by multi-candidate rejection sampling: drawn
without replacement by a test drafter (three candidates under the last token, two under
the first) and grown by the perturbed draft model (six nodes, three deep). The
control tests show the same check rejects a sampler, of either kind, that emits the
draft's tokens unchecked, and a tree sampler that never updates its residual.

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
from specmlx.drafters.protocol import Proposal
from specmlx.drafters.treedraft import without_replacement
from specmlx.sampling import sample
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


class SampledTree:
    """A drafter that proposes a tree drawn without replacement: three candidates under
    the last token from a flattened copy of the target's first distribution, two under
    the first candidate from a flattened copy of the target's next one (so drafts pass
    often, fail often, and later siblings decide much of the output)."""

    name = "sampled-tree"

    def __init__(self, joint: np.ndarray):
        first = joint.sum(1)
        self.q1 = self.flat(first)
        self.q2 = self.flat(joint / np.maximum(first[:, None], 1e-30))

    @staticmethod
    def flat(p: np.ndarray) -> mx.array:
        x = np.sqrt(p)
        return mx.array(x / x.sum(-1, keepdims=True), mx.float32)

    def start(self, context):
        pass

    def propose(self, g, keys, draw, go_on=None):
        if g < 5:  # a later round, where the first emitted one token: one draft from q1
            return Proposal(sample(self.q1, keys[0])[None], self.q1[None])
        k = mx.random.split(keys[0], 5)
        tokens, q = [], []
        for i, (d, parent) in enumerate([(self.q1, -1)] * 3 + [(None, 0)] * 2):
            d = self.q2[tokens[0].item()] if d is None else d
            tried = [t for t, p in zip(tokens, PARENTS, strict=False) if p == parent]
            row = without_replacement(d, mx.stack(tried)) if tried else d
            tokens.append(sample(row, k[i]))
            q.append(row)
        return Proposal(mx.stack(tokens), mx.stack(q), PARENTS)

    def commit(self, proposal, verdict):
        return 0


PARENTS = [-1, -1, -1, 0, 0]


def tree_pairs(target):
    settings = SETTINGS["T=1.0"]
    joint = exact_joint(target, settings)
    counts = np.zeros_like(joint)
    session, drafter = specmlx.Session(target), SampledTree(joint)
    for seed in range(S):
        gen = specmlx.generate(
            target,
            PROMPT,
            drafter=drafter,
            num_draft=5,
            max_tokens=6,  # room for the tree: a round emits at most g + 1 tokens
            seed=seed,
            session=session,
            sampling="rejection",
            **settings,
        )
        a, b = (step.token for step in islice(gen, 2))
        gen.close()
        counts[a, b] += 1
    assert gen.stats.trees_as_chains == 0 and gen.stats.rounds_by_gamma.get(5) == 1
    return counts, joint


def test_trees_judged_by_multi_candidate_rejection_sampling_keep_the_target_distribution(no_eos):
    counts, joint = tree_pairs(no_eos["target"])
    assert chi_square_pvalue(counts, joint) > ALPHA


def test_draft_model_trees_keep_the_target_distribution(no_eos):
    target, settings = no_eos["target"], SETTINGS["T=1.0"]
    kw = dict(gamma=3, max_tokens=8, sampling="rejection", tree=6, draft_mode="model")
    counts = sampled_pairs(target, no_eos["perturbed"], settings, **kw)
    assert chi_square_pvalue(counts, exact_joint(target, settings)) > ALPHA
    one = specmlx.generate(
        target, PROMPT, draft=no_eos["perturbed"], num_draft=3, max_tokens=8, **settings, tree=6
    )
    assert one.run().stats.tree_rounds > 0


def test_the_check_rejects_a_tree_sampler_that_never_updates_its_residual(no_eos, monkeypatch):
    monkeypatch.setattr(verify, "_after_rejection", lambda residual, q, rows: residual)
    verify.make_tree_verifier.cache_clear()
    try:
        counts, joint = tree_pairs(no_eos["target"])
    finally:
        verify.make_tree_verifier.cache_clear()
    assert chi_square_pvalue(counts, joint) < ALPHA
