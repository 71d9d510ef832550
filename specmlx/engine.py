"""The engine: speculative rounds, their timing and their text.

One round: the policy plans (which drafter, how many drafts); the drafter proposes, as a
chain or a tree, with the distributions q its drafts were drawn from; the Target runs ONE
forward pass over them and accepts or rejects on the device (target.py), its cache keeping
the accepted path; every drafter is told the Verdict; the statistics and the policy see a
RoundSummary. With no drafter it is plain autoregressive decoding of the target, the
baseline everything is measured against, sampled through the very same code (so greedy
outputs match exactly).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx

from . import constrained, processors
from . import drafters as registry
from . import tree as trees
from .drafters.protocol import Drafter, Proposal, Verdict, cost_id, interrupted
from .errors import SpecmlxError
from .heads import is_head
from .loading import Model, backend, check_pair
from .lockstep import lockstep
from .policy import AutoGamma, FixedGamma, Policy, RoundSummary, load_costs, save_costs
from .policy.choice import Scheduler
from .policy.costs import Costs, band_start, from_shorter
from .processors import Processor
from .sampling import SamplingParams, position_keys
from .settings import (
    MAX_GAMMA,
    check_processing,
    check_seed,
    check_settings,
    parse_tree,
    tree_nodes,
)
from .stats import Stats
from .target import Target, kernels

if TYPE_CHECKING:
    from .heads.head import Head


@dataclass(frozen=True)
class Step:
    token: int  # the emitted token id
    text: str  # the text this token adds (may be "" while a multi-byte char is incomplete)
    from_draft: bool  # an accepted draft token (True) or the target's own sample (False)
    # With generate(logprobs=k): the token's log-probability under the target's processed
    # logits (before temperature, top-k, top-p) and the k most likely (id, log-probability)
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    # Where it came from, for a reader that shows speculation at work (the server's chat
    # page): the drafter whose accepted draft it is ("model", "lookup", "head"...; None
    # for the target's own sample), and how many drafts its round proposed.
    drafter: str | None = None
    round_drafts: int = 0


@dataclass(frozen=True)
class _Call:
    """What one generate() call asks, beside its models and policy."""

    ids: list[int]
    params: SamplingParams
    max_tokens: int
    seed: int
    processor: Processor | None = None
    logprobs: int | None = None


def encode_prompt(model: Model, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        tokenizer = model.tokenizer
        bos = tokenizer.bos_token
        ids = tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise SpecmlxError("the prompt is empty; give at least one token of text")
    limit = model.vocab_size
    if any(not 0 <= t < limit for t in ids):
        raise SpecmlxError(f"prompt token ids must be in [0, {limit}) for {model.name}")
    return ids


class Session:
    """The Target's cache and every drafter's state, kept across generate() calls, and
    what the γ policy learnt.

    Pass the whole conversation each time: only the tokens after the longest prefix
    already in the caches are prefilled, so a chat turn costs its new tokens only.
    An interrupted call leaves the caches consistent for the next one.
    """

    def __init__(
        self,
        target: Model,
        draft: Model | Head | None = None,
        max_gamma: int = MAX_GAMMA,
        head: Head | None = None,
    ):
        if is_head(draft):  # `draft` may be either: a model, or a head (heads/)
            draft, head = None, draft
        if draft is not None:
            check_pair(target, draft)
        if head is not None and head.target is not target:
            raise SpecmlxError("this head was loaded for another target; load it with this one")
        self.model, self.draft, self.head, self.max_gamma = target, draft, head, max_gamma
        self.target = Target(target)
        self._schedulers: dict[tuple[str, str], Scheduler] = {}
        self._costs: dict[tuple[str, int], Costs] = {}
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (every cache); keep the models and what was measured."""
        self.target.reset()
        self.made: dict[str, Drafter | None] = {}  # registered drafters, made when first run

    @property
    def sources(self) -> tuple:
        """What it drafts from: the draft model and the head (either may be None)."""
        return self.draft, self.head

    def drafters(self, mode: str) -> list[Drafter]:
        sources = registry.Sources(self.draft, self.head, self.vocab_size)
        return registry.select(mode, sources, self.made)

    def drafter_caches(self) -> list[list]:
        """The caches its drafters keep (a draft model's), for what a Session holds."""
        return [d.cache for d in self.made.values() if isinstance(getattr(d, "cache", None), list)]

    def cost_key(self, drafter_id: str, band: int = 0) -> str:
        """Costs depend on the target, the drafter (a draft model's dtype and head: a
        sub-vocabulary makes its pass cheaper), the context's length (policy.costs'
        bands) and the backend (and its kernels, compiled or not, and which build)."""
        return f"{self.cost_kernels(drafter_id, band)}{kernels()[1]}"

    def cost_kernels(self, drafter_id: str, band: int = 0) -> str:
        """The cost key but for the kernels' build: what a rebuilt kernel's key starts with."""
        return f"{self.cost_kin(drafter_id, band)}{kernels()[0]}; build "

    def cost_kin(self, drafter_id: str, band: int = 0) -> str:
        """What cost keys of the same models on other kernels start with: their costs are
        this pair's first guess (policy.load_costs)."""
        m = self.model
        context = f"context {band_start(band)}+|" if band else ""
        weights = f"{m.weights or 'as stored'}{m.split}"  # split over ranks: other costs
        return f"{m.path}:{m.dtype}:{weights}|{drafter_id}|{backend()}|{context}"

    def costs(self, which: str, band: int = 0) -> Costs:
        """The measured costs of a drafter (by cost_id) at a band of context length: kept
        from earlier runs, else a kin's (other kernels), else, beyond the first band, what
        does not grow with the context from the band below (costs.from_shorter)."""
        if (which, band) not in self._costs:
            kins = (self.cost_kernels(which, band), self.cost_kin(which, band))
            costs = load_costs(self.cost_key(which, band), kins)
            if band and costs == Costs():
                costs = from_shorter(self.costs(which, band - 1))
            self._costs[(which, band)] = costs
        return self._costs[(which, band)]

    def schedulers(self, drafters: list[Drafter]) -> dict[str, Scheduler]:
        """A γ scheduler per drafter. A drafter that costs a pass has costs of its own;
        free ones share the target's cost curve with the call's first costly drafter."""
        out = {}
        for d in drafters:
            which = self._which(d, drafters)
            key = (d.name, which)
            if key not in self._schedulers:
                free = registry.is_free(d)
                self._schedulers[key] = Scheduler(self.costs(which), self.max_gamma, free)
            out[d.name] = self._schedulers[key]
        return out

    def costs_at(self, drafters: list[Drafter]):
        """band -> {drafter name: its costs there}, for the policy to price each round at
        the context the target holds."""
        return lambda band: {d.name: self.costs(self._which(d, drafters), band) for d in drafters}

    def _which(self, drafter: Drafter, drafters: list[Drafter]) -> str:
        """Whose costs a drafter's are: its own if it costs a pass, else the call's first
        costly drafter's (free drafts share the target's curve with it)."""
        if not registry.is_free(drafter):
            return cost_id(drafter)
        costly = [d for d in drafters if not registry.is_free(d)]
        return cost_id(costly[0]) if costly else "-:full head"

    def save_costs(self) -> None:
        # replacing: a rebuilt kernel's figures stand for the build before (which they
        # started from, as a kin: load_costs), so that one is dropped
        for (which, band), costs in self._costs.items():
            key, older = self.cost_key(which, band), self.cost_kernels(which, band)
            save_costs(key, costs, replacing=older)

    @property
    def vocab_size(self) -> int:
        sizes = [self.model.vocab_size] + ([self.draft.vocab_size] if self.draft else [])
        return min(sizes)


