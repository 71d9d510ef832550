"""`specmlx serve` as clients see it: a live server on a free localhost port, spoken to with
OpenAI's own client (and httpx where the raw status and body are the point)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import openai
import pytest
import uvicorn

import specmlx
from specmlx.server import make_app, worker
from specmlx.server.pool import SessionPool, session_bytes

MODEL = "tiny-test"
GREEDY = {"temperature": 0, "max_tokens": 16}
# How long a wait may last before the test calls it a hang. Nothing here asserts how fast
# the server is: a wait that ends does so by an event, and this only bounds a broken one.
HANG_S = 120


def wait_until(condition, what: str) -> None:
    """Poll `condition` until it holds; fail after HANG_S (a hang, not a slow machine)."""
    deadline = time.monotonic() + HANG_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} never happened (hung for {HANG_S} s)")
        time.sleep(0.01)


@contextmanager
def running(app):
    """Serve `app` from a thread on a free port of 127.0.0.1; yield its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), "the server's start")
    assert server.started, "the server's thread ended before it started serving"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(20)
        sock.close()


@pytest.fixture(scope="module")
def url(models):
    with running(make_app(models["target"], models["perturbed"], model_id=MODEL)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat(client, content: str, **settings):
    settings = {**GREEDY, **settings}
    extra = {k: settings.pop(k) for k in ("num_draft", "top_k") if k in settings}
    messages = content if isinstance(content, list) else [{"role": "user", "content": content}]
    return client.chat.completions.create(
        model=MODEL, messages=messages, extra_body=extra or None, **settings
    )


def streamed(client, content: str, **settings) -> tuple[list[str], list]:
    """The text deltas of a streamed chat completion, and all its chunks."""
    chunks = list(chat(client, content, stream=True, **settings))
    deltas = [c.choices[0].delta.content for c in chunks if c.choices]
    return [d for d in deltas if d], chunks


def stats_of(response) -> dict:
    return response.model_extra["specmlx"]


def template_ids(target, content: str) -> list[int]:
    messages = [{"role": "user", "content": content}]
    return target.tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def test_chat_completion(client):
    reply = chat(client, "hello there")
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.model == MODEL
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    stats = stats_of(reply)
    assert 0 <= stats["acceptance"] <= 1 and stats["tokens_per_pass"] >= 1
    assert {"rounds_by_gamma", "decode_tps", "ttft_s", "prefill_tokens"} <= set(stats)


def test_stream_concatenates_to_the_whole_reply(client):
    whole = chat(client, "tell me a story", max_tokens=24)
    deltas, chunks = streamed(client, "tell me a story", max_tokens=24)
    assert "".join(deltas) == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])


def test_usage_counts_prompt_and_completion_tokens(client, models):
    target, draft = models["target"], models["perturbed"]
    ids = template_ids(target, "count these")
    alone = specmlx.generate(target, ids, draft=draft, max_tokens=16).run()
    reply = chat(client, "count these")
    usage = reply.usage
    assert usage.prompt_tokens == len(ids)
    assert usage.completion_tokens == alone.stats.tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    _, chunks = streamed(client, "count these", stream_options={"include_usage": True})
    assert not chunks[-1].choices and chunks[-1].usage == usage
    assert all(c.usage is None for c in chunks[:-1])


def test_greedy_output_equals_specmlx_generate(client, models):
    target, draft = models["target"], models["perturbed"]
    ids = template_ids(target, "def fibonacci")
    expected = specmlx.generate(target, ids, draft=draft, max_tokens=16).run().text
    assert chat(client, "def fibonacci").choices[0].message.content == expected
    prompt = "class Stack:\n    def push(self"
    expected = specmlx.generate(target, prompt, draft=draft, max_tokens=16, num_draft=3).run()
    got = client.completions.create(
        model=MODEL, prompt=prompt, extra_body={"num_draft": 3}, **GREEDY
    )
    assert got.choices[0].text == expected.text
    assert stats_of(got)["rounds_by_gamma"].keys() <= {"3", "2", "1", "0"}


