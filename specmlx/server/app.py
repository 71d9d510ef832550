"""The OpenAI-compatible HTTP API: chat and text completions (streamed or not), models,
health, and a chat page at `/` (page.html) that shows speculation at work. A request's
body is read within a size limit on the event loop; parsing it, rendering the chat
template and encoding the prompt run on worker threads, so a large
prompt never holds up other requests (or /health); its decode is queued on the worker,
and what comes back is shaped as OpenAI does, plus a `specmlx` object of the run's
speculative statistics. Every request is logged in one line at info level.
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import mlx.core as mx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import constrained
from ..engine import Step
from ..errors import SpecmlxError
from ..loading import Model
from .errors import HANDLERS, APIError, error_body
from .fields import Asked, Defaults, parse, read_json
from .pool import SessionPool
from .prompts import ChatPrompts, Transcripts, check_context, completion_ids
from .tokens import TokenText, chat_logprobs, kept, sources, text_logprobs
from .tools import ToolFormat, ToolFormats, ToolReply, forced_call_grammar
from .worker import Finished, Job, Mirror, Worker

log = logging.getLogger("specmlx.server")

MAX_BODY_BYTES = 4 << 20  # a 100k-token prompt is ~0.4 MB of text
# Requests prepared at once (parse, template, encode) on worker threads: more would only
# share the cores that the decode needs.
PREPARING = 4
GONE = 499  # nginx's "client closed request", for the log: nobody receives it
# The chat page at `/`: one static file that talks to this server's API.
PAGE = Path(__file__).with_name("page.html")


@dataclass(frozen=True)
class Prepared:
    """A request parsed and its prompt encoded, ready to queue."""

    asked: Asked
    ids: list[int]
    room: int  # tokens the context leaves for the reply
    text: str  # chat: the rendered prompt, as Transcripts remembers it
    tools: ToolFormat | None  # chat with tools: the model's call syntax
    grammar: str | None = None  # what the reply must follow (constrained.py); None: free


def make_app(
    target: Model,
    draft: Model | None,
    *,
    model_id: str,
    api_key: str | None = None,
    cache_bytes: int = 4 << 30,
    defaults: Defaults = Defaults(),
    strict_model: bool = False,
    max_body_bytes: int = MAX_BODY_BYTES,
    world=None,
) -> Starlette:
    """The server for one model pair; its decode thread runs while the app is served.

    model_id: the name clients pass as `model`. Any other name is served too, as the
    same model, and noted in the request's log line (clients with a fixed model name
    work), unless strict_model: then only model_id and the target's directory name or
    path are, and others get a 404. api_key: when set, every /v1 request must carry it
    as a bearer token. cache_bytes: the budget for the KV caches kept between requests.
    max_body_bytes: larger request bodies get a 413 before they are read whole.
    world: rank 0's group where the target is split over ranks (the others run
    worker.follow, decoding what this server's decode thread sends them).
    """
    # MLX evaluates an array on the streams of the thread that made it, and the decode
    # thread has its own: lazily loaded weights must be read here, by the thread that
    # loaded them, or the first forward pass on the decode thread fails.
    mx.eval([m.module.parameters() for m in (target, draft) if m is not None])
    worker = Worker(SessionPool(target, draft, cache_bytes), Mirror(world))
    transcripts = Transcripts()
    chats = ChatPrompts(target)
    formats = ToolFormats(target)
    names = {model_id, target.name, str(target.path)}
    token_text = TokenText(target.tokenizer.decode)
    created = int(time.time())
    preparing = anyio.CapacityLimiter(PREPARING)

    def check_request(request: Request) -> None:
        if api_key is None:
            return
        # The scheme is case-insensitive (RFC 9110): "bearer KEY" is as good as "Bearer KEY".
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode(), api_key.encode()
        ):
            raise APIError(
                401,
                "invalid API key (send it as Authorization: Bearer KEY)",
                None,
                "invalid_api_key",
            )

    def check_model(name: str, request: Request) -> None:
        if name in names:
            return
        if strict_model:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server runs {model_id!r}",
                "model",
                "model_not_found",
            )
        request.state.other_model = name

    async def read(request: Request) -> bytes:
        """The body, refused with a 413 as soon as it is known to exceed the limit."""
        check_request(request)
        too_large = APIError(
            413,
            f"the request body is over {max_body_bytes} bytes (the server's --max-body-mb)",
            code="request_too_large",
        )
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > max_body_bytes:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    def prepare_chat(raw: bytes, request: Request) -> Prepared:
        asked = parse(read_json(raw), True, defaults)
        check_model(asked.model, request)
        form = None
        if asked.tools:
            form = formats.get()
            if form is None:
                raise APIError(
                    400,
                    f"{target.name}'s chat template has no tool-call format that mlx-lm can "
                    "parse: tools cannot be offered to it",
                    param="tools",
                )
            if not asked.parallel_tool_calls and not form.end:
                raise APIError(
                    400,
                    f"parallel_tool_calls false is not supported for {target.name}: its calls "
                    "have no end marker to stop at",
                    param="parallel_tool_calls",
                )
        grammar = reply_grammar(target, asked, form)
        text = chats.render(asked.messages, asked.tools)
        ids = transcripts.encode(text, chats.encode)
        room = check_context(target, ids, "messages")
        return Prepared(asked, ids, room, text, form, grammar)

    def prepare_completion(raw: bytes, request: Request) -> Prepared:
        asked = parse(read_json(raw), False, defaults)
        check_model(asked.model, request)
        ids = completion_ids(target, asked.prompt)
        return Prepared(asked, ids, check_context(target, ids, "prompt"), "", None)

    async def prepared(request: Request, prepare: Callable) -> Prepared:
        raw = await read(request)
        return await anyio.to_thread.run_sync(prepare, raw, request, limiter=preparing)

    def start(ready: Prepared, arrived: float) -> Job:
        asked = ready.asked
        seed = asked.seed if asked.seed is not None else secrets.randbits(63)
        stops = asked.stops
        if ready.tools is not None and not asked.parallel_tool_calls:
            stops = [*stops, ready.tools.end]  # the reply ends with its first call
        settings = asked.settings(min(asked.max_tokens, ready.room), seed, ready.grammar)
        return worker.submit(ready.ids, settings, stops, arrived)

    async def chat_completions(request: Request):
        arrived = time.perf_counter()
        ready = await prepared(request, prepare_chat)
        job = start(ready, arrived)

        def remember(done: Finished) -> None:
            # The prompt, and the prompt with its reply as the client got it, unless a stop
            # string cut that short of its tokens: the next turn extends one of them.
            # (The reply's text need not be what its tokens decode to alone: detokenizers
            # drop a first token's leading space, say. What counts is that the client
            # sends this text back, and that these are the tokens the model saw.)
            transcripts.remember(ready.text, ready.ids)
            if not done.cut:
                transcripts.remember(ready.text + done.text, ready.ids + done.tokens)

        parts = ToolReply(ready.tools, ready.asked.tools)
        return await respond(request, job, ready, "chat.completion", parts, remember)

    async def completions(request: Request):
        arrived = time.perf_counter()
        ready = await prepared(request, prepare_completion)
        job = start(ready, arrived)
        parts = ToolReply(None, None)
        return await respond(request, job, ready, "text_completion", parts, lambda done: None)

    async def respond(
        request: Request, job: Job, ready: Prepared, kind: str, parts: ToolReply, remember
    ):
        asked = ready.asked
        reply = Reply(kind, asked.model, len(ready.ids), asked.logprobs, token_text)
        if asked.stream:
            events = stream(job, reply, parts, asked.include_usage, remember, request)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            done = await result_unless_gone(job, request)
        finally:
            job.cancel()  # a no-op once it finished; stops it if this handler is cancelled
        if done is None:
            return Response(status_code=GONE)
        remember(done)
        request.state.done = done
        content, calls = parts.add(done.text)
        rest, more = parts.finish()
        steps = kept(job.steps, done)
        body = reply.whole(done, content + rest, calls + more, finish_reason(done, parts), steps)
        return JSONResponse(body)

    async def models(request: Request):
        check_request(request)
        return JSONResponse({"object": "list", "data": [model_object(model_id)]})

    async def model(request: Request):
        check_request(request)
        name = request.path_params["model"]
        check_model(name, request)
        return JSONResponse(model_object(name))

    def model_object(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "specmlx"}

    async def page(request: Request):
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))

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
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/", page, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers=HANDLERS, lifespan=lifespan)
    app.add_middleware(LogRequests)
    return app


def reply_grammar(target: Model, asked: Asked, form: ToolFormat | None) -> str | None:
    """What a chat reply must follow (constrained.py): calls of the forced tools, or JSON
    of the response_format's schema; None where it is free. A 400 naming the field where
    it cannot be made."""
    if asked.forced_tools:
        if asked.json_schema is not None:
            raise APIError(
                400,
                "response_format cannot constrain a reply that tool_choice forces to be a "
                "call: send one of them",
                param="response_format",
            )
        chosen = [t["function"] for t in asked.tools if t["function"]["name"] in asked.forced_tools]
        grammar, field = (
            forced_call_grammar(target, form, chosen, asked.parallel_tool_calls),
            "tool_choice",
        )
    elif asked.json_schema is not None:
        grammar, field = constrained.json_grammar(asked.json_schema), "response_format"
    else:
        return None
    try:
        constrained.check(target, grammar)
    except SpecmlxError as e:
        raise APIError(400, f"{field}: {e}", param=field) from None
    return grammar


async def result_unless_gone(job: Job, request: Request) -> Finished | None:
    """The Job's result; None if its client goes first: the Job is then cancelled, and
    the worker stops it before its next round. (A streamed reply learns the same from
    Starlette, which cancels its generator.)"""
    outcome: Finished | Exception | None = None
    async with anyio.create_task_group() as group:

        async def watch() -> None:
            # The body has been read: what the server receives next is the disconnect.
            while (await request.receive())["type"] != "http.disconnect":
                pass
            job.cancel()
            group.cancel_scope.cancel()

        group.start_soon(watch)
        try:
            outcome = await job.result()
        except Exception as e:  # raised outside the group, not wrapped in an ExceptionGroup
            outcome = e
        group.cancel_scope.cancel()
    if isinstance(outcome, SpecmlxError):
        raise APIError(400, str(outcome))
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


async def stream(
    job: Job, reply: Reply, parts: ToolReply, include_usage: bool, remember, request: Request
) -> AsyncIterator[str]:
    """Server-sent events: the reply's pieces as chunks (a tool call as one chunk once
    it has closed), a last chunk with the finish reason (and the run's statistics), usage
    if asked, then [DONE]. A client that goes away cancels this generator, which cancels
    the Job."""
    taken = 0  # job.steps already sent: each chunk carries the Steps that arrived before it
    try:
        if reply.chat:
            yield sse(reply.first_chunk())
        async for text in job.texts():
            content, calls = parts.add(text)
            if content or calls:
                yield sse(reply.chunk(content, calls, steps=job.steps[taken:]))
                taken = len(job.steps)
        done = job.finished
        content, calls = parts.finish()
        rest = kept(job.steps, done)[taken:]
        if content or calls or rest:
            yield sse(reply.chunk(content, calls, steps=rest))
        remember(done)
        request.state.done = done
        yield sse(reply.last_chunk(done, finish_reason(done, parts)))
        if include_usage:
            yield sse(reply.usage_chunk(done))
    except Exception as e:  # the status line has gone: report it as OpenAI streams do
        status = 400 if isinstance(e, SpecmlxError) else 500
        message = str(e) if status == 400 else f"internal error: {e}"
        request.state.error = message
        yield sse(error_body(status, message))
    finally:
        job.cancel()
    yield "data: [DONE]\n\n"


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def finish_reason(done: Finished, parts: ToolReply) -> str:
    """OpenAI's: "tool_calls" where the reply stopped after calling (as mlx-lm decides)."""
    return "tool_calls" if parts.calls and done.finish_reason == "stop" else done.finish_reason


class Reply:
    """The response's shape, chat or text completion, whole or as stream chunks; with
    `logprobs` (k, or None for none) each choice has its tokens' log-probabilities, and a
    stream's chunks each carry specmlx's record of their tokens (tokens.sources)."""

    def __init__(
        self,
        kind: str,
        model: str,
        prompt_tokens: int,
        logprobs: int | None = None,
        token_text: TokenText | None = None,
    ):
        self.chat = kind == "chat.completion"
        self.kind, self.model, self.prompt_tokens = kind, model, prompt_tokens
        self.logprobs, self.token_text = logprobs, token_text
        self.offset = 0  # characters of a text completion's steps already shown
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

    def _choice(
        self, key: str, content: dict | str, finish: str | None = None, steps: list[Step] = ()
    ) -> dict:
        return {
            "index": 0,
            key: content,
            "logprobs": self._logprobs(steps),
            "finish_reason": finish,
        }

    def _logprobs(self, steps: list[Step]) -> dict | None:
        if self.logprobs is None or not steps:
            return None
        if self.chat:
            return chat_logprobs(steps, self.token_text)
        shown = text_logprobs(steps, self.token_text, self.offset)
        self.offset += sum(len(s.text) for s in steps)
        return shown

    def whole(
        self, done: Finished, content: str, calls: list[dict], finish: str, steps: list[Step]
    ) -> dict:
        if self.chat:
            message: dict = {"role": "assistant", "content": content}
            if calls:
                # Where the reply is only calls, there is no content (whitespace between
                # calls is not a message); a call's index belongs to streams alone.
                message["content"] = content if content.strip() else None
                message["tool_calls"] = [
                    {k: v for k, v in c.items() if k != "index"} for c in calls
                ]
            choice = self._choice("message", message, finish, steps)
        else:
            choice = self._choice("text", content, finish, steps)
        if self.logprobs is not None and choice["logprobs"] is None:  # a reply of no tokens
            choice["logprobs"] = self._empty_logprobs()
        body = self._body(self.kind, [choice])
        body.update(usage=self.usage(done), specmlx=run_stats(done))
        return body

    def first_chunk(self) -> dict:
        """A chat stream opens with who speaks (text completions have no roles)."""
        delta = {"role": "assistant", "content": ""}
        return self._body(self.chunk_kind, [self._choice("delta", delta)])

    def _empty_logprobs(self) -> dict:
        if self.chat:
            return {"content": [], "refusal": None}
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def chunk(
        self,
        text: str,
        calls: list[dict] | None = None,
        finish: str | None = None,
        steps: list[Step] = (),
    ) -> dict:
        if self.chat:
            delta: dict = {"content": text} if text else {}
            if calls:
                delta["tool_calls"] = calls
            choice = self._choice("delta", delta, finish, steps)
        else:
            choice = self._choice("text", text, finish, steps)
        body = self._body(self.chunk_kind, [choice])
        if steps:
            body["specmlx"] = {"tokens": sources(steps)}
        return body

    def last_chunk(self, done: Finished, finish: str) -> dict:
        body = self.chunk("", finish=finish)
        body["specmlx"] = run_stats(done)
        return body

    def usage_chunk(self, done: Finished) -> dict:
        body = self._body(self.chunk_kind, [])
        body["usage"] = self.usage(done)
        return body

    def usage(self, done: Finished) -> dict:
        completion = done.stats.tokens
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }


def run_stats(done: Finished) -> dict:
    """The speculative numbers of one reply, as `specmlx generate --json` names them;
    ttft_s from the request's arrival (its wait in the queue included)."""
    stats = done.stats
    return {
        "acceptance": stats.acceptance,
        "tokens_per_pass": stats.tokens_per_pass,
        "gamma": stats.gamma,
        "rounds_by_gamma": {str(g): n for g, n in sorted(stats.rounds_by_gamma.items())},
        "draft_mode": stats.draft_mode,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "decode_tps": stats.decode_tps,
        "ttft_s": done.ttft_s,
        "queue_s": done.queue_s,
        "prompt_tokens": stats.prompt_tokens,
        "prefill_tokens": stats.prefill_tokens,
        "tree_rounds": stats.tree_rounds,
        "tree_nodes": stats.tree_nodes,
        "rounds_by_shape": stats.rounds_by_shape,
        "batch": stats.batch,  # served beside others: what the batch did (batch.Seat.report)
    }


class LogRequests:
    """One info line per HTTP request once its response has gone (a stream's at its
    end): method, path, status, seconds, and for a completion its tokens, tok/s, α and
    TTFT; for an error, its message. (/health's at debug level.)"""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})  # Starlette's request.state reads this dict
        status, start = 500, time.perf_counter()  # 500: what Starlette answers a crash with

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            seconds = time.perf_counter() - start
            # A load balancer's polls of /health would bury the requests' lines.
            level = logging.DEBUG if scope["path"] == "/health" else logging.INFO
            log.log(level, request_line(scope["method"], scope["path"], status, seconds, state))


def request_line(method: str, path: str, status: int, seconds: float, state: dict) -> str:
    line = f"{method} {path} {status} {seconds:.2f}s"
    done: Finished | None = state.get("done")
    if done is not None:
        stats = done.stats
        line += (
            f" prompt={stats.prompt_tokens} tokens={stats.tokens} "
            f"tok/s={stats.decode_tps:.1f} α={stats.acceptance:.2f} ttft={done.ttft_s:.2f}s"
        )
    if "other_model" in state:
        line += f" (model {state['other_model']!r} asked for: served as this server's model)"
    if "error" in state:
        line += f": {state['error']}"
    return line