class Generation:
    """An iterator of Steps; `.stats`, `.tokens` and `.text` fill in as it runs."""

    def __init__(self, steps_factory):
        self.stats = Stats()
        self.tokens: list[int] = []
        self.text = ""
        self._steps = steps_factory(self)

    def __iter__(self) -> Iterator[Step]:
        return self

    def __next__(self) -> Step:
        step = next(self._steps)
        self.tokens.append(step.token)
        self.text += step.text
        return step

    def close(self) -> None:
        """Stop early (e.g. on Ctrl-C); the session's caches stay consistent."""
        self._steps.close()

    def run(self) -> Generation:
        """Consume the whole generation; return self for chaining."""
        for _ in self:
            pass
        return self


def generate(
    target: Model,
    prompt: str | list[int],
    draft: Model | Head | None = None,
    *,
    max_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    num_draft: int | str = "auto",
    draft_mode: str | None = None,
    drafter: Drafter | None = None,
    sampling: str | None = None,
    tree: int | str = "auto",
    seed: int = 0,
    session: Session | None = None,
    on_prefill: Callable[[int, int], None] | None = None,
    logit_bias: dict[int, float] | None = None,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    logprobs: int | None = None,
    grammar: str | None = None,
) -> Generation:
    """Generate from `target`, speculatively when a `draft` (or a `drafter`) is given.

    The output distribution is exactly the target's (processed with temperature,
    top-k, top-p); at temperature 0 the tokens equal the target's own greedy tokens.
    Iterate the result for Steps; its `.stats` holds the run's statistics. With a
    `session`, caches persist across calls (its draft is used unless num_draft is 0).

    num_draft: γ, an int, or "auto" to pick it each round from measured costs and
    acceptance (never slower than plain decoding by more than the probes it takes).
    draft_mode: a registered drafter's name (specmlx.drafters.modes(): "lookup", "model",
    ...) or "auto" (every one that can run, free ones first); None (the default): "auto"
    with a draft model, else "model" (plain decoding).
    drafter: any object implementing the drafter protocol (drafters/protocol.py), run
    alone in place of the registered ones.
    sampling: at temperature > 0, "rejection" (modified rejection sampling) or "coupled"
    (every position's randomness keyed by (seed, position): one text per seed, whatever
    the rounds, equal to the target alone's); None: settings.DEFAULT_SAMPLING.
    tree: "auto" (the default: with auto γ, a tree of up to settings.MAX_TREE nodes from a
    drafter that grows them (draft model, head, lookup) where the measured costs and this text's
    acceptance make it beat the best chain; with a fixed γ, chains), "off", or N in
    2..MAX_TREE (auto γ: trees of at most N nodes; fixed γ: N nodes, γ deep, every round),
    or its text (settings.parse_tree: one line on a bad value). Exact at any temperature.
    on_prefill: called with (tokens done, tokens in all) as the target takes the prompt,
    chunk by chunk (see caches.prefill); not called when the caches already hold it.
    logit_bias, presence_penalty, frequency_penalty: as OpenAI's (processors.py), applied
    to the target's logits at every position it judges: the text follows the processed
    distribution exactly. logprobs: k (0 to settings.MAX_LOGPROBS) to give each Step its
    log-probability and the k most likely tokens'; None (the default) for none.
    grammar: an llguidance grammar (constrained.json_grammar, tool_call_grammar) the text
    must follow: its token mask is one more processor, so the text is the masked target's.
    """
    params, num_draft = check_settings(
        max_tokens, temperature, top_p, top_k, num_draft, draft_mode, sampling
    )
    check_seed(seed)
    tree = parse_tree(tree)
    check_processing(logit_bias, presence_penalty, frequency_penalty, logprobs, target.vocab_size)
    mask = constrained.mask(target, grammar) if grammar is not None else None
    processor = processors.make(logit_bias, presence_penalty, frequency_penalty, mask)
    if session is None:
        session = Session(target, draft)
    elif session.model is not target or not any(draft is d for d in (None, *session.sources)):
        raise SpecmlxError("this session was made for other models; make a new Session")
    mode = getattr(drafter, "name", None) or draft_mode
    has_draft = session.draft is not None or session.head is not None
    mode = mode or registry.default_mode(has_draft)
    ids = encode_prompt(target, prompt)
    chosen = [drafter] if drafter is not None else session.drafters(mode) if num_draft else []
    if chosen:
        session.target.check_rollback()
    readers = [d for d in chosen if registry.reads_hidden(d)]
    session.target.set_hidden(bool(readers), registry.taps(readers[0]) if readers else None)
    nodes = tree_nodes(tree, num_draft == "auto") if session.target.verifies_trees else 0
    policy = _policy(session, params, num_draft if chosen else 0, chosen, nodes)
    policy = lockstep(policy, target, params)  # split over ranks: every rank one plan
    if session.target.batch is not None:  # its passes shared with others' (specmlx.batch)
        policy = session.target.batch.wrap(policy)

    def steps(gen: Generation) -> Iterator[Step]:
        gen.stats.gamma, gen.stats.draft_mode = num_draft if chosen else 0, mode
        gen.stats.tree = tree
        gen.stats.drafters = [d.name for d in chosen]
        gen.stats.sampling = "coupled" if params.coupled else "rejection"
        try:
            call = _Call(ids, params, max_tokens, seed, processor, logprobs)
            yield from _decode(session, call, policy, gen, on_prefill)
        except GeneratorExit:  # closed between steps: the caches hold what was emitted
            raise
        except BaseException:
            # Stopped mid-pass (Ctrl-C, an error): a cache that cannot be trimmed back may
            # hold part of a round; the next call must prefill it anew.
            session.target.interrupted()
            for d in chosen:
                interrupted(d)
            raise

    return Generation(steps)


