"""End to end through generate(), trees of drafts at T = 1 under rejection sampling keep
the target's exact distribution: multi-candidate rejection sampling judges them whole.

test_lossless.py's check (S = 3,000 seeded runs, the first two tokens against the
target's exact joint, chi-square at 0.001, the same stated power: a total variation of
~0.1 on the main cells is caught with probability > 0.99) on trees drawn without
replacement by a test drafter (three candidates under the last token, two under the
first) and grown by the perturbed draft model (six nodes, three deep); the control, a
tree sampler that never updates its residual, is rejected by the same check.
"""

from itertools import islice

import mlx.core as mx
import numpy as np
import pytest
from stats_util import ALPHA, chi_square_pvalue
from test_lossless import PROMPT, SETTINGS, S, exact_joint, sampled_pairs

import specmlx
from specmlx import verify
from specmlx.drafters.protocol import Proposal
from specmlx.drafters.treedraft import without_replacement
from specmlx.sampling import sample
from specmlx.tiny import build_tiny_model


@pytest.fixture(scope="module")
def no_eos(tmp_path_factory):
    """One-layer qwen2 target and perturbed draft (the sampler is what is tested)."""
    root = tmp_path_factory.mktemp("tree-lossless")
    target = build_tiny_model(root / "target", seed=0, layers=1)
    perturbed = build_tiny_model(
        root / "perturbed", seed=1, layers=1, perturb_from=target, noise=0.1
    )
    models = {"target": specmlx.load(target), "perturbed": specmlx.load(perturbed)}
    for m in models.values():
        m.tokenizer.eos_token_ids = set()
    return models


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
