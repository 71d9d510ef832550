"""Speculative decoding: the round loop, cache rollback, stop conditions and statistics.

One round: the drafter proposes g tokens; the target runs ONE forward pass over
[last emitted token, d_1..d_g] and yields g+1 distributions; accept/reject on the
device; both caches are trimmed back to the accepted prefix. With no drafter it is
plain autoregressive decoding of the target, the baseline everything is measured
against, sampled through the very same code (so greedy outputs must match exactly).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import mlx.core as mx
import numpy as np

from .caches import check_rollback, make_cache, sync_cache, trim, unrollable
from .drafters import LookupDrafter, ModelDrafter, point_mass
from .errors import SpecmlxError
from .loading import Model, backend, check_pair
from .sampling import SamplingParams
from .schedule import Scheduler, load_costs, save_costs
from .verify import make_sampler, make_verifier, top_probabilities, top_probability


@dataclass(frozen=True)
class Step:
    token: int  # the emitted token id
    text: str  # the text this token adds (may be "" while a multi-byte char is incomplete)
    from_draft: bool  # an accepted draft token (True) or the target's own sample (False)


@dataclass
class Stats:
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens actually processed (the rest came from the cache)
    tokens: int = 0  # emitted (EOS excluded)
    target_passes: int = 0  # target forward passes after prefill
    drafted: int = 0
    accepted: int = 0
    gamma: int | str = 0  # as asked: an int, or "auto"
    draft_mode: str = "model"
    rounds_by_gamma: dict[int, int] = field(default_factory=dict)  # the γ actually used
    rounds_by_source: dict[str, int] = field(default_factory=dict)  # model/lookup/probe/plain
    cut_short: int = 0  # auto rounds the draft's own confidence ended before the γ chosen
    predicted_tps: float = 0.0  # the cost model's forecast for its last choice (auto only)
    prefill_time: float = 0.0  # both models' prompt processing (the draft's too), seconds
    draft_time: float = 0.0
    verify_time: float = 0.0
    decode_time: float = 0.0  # first round to last token, seconds
    ttft: float = 0.0  # call to first emitted token, seconds
    finish_reason: str = ""  # "eos" | "length"
    accepted_by_position: list[int] = field(default_factory=list)
    drafted_by_position: list[int] = field(default_factory=list)

    @property
    def acceptance(self) -> float:
        """alpha: the fraction of drafted tokens the target accepted."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """tau: mean tokens emitted per target forward pass (1.0 for plain decoding)."""
        return self.tokens / self.target_passes if self.target_passes else 0.0

    @property
    def decode_tps(self) -> float:
        return self.tokens / self.decode_time if self.decode_time else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.prefill_time if self.prefill_time else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(
            acceptance=self.acceptance,
            tokens_per_pass=self.tokens_per_pass,
            decode_tps=self.decode_tps,
            prefill_tps=self.prefill_tps,
        )
        return out


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


DRAFT_MODES = ("model", "lookup", "auto")


class Session:
    """Both models' KV caches, kept across generate() calls.

    Pass the whole conversation each time: only the tokens after the longest prefix
    already in the caches are prefilled, so a chat turn costs its new tokens only.
    An interrupted call leaves the caches consistent for the next one.
    """

    def __init__(self, target: Model, draft: Model | None = None, max_gamma: int = 8):
        if draft is not None:
            check_pair(target, draft)
        self.target = target
        self.draft = draft
        self.max_gamma = max_gamma
        self.cache = make_cache(target.module)
        self.cached: list[int] = []  # tokens whose KV entries are in the target cache
        self.drafter = ModelDrafter(draft) if draft is not None else None
        self._schedulers: dict[str, Scheduler] = {}

    @property
    def cost_key(self) -> str:
        """Costs depend on both models, their dtype and the backend (and its kernels)."""
        from .native import describe

        def model(m: Model | None) -> str:
            return f"{m.path}:{m.dtype}:{m.weights or 'as stored'}" if m else "-"

        kernels = describe() if backend() == "cpu" else "mlx"
        return f"{model(self.target)}|{model(self.draft)}|{backend()}|{kernels}"

    def scheduler(self, source: str) -> Scheduler:
        """The γ policy for a draft source; both share one measured target cost curve."""
        if not self._schedulers:
            costs = load_costs(self.cost_key)
            self._schedulers = {
                "model": Scheduler(costs, self.max_gamma),
                "lookup": Scheduler(costs, self.max_gamma, free_drafts=True),
            }
        return self._schedulers[source]

    def save_costs(self) -> None:
        if self._schedulers:
            save_costs(self.cost_key, self._schedulers["model"].costs)

    @property
    def vocab_size(self) -> int:
        sizes = [self.target.vocab_size] + ([self.draft.vocab_size] if self.draft else [])
        return min(sizes)

    def reset(self) -> None:
        self.__init__(self.target, self.draft)


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
    draft: Model | None = None,
    *,
    max_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    num_draft: int | str = "auto",
    draft_mode: str = "model",
    seed: int = 0,
    session: Session | None = None,
) -> Generation:
    """Generate from `target`, speculatively when a `draft` is given.

    The output distribution is exactly the target's (processed with temperature,
    top-k, top-p); at temperature 0 the tokens equal the target's own greedy tokens.
    Iterate the result for Steps; its `.stats` holds the run's statistics. With a
    `session`, caches persist across calls (its draft is used unless num_draft is 0).

    num_draft: γ, an int, or "auto" to pick it each round from measured costs and
    acceptance (never slower than plain decoding by more than the probes it takes).
    draft_mode: "model" (the draft model), "lookup" (prompt n-gram lookup, no draft
    model needed) or "auto" (lookup when the context has a match, else the model).
    """
    params = SamplingParams(temperature, top_p, top_k)
    if max_tokens < 1:
        raise SpecmlxError(f"max_tokens must be >= 1, got {max_tokens}")
    if num_draft != "auto" and (
        isinstance(num_draft, bool) or not isinstance(num_draft, int) or num_draft < 0
    ):
        raise SpecmlxError(
            f"num_draft (gamma) must be 'auto' or an integer >= 0, got {num_draft!r}"
        )
    if draft_mode not in DRAFT_MODES:
        raise SpecmlxError(
            f"draft mode must be one of {', '.join(DRAFT_MODES)}, got {draft_mode!r}"
        )
    if session is None:
        session = Session(target, draft)
    elif session.target is not target or (draft is not None and session.draft is not draft):
        raise SpecmlxError("this session was made for other models; make a new Session")
    if num_draft != 0 and (draft_mode != "model" or session.draft is not None):
        check_rollback(
            target, *([session.draft] if session.draft and draft_mode != "lookup" else [])
        )
    ids = encode_prompt(target, prompt)

    def steps(gen: Generation) -> Iterator[Step]:
        try:
            yield from _decode(session, ids, params, max_tokens, num_draft, draft_mode, seed, gen)
        except GeneratorExit:  # closed between steps: the caches hold what was emitted
            raise
        except BaseException:
            # Stopped mid-pass (Ctrl-C, an error): a cache that cannot be trimmed back may
            # hold part of a round; the next call must prefill it anew.
            if unrollable(session.cache) is not None:
                session.cached.clear()
            raise

    return Generation(steps)


def _decode(
    session: Session,
    ids: list[int],
    params: SamplingParams,
    max_tokens: int,
    gamma: int | str,
    draft_mode: str,
    seed: int,
    gen: Generation,
) -> Iterator[Step]:
    target, cache, cached = session.target, session.cache, session.cached
    model_drafter = session.drafter if draft_mode != "lookup" else None
    lookup = LookupDrafter(ids) if draft_mode != "model" else None
    speculate = gamma != 0 and (model_drafter is not None or lookup is not None)
    vocab = session.vocab_size
    stats = gen.stats
    stats.gamma = gamma if speculate else 0
    stats.draft_mode = draft_mode
    stats.prompt_tokens = len(ids)
    start = time.perf_counter()
    stats.prefill_tokens = sync_cache(target, cache, cached, ids[:-1])
    if model_drafter is not None and speculate:
        model_drafter.prefill(ids)
        if gamma != "auto":
            model_drafter.catch_up()  # it will draft: take its prompt now, as prefill
    stats.prefill_time = time.perf_counter() - start
    if gamma == "auto":
        for source in ("model", "lookup"):
            session.scheduler(source).start_call(sampled=not params.greedy)
    verify = make_verifier(params, vocab)
    draw = make_sampler(params, vocab)
    # Plain rounds show the γ policy how sure the target is: its forecast of acceptance.
    watching = session.scheduler("model") if gamma == "auto" and model_drafter else None
    scratch = np.empty(vocab, np.float32) if watching is not None else None
    eos = target.tokenizer.eos_token_ids
    detok = target.tokenizer.detokenizer
    key = mx.random.key(seed)
    last = ids[-1]
    block = []
    prompt_pending = model_drafter is not None and gamma == "auto"  # draft prompt not fed yet
    decode_start = time.perf_counter()
    not_decode = 0.0  # the draft's prompt prefill when auto γ starts drafting mid-decode

    while stats.tokens < max_tokens:
        key, round_key = mx.random.split(key)
        t0 = time.perf_counter()
        source, g, scheduler, found = _plan_round(
            session, gamma, model_drafter, lookup, stats, max_tokens - stats.tokens
        )
        # Never draft past max_tokens: a fully accepted round emits g + 1 tokens.
        g = min(g, max_tokens - stats.tokens - 1) if speculate else 0
        caught_up = False  # this round's draft time includes tokens decoded before it
        tops = None  # the target's top probability at each judged model draft (auto)
        draft_tops: list[float] = []  # the draft's own, at each of its drafts (auto)
        if g > 0:
            draft_key, verify_key = mx.random.split(round_key)
            if source == "model":
                if prompt_pending:  # the draft's prompt is prefill, not decode, time
                    prompt_part = len(model_drafter.pending) - stats.tokens
                    fed = model_drafter.catch_up()
                    prompt_pending = False
                    caught_up = fed > prompt_part
                    moved = (time.perf_counter() - t0) * min(prompt_part, fed) / max(fed, 1)
                    stats.prefill_time += moved
                    not_decode += moved
                    t0 += moved
                # auto: the draft's own confidence may end the round early
                go_on = (
                    None if scheduler is None else _stop_rule(scheduler, draft_tops, vocab, scratch)
                )
                draft_tokens, q = model_drafter.propose(g, draft_key, draw, go_on)
                stats.cut_short += draft_tokens.shape[0] < g
                g = draft_tokens.shape[0]
            else:  # lookup, or a cost probe's free guesses (the last token repeated)
                draft_tokens = mx.array((found[:g] + [last] * g)[:g], mx.uint32)
                q = None if params.greedy else point_mass(draft_tokens, vocab)
                if source == "probe" and session.drafter and not scheduler.free_drafts:
                    # Re-time the draft too: a figure taken in a burst of load must not
                    # keep it out for good (these probes never run the draft otherwise).
                    scheduler.costs.observe_draft(session.drafter.time_pass())
            mx.eval(draft_tokens, q)
            t1 = time.perf_counter()
            x = mx.concatenate([mx.array([last], mx.uint32), draft_tokens])
            logits = target.module(x[None], cache=cache)[0]
            n, token, p = verify(logits, q, draft_tokens, verify_key)
            mx.eval(n, token)  # the one host sync of the round
            n, token = n.item(), token.item()
            if scheduler is not None and source == "model":  # calibrates the forecast
                tops = top_probabilities(logits, p, min(n + 1, g), vocab, scratch)
            drafts = draft_tokens.tolist()
            trim(cache, g - n)
            stats.draft_time += t1 - t0
            stats.drafted += g
            stats.accepted += n
            _count_positions(stats, g, n)
        else:
            source, t1 = "plain", t0
            logits = target.module(mx.array([[last]], mx.uint32), cache=cache)[0, -1:]
            probs, token = draw(logits, round_key)
            n, token, drafts = 0, token.item(), []
            if watching is not None and stats.tokens > 0:  # a reply's first token is no
                # sign of its text: it follows the chat template's header (opening_agreement.md)
                watching.observe_confidence(top_probability(logits, probs, vocab, scratch))
        t2 = time.perf_counter()
        stats.verify_time += t2 - t1
        stats.target_passes += 1
        stats.rounds_by_gamma[g] = stats.rounds_by_gamma.get(g, 0) + 1
        stats.rounds_by_source[source] = stats.rounds_by_source.get(source, 0) + 1
        if scheduler is not None:
            draft_s = None if source == "probe" else t1 - t0
            passes = None if caught_up else _draft_passes(source, g, model_drafter, scheduler)
            judged = draft_tops[: min(n + 1, g)]
            scheduler.record(g, n, t2 - t1, draft_s, passes, tops, judged)
        cached += [last] + drafts[:n]
        block = drafts[:n] + [token]
        if model_drafter is not None and source == "model":
            model_drafter.rollback(g, n, drafts, block)
        elif session.drafter is not None:
            session.drafter.pending += block  # the draft model sat out: it catches up later
        if lookup is not None:
            lookup.extend(block)
        last = token
        for i, t in enumerate(block):
            if t in eos:
                stats.finish_reason = "eos"
                break
            detok.add_token(t)
            stats.tokens += 1
            if stats.tokens == 1:
                stats.ttft = time.perf_counter() - start
            if stats.tokens == max_tokens or (i + 1 < len(block) and block[i + 1] in eos):
                detok.finalize()  # known to be the last token: flush held-back bytes
            yield Step(t, detok.last_segment, i < n)
            if stats.tokens == max_tokens:
                break
        stats.decode_time = time.perf_counter() - decode_start - not_decode
        if stats.finish_reason:
            break
    stats.finish_reason = stats.finish_reason or "length"
    if gamma == "auto":
        session.save_costs()
    if stats.finish_reason == "eos" and block[0] in eos:
        # EOS opened a round: the previous token was yielded before we knew it was last.
        detok.finalize()
        gen.text += detok.last_segment


def _plan_round(
    session: Session,
    gamma: int | str,
    model_drafter: ModelDrafter | None,
    lookup: LookupDrafter | None,
    stats: Stats,
    remaining: int,
) -> tuple[str, int, Scheduler | None, list[int]]:
    """Which drafts to use this round, how many, the scheduler that learns from it, and
    what lookup found (one scan of the history: a shorter proposal is its prefix)."""
    longest = max(session.max_gamma, gamma if gamma != "auto" else 0)
    found = lookup.find(longest) if lookup is not None else []
    if lookup is not None and (model_drafter is None or found):
        source = "lookup"
    elif model_drafter is not None:
        source = "model"
    else:
        return "plain", 0, None, found
    if gamma != "auto":
        # lookup proposes only what the context offers
        return source, len(found[:gamma]) if source == "lookup" else gamma, None, found
    scheduler = session.scheduler(source)
    choice = scheduler.choose(remaining)
    stats.predicted_tps = choice.predicted_tps
    if choice.cost_probe:
        return "probe", choice.gamma, scheduler, found
    if source == "lookup":
        return source, len(found[: choice.gamma]), scheduler, found
    return source, choice.gamma, scheduler, found


def _stop_rule(scheduler: Scheduler, draft_tops: list[float], vocab: int, scratch: np.ndarray):
    """An auto round's `go_on` for ModelDrafter.propose: keeps the draft's top probability
    at each draft in `draft_tops` and asks the scheduler whether to make another."""

    def go_on(logits: mx.array, probs: mx.array | None) -> bool:
        draft_tops.append(top_probability(logits, probs, vocab, scratch))
        return scheduler.keep_drafting(draft_tops)

    return go_on


def _draft_passes(
    source: str, g: int, drafter: ModelDrafter | None, scheduler: Scheduler
) -> float | None:
    """How many one-token draft passes this round's draft time stands for, or None when
    it is no clean figure of one: a first pass that also fed a long backlog, or a
    Session's first proposal. In a fresh process that one pays the draft model's one-time
    work (its first one-token pass: 250-280 ms against 67 ms after, on this CPU); taken as the
    draft's cost, it put the 0.5B draft at 0.8-1.0 of the 1.5B target's T(1), where it is
    0.45, and auto never drafted again in that process, code included."""
    if source != "model":
        return g
    if drafter.proposals == 1:
        return None
    if drafter.backlog == 0:
        return g
    if drafter.backlog == 1:  # after a fully accepted round: its last draft rode along
        two = scheduler.costs.ratio(2)  # priced on the target's curve, the same shape
        return g - 1 + two if two else None
    return None


def _count_positions(stats: Stats, g: int, n: int) -> None:
    while len(stats.drafted_by_position) < g:
        stats.drafted_by_position.append(0)
        stats.accepted_by_position.append(0)
    for i in range(g):
        stats.drafted_by_position[i] += 1
        stats.accepted_by_position[i] += i < n
