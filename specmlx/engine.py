"""The engine: speculative rounds, rollback, stop conditions, statistics.

One round: the policy plans (which drafter, how many drafts); the drafter proposes g
tokens with their q; the target runs ONE forward pass over [last emitted token, d_1..d_g]
and yields g+1 distributions; accept/reject on the device; the caches commit the
accepted prefix; the policy and the statistics observe the round. With no drafter it is
plain autoregressive decoding of the target, the baseline everything is measured
against, sampled through the very same code (so greedy outputs match exactly).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import mlx.core as mx

from .caches import (
    check_rollback,
    checkpoint,
    make_cache,
    rewind,
    set_state,
    snapshot,
    state_of,
    sync_cache,
    trims_exactly,
)
from .drafters import CostProbe, Drafter, LookupDrafter, ModelDrafter, model_drafter
from .errors import SpecmlxError
from .loading import Model, backend, check_pair
from .policy import AutoGamma, FixedGamma, Policy, Round, load_costs, save_costs
from .policy.choice import Scheduler
from .sampling import SamplingParams
from .settings import MAX_GAMMA, check_seed, check_settings, resolve_draft_mode
from .verify import make_sampler, make_verifier


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
    # What auto's last choice for the draft model rested on (see policy.Plan): the draft's
    # cost per target pass and this text's forecast α; None where not measured or seen.
    draft_ratio: float | None = None
    forecast_alpha: float | None = None
    prefill_time: float = 0.0  # both models' prompt processing (the draft's too), seconds
    draft_time: float = 0.0
    verify_time: float = 0.0
    rewind_time: float = 0.0  # rejected drafts undone by running kept tokens again
    rewinds: int = 0  # rounds that needed such a re-run (caches that cannot be trimmed)
    decode_time: float = 0.0  # first round to last token, seconds
    ttft: float = 0.0  # call to first emitted token, seconds
    finish_reason: str = ""  # "eos" | "length"
    eos: int = 0  # 1 where the target produced an EOS (never emitted, but a pass made it)
    accepted_by_position: list[int] = field(default_factory=list)
    drafted_by_position: list[int] = field(default_factory=list)

    @property
    def acceptance(self) -> float:
        """alpha: the fraction of drafted tokens the target accepted."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """tau: tokens the target produced per forward pass, 1.0 for plain decoding: the
        pass that sampled an EOS counts its token too, though the EOS is never emitted."""
        produced = self.tokens + self.eos
        return produced / self.target_passes if self.target_passes else 0.0

    @property
    def decode_tps(self) -> float:
        return self.tokens / self.decode_time if self.decode_time else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.prefill_time if self.prefill_time else 0.0

    def add_round(self, r: Round) -> None:
        """Count a finished round (the engine's one observer of its own timing)."""
        self.target_passes += 1
        self.rounds_by_gamma[r.drafted] = self.rounds_by_gamma.get(r.drafted, 0) + 1
        self.rounds_by_source[r.source] = self.rounds_by_source.get(r.source, 0) + 1
        self.verify_time += r.verify_s
        self.rewind_time += r.rewind_s
        self.rewinds += r.rewind_s > 0
        if r.plan.predicted_tps:
            self.predicted_tps = r.plan.predicted_tps
        if r.plan.draft_ratio is not None:
            self.draft_ratio = r.plan.draft_ratio
        if r.plan.alpha is not None:
            self.forecast_alpha = r.plan.alpha
        if r.proposal is None:
            return
        self.draft_time += r.draft_s
        self.prefill_time += r.proposal.prompt_s
        self.drafted += r.drafted
        self.accepted += r.accepted
        self.cut_short += r.drafted < r.asked
        while len(self.drafted_by_position) < r.drafted:
            self.drafted_by_position.append(0)
            self.accepted_by_position.append(0)
        for i in range(r.drafted):
            self.drafted_by_position[i] += 1
            self.accepted_by_position[i] += i < r.accepted

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


class Session:
    """Both models' caches, kept across generate() calls, and what the γ policy learnt.

    Pass the whole conversation each time: only the tokens after the longest prefix
    already in the caches are prefilled, so a chat turn costs its new tokens only.
    An interrupted call leaves the caches consistent for the next one.
    """

    def __init__(self, target: Model, draft: Model | None = None, max_gamma: int = MAX_GAMMA):
        if draft is not None:
            check_pair(target, draft)
        self.target = target
        self.draft = draft
        self.max_gamma = max_gamma
        self._schedulers: dict[str, Scheduler] = {}
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (both caches); keep the models and what was measured."""
        self.cache = make_cache(self.target.module)
        self.cached: list[int] = []  # tokens whose entries are in the target cache
        self.prompt_snapshot = None  # the cache at the last call's prompt, where trims can't
        self.drafter = None if self.draft is None else model_drafter(self.draft, self.vocab_size)

    @property
    def cost_key(self) -> str:
        """Costs depend on both models, their dtype, the draft's head (a sub-vocabulary
        makes its pass cheaper) and the backend (and its kernels, compiled or not, and
        which build of them)."""
        return f"{self.cost_kernels}{self.cost_build}"

    @property
    def cost_kernels(self) -> str:
        """The cost key but for the kernels' build: what a rebuilt kernel's key starts with."""
        from .cpu import describe

        return f"{self.cost_kin}{describe() if backend() == 'cpu' else 'mlx'}; build "

    @property
    def cost_build(self) -> str:
        from .cpu.native import build_id

        return build_id() if backend() == "cpu" else ""

    @property
    def cost_kin(self) -> str:
        """What cost keys of the same models on other kernels start with: their costs are
        this pair's first guess (policy.load_costs)."""

        def model(m: Model | None) -> str:
            return f"{m.path}:{m.dtype}:{m.weights or 'as stored'}" if m else "-"

        head = self.drafter.head if self.drafter is not None else None
        vocab = f"head {head.ids.size}" if head is not None else "full head"
        return f"{model(self.target)}|{model(self.draft)}:{vocab}|{backend()}|"

    def scheduler(self, source: str) -> Scheduler:
        """The γ policy for a draft source; both share one measured target cost curve."""
        if not self._schedulers:
            costs = load_costs(self.cost_key, (self.cost_kernels, self.cost_kin))
            self._schedulers = {
                "model": Scheduler(costs, self.max_gamma),
                "lookup": Scheduler(costs, self.max_gamma, free_drafts=True),
            }
        return self._schedulers[source]

    def save_costs(self) -> None:
        if self._schedulers:
            # replacing: a rebuilt kernel's figures stand for the build before (which
            # they started from, as a kin: load_costs), so that one is dropped
            save_costs(self.cost_key, self._schedulers["model"].costs, replacing=self.cost_kernels)

    @property
    def vocab_size(self) -> int:
        sizes = [self.target.vocab_size] + ([self.draft.vocab_size] if self.draft else [])
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
    draft: Model | None = None,
    *,
    max_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    num_draft: int | str = "auto",
    draft_mode: str | None = None,
    seed: int = 0,
    session: Session | None = None,
    on_prefill: Callable[[int, int], None] | None = None,
) -> Generation:
    """Generate from `target`, speculatively when a `draft` is given.

    The output distribution is exactly the target's (processed with temperature,
    top-k, top-p); at temperature 0 the tokens equal the target's own greedy tokens.
    Iterate the result for Steps; its `.stats` holds the run's statistics. With a
    `session`, caches persist across calls (its draft is used unless num_draft is 0).

    num_draft: γ, an int, or "auto" to pick it each round from measured costs and
    acceptance (never slower than plain decoding by more than the probes it takes).
    draft_mode: "model" (the draft model), "lookup" (prompt n-gram lookup, no draft
    model needed) or "auto" (lookup when the context has a match, else the model); None
    (the default): "auto" with a draft model, else "model" (plain decoding).
    on_prefill: called with (tokens done, tokens in all) as the target takes the prompt,
    chunk by chunk (see caches.prefill); not called when the caches already hold it.
    """
    params, num_draft = check_settings(max_tokens, temperature, top_p, top_k, num_draft, draft_mode)
    check_seed(seed)
    if session is None:
        session = Session(target, draft)
    elif session.target is not target or (draft is not None and session.draft is not draft):
        raise SpecmlxError("this session was made for other models; make a new Session")
    draft_mode = resolve_draft_mode(draft_mode, session.drafter is not None)
    ids = encode_prompt(target, prompt)
    policy, drafters = _policy(session, params, num_draft, draft_mode)
    if drafters:
        check_rollback(target, *(d.model for d in drafters if isinstance(d, ModelDrafter)))
    else:
        num_draft = 0

    def steps(gen: Generation) -> Iterator[Step]:
        gen.stats.gamma, gen.stats.draft_mode = num_draft, draft_mode
        try:
            yield from _decode(
                session, ids, params, max_tokens, seed, policy, drafters, gen, on_prefill
            )
        except GeneratorExit:  # closed between steps: the caches hold what was emitted
            raise
        except BaseException:
            # Stopped mid-pass (Ctrl-C, an error): a cache that cannot be trimmed back may
            # hold part of a round; the next call must prefill it anew.
            if not trims_exactly(session.cache):
                session.cached.clear()
            drafter = session.drafter
            if drafter is not None and not trims_exactly(drafter.cache):
                drafter.cached.clear()
            raise

    return Generation(steps)