def test_stop_string_is_honoured_and_never_emitted(client):
    full = chat(client, "stop me", max_tokens=32).choices[0].message.content
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    expected = full[: full.index(stop)]
    reply = chat(client, "stop me", max_tokens=32, stop=[stop, "never appears"])
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].finish_reason == "stop"
    deltas, _ = streamed(client, "stop me", max_tokens=32, stop=stop)
    assert "".join(deltas) == expected
    assert stop not in "".join(deltas)


def test_seed_reproduces_a_sampled_reply(client):
    def sample(seed: int) -> str:
        reply = chat(client, "roll the dice", temperature=1, seed=seed, num_draft=3)
        return reply.choices[0].message.content

    first = sample(7)
    assert sample(7) == first
    assert any(sample(seed) != first for seed in (8, 9, 10))


def test_second_chat_turn_prefills_only_its_new_tokens(client):
    first = chat(client, "my name is Ada", max_tokens=8)
    messages = [
        {"role": "user", "content": "my name is Ada"},
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "what is my name"},
    ]
    second = chat(client, messages, max_tokens=8)
    new = second.usage.prompt_tokens - first.usage.prompt_tokens - first.usage.completion_tokens
    # The last prompt token is never prefilled (it starts decoding); a reply cut by
    # max_tokens leaves its own last token out of the cache, to be prefilled now.
    assert stats_of(second)["prefill_tokens"] <= new
    assert stats_of(second)["prefill_tokens"] < second.usage.prompt_tokens // 2


class HeldDecodes:
    """The server's decodes, each held after its first step until `release` is set: a
    reply that is provably still decoding, on a machine of any speed. Installed over the
    decode thread's `generate` (specmlx.server.worker looks it up at every decode).

    held: set once a decode has emitted its first step and waits. prompts: the prompt ids
    of every decode begun, in the order the decode thread began them."""

    def __init__(self, monkeypatch):
        self.held, self.release = threading.Event(), threading.Event()
        self.prompts: list[list[int]] = []
        real = worker.generate

        def generate(target, ids, **settings):
            self.prompts.append(list(ids))
            return HeldGeneration(real(target, ids, **settings), self)

        monkeypatch.setattr(worker, "generate", generate)


class HeldGeneration:
    """A Generation whose steps stop after the first until its holder releases them; its
    text, tokens, stats and close are the real one's."""

    def __init__(self, gen, holder: HeldDecodes):
        self._gen, self._holder = gen, holder

    def __iter__(self):
        for i, step in enumerate(self._gen):
            yield step
            if i == 0:  # the worker has handed the first step on and asks for the next
                self._holder.held.set()
                self._holder.release.wait(HANG_S)

    def __getattr__(self, name: str):
        return getattr(self._gen, name)


def test_health_answers_while_a_reply_decodes_and_requests_queue_in_order(
    client, url, models, monkeypatch
):
    # The decode thread is held mid-reply, so /health can only answer if the event loop
    # never waits on a decode: it would hang here otherwise, whatever the machine's speed.
    target = models["target"]
    prompts = ["first in line", "second in line"]
    alone = [chat(client, p).choices[0].message.content for p in prompts]
    with httpx.Client(base_url=url, timeout=HANG_S) as http:
        before = http.get("/health").json()
        holder = HeldDecodes(monkeypatch)
        with ThreadPoolExecutor(2) as pool:
            try:
                first = pool.submit(chat, client, prompts[0])
                assert holder.held.wait(HANG_S), "the first reply never began decoding"
                second = pool.submit(chat, client, prompts[1])
                # /health answers, again and again, while the first reply is held mid-decode
                # and until the second request has queued behind it.
                wait_until(lambda: http.get("/health").json()["waiting"] == 1, "the queueing")
                during = http.get("/health").json()
                assert not first.done() and not second.done()
            finally:
                holder.release.set()
            replies = [first.result(), second.result()]
        after = http.get("/health").json()
    assert during["status"] == "ok" and during["decoded_tokens"] == before["decoded_tokens"]
    assert [r.choices[0].message.content for r in replies] == alone  # holding changes nothing
    assert holder.prompts == [template_ids(target, p) for p in prompts]  # first come first served
    decoded = sum(r.usage.completion_tokens for r in replies)
    assert after["waiting"] == 0 and after["decoded_tokens"] == before["decoded_tokens"] + decoded


