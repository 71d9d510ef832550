"""A small model that samples g tokens autoregressively from its own q."""

from __future__ import annotations

import time
from functools import partial

import mlx.core as mx
import numpy as np

from .. import tree
from ..caches import (
    PREFILL_STEP,
    align_cache,
    check_rollback,
    checkpoint,
    keep_rows,
    layers,
    make_cache,
    prefill,
    rewind,
    snapshot,
    timed_pass,
    trims_exactly,
)
from ..cpu import softmax
from ..loading import Model
from ..treepass import grown_mask, grows_trees, rope_owners, tree_pass
from ..verify import top_probability
from . import Sources
from .protocol import Draw, GoOn, Proposal, Verdict
from .subvocab import SubHead, draft_size, shared_sub_head
from .treedraft import grow


class ModelDrafter:
    """The draft model, with a KV cache that persists across a Session's calls.

    It is fed lazily: what the text gained while it sat out rides along with its next
    draft pass (a pass over a few tokens costs little more than one), and a call that
    never drafts (auto γ = 0) never pays for its prompt.

    With a `head` (drafters.subvocab), its logits cover that sub-vocabulary only: it draws
    from them, and its q is zero outside.
    """

    name = "model"

    def __init__(self, model: Model, width: int, head: SubHead | None = None):
        self.model = model
        self.width = width  # the vocabulary verify compares over
        self.head = head
        self.scratch = np.empty(width, np.float32)
        self.cache = make_cache(model.module)
        self.cached: list[int] = []  # tokens whose entries are in the cache
        self.prompt_snapshot = None  # the cache at the last prompt it took, where trims can't
        self.pending: list[int] = []  # tokens of the text not yet fed; the last drafts next
        self.prompt_left = 0  # how many of `pending` are the call's prompt
        self.saved: list | None = None  # the cache's checkpoint before the last proposal
        self.fed: list[int] = []  # what its first pass took
        self.proposals = 0  # made in this Session
        self.timed = 0  # passes time_pass has run
        # A tree being grown (treedraft.grow): where its nodes start in the cache, and
        # the nodes run so far, in the order their entries follow (grow's ids while it
        # grows, the proposal's after it; None: a node the proposal cut)
        self.tree_start, self.tree_fed = 0, []
        self.grown = False  # the last proposal was grown as a tree (even if cut to a chain)
        self.owners: list | None = None  # the attention layers, where a tree's positions go

    @property
    def trees(self) -> bool:
        """Whether it drafts trees: where its cache keeps every position in order, so a
        tree can grow in it pass by pass and be cut to the accepted path."""
        return grows_trees(self.cache)

    def start(self, context: list[int]) -> None:
        keep = align_cache(self.model, self.cache, self.cached, context[:-1], self.prompt_snapshot)
        self.pending = context[keep:]
        self.prompt_left = len(self.pending) - 1
        if not self.prompt_left:
            self.prompt_snapshot = snapshot(self.cache, self.cached)

    @property
    def behind(self) -> int:
        """Tokens of the text it must take before it drafts from the last one: the call's
        prompt where it has not taken it yet, and what it missed while it sat out or
        prompt lookup drafted. Drafting must win them back within the call: where a pass
        over many tokens costs several one-token passes, a long prompt costs the draft
        more than a short reply can save."""
        return max(0, len(self.pending) - 1)

    @property
    def cost_id(self) -> str:
        """What its pass costs depend on: the model, its dtype and weights, its head."""
        m, head = self.model, self.head
        vocab = f"head {head.ids.size}" if head is not None else "full head"
        return f"{m.path}:{m.dtype}:{m.weights or 'as stored'}:{vocab}"

    def interrupted(self) -> None:
        if not trims_exactly(self.cache):
            self.cached.clear()

    def propose(
        self,
        g: int,
        keys: mx.array,
        draw: Draw,
        go_on: GoOn | None = None,
        tree: tree.Shape | None = None,
    ) -> Proposal:
        """g tokens and their q, lazily (nothing is synced unless `go_on` is given: it is
        shown its top probability at each draft as it is made, the last one too, which
        syncs every pass). With a `tree` shape (where `trees`), a tree within it
        (treedraft.grow: a pass per level, synced at each)."""
        start = time.perf_counter()
        if self.prompt_left:
            self._feed(self.prompt_left)
            self.prompt_snapshot = snapshot(self.cache, self.cached)
        prompt_s = time.perf_counter() - start
        first = self.proposals == 0
        self.proposals += 1
        if len(self.pending) > PREFILL_STEP:  # a long wait: feed it in bounded chunks first
            self._feed(len(self.pending) - 1)
        fed = len(self.pending) - 1
        self.saved = checkpoint(self.cache)  # what a rejection rewinds to, where trims can't
        self.fed = list(self.pending)
        self.cached += self.pending
        x = mx.array(self.pending, mx.uint32)
        if tree is not None:
            self.pending, root = [], self._every_logits(x)[-1:]
            self.tree_start, self.tree_fed = len(self.cached), []
            proposal, kept = grow(root, self._tree_step, tree, keys, draw, self.width)
            index = {node: i for i, node in enumerate(kept)}  # its ids to the proposal's
            self.tree_fed = [index.get(node) for node in self.tree_fed]
            self.grown = True
            proposal.fed, proposal.first, proposal.prompt_s = fed, first, prompt_s
            return proposal
        tokens, qs, tops = [], [], []
        for k in keys[:g]:
            logits, probs, x = self.step(x, k, draw)
            mx.async_eval(x)
            tokens.append(x)
            narrow = probs is not None and probs.shape[-1] != self.width  # over its head's ids
            qs.append(self.head.widen(probs) if narrow else probs)
            if go_on is not None:
                shown = self._shown(logits, probs)
                tops.append(top_probability(logits, shown, self.width, self.scratch))
                if not go_on(tops):
                    break
        self.pending = []
        q = None if qs[0] is None else mx.concatenate(qs)
        return Proposal(mx.concatenate(tokens), q, None, fed, first, prompt_s, tops=tops)

    def step(self, x: mx.array, key: mx.array, draw: Draw) -> tuple:
        """One draft pass over tokens x (lazy): (logits, the distribution drawn from or None
        when greedy, the token drawn (1,)). With a head, logits and distribution cover its
        sub-vocabulary and the token is mapped back to its full id; but a draw that wants
        the full vocabulary (coupled sampling: Draw's `full_width`) is shown the logits
        widened, so the draft draws over the target's ordering of tokens."""
        if self.head is None:
            logits = self.model.module(x[None], cache=self.cache)[:, -1, :]
            return (logits, *draw(logits, key))
        logits = self.head.logits(self.model.module, x, self.cache)
        if getattr(draw, "full_width", False):
            return (logits, *draw(self.head.widen_logits(logits), key))
        probs, index = draw(logits, key)
        return logits, probs, self.head.token(index)

    def _tree_step(self, feed: list[int], tokens: list[int], parents: list[int]) -> mx.array:
        """treedraft's Step: the nodes `feed` run after the tree's nodes run before, each
        at its depth's position, seeing the context and its ancestors."""
        depths, ancestry = tree.depths(parents), tree.ancestry(parents)
        nodes = self.tree_fed + feed
        root = self.tree_start - 1  # the last emitted token's position
        positions = [root + depths[j] for j in nodes]
        seen = mx.array([[ancestry[j + 1][k + 1] for k in nodes] for j in feed])
        offset = self.tree_start + len(self.tree_fed)  # the layers' offset: where it starts
        at = [p - offset for p in positions[len(self.tree_fed) :]]
        dtype = getattr(mx, self.model.dtype)
        masks = [grown_mask(self.tree_start, positions, seen, dtype) for _ in layers(self.cache)]
        if self.owners is None:  # the modules do not change: walk them once
            self.owners = rope_owners(self.model.module)
        with tree_pass(self.cache, self.owners, masks, at):
            logits = self._every_logits(mx.array([tokens[j] for j in feed], mx.uint32))
        self.tree_fed = nodes
        return logits

    def _every_logits(self, x: mx.array) -> mx.array:
        """(len(x), V') logits at every position of a pass over x, over the full
        vocabulary (a head's widened with -inf)."""
        if self.head is None:
            return self.model.module(x[None], cache=self.cache)[0]
        return self.head.widen_logits(self.head.logits(self.model.module, x, self.cache, True))

    def _shown(self, logits: mx.array, probs: mx.array | None) -> mx.array | None:
        """What its confidence is read from. Over a sub-vocabulary the logits are not the
        full row top_probability expects at temperature 0: their softmax is read."""
        if self.head is None or probs is not None:
            return probs
        return softmax(logits.astype(mx.float32))

    def commit(self, proposal: Proposal | None, verdict: Verdict) -> int:
        accepted, emitted = verdict.accepted, verdict.emitted
        if proposal is None:
            self.pending += emitted  # it sat out: it takes them with its next pass
            return 0
        if self.grown:
            return self._commit_tree(proposal, verdict)
        # It fed d_1..d_{g-1} through itself; d_g was sampled but never fed.
        g = proposal.tokens.shape[0]
        drafts = proposal.tokens.tolist()
        self.cached += drafts[: g - 1]
        if accepted == g:
            self.pending = [drafts[-1], emitted[-1]]  # d_g and the bonus token
            return 0
        rejected = g - 1 - accepted
        kept = self.fed + drafts[:accepted]
        rerun = rewind(self.model, self.cache, self.saved, kept, rejected)
        del self.cached[len(self.cached) - rejected :]
        self.pending = emitted[-1:]
        return rerun

    def _commit_tree(self, proposal: Proposal, verdict: Verdict) -> int:
        """Keep the cache entries of the accepted nodes it ran (a path's nodes were run in
        its order), moved up after the context; the rest of the path (a leaf it never ran)
        and the target's token are taken with its next pass."""
        ran = {node: i for i, node in enumerate(self.tree_fed) if node is not None}
        kept = [j for j in verdict.path if j in ran]
        keep_rows(self.cache, [ran[j] for j in kept], len(self.tree_fed))
        drafts = proposal.tokens.tolist()
        self.cached += [drafts[j] for j in kept]
        self.pending = [drafts[j] for j in verdict.path[len(kept) :]] + [verdict.token]
        self.tree_fed, self.grown = [], False
        return 0

    def time_pass(self) -> float:
        """Seconds for one one-token pass, the cache left as it was: the draft's cost now,
        without taking what it missed. The first time, the best of two: a process's first
        pass pays one-time work. After that one pass: the costs keep the median of several
        such figures, so one that meets a burst of load moves nothing, and each pass here
        emits no token (a second one was a T(1) more in every cost probe: with a draft as
        costly as the target, 3-5% of a 48-token reply)."""
        token = (self.cached or self.pending)[-1:]
        forward = None if self.head is None else partial(self.head.logits, self.model.module)
        runs = 1 if self.timed or self.proposals else 2
        self.timed += runs
        return min(timed_pass(self.model, self.cache, token, forward) for _ in range(runs))

    def _feed(self, n: int) -> None:
        """Feed the first n pending tokens through the draft as a prefill."""
        tokens, self.pending = self.pending[:n], self.pending[n:]
        prefill(self.model, self.cache, tokens)
        self.cached += tokens
        self.prompt_left = max(0, self.prompt_left - n)


def model_drafter(model: Model, width: int) -> ModelDrafter:
    """The draft model's drafter: with the head cut to draft_size's tokens where that is
    set, else its full head. `width`: the vocabulary verify compares over."""
    size = draft_size(model)
    # A target with fewer tokens than the draft: the full head (the draw cuts its logits).
    if size is None or width < model.vocab_size:
        return ModelDrafter(model, width)
    return ModelDrafter(model, width, shared_sub_head(model, size, width))


def make(sources: Sources) -> ModelDrafter | None:
    """The registered factory: the draft model's drafter, None without a draft model.
    Its cache must roll back exactly like the target's (caches.check_rollback)."""
    if sources.draft is None:
        return None
    check_rollback(sources.draft)
    return model_drafter(sources.draft, sources.width)