def _policy(
    session: Session, params: SamplingParams, gamma: int | str, draft_mode: str
) -> tuple[Policy, list[Drafter]]:
    """The γ policy for this call, and every drafter that must follow the text."""
    vocab, sampled = session.vocab_size, not params.greedy
    model = session.drafter if draft_mode != "lookup" else None
    lookup = LookupDrafter(vocab, sampled) if draft_mode != "model" else None
    if gamma == 0 or (model is None and lookup is None):
        return FixedGamma(0, None, None), []
    drafters: list[Drafter] = [d for d in (model, lookup) if d is not None]
    if gamma != "auto":
        return FixedGamma(gamma, model, lookup), drafters
    probe = CostProbe(vocab, sampled)
    schedulers = {"model": session.scheduler("model"), "lookup": session.scheduler("lookup")}
    policy = AutoGamma(schedulers, model, lookup, probe, vocab, sampled, session.save_costs)
    return policy, [*drafters, probe]


def _decode(
    session: Session,
    ids: list[int],
    params: SamplingParams,
    max_tokens: int,
    seed: int,
    policy: Policy,
    drafters: list[Drafter],
    gen: Generation,
    on_prefill: Callable[[int, int], None] | None = None,
) -> Iterator[Step]:
    target, cache, cached, stats = session.target, session.cache, session.cached, gen.stats
    stats.prompt_tokens = len(ids)
    start = time.perf_counter()
    stats.prefill_tokens = sync_cache(
        target, cache, cached, ids[:-1], on_prefill, session.prompt_snapshot
    )
    session.prompt_snapshot = snapshot(cache, cached)
    for drafter in drafters:
        drafter.start(ids)
    stats.prefill_time = time.perf_counter() - start
    verify = make_verifier(params, session.vocab_size)
    draw = make_sampler(params, session.vocab_size)
    text = _Text(target.tokenizer)
    key, last = mx.random.key(seed), ids[-1]
    decode_start, prompt_s = time.perf_counter(), 0.0
    # While Python handles a plain round's token, the device computes the next plain pass
    # (as mlx-lm's generate_step does: bench/plain_queue.py). A plain round builds that
    # pass before it reads its own token, but runs it only once the next round is planned
    # plain: where the next round drafts, the pass is taken back out of the cache unrun
    # (a trim would leave its writes in the arrays, computed when next read: a whole
    # target pass lost at every switch to drafting). Only caches that trim exactly
    # pipeline: the others checkpoint and rewind around every pass.
    pipeline = trims_exactly(cache)
    queued = None  # (logits, probs, token) of a running plain pass over `last`
    plan = policy.plan(max_tokens)
    # Never draft past max_tokens: a fully accepted round emits g + 1 tokens.
    asked = min(plan.gamma, max_tokens - 1)

    while True:
        key, round_key = mx.random.split(key)
        _, next_key = mx.random.split(key)  # the round_key of the next round
        t0 = time.perf_counter()
        proposal = ahead = None
        if asked > 0:
            draft_key, round_key = mx.random.split(round_key)
            proposal = plan.drafter.propose(asked, draft_key, draw, plan.go_on)
            mx.eval(proposal.tokens, proposal.q)
            prompt_s += proposal.prompt_s
        t1 = time.perf_counter()
        saved = checkpoint(cache) if proposal is not None else None
        if proposal is not None:
            x = mx.concatenate([mx.array([last], mx.uint32), proposal.tokens])
            logits = target.module(x[None], cache=cache)[0]
            n, token, probs = verify(logits, proposal.q, proposal.tokens, round_key)
            mx.eval(n, token)  # the one host sync of the round
        else:
            if queued is None:
                queued = _plain_pass(target, cache, draw, mx.array([last], mx.uint32), round_key)
            (logits, probs, token), queued, n = queued, None, 0
            if pipeline and stats.tokens + 1 < max_tokens:
                before = state_of(cache)
                ahead = _plain_pass(target, cache, draw, token, next_key, run=False)
            mx.eval(token)  # the sync: only this pass, not the one built after it
        n, token = int(n), token.item()
        t2 = time.perf_counter()
        drafts = proposal.tokens.tolist() if proposal is not None else []
        rerun = rewind(target, cache, saved, [last, *drafts[:n]], len(drafts) - n)
        cached += [last, *drafts[:n]]
        emitted = [*drafts[:n], token]
        for drafter in drafters:
            rerun += drafter.commit(proposal if drafter is plan.drafter else None, n, emitted)
        t3 = time.perf_counter()
        source = plan.drafter.name if proposal is not None else "plain"
        draft_s = t1 - t0 - (proposal.prompt_s if proposal is not None else 0.0)
        rewind_s = t3 - t2 if rerun else 0.0
        done = Round(
            plan, source, asked, len(drafts), n, draft_s, t2 - t1, rewind_s, proposal, logits, probs
        )
        stats.add_round(done)
        policy.observe(done)
        last = token
        left = max_tokens - stats.tokens - len(emitted)
        more = left > 0 and not any(t in text.eos for t in emitted)
        if more:
            plan = policy.plan(left)
            asked = min(plan.gamma, left - 1)
        if ahead is not None:
            if more and asked == 0:
                del before  # its views would make the pass copy each layer's arrays
                mx.async_eval(ahead[2])
                queued = ahead
            else:
                set_state(cache, before)
        elif more and asked == 0 and pipeline:
            queued = _plain_pass(target, cache, draw, mx.array([last], mx.uint32), next_key)
        policy.while_running()  # what the policy can learn with the next pass running
        for step in text.steps(emitted, n, max_tokens - stats.tokens):
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


