"""The head drafter: drafts from the target's features with a feature head (head.py).

Its cache holds one row per position of the text: row i was fed the target's feature at
position i and the embedding of token i + 1, and its output drafts token i + 2. The
target's features come with the prompt (Target.features) and with every Verdict (the
rows of the positions it kept), so the head runs no target pass of its own: it takes the
prompt's rows at the start (one layer over them) and each round's with its next draft
pass. Its own drafts' rows (fed its own features) are
trimmed once the target has judged them: the target's features replace them.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from .. import tree
from ..caches import PREFILL_STEP, common_prefix_len
from ..cpu import softmax
from ..drafters import Sources
from ..drafters.protocol import Draw, GoOn, Proposal, Verdict
from ..drafters.subvocab import SubHead
from ..drafters.treedraft import grow
from ..target import Features
from ..tree import Shape
from ..treepass import grown_mask, rope_owners, tree_pass
from ..verify import top_probability
from .feature import text_args
from .head import Head


class HeadDrafter:
    name = "head"
    reads_hidden = True
    trees = True  # its cache keeps every row in order: a tree grows in it level by level

    def __init__(self, head: Head, width: int):
        self.head = head
        self.width = width  # the vocabulary verify compares over
        self.sub = None if head.ids is None else SubHead(head.ids, width, head.rows, head.tied)
        self.taps = head.taps
        self.dim = text_args(head.target)[1].hidden_size
        self.scratch = np.empty(width, np.float32)
        self.cache = [KVCache()]
        self.text: list[int] = []  # t_0 .. t_R: row r of the cache took t_{r+1}
        self.waiting: list[mx.array] = []  # features of rows not fed yet, in order
        self.tokens: list[int] = []  # their next tokens
        self.drafted = 0  # rows its last proposal fed of its own drafts
        self.proposals = 0
        # A tree being grown (treedraft.grow): where its rows start in the cache, the nodes
        # run so far, and each one's output feature (-1: the last emitted token's row).
        self.tree_start, self.tree_fed, self.tree_features = 0, [], {}
        self.owners: list | None = None  # the head's attention layers, where positions go

    @property
    def cost_id(self) -> str:
        target, head = self.head.target, self.head
        vocab = f"vocab {head.ids.size}" if head.ids is not None else "full vocab"
        return f"{head.kind}:{head.path}:{target.dtype}:{target.weights or 'as stored'}:{vocab}"

    @property
    def behind(self) -> int:
        """Rows it must take before it drafts from the last: what the text gained while
        it sat out (it took the prompt's at the start)."""
        return max(0, len(self.tokens) - 1)

    def available(self, g: int) -> int:
        """It drafts only once it has the target's feature of the last position."""
        return g if self.tokens else 0

    def start(self, context: list[int], features: Features | None = None) -> None:
        """A new call over `context`; `features`: the target's, one row per position of
        context but the last (Target.features)."""
        n = len(context)
        rows = max(0, min(common_prefix_len(self.text, context) - 1, n - 2))
        self._trim(self._rows() - rows)
        self.text = context[: rows + 1]
        self.waiting, self.tokens = [], []
        if features is not None and n > 1 and features.rows >= n - 1:
            self.waiting = [features.read(rows, n - 1)]
            self.tokens = context[rows + 1 :]
            # The prompt's rows now, with the target's prefill: one layer over them costs
            # a small share of the target's passes over them, and a head that is never
            # behind is priced by the policy on its draft pass alone.
            if len(self.tokens) > 1:
                self._feed(len(self.tokens) - 1)

    def propose(
        self,
        g: int,
        keys: mx.array,
        draw: Draw,
        go_on: GoOn | None = None,
        tree: Shape | None = None,
    ) -> Proposal:
        """g drafts and their q, lazily, as the draft model's (drafters/model.py); with a
        `tree` shape, a tree within it (treedraft.grow: a head pass per level)."""
        self.proposals += 1
        features = self._waiting()
        x = mx.array(self.tokens, mx.uint32)
        self.text += self.tokens
        self.waiting, self.tokens = [], []
        if tree is not None:
            fed_back, out = self._run(x, features)
            self.tree_start, self.tree_fed = self._rows(), []
            self.tree_features = {-1: fed_back[0, -1:]}
            root = self._every_logits(out[0, -1:])
            return grow(root, self._tree_step, tree, keys, draw, self.width)[0]
        tokens, qs, tops = [], [], []
        for i, k in enumerate(keys[:g]):
            features, logits, probs, token = self.step(x, features, k, draw)
            self.drafted = i  # rows of its own drafts fed so far (this pass's input)
            mx.async_eval(token)
            tokens.append(token)
            qs.append(self.sub.widen(probs) if self._narrow(probs) else probs)
            if go_on is not None:
                tops.append(
                    top_probability(logits, self._shown(logits, probs), self.width, self.scratch)
                )
                if not go_on(tops):
                    break
            x = token
        q = None if qs[0] is None else mx.concatenate(qs)
        return Proposal(mx.concatenate(tokens), q, None, 0, self.proposals == 1, tops=tops)

    def step(self, x: mx.array, features: mx.array, key: mx.array, draw: Draw) -> tuple:
        """One head pass over tokens x (L,) and their rows' features (L, F), lazily:
        (the last row's output feature (1, D), logits, the distribution drawn from or
        None when greedy, the token drawn (1,))."""
        head = self.head
        fed_back, out = self._run(x, features)
        logits = head.logits(out[:, -1, :])
        if self.sub is None:
            return (fed_back[0, -1:], logits, *draw(logits, key))
        if getattr(draw, "full_width", False):
            return (fed_back[0, -1:], logits, *draw(self.sub.widen_logits(logits), key))
        probs, index = draw(logits, key)
        return fed_back[0, -1:], logits, probs, self.sub.token(index)

    def _tree_step(self, feed: list[int], tokens: list[int], parents: list[int]) -> mx.array:
        """treedraft's Step: the nodes `feed`, each from its parent's output feature, at
        its depth's position, seeing the context's rows and its ancestors'."""
        depths, ancestry = tree.depths(parents), tree.ancestry(parents)
        nodes = self.tree_fed + feed
        positions = [self.tree_start - 1 + depths[j] for j in nodes]
        seen = mx.array([[ancestry[j + 1][k + 1] for k in nodes] for j in feed])
        at = [p - self.tree_start - len(self.tree_fed) for p in positions[len(self.tree_fed) :]]
        if self.owners is None:  # the modules do not change: walk them once
            self.owners = rope_owners(self.head.module)
        features = mx.concatenate([self.tree_features[parents[j]] for j in feed])
        x = mx.array([tokens[j] for j in feed], mx.uint32)
        mask = grown_mask(self.tree_start, positions, seen, mx.float32)
        with tree_pass(self.cache, self.owners, [mask], at):
            fed_back, out = self._run(x, features)
        for i, j in enumerate(feed):
            self.tree_features[j] = fed_back[0, i : i + 1]
        self.tree_fed = nodes
        return self._every_logits(out[0])

    def _every_logits(self, out: mx.array) -> mx.array:
        """Logits (L, V') of output rows over the full vocabulary (-inf outside a
        sub-vocabulary's ids)."""
        logits = self.head.logits(out)
        return logits if self.sub is None else self.sub.widen_logits(logits)

    def commit(self, proposal: Proposal | None, verdict: Verdict) -> int:
        if proposal is not None:
            # its own drafts' rows, a chain's or a tree's: the target's features replace them
            self._trim(self.drafted + len(self.tree_fed))  # one of them is 0
            self.drafted, self.tree_fed, self.tree_features = 0, [], {}
        if verdict.hidden is not None:
            self.waiting.append(verdict.hidden)
            self.tokens += verdict.emitted
        return 0

    def time_pass(self) -> float:
        """Seconds of one head pass over one row, its cache left as it was."""
        features = self.waiting[-1][-1:] if self.waiting else mx.zeros((1, self.dim))
        x = mx.array(self.tokens[-1:] or [0], mx.uint32)
        draw = lambda logits, key: (None, mx.argmax(logits, axis=-1))  # noqa: E731
        start = time.perf_counter()
        mx.eval(self.step(x, features, mx.random.key(0), draw)[-1])
        seconds = time.perf_counter() - start
        self._trim(1)
        return seconds

    def _feed(self, n: int) -> None:
        """Feed the first n waiting rows through the head, in bounded chunks."""
        features = self._waiting()
        tokens = self.tokens[:n]
        for at in range(0, n, PREFILL_STEP):
            x = mx.array(tokens[at : at + PREFILL_STEP], mx.uint32)
            rows = features[at : at + x.size]
            self._run(x, rows)
            mx.eval(self.cache[0].state)
        self.text += tokens
        self.waiting, self.tokens = [features[n:]], self.tokens[n:]

    def _waiting(self) -> mx.array:
        """The waiting rows' features as one array."""
        return mx.concatenate(self.waiting) if len(self.waiting) > 1 else self.waiting[0]

    def _run(self, x: mx.array, features: mx.array) -> tuple[mx.array, mx.array]:
        """A head pass over tokens x (L,) and their rows' features (L, F), lazily."""
        return self.head.module(self.head.embed(x[None]), features[None], self.cache[0])

    def _rows(self) -> int:
        return self.cache[0].offset

    def _trim(self, n: int) -> None:
        if n > 0:
            self.cache[0].trim(n)

    def _narrow(self, probs: mx.array | None) -> bool:
        return probs is not None and self.sub is not None and probs.shape[-1] != self.width

    def _shown(self, logits: mx.array, probs: mx.array | None) -> mx.array | None:
        """What its confidence is read from: over a sub-vocabulary, the logits are not
        the full row top_probability expects at temperature 0."""
        if self.sub is None or probs is not None:
            return probs
        return softmax(logits.astype(mx.float32))


def make(sources: Sources) -> HeadDrafter | None:
    """The registered factory: the loaded head's drafter, None without a head."""
    return None if sources.head is None else HeadDrafter(sources.head, sources.width)