def _policy(
    session: Session,
    params: SamplingParams,
    gamma: int | str,
    drafters: list[Drafter],
    trees: int = 0,
) -> Policy:
    """The γ policy for this call over its drafters; `trees`: the most nodes of a tree
    (settings.tree_nodes; 0: chains)."""
    if gamma != "auto":
        return FixedGamma(gamma, drafters, trees)
    schedulers = session.schedulers(drafters)
    costs_at = session.costs_at(drafters)
    sampled = not params.greedy
    return AutoGamma(drafters, schedulers, sampled, session.save_costs, costs_at, trees)


def _decode(
    session: Session,
    call: _Call,
    policy: Policy,
    gen: Generation,
    on_prefill: Callable[[int, int], None] | None = None,
) -> Iterator[Step]:
    """plan → propose → verify → commit → observe, then stream the round's text."""
    ids, max_tokens, target, stats = call.ids, call.max_tokens, session.target, gen.stats
    text, drafters = (
        _Text(session.model.tokenizer, call.logprobs),
        [*policy.drafters, *policy.helpers],
    )
    start = time.perf_counter()
    _prefill(session, call, drafters, stats, on_prefill)
    keys, last, produced, prompt_s = _Keys(call.seed, call.params.coupled), ids[-1], 0, 0.0
    decode_start = time.perf_counter()
    plan = policy.plan(max_tokens, len(ids))
    asked = min(plan.gamma, max_tokens - 1)  # a fully accepted round emits γ + 1 tokens
    while True:
        round_key, draft_keys = keys.round(produced, asked)
        t0, proposal = time.perf_counter(), None
        if asked > 0:
            proposal = _propose(plan, asked, draft_keys, target, last)
            mx.eval(proposal.tokens, proposal.q)
            prompt_s += proposal.prompt_s
            t1 = time.perf_counter()
            verdict = target.verify(last, proposal, round_key)
        else:
            t1 = time.perf_counter()
            ahead = keys.plain(produced + 1)
            verdict = target.step(last, round_key, ahead, room=produced + 1 < max_tokens)
        t2 = time.perf_counter()
        rerun = sum(d.commit(proposal if d is plan.drafter else None, verdict) for d in drafters)
        rewind_s = verdict.rewind_s + (time.perf_counter() - t2 if rerun else 0.0)
        summary = _summary(plan, asked, proposal, verdict, t1 - t0, rewind_s)
        stats.add_round(summary)
        policy.observe(summary)
        last, produced = verdict.token, produced + len(verdict.emitted)
        left = max_tokens - produced
        more = left > 0 and not any(t in text.eos for t in verdict.emitted)
        if more:
            plan = policy.plan(left, len(ids) + produced)
            asked = min(plan.gamma, left - 1)
        target.next_round(more and asked == 0, last, keys.plain(produced))
        policy.while_running()  # what the policy can learn with the next pass running
        for step in text.steps(verdict, max_tokens - stats.tokens, summary):
            stats.tokens += 1
            if stats.tokens == 1:
                stats.ttft = time.perf_counter() - start
            yield step
        stats.decode_time = time.perf_counter() - decode_start - prompt_s
        if text.ended:
            stats.finish_reason, stats.eos = "eos", 1
        if not more:
            break
    stats.finish_reason = stats.finish_reason or "length"
    policy.finish()
    gen.text += text.flush()


