"""The OpenAI-compatible HTTP API: chat and text completions (streamed or not), models,
health. Handlers parse and check a request on the event loop, queue its decode on the
worker, and shape what comes back as OpenAI does, plus a `specmlx` object of the run's
speculative statistics.
"""

from __future__ import annotations

import hmac
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import mlx.core as mx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from ..engine import Stats
from ..errors import SpecmlxError
from ..loading import Model
from .errors import HANDLERS, APIError, error_body
from .fields import Asked, Defaults, parse, read_json
from .pool import SessionPool
from .prompts import Transcripts, chat_text, check_context, completion_ids
from .worker import Finished, Job, Worker


def make_app(
    target: Model,
    draft: Model | None,
    *,
    model_id: str,
    api_key: str | None = None,
    cache_bytes: int = 4 << 30,
    defaults: Defaults = Defaults(),
) -> Starlette:
    """The server for one model pair; its decode thread runs while the app is served.

    model_id: the name clients pass as `model` (the target's directory name is also
    accepted). api_key: when set, every /v1 request must carry it as a bearer token.
    cache_bytes: the budget for the KV caches kept between requests.
    """
    # MLX evaluates an array on the streams of the thread that made it, and the decode
    # thread has its own: lazily loaded weights must be read here, by the thread that
    # loaded them, or the first forward pass on the decode thread fails.
    mx.eval([m.module.parameters() for m in (target, draft) if m is not None])
    worker = Worker(SessionPool(target, draft, cache_bytes))
    transcripts = Transcripts()
    names = {model_id, target.name, str(target.path)}
    created = int(time.time())

    def check_request(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(
                401,
                "invalid API key (send it as Authorization: Bearer KEY)",
                None,
                "invalid_api_key",
            )

    async def read(request: Request, chat: bool) -> Asked:
        check_request(request)
        asked = parse(read_json(await request.body()), chat, defaults)
        if asked.model not in names:
            raise APIError(
                404,
                f"the model {asked.model!r} does not exist; this server runs {model_id!r}",
                "model",
                "model_not_found",
            )
        return asked

    def start(asked: Asked, ids: list[int], param: str) -> Job:
        room = check_context(target, ids, param)
        seed = asked.seed if asked.seed is not None else secrets.randbits(63)
        return worker.submit(ids, asked.settings(min(asked.max_tokens, room), seed), asked.stops)

    async def chat_completions(request: Request):
        asked = await read(request, chat=True)
        text = chat_text(target, asked.messages)
        ids = transcripts.encode(target.tokenizer, text)
        job = start(asked, ids, "messages")

        def remember(done: Finished) -> None:
            # The prompt, and the prompt with its reply as the client got it, unless a stop
            # string cut that short of its tokens: the next turn extends one of them.
            # (The reply's text need not be what its tokens decode to alone: detokenizers
            # drop a first token's leading space, say. What counts is that the client
            # sends this text back, and that these are the tokens the model saw.)
            transcripts.remember(text, ids)
            if not done.cut:
                transcripts.remember(text + done.text, ids + done.tokens)

        return await respond(job, asked, "chat.completion", len(ids), remember)

    async def completions(request: Request):
        asked = await read(request, chat=False)
        ids = completion_ids(target, asked.prompt)
        job = start(asked, ids, "prompt")
        return await respond(job, asked, "text_completion", len(ids), lambda done: None)

    async def respond(job: Job, asked: Asked, kind: str, prompt_tokens: int, remember):
        reply = Reply(kind, asked.model)
        if asked.stream:
            events = stream(job, reply, prompt_tokens, asked.include_usage, remember)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            done = await job.result()
        except SpecmlxError as e:
            raise APIError(400, str(e)) from None
        finally:
            job.cancel()  # a no-op once it finished; stops it if this handler is cancelled
        remember(done)
        return JSONResponse(reply.whole(done, prompt_tokens))

    async def models(request: Request):
        check_request(request)
        data = [{"id": model_id, "object": "model", "created": created, "owned_by": "specmlx"}]
        return JSONResponse({"object": "list", "data": data})

    async def health(request: Request):
        pool = worker.pool
        return JSONResponse(
            {
                "status": "ok",
                "model": model_id,
                "draft": draft.name if draft else None,
                "waiting": worker.waiting(),
                "decoded_tokens": worker.decoded_tokens,
                "sessions": len(pool.idle),
                "cache_bytes": pool.cache_bytes,
            }
        )

    @asynccontextmanager
    async def lifespan(app: Starlette):
        worker.start()
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(worker.stop)

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers=HANDLERS, lifespan=lifespan)


