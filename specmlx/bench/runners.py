"""One timed generation per engine: specmlx (the target alone at γ = 0) and mlx-lm's own
stream_generate, on the same loaded models, timed on the same clock, each returned as a
RunRecord.

Timing is the same for every engine: prefill (prompt into the KV caches of the target,
and of the draft when there is one), then decode from the first round to the last
token. mlx-lm's prefill is done here with the same model calls and handed over as its
`prompt_cache`, so its decode clock starts exactly where specmlx's does.

The engine, the caches and mlx-lm import mlx-lm's model code (seconds): they are imported
in the functions that run them, so rendering a saved result never pays for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import mlx.core as mx

from ..loading import Model
from .machine import process_memory
from .modes import Mode
from .record import RunRecord


def encode(model: Model, text: str, chat_template: bool) -> list[int]:
    """Token ids of `text`, wrapped in the chat template when asked and available."""
    tokenizer = model.tokenizer
    if chat_template and getattr(tokenizer, "has_chat_template", False):
        messages = [{"role": "user", "content": text}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    from ..engine import encode_prompt

    return encode_prompt(model, text)


def run_specmlx(
    target: Model,
    draft: Model | None,
    ids: list[int],
    mode: Mode,
    temperature: float,
    max_tokens: int,
    seed: int,
) -> RunRecord:
    """specmlx.generate at the mode's γ and draft mode (γ = 0: the target alone)."""
    from ..drafters import uses_model
    from ..engine import generate

    mx.reset_peak_memory()
    start = time.perf_counter()
    kwargs: dict = {"num_draft": mode.gamma, "draft_mode": mode.draft_mode}
    kwargs["sampling"] = mode.sampling
    if mode.speculative and uses_model(mode.draft_mode):  # prompt lookup needs none
        kwargs["draft"] = draft
    gen = generate(
        target, ids, max_tokens=max_tokens, temperature=temperature, seed=seed, **kwargs
    ).run()
    wall = time.perf_counter() - start
    s = gen.stats
    return RunRecord(
        prompt_id="",
        category="",
        temperature=temperature,
        mode=mode.name,
        engine=mode.engine,
        gamma=mode.gamma,
        family=mode.family,
        order=-1,
        prompt_tokens=s.prompt_tokens,
        tokens=s.tokens,
        token_ids=list(gen.tokens),
        text=gen.text,
        finish_reason=s.finish_reason,
        prefill_s=s.prefill_time,
        ttft_s=s.ttft,
        decode_s=s.decode_time,
        wall_s=wall,
        target_passes=s.target_passes,
        drafted=s.drafted,
        accepted=s.accepted,
        draft_s=s.draft_time,
        peak_memory_bytes=mx.get_peak_memory(),
        rss_bytes=process_memory()[0],
        accepted_by_position=list(s.accepted_by_position),
        drafted_by_position=list(s.drafted_by_position),
        engine_stats=s.to_dict(),
    )


def mlx_lm_rounds(flags: list[bool], gamma: int, max_tokens: int) -> dict:
    """Rebuild mlx-lm's rounds from its per-token `from_draft` flags.

    mlx-lm drafts min(γ, tokens left) each round, accepts the longest prefix equal to
    the target's own tokens (flagged True) and then emits one target token (False).
    `flags` must include the EOS token's flag when generation stopped on EOS.
    """
    rounds = drafted = accepted = emitted = 0
    drafted_at: list[int] = []
    accepted_at: list[int] = []
    i = 0
    while i < len(flags):
        g = min(gamma, max_tokens - emitted)
        rounds += 1
        drafted += g
        n = 0
        while i < len(flags) and flags[i] and n < g:
            n += 1
            i += 1
        drafted_at += [0] * (g - len(drafted_at))
        accepted_at += [0] * (g - len(accepted_at))
        for k in range(g):
            drafted_at[k] += 1
            accepted_at[k] += k < n
        accepted += n
        emitted += n
        if i < len(flags):  # the target's own token closes the round
            i += 1
            emitted += 1
    return {
        "target_passes": rounds,
        "drafted": drafted,
        "accepted": accepted,
        "drafted_by_position": drafted_at,
        "accepted_by_position": accepted_at,
    }


def run_mlx_lm(
    target: Model,
    draft: Model | None,
    ids: list[int],
    mode: Mode,
    temperature: float,
    max_tokens: int,
    seed: int,
) -> RunRecord:
    """mlx-lm's own stream_generate (speculative when mode.gamma > 0) on the same models."""
    from mlx_lm.generate import stream_generate
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    from ..caches import prefill

    mx.reset_peak_memory()
    start = time.perf_counter()
    cache = make_prompt_cache(target.module)
    prefill(target, cache, ids[:-1])
    kwargs: dict = {"sampler": make_sampler(temp=temperature)}
    if mode.speculative:
        draft_cache = make_prompt_cache(draft.module)
        prefill(draft, draft_cache, ids[:-1])
        cache = cache + draft_cache  # mlx-lm's layout: target layers, then draft layers
        kwargs.update(draft_model=draft.module, num_draft_tokens=mode.gamma)
    decode_start = time.perf_counter()
    mx.random.seed(seed)
    eos = target.tokenizer.eos_token_ids
    tokens: list[int] = []
    flags: list[bool] = []
    text = ""
    finish = "length"
    ttft = 0.0
    for response in stream_generate(
        target.module,
        target.tokenizer,
        mx.array(ids[-1:], mx.uint32),
        max_tokens=max_tokens,
        prompt_cache=cache,
        **kwargs,
    ):
        if not ttft:
            ttft = time.perf_counter() - start
        text += response.text
        flags.append(response.from_draft)
        if response.finish_reason == "stop" and response.token in eos:
            finish = "eos"
        else:
            tokens.append(response.token)
    end = time.perf_counter()
    rounds = mlx_lm_rounds(flags, mode.gamma if mode.speculative else 0, max_tokens)
    return RunRecord(
        prompt_id="",
        category="",
        temperature=temperature,
        mode=mode.name,
        engine=mode.engine,
        gamma=mode.gamma,
        family=mode.family,
        order=-1,
        prompt_tokens=len(ids),
        tokens=len(tokens),
        token_ids=tokens,
        text=text,
        finish_reason=finish,
        prefill_s=decode_start - start,
        ttft_s=ttft,
        decode_s=end - decode_start,
        wall_s=end - start,
        draft_s=None,
        peak_memory_bytes=mx.get_peak_memory(),
        rss_bytes=process_memory()[0],
        **rounds,
    )


# A runner per Mode.engine; run_bench takes others (tests time fakes).
RUNNERS: dict[str, Callable[..., RunRecord]] = {"specmlx": run_specmlx, "mlx-lm": run_mlx_lm}