def _prefill(
    session: Session,
    call: _Call,
    drafters: list[Drafter],
    stats: Stats,
    on_prefill: Callable[[int, int], None] | None,
) -> None:
    """The Target takes the prompt but its last token (the first round's input), and every
    drafter is told the call's context."""
    start, ids, width = time.perf_counter(), call.ids, session.vocab_size
    stats.prompt_tokens = len(ids)
    done = session.target.start(ids[:-1], call.params, width, on_prefill, call.processor)
    stats.prefill_tokens = done
    for drafter in drafters:
        if registry.reads_hidden(drafter):
            drafter.start(ids, session.target.features)
        else:
            drafter.start(ids)
    stats.prefill_time = time.perf_counter() - start


def _propose(plan, asked: int, keys: mx.array, target: Target, last: int) -> Proposal:
    """The planned drafter's proposal of at most `asked` drafts after `last`: a tree where
    the plan has one (cut to `asked` nodes: a planned shape's prefix is the best of its
    size), else a chain, drawn as the call's processor shapes the target (draft_draw)."""
    if plan.tree is None:
        proposal = plan.drafter.propose(asked, keys, target.draft_draw(last), plan.go_on)
    else:
        shape = trees.Shape(plan.tree.parents[:asked], plan.tree.depth)
        proposal = plan.drafter.propose(asked, keys, target.draw, plan.go_on, tree=shape)
    return _at_most(asked, proposal)