async def stream(
    job: Job, reply: Reply, prompt_tokens: int, include_usage: bool, remember
) -> AsyncIterator[str]:
    """Server-sent events: the reply's pieces as chunks, a last chunk with the finish
    reason (and the run's statistics), usage if asked, then [DONE]. A client that goes
    away cancels this generator, which cancels the Job."""
    try:
        if reply.chat:
            yield sse(reply.first_chunk())
        async for text in job.texts():
            yield sse(reply.chunk(text))
        done = job.finished
        remember(done)
        yield sse(reply.last_chunk(done))
        if include_usage:
            yield sse(reply.usage_chunk(done, prompt_tokens))
    except Exception as e:  # the status line has gone: report it as OpenAI streams do
        status = 400 if isinstance(e, SpecmlxError) else 500
        yield sse(error_body(status, str(e) if status == 400 else f"internal error: {e}"))
    finally:
        job.cancel()
    yield "data: [DONE]\n\n"


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class Reply:
    """The response's shape, chat or text completion, whole or as stream chunks."""

    def __init__(self, kind: str, model: str):
        self.chat = kind == "chat.completion"
        self.kind, self.model = kind, model
        self.chunk_kind = "chat.completion.chunk" if self.chat else kind
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _body(self, kind: str, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _choice(self, key: str, content: dict | str, finish: str | None = None) -> dict:
        return {"index": 0, key: content, "logprobs": None, "finish_reason": finish}

    def whole(self, done: Finished, prompt_tokens: int) -> dict:
        if self.chat:
            message = {"role": "assistant", "content": done.text}
            choice = self._choice("message", message, done.finish_reason)
        else:
            choice = self._choice("text", done.text, done.finish_reason)
        body = self._body(self.kind, [choice])
        body.update(usage=usage(done, prompt_tokens), specmlx=run_stats(done.stats))
        return body

    def first_chunk(self) -> dict:
        """A chat stream opens with who speaks (text completions have no roles)."""
        delta = {"role": "assistant", "content": ""}
        return self._body(self.chunk_kind, [self._choice("delta", delta)])

    def chunk(self, text: str, finish: str | None = None) -> dict:
        if self.chat:
            choice = self._choice("delta", {"content": text} if text else {}, finish)
        else:
            choice = self._choice("text", text, finish)
        return self._body(self.chunk_kind, [choice])

    def last_chunk(self, done: Finished) -> dict:
        body = self.chunk("", done.finish_reason)
        body["specmlx"] = run_stats(done.stats)
        return body

    def usage_chunk(self, done: Finished, prompt_tokens: int) -> dict:
        body = self._body(self.chunk_kind, [])
        body["usage"] = usage(done, prompt_tokens)
        return body


def usage(done: Finished, prompt_tokens: int) -> dict:
    completion = done.stats.tokens
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def run_stats(stats: Stats) -> dict:
    """The speculative numbers of one reply, as `specmlx generate --json` names them."""
    return {
        "acceptance": stats.acceptance,
        "tokens_per_pass": stats.tokens_per_pass,
        "gamma": stats.gamma,
        "rounds_by_gamma": {str(g): n for g, n in sorted(stats.rounds_by_gamma.items())},
        "draft_mode": stats.draft_mode,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "decode_tps": stats.decode_tps,
        "ttft_s": stats.ttft,
        "prompt_tokens": stats.prompt_tokens,
        "prefill_tokens": stats.prefill_tokens,
    }
