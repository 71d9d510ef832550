"""The target model and everything its passes touch.

A Target owns its model's cache, the tokens in it, the prompt's snapshot, the rollback
after each round (trim, cut or checkpoint-and-rewind: caches.py) and the plain pass it
queues ahead. The engine asks it for one of two things a round:

- `verify(last, proposal, key)`: ONE pass over [last emitted token, *drafts], the drafts
  a chain or a tree (specmlx.tree); accept/reject on the device; the cache keeps exactly
  the accepted path. A tree runs with a tree mask and each node at its depth's position,
  and its kept entries are compacted, on every attention cache (caches.TREE_KINDS):
  greedy or coupled, each node judged against the target's own token at its parent;
  under rejection sampling by multi-candidate rejection sampling (verify.
  accept_tree_reject). On a recurrent state its first path is verified as a chain,
  which is exact, and the Verdict says so.
- `step(last, key, next_key, room)`: one plain pass. While Python handles its token the
  device may already compute the next plain pass (as mlx-lm's generate_step does): it is
  built before the token is read and run only once `next_round` learns that the next
  round is plain; where it drafts, the pass is taken back out of the cache unrun (a trim
  would leave its writes in the arrays, computed when next read: a whole pass lost at
  every switch to drafting). Only caches that trim exactly pipeline.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from . import tree
from .caches import (
    check_rollback,
    checkpoint,
    keep_rows,
    layers,
    make_cache,
    rewind,
    set_state,
    snapshot,
    state_of,
    sync_cache,
    trims_exactly,
    verifies_trees,
)
from .errors import SpecmlxError
from .lm_head import body, body_and_head, cuttable
from .loading import Model, backend
from .processors import Processor, reads_history
from .proposal import Draw, Proposal, Verdict, point_mass
from .sampling import SamplingParams
from .treepass import rope_owners, tree_mask, tree_pass
from .verify import make_sampler, make_tree_verifier, make_verifier, top_probabilities


class Target:
    def __init__(self, model: Model):
        self.model = model
        self.hidden = False  # keep the features of each pass (set_hidden)
        self.taps: tuple[int, ...] | None = None  # which layers' outputs are the features
        self._rope_owners: list | None = None  # the attention layers, where a tree's positions go
        # Its place in a batch (specmlx.batch.Seat), where its passes are shared with
        # other sequences' in one; None: every pass its own
        self.batch = None
        self.reset()

    def reset(self) -> None:
        """Forget the text (the cache); keep the model."""
        self.cache = make_cache(self.model.module)
        self.cached: list[int] = []  # tokens whose entries are in the cache
        self.prompt_snapshot = None  # the cache at the last prompt, where trims can't
        self._queued = None  # a running plain pass: (logits, probs, token, hidden)
        self._ahead = None  # a plain pass built but not running, and the state before it
        self._before = None
        self.features = Features()  # one row per cached position, while `hidden` is on

    def set_hidden(self, on: bool, taps: tuple[int, ...] | None = None) -> None:
        """Keep the features of every cached position and show each round's in its
        Verdict (for a drafter that reads them): the last hidden states, or with `taps`
        those decoder layers' outputs side by side (lm_head.body). The pass is split into
        body and head, which only some architectures allow."""
        if on and not cuttable(self.model):
            arch = self.model.config.get("model_type", "this architecture")
            raise SpecmlxError(
                f"this drafter reads the target's hidden states, which specmlx cannot take "
                f"from {arch} ({self.model.name}); choose another drafter"
            )
        layers = len(self.model.module.model.layers) if on else 0
        if taps and not all(0 <= i < layers for i in taps):
            raise SpecmlxError(
                f"this drafter reads the outputs of target layers {list(taps)}, but "
                f"{self.model.name} has {layers} layers; use a drafter made for this target"
            )
        if (on, taps) != (self.hidden, self.taps):
            self.features = Features()  # features of other layers, or none, are kept
        self.hidden, self.taps = on, taps or None

    def check_rollback(self) -> None:
        """Refuse, before anything is decoded, a cache a rejected draft could not be rolled
        back from exactly (it would emit text that is not the target's)."""
        check_rollback(self.model)

    @property
    def verifies_trees(self) -> bool:
        """Whether a tree is verified whole: where every layer's cache can have its kept
        path compacted and the rest cut (caches.TREE_KINDS); not a recurrent state."""
        return verifies_trees(self.cache)

    @property
    def pipelines(self) -> bool:
        """Whether plain passes are queued ahead: only where a trim rolls the cache back
        (the others checkpoint and rewind around every pass). Read once a call: the
        layers' kinds do not change within one. Nor where a processor reads the tokens
        generated: the pass built ahead does not know its own input yet. Nor while its
        passes are shared with other sequences' (a batch runs each round's pass at once)."""
        shared = self.batch is not None and self.batch.shared
        return self._trims and not reads_history(self.processor) and not shared

    def start(
        self,
        prompt: list[int],
        params: SamplingParams,
        vocab_size: int,
        progress: Callable[[int, int], None] | None = None,
        processor: Processor | None = None,
    ) -> int:
        """A new call: the cache made to hold `prompt` (reusing the longest prefix it holds)
        and the call's samplers, its logits processed by `processor` (processors.py) before
        every judgement; returns how many prompt tokens were processed."""
        self._queued = self._ahead = self._before = None
        if self.hidden:
            self._align_features()
        forward = self._feature_pass if self.hidden else None
        done, features = sync_cache(
            self.model, self.cache, self.cached, prompt, progress, self.prompt_snapshot, forward
        )
        if self.hidden:
            self.features.cut(len(self.cached) - done)
            for rows in features:
                self.features.add(rows[0])
        self.prompt_snapshot = snapshot(self.cache, self.cached)
        self._trims = trims_exactly(self.cache)
        self.processor, self.output_from = processor, len(prompt) + 1
        self.params, self.vocab_size = params, vocab_size
        self.verifier = make_verifier(params, vocab_size)
        self.draw = make_sampler(params, vocab_size)
        self._scratch = np.empty(vocab_size, np.float32)
        return done

    def _align_features(self) -> None:
        """Features must cover every cached position a drafter may read: where they do
        not (the drafter came in mid-session), the positions without them are run again."""
        self.features.cut(len(self.cached))
        snapshot = self.prompt_snapshot
        if snapshot is not None and len(snapshot.tokens) > self.features.rows:
            self.prompt_snapshot = None  # taken before the features were kept
        if self.features.rows == len(self.cached):
            return
        if trims_exactly(self.cache):
            del self.cached[self.features.rows :]  # the next sync trims the cache to it
        else:
            self.cache, self.prompt_snapshot = make_cache(self.model.module), None
            self.cached.clear()
            self.features = Features()

    def _feature_pass(self, x: mx.array, cache: list) -> mx.array:
        return body(self.model, x, cache, self.taps)[1]

    def interrupted(self) -> None:
        """A call stopped mid-pass: a cache that cannot be trimmed back may hold part of a
        round, so the next call prefills anew."""
        self._queued = self._ahead = self._before = None
        if not trims_exactly(self.cache):
            self.cached.clear()

    # -- plain rounds -------------------------------------------------------------

    def step(self, last: int, key: mx.array, next_key: mx.array, room: bool) -> Verdict:
        """One plain pass over `last`; with `room` for another token, the next plain pass
        is built (over this one's token, with `next_key`) for `next_round` to run."""
        start = time.perf_counter()
        if self._queued is None:
            self._queued = self._plain_pass(mx.array([last], mx.uint32), key, [last])
        (logits, probs, token, hidden), self._queued = self._queued, None
        if room and self.pipelines:
            self._before = state_of(self.cache)
            self._ahead = self._plain_pass(token, next_key, run=False)
        mx.eval(token)  # the sync: only this pass, not the one built after it
        self.cached.append(last)
        if hidden is not None:
            self.features.add(hidden)
        return Verdict(
            0,
            token.item(),
            hidden=hidden,
            verify_s=time.perf_counter() - start,
            tops=lambda k: self._tops(logits, probs, k),
            logprobs=lambda k: logprobs(logits, [0], [token.item()], k, self.vocab_size),
        )

    def next_round(self, plain: bool, last: int, key: mx.array) -> None:
        """The next round is planned: `plain` or drafting, over `last` with `key`."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            if plain:
                self._before = None  # its views would make the pass copy each layer's arrays
                mx.async_eval(ahead[2])
                self._queued = ahead
            else:
                set_state(self.cache, self._before)
                self._before = None
        elif plain and self.pipelines:
            self._queued = self._plain_pass(mx.array([last], mx.uint32), key, [last])

    def _plain_pass(
        self, x: mx.array, key: mx.array, last: list[int] | None = None, run: bool = True
    ) -> tuple:
        """A plain pass over x: `last`, x's token where it is known (a processor that reads
        the generated tokens needs it; pipelines() says when it can be unknown)."""
        logits, hidden = self._forward(x)
        logits = self._process(logits[-1:], lambda: [last or []])
        probs, token = self.draw(logits, key)
        if run:
            mx.async_eval(token)
        return logits, probs, token, hidden

    # -- drafting rounds ----------------------------------------------------------

    def draft_draw(self, last: int) -> Draw:
        """What a chain's drafts after `last` are drawn with: the call's sampler, over the
        draft's logits processed as the target's will be (a bias, penalties, a grammar's
        mask), each draft's history its own, so that the drafts are ones the processed
        target can accept. Where the logits are not one position over the full vocabulary
        (a head's sub-vocabulary, a tree's level), it draws unprocessed: exact either way."""
        if self.processor is None:
            return self.draw
        history = self._histories([[last]])[0]
        processed = True

        def draw(logits: mx.array, key: mx.array) -> tuple:
            nonlocal processed
            processed = processed and logits.shape[0] == 1 and logits.shape[-1] >= self.vocab_size
            if not processed:
                return self.draw(logits, key)
            probs, token = self.draw(self.processor(logits, [history]), key)
            history.append(token.item())
            return probs, token

        draw.full_width = getattr(self.draw, "full_width", False)
        return draw

    def verify(self, last: int, proposal: Proposal, key: mx.array) -> Verdict:
        """One pass over [last, *proposal's drafts]; the cache keeps the accepted path."""
        start = time.perf_counter()
        as_chain = not proposal.is_chain and not self.verifies_trees
        if as_chain:
            proposal = proposal.along(tree.first_path(proposal.parents))
        saved = checkpoint(self.cache) if proposal.is_chain else None
        x = mx.concatenate([mx.array([last], mx.uint32), proposal.tokens])
        drafts = proposal.tokens.tolist()
        if proposal.is_chain:
            logits, hidden = self._forward(x)
            logits = self._process(logits, lambda: [[last, *drafts[:i]] for i in range(len(x))])
            q = proposal.q
            if q is None and not (self.params.greedy or self.params.coupled):  # guesses
                q = point_mass(proposal.tokens, self.vocab_size)
            n, token, probs = self.verifier(logits, q, proposal.tokens, key)
            mx.eval(n, token)  # the one host sync of the round
            path = list(range(int(n)))
        else:
            logits, hidden = self._tree_forward(x, proposal.parents)
            logits = self._process(logits, lambda: self._tree_after(last, drafts, proposal.parents))
            n, token, row, probs = self._judge_tree(logits, proposal, key)
            mx.eval(n, token, row)
            path = tree.path_to(proposal.parents, int(row) - 1)
        verified = time.perf_counter()
        kept = [last, *(drafts[j] for j in path)]
        rows = [0, *(j + 1 for j in path)]  # the pass rows of the root and the kept drafts
        if proposal.is_chain:
            rerun = rewind(self.model, self.cache, saved, kept, len(drafts) - len(path))
        else:
            rerun = 0
            keep_rows(self.cache, rows, len(x))
        self.cached += kept
        if hidden is not None:
            hidden = hidden[mx.array(rows)]
            self.features.add(hidden)
        return Verdict(
            len(path),
            token.item(),
            path=path,
            drafts=kept[1:],
            hidden=hidden,
            verify_s=verified - start,
            rewind_s=time.perf_counter() - verified if rerun else 0.0,
            rerun=rerun,
            tree_as_chain=as_chain,
            tops=lambda k: self._tops(logits, probs, k, None if proposal.is_chain else rows),
            logprobs=lambda k: logprobs(
                logits, rows, [*kept[1:], token.item()], k, self.vocab_size
            ),
        )

    def _judge_tree(self, logits: mx.array, proposal: Proposal, key: mx.array) -> tuple:
        """The tree verifier over the pass's rows: greedy or coupled, accept_tree (coupled,
        each row drawn with the key of its depth's position: `key` holds one per position
        from the root's on); rejection sampling, accept_tree_reject with the drafts' q
        (point masses for guesses)."""
        parents = proposal.parents
        ancestry, depths, ranks = tree.ancestry(parents), tree.depths(parents), tree.ranks(parents)
        judge = make_tree_verifier(self.params, self.vocab_size)
        sampled = not (self.params.greedy or self.params.coupled)
        q = proposal.q
        if sampled and q is None:  # guesses
            q = point_mass(proposal.tokens, self.vocab_size)
        if self.params.coupled:
            key = key[mx.array([0, *depths])]
        return judge(
            logits,
            q,
            proposal.tokens,
            mx.array([p + 1 for p in parents], mx.uint32),
            mx.array([[r == k for r in ranks] for k in range(max(ranks) + 1)], mx.float32),
            mx.array([row[1:] for row in ancestry[1:]], mx.float32),
            mx.array(depths, mx.int32),
            key,
        )

    def _tree_forward(self, x: mx.array, parents: list[int]) -> tuple:
        """The pass over a tree's rows: each row attends to the cache and its ancestors,
        at the position of its depth."""
        depths = [0, *tree.depths(parents)]
        ancestry = mx.array(tree.ancestry(parents))
        if self._rope_owners is None:  # the modules do not change: walk them once
            self._rope_owners = rope_owners(self.model.module)
        dtype = getattr(mx, self.model.dtype)
        masks = [tree_mask(c, depths, ancestry, dtype) for c in layers(self.cache)]
        with tree_pass(self.cache, self._rope_owners, masks, depths):
            return self._forward(x, shareable=False)

    def _process(self, logits: mx.array, after: Callable[[], list[list[int]]]) -> mx.array:
        """The processor applied to rows whose tokens follow the cached text and then
        `after()[r]` each (made only where there is a processor): its history is what the
        call generated up to there."""
        if self.processor is None:
            return logits
        return self.processor(logits, self._histories(after()))

    def _histories(self, after: list[list[int]]) -> list[list[int]]:
        """What the call has generated before each row whose tokens follow the cached text
        and then `after[r]`: a processor's history."""
        text = self.cached[self.output_from :]
        start = max(0, self.output_from - len(self.cached))  # the prompt's last token
        return [text + a[start:] for a in after]

    @staticmethod
    def _tree_after(last: int, drafts: list[int], parents: list[int]) -> list[list[int]]:
        """The tokens after the cached text up to each row of a tree's pass: the root's,
        then each node's path."""
        paths = [[], *(tree.path_to(parents, j) for j in range(len(drafts)))]
        return [[last, *(drafts[k] for k in path)] for path in paths]

    def _forward(self, x: mx.array, shareable: bool = True) -> tuple[mx.array, mx.array | None]:
        """(logits (L, V), last hidden states (L, D) or None) of a pass over tokens x: in a
        batch, one row of the round's shared pass where it can be (not a tree's, nor one
        that keeps features)."""
        if self.batch is not None:
            logits = self.batch.forward(self.model, self.cache, x, shareable and not self.hidden)
            if logits is not None:
                return logits, None
        if self.hidden:
            logits, hidden = body_and_head(self.model, x[None], self.cache, self.taps)
            return logits[0], hidden[0]
        return self.model.module(x[None], cache=self.cache)[0], None

    def _tops(self, logits: mx.array, probs, k: int, rows: list[int] | None = None) -> list:
        """The target's top probability at the first k judged rows: read on the host (the
        engine asks while the next pass runs), from logits or the sampled distribution."""
        if rows is not None:
            index = mx.array(rows[:k])
            logits, probs = logits[index], None if probs is None else probs[index]
        return top_probabilities(logits, probs, k, self.vocab_size, self._scratch)


def logprobs(logits: mx.array, rows: list[int], tokens: list[int], k: int, vocab: int) -> list:
    """[(log-probability of tokens[i], [(id, log-probability)] of the k most likely)] at
    pass rows `rows`: the processed logits' (processors.py), before temperature, top-k and
    top-p, as OpenAI's logprobs are."""
    rows = logits[mx.array(rows)][:, :vocab].astype(mx.float32)
    picked = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(picked, mx.array(tokens)[:, None], axis=-1)[:, 0]
    top = mx.argsort(-picked, axis=-1)[:, :k] if k else None
    out = []
    for i, value in enumerate(chosen.tolist()):
        best = [] if top is None else top[i].tolist()
        out.append((value, [(t, picked[i, t].item()) for t in best]))
    return out


class Features:
    """The target's features (Target.set_hidden) at each cached position, in the pieces
    the passes made them in: appending a round's rows copies nothing."""

    def __init__(self):
        self.parts: list[mx.array] = []
        self.rows = 0

    def add(self, rows: mx.array) -> None:
        self.parts.append(rows)
        self.rows += rows.shape[0]

    def cut(self, n: int) -> None:
        """Keep the first n rows."""
        while self.rows > n:
            last = self.parts.pop()
            self.rows -= last.shape[0]
            if self.rows < n:
                self.add(last[: n - self.rows])

    def read(self, start: int, stop: int) -> mx.array:
        """Rows [start, stop) as one array (the pieces joined into one, once)."""
        if len(self.parts) > 1:
            self.parts = [mx.concatenate(self.parts)]
        return self.parts[0][start:stop] if self.parts else mx.zeros((0, 0))


def kernels() -> tuple[str, str]:
    """(what runs the passes, which build of its kernels): what measured costs depend on
    besides the models."""
    if backend() != "cpu":
        return "mlx", ""
    from .cpu import build_id, describe

    return describe(), build_id()