def _plain_pass(
    target: Model, cache: list, draw, x: mx.array, key: mx.array, run: bool = True
) -> tuple:
    """One plain step over token `x`: (logits, probs, token), lazy, and set running unless
    `run` is False."""
    logits = target.module(x.reshape(1, 1), cache=cache)[0, -1:]
    probs, token = draw(logits, key)
    if run:
        mx.async_eval(token)
    return logits, probs, token


class _Text:
    """The text of emitted tokens, streamed: ends at EOS (never emitted), and flushes the
    detokenizer's held-back bytes as soon as a token is known to be the last."""

    def __init__(self, tokenizer):
        self.eos = tokenizer.eos_token_ids
        self.detok = tokenizer.detokenizer
        self.ended = False
        self.flushed = False

    def steps(self, block: list[int], accepted: int, room: int) -> Iterator[Step]:
        """Steps for a round's `block` (its first `accepted` were drafts), at most `room`."""
        for i, token in enumerate(block[:room]):
            if token in self.eos:
                self.ended = True
                return
            self.detok.add_token(token)
            if i + 1 == room or (i + 1 < len(block) and block[i + 1] in self.eos):
                self.detok.finalize()  # known to be the last token
                self.flushed = True
            yield Step(token, self.detok.last_segment, i < accepted)

    def flush(self) -> str:
        """What the detokenizer still held when EOS opened a round: the token before it
        was streamed before anyone knew it was the last."""
        if self.flushed:
            return ""
        self.detok.finalize()
        return self.detok.last_segment