def _at_most(asked: int, proposal: Proposal) -> Proposal:
    """A proposal within what was asked: more drafts could run past max_tokens, or past
    the keys drawn for the round."""
    if proposal.tokens.shape[0] > asked:
        raise SpecmlxError(
            f"a drafter proposed {proposal.tokens.shape[0]} drafts where {asked} were asked; "
            "a proposal (chain or tree) holds at most the g drafts asked"
        )
    return proposal


class _Keys:
    """Each round's random keys. Rejection sampling splits them from the seed round by
    round; coupled sampling keys every output position by (seed, position) alone, so the
    text does not depend on how the positions fell into rounds."""

    def __init__(self, seed: int, coupled: bool):
        self.key = mx.random.key(seed)
        self.at = position_keys(seed) if coupled else None

    def round(self, produced: int, asked: int) -> tuple[mx.array, mx.array | None]:
        """(the round's key: a plain step's, or the verify's (one per position when
        coupled); a key per draft, None for a plain round), `produced` tokens in."""
        if self.at is not None:
            keys = self.at(produced, asked + 1)
            return (keys if asked else keys[0]), (keys[:asked] if asked else None)
        self.key, round_key = mx.random.split(self.key)
        if not asked:
            return round_key, None
        draft_key, round_key = mx.random.split(round_key)
        return round_key, mx.random.split(draft_key, asked)

    def plain(self, produced: int) -> mx.array:
        """The key of a plain round that starts after the round now running, at
        `produced` tokens in: built ahead, before that round is planned."""
        if self.at is not None:
            return self.at(produced, 1)[0]
        return mx.random.split(self.key)[1]


def _summary(
    plan, asked: int, proposal: Proposal | None, verdict: Verdict, draft_s: float, rewind_s: float
) -> RoundSummary:
    """The round in numbers, for the statistics and the policy."""
    common = dict(verify_s=verdict.verify_s, rewind_s=rewind_s, target_tops=verdict.tops)
    if proposal is None:
        return RoundSummary(plan, "plain", asked, 0, 0, 0.0, **common)
    return RoundSummary(
        plan,
        plan.drafter.name,
        asked,
        proposal.tokens.shape[0],
        verdict.accepted,
        draft_s - proposal.prompt_s,
        prompt_s=proposal.prompt_s,
        fed=proposal.fed,
        first=proposal.first,
        timed_draft_s=proposal.timed_draft_s,
        tree_as_chain=verdict.tree_as_chain,
        draft_tops=proposal.tops,
        parents=None if verdict.tree_as_chain else proposal.parents,
        path=verdict.path,
        **common,
    )


class _Text:
    """The text of emitted tokens, streamed: ends at EOS (never emitted), and flushes the
    detokenizer's held-back bytes as soon as a token is known to be the last."""

    def __init__(self, tokenizer, logprobs: int | None = None):
        self.eos = tokenizer.eos_token_ids
        self.detok = tokenizer.detokenizer
        self.ended = False
        self.flushed = False
        self.logprobs = logprobs  # k for each Step's top_logprobs; None: no logprobs

    def steps(self, verdict: Verdict, room: int, summary: RoundSummary) -> Iterator[Step]:
        """Steps for a round's emitted tokens (its first `accepted` were drafts), at most
        `room`, with their log-probabilities where the call asked for them."""
        block, accepted = verdict.emitted, verdict.accepted
        scored = verdict.logprobs(self.logprobs) if self.logprobs is not None else None
        for i, token in enumerate(block[:room]):
            if token in self.eos:
                self.ended = True
                return
            self.detok.add_token(token)
            if i + 1 == room or (i + 1 < len(block) and block[i + 1] in self.eos):
                self.detok.finalize()  # known to be the last token
                self.flushed = True
            lp, top = scored[i] if scored is not None else (None, None)
            by = summary.source if i < accepted else None  # a plain round accepts none
            yield Step(token, self.detok.last_segment, i < accepted, lp, top, by, summary.drafted)

    def flush(self) -> str:
        """What the detokenizer still held when EOS opened a round: the token before it
        was streamed before anyone knew it was the last."""
        if self.flushed:
            return ""
        self.detok.finalize()
        return self.detok.last_segment