def test_concurrent_streams_each_equal_the_request_run_alone(client, url):
    # What a reply is does not depend on the requests beside it (responsiveness meanwhile:
    # the test above).
    prompts = [[f"client {c} request {r}" for r in range(4)] for c in range(8)]  # 8 clients x 4
    alone = {p: chat(client, p).choices[0].message.content for ps in prompts for p in ps}

    def one_client(requests: list[str]) -> list[tuple[str, str]]:
        own = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        return [(p, "".join(streamed(own, p)[0])) for p in requests]

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = [r for rs in pool.map(one_client, prompts) for r in rs]
    assert len(results) == sum(len(ps) for ps in prompts)
    assert all(text == alone[p] for p, text in results)


def test_client_leaving_mid_stream_stops_its_decode(client, url):
    prompt = "a very long answer please"
    expected = chat(client, prompt).choices[0].message.content
    with httpx.Client(base_url=url, timeout=30) as http:
        before = http.get("/health").json()["decoded_tokens"]
        body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}]}
        body.update(stream=True, temperature=0, max_tokens=1500)
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            data = []
            for line in response.iter_lines():
                data += [line] if line.startswith("data: ") else []
                if len(data) == 4:
                    break
    assert all('"finish_reason": null' in line for line in data)
    # The next request waits behind the abandoned one, on the Session it left behind.
    after_leaving = chat(client, prompt)
    assert after_leaving.choices[0].message.content == expected
    decoded = httpx.get(f"{url}/health").json()["decoded_tokens"] - before
    assert decoded - after_leaving.usage.completion_tokens < 1000


def test_bad_requests_get_openai_shaped_errors(client, url, models):
    chat_path, text_path = "/v1/chat/completions", "/v1/completions"
    user = [{"role": "user", "content": "hi"}]
    cases = [
        (chat_path, b"{not json", 400, None),
        (chat_path, {"messages": user}, 400, "model"),
        (chat_path, {"model": MODEL}, 400, "messages"),
        (chat_path, {"model": MODEL, "messages": user, "n": 2}, 400, "n"),
        (chat_path, {"model": MODEL, "messages": user, "temperature": "hot"}, 400, "temperature"),
        (chat_path, {"model": MODEL, "messages": user, "max_tokens": 0}, 400, None),
        (chat_path, {"model": MODEL, "messages": user, "top_p": 0}, 400, None),
        (chat_path, {"model": MODEL, "messages": user, "stop": [""]}, 400, "stop"),
        (chat_path, {"model": MODEL, "messages": user, "num_draft": "many"}, 400, None),
        (chat_path, {"model": MODEL, "messages": [{"content": "hi"}]}, 400, "messages[0]"),
        (text_path, {"model": MODEL, "prompt": [10**9]}, 400, "prompt"),
        (text_path, {"model": MODEL, "prompt": ""}, 400, "prompt"),
        (text_path, {"model": MODEL, "prompt": [1] * 2048}, 400, "prompt"),
        (text_path, {"model": MODEL, "prompt": "hi", "draft_mode": "psychic"}, 400, None),
    ]
    with httpx.Client(base_url=url, timeout=30) as http:
        for path, body, status, param in cases:
            sent = {"content": body} if isinstance(body, bytes) else {"json": body}
            response = http.post(path, **sent)
            assert response.status_code == status, (body, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
            assert error["param"] == param, (body, error)
        too_long = http.post(text_path, json={"model": MODEL, "prompt": [1] * 2048}).json()
        assert "2048" in too_long["error"]["message"]
        assert http.get(chat_path).status_code == 405
        assert http.get("/v1/nothing").json()["error"]["message"]
        assert http.get("/health").status_code == 200  # still serving
    with pytest.raises(openai.BadRequestError):
        chat(client, "hi", max_tokens=-1)
    assert chat(client, "hi").choices[0].message.content  # and still answering


def test_pool_takes_the_longest_prefix_and_keeps_to_its_budget(models):
    target, draft = models["target"], models["perturbed"]
    pool = SessionPool(target, draft, budget_bytes=1 << 30)
    first, second = [5, 6, 7, 8, 9, 10], [40, 41, 42, 43]
    for ids in (first, second):
        session = pool.take(ids)
        # A fixed γ of model drafts: both sessions' draft caches filled alike (under auto
        # γ and draft mode, whether one was depended on the costs earlier tests left).
        run = dict(session=session, max_tokens=4, num_draft=2, draft_mode="model")
        specmlx.generate(target, ids, draft=draft, **run).run()
        pool.give_back(session)
    one, two = pool.idle
    assert pool.take(second + [1]) is two and pool.take(first[:3]) is one
    assert session_bytes(one) > 0
    pool.budget_bytes = session_bytes(two)  # room for one: the least recently used goes
    pool.give_back(one)
    pool.give_back(two)
    assert pool.idle == [two] and pool.cache_bytes == session_bytes(two)
    pool.budget_bytes = 0  # room for none: even the one just used is emptied
    pool.give_back(pool.take(second))
    assert pool.cache_bytes == 0 and pool.idle[0].target.cached == []


def test_interleaved_conversations_keep_a_session_each(models):
    # Both start with the same system prompt: the second must not take over the first's
    # caches, and each one's next turn must find its own.
    target, draft = models["target"], models["perturbed"]
    pool = SessionPool(target, draft, budget_bytes=1 << 30)
    system = [5, 6, 7, 8]
    a, b = system + [10, 11, 12, 13, 14, 15], system + [20, 21, 22, 23, 24, 25]
    sessions = {}
    for name, ids in (("a", a), ("b", b)):
        sessions[name] = pool.take(ids)
        specmlx.generate(target, ids, draft=draft, session=sessions[name], max_tokens=4).run()
        pool.give_back(sessions[name])
    assert sessions["a"] is not sessions["b"]
    for name in ("a", "b"):
        next_turn = sessions[name].target.cached + [30, 31]
        assert pool.take(next_turn) is sessions[name]


def test_api_key_is_required_when_set(models):
    app = make_app(models["target"], models["perturbed"], model_id=MODEL, api_key="sekrit")
    with running(app) as base:
        wrong = openai.OpenAI(base_url=f"{base}/v1", api_key="guess", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        response = httpx.get(f"{base}/v1/models")
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{base}/health").status_code == 200  # open, for load balancers
        right = openai.OpenAI(base_url=f"{base}/v1", api_key="sekrit", max_retries=0)
        assert [m.id for m in right.models.list()] == [MODEL]


def test_serve_command_starts_and_answers(tmp_path):
    """`specmlx serve --model tiny --port 0`, as a user starts it."""
    env = {**os.environ, "SPECMLX_HOME": str(tmp_path)}
    command = [sys.executable, "-m", "specmlx", "serve", "--model", "tiny", "--port", "0"]
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        for line in process.stderr:
            seen.append(line)
            found = re.search(r"serving tiny at (http://127\.0\.0\.1:\d+)/v1", line)
            if found:
                break
        assert found, "".join(seen)
        assert any("localhost" in line for line in [*seen, process.stderr.readline()])
        base = found[1]

        def answers() -> bool:
            try:
                return httpx.get(f"{base}/health").json()["status"] == "ok"
            except httpx.ConnectError:
                return False

        wait_until(answers, "an answer from /health")
        assert httpx.get(f"{base}/v1/models").json()["data"][0]["id"] == "tiny"
    finally:
        process.terminate()
        process.wait(20)
