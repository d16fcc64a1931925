"""The HTTP server on a real loopback socket (uvicorn in a thread), with tiny random models and the tiny
character tokenizer: every route, streaming and not; greedy answers equal to plain `generate`; every
kind of bad input with its status and message; API key; a client that disconnects; the queue limit;
a request whose drafting or verification fails while the others go on; shutdown."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
import torch

from hf_spin.drafters import Draft, Drafter
from hf_spin.serving import Limits, build_app
from hf_spin.serving.server import Server
from hf_spin.stats import DrafterStats

from .speculation import assert_speculated
from .speculation import pool as spin_pool
from .test_engine import POISON, PoisonProposer, PoisonTarget
from .tiny_tokenizers import PROMPTS, char_tokenizer

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
TIMEOUT = 60


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tok():
    t = char_tokenizer()
    t.chat_template = CHAT_TEMPLATE
    return t


class Served:
    """An app served by uvicorn on 127.0.0.1 (a free port) in a background thread."""

    def __init__(self, app):
        self.app = app
        self.service = app.state.service
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = Server(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=TIMEOUT, **kwargs)

    def async_client(self, **kwargs) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=TIMEOUT, **kwargs)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def served(target, drafter, tok):
    pool = spin_pool([drafter, "prompt_lookup"], policy="round_robin")
    s = Served(
        build_app(
            target,
            tok,
            pool,
            model_id="tiny-llama",
            max_batch_size=4,
            max_queue=16,
            limits=Limits(max_input_tokens=64, max_total_tokens=128),
        )
    )
    yield s
    s.stop()


def served_totals(s: Served) -> DrafterStats:
    """What the server's drafters did since it started, summed over drafters."""
    return DrafterStats.total(s.service.metrics.drafter_totals().values())


def plain(target, tok, text: str, n: int) -> list[int]:
    """Plain greedy `generate` on the prompt alone: its new tokens (EOS included when it stops there)."""
    ids = tok(text)["input_ids"]
    return target.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids) :].tolist()


def sse(lines) -> list:
    """The data of each server-sent event (JSON decoded; "[DONE]" kept as a string)."""
    out = []
    for line in lines:
        if line.startswith("data:"):
            data = line[5:].strip()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# --- every route --------------------------------------------------------------------------------------


def test_health_info_and_metrics(served):
    with served.client() as c:
        assert c.get("/health").json() == {"status": "ok"}
        info = c.get("/info").json()
        assert info["model_id"] == "tiny-llama" and info["router"] == "hf_spin" and info["speculation"] is True
        assert [d["kind"] for d in info["drafters"]] == ["model", "prompt_lookup"] and info[
            "policy"
        ] == "RoundRobinPolicy"
        assert info["max_input_tokens"] == 64 and info["max_total_tokens"] == 128 and info["max_batch_size"] == 4
        assert c.post("/generate", json={"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 8}}).status_code == 200
        r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in (
        "hf_spin_requests_total",
        "hf_spin_generated_tokens_total",
        "hf_spin_prompt_tokens_total",
        "hf_spin_queue_depth",
        "hf_spin_batch_size",
        "hf_spin_step_seconds_bucket",
        "hf_spin_time_to_first_token_seconds_bucket",
        "hf_spin_drafter_acceptance_rate",
        "hf_spin_drafter_mean_accepted_length",
        "hf_spin_micro_batches",
    ):
        assert name in text, name
    assert 'hf_spin_requests_total{route="generate",status="ok"}' in text
    assert 'hf_spin_drafter_drafted_tokens_total{drafter="prompt_lookup"}' in text


def test_generate_greedy_equals_plain_generate_under_concurrency(served, target, tok):
    """Eight concurrent requests (rows join and leave a batch of 4, the rest queue): each answer is
    token for token what plain `generate` gives for its prompt alone."""
    prompts = [p + suffix for p in PROMPTS for suffix in ("", " and")]
    lengths = [24, 9, 17, 30, 12, 5, 20, 26]

    async def go():
        async with served.async_client() as c:
            return await asyncio.gather(
                *(
                    c.post("/generate", json={"inputs": p, "parameters": {"max_new_tokens": n, "details": True}})
                    for p, n in zip(prompts, lengths)
                )
            )

    before = served_totals(served)
    responses = asyncio.run(go())
    after = served_totals(served)
    assert_speculated(
        DrafterStats(
            **{f: getattr(after, f) - getattr(before, f) for f in ("drafted", "accepted", "failures")},
            longest_draft=after.longest_draft,
        )
    )
    for r, p, n in zip(responses, prompts, lengths):
        assert r.status_code == 200, r.text
        body = r.json()
        ids = [t["id"] for t in body["details"]["tokens"]]
        assert ids == plain(target, tok, p, n)
        assert body["generated_text"] == tok.decode(ids, skip_special_tokens=True)
        assert body["details"]["generated_tokens"] == len(ids)
        assert body["details"]["finish_reason"] in ("length", "eos_token")
        assert "".join(t["text"] for t in body["details"]["tokens"] if not t["special"]) == body["generated_text"]
        assert all(t["logprob"] <= 0 for t in body["details"]["tokens"])
        assert int(r.headers["x-generated-tokens"]) == len(ids)


@pytest.mark.parametrize("pipeline", [2, True], ids=["two_micro_batches", "spin_heuristic"])
def test_pipelined_server_greedy_equals_plain_generate(target, drafter, tok, pipeline):
    pool = spin_pool([drafter, "prompt_lookup"], policy="round_robin")
    s = Served(
        build_app(
            target,
            tok,
            pool,
            max_batch_size=6,
            pipeline=pipeline,
            limits=Limits(max_input_tokens=64, max_total_tokens=128),
        )
    )
    prompts = [p + suffix for p in PROMPTS for suffix in ("", " or")]
    lengths = [20, 7, 15, 25, 11, 6, 18, 22]
    try:

        async def go():
            async with s.async_client() as c:
                return await asyncio.gather(
                    *(
                        c.post("/generate", json={"inputs": p, "parameters": {"max_new_tokens": n, "details": True}})
                        for p, n in zip(prompts, lengths)
                    )
                )

        for r, p, n in zip(asyncio.run(go()), prompts, lengths):
            assert r.status_code == 200, r.text
            assert [t["id"] for t in r.json()["details"]["tokens"]] == plain(target, tok, p, n)
        assert_speculated(served_totals(s))
        with s.client() as c:
            assert c.get("/info").json()["pipeline"] == ("auto" if pipeline is True else 2)
            assert "hf_spin_micro_batches" in c.get("/metrics").text
    finally:
        s.stop()


@pytest.mark.parametrize("pipeline", [None, 2], ids=["one_engine", "two_micro_batches"])
def test_concurrent_requests_share_one_suffix_index_uncorrupted(target, tok, pipeline):
    """Sixteen concurrent requests, twice, on a server whose pool holds a suffix drafter (with two
    micro-batches: two lanes, each with its own copy of the drafter, drafting and learning into the
    one shared index from two threads): every answer equals plain `generate`, the index's counts equal
    a rebuild from what it holds, and the second round drafts from the first round's answers."""
    pool = spin_pool(["suffix"])
    options = {"pipeline": pipeline} if pipeline else {}
    s = Served(
        build_app(
            target, tok, pool, max_batch_size=6, limits=Limits(max_input_tokens=64, max_total_tokens=128), **options
        )
    )
    prompts = [p + suffix for p in PROMPTS for suffix in ("", " or", " and", " so")]
    lengths = [12 + 3 * (i % 5) for i in range(len(prompts))]
    index = pool.drafters[0].index
    try:

        async def go():
            async with s.async_client() as c:
                return await asyncio.gather(
                    *(
                        c.post("/generate", json={"inputs": p, "parameters": {"max_new_tokens": n, "details": True}})
                        for p, n in zip(prompts, lengths)
                    )
                )

        accepted, generated = [], []
        for _ in range(2):
            before = served_totals(s).accepted
            generated.append(0)
            for r, p, n in zip(asyncio.run(go()), prompts, lengths):
                assert r.status_code == 200, r.text
                ids = [t["id"] for t in r.json()["details"]["tokens"]]
                assert ids == plain(target, tok, p, n)
                generated[-1] += len(ids)
            accepted.append(served_totals(s).accepted - before)
            index.check()
        # every answer learned once: the first round's by now (the last rows to end leave the batch,
        # and reach the index, at the engine's next step)
        assert generated[0] <= index.tokens <= sum(generated), (generated, index.tokens)
        assert accepted[1] > accepted[0], accepted
    finally:
        s.stop()


def test_generate_stream_one_event_per_token(served, target, tok):
    with (
        served.client() as c,
        c.stream("POST", "/generate_stream", json={"inputs": PROMPTS[1], "parameters": {"max_new_tokens": 14}}) as r,
    ):
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse(r.iter_lines())
    ids = [e["token"]["id"] for e in events]
    assert ids == plain(target, tok, PROMPTS[1], 14)
    assert [e["index"] for e in events] == list(range(1, len(ids) + 1))
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    last = events[-1]
    assert last["generated_text"] == tok.decode(ids, skip_special_tokens=True)
    with served.client() as c:  # TGI's compat route: either shape by `stream`
        assert (
            c.post("/", json={"inputs": PROMPTS[1], "parameters": {"max_new_tokens": 14}}).json()["generated_text"]
            == last["generated_text"]
        )
        with c.stream(
            "POST", "/", json={"inputs": PROMPTS[1], "parameters": {"max_new_tokens": 14}, "stream": True}
        ) as r:
            assert [e["token"]["id"] for e in sse(r.iter_lines())] == ids
    assert last["details"]["generated_tokens"] == len(ids) and last["details"]["input_length"] == len(
        tok(PROMPTS[1])["input_ids"]
    )


def test_openai_completions_and_chat_greedy_stream_and_not(served, target, tok):
    expected = tok.decode(plain(target, tok, PROMPTS[2], 12), skip_special_tokens=True)
    chat_prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    chat_ids = tok(chat_prompt, add_special_tokens=False)["input_ids"]
    chat_expected = tok.decode(
        target.generate(input_ids=torch.tensor([chat_ids]), max_new_tokens=10, do_sample=False)[0, len(chat_ids) :],
        skip_special_tokens=True,
    )
    with served.client() as c:
        r = c.post("/v1/completions", json={"model": "x", "prompt": PROMPTS[2], "max_tokens": 12, "temperature": 0})
        body = r.json()
        assert (
            r.status_code == 200
            and body["object"] == "text_completion"
            and body["id"].startswith("cmpl-")
            and body["model"] == "x"
        )
        assert body["choices"][0]["text"] == expected and body["choices"][0]["finish_reason"] in ("length", "stop")
        assert (
            body["usage"]["completion_tokens"] <= 12
            and body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
        )
        with c.stream(
            "POST",
            "/v1/completions",
            json={
                "prompt": PROMPTS[2],
                "max_tokens": 12,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ) as s:
            events = sse(s.iter_lines())
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == body["usage"]["completion_tokens"]
        assert "".join(e["choices"][0]["text"] for e in events[:-2]) == expected
        assert events[-3]["choices"][0]["finish_reason"] == body["choices"][0]["finish_reason"]

        chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 10, "temperature": 0}
        r = c.post("/v1/chat/completions", json=chat)
        body = r.json()
        assert r.status_code == 200 and body["object"] == "chat.completion"
        assert body["choices"][0]["message"] == {"role": "assistant", "content": chat_expected}
        with c.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as s:
            events = sse(s.iter_lines())
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""} and events[-1] == "[DONE]"
        assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1]) == chat_expected
        assert events[-2]["choices"][0]["finish_reason"] == body["choices"][0]["finish_reason"]


def test_stop_sequences_tgi_keeps_them_openai_cuts_them(served, target, tok):
    text = tok.decode(plain(target, tok, PROMPTS[3], 30), skip_special_tokens=True)
    stop = text[5:7]  # two characters the model will produce
    cut = text[: text.find(stop)]
    with served.client() as c:
        r = c.post(
            "/generate",
            json={"inputs": PROMPTS[3], "parameters": {"max_new_tokens": 30, "stop": [stop], "details": True}},
        ).json()
        assert r["generated_text"] == cut + stop and r["details"]["finish_reason"] == "stop_sequence"
        r = c.post(
            "/v1/completions", json={"prompt": PROMPTS[3], "max_tokens": 30, "temperature": 0, "stop": stop}
        ).json()
        assert r["choices"][0]["text"] == cut and r["choices"][0]["finish_reason"] == "stop"
        with c.stream(
            "POST",
            "/v1/completions",
            json={"prompt": PROMPTS[3], "max_tokens": 30, "temperature": 0, "stop": [stop], "stream": True},
        ) as s:
            events = sse(s.iter_lines())
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == cut


def test_seeded_sampling_is_reproducible(served):
    body = {
        "inputs": PROMPTS[0],
        "parameters": {"max_new_tokens": 16, "temperature": 0.9, "top_k": 20, "seed": 11, "details": True},
    }
    with served.client() as c:
        a, b = c.post("/generate", json=body).json(), c.post("/generate", json=body).json()
        other = c.post("/generate", json={**body, "parameters": {**body["parameters"], "seed": 12}}).json()
    assert a["generated_text"] == b["generated_text"] and a["details"]["seed"] == 11
    assert [t["id"] for t in a["details"]["tokens"]] != [t["id"] for t in other["details"]["tokens"]]


# --- bad input: status and message ---------------------------------------------------------------

BAD = [
    ("/generate", '{"inputs": "ab", ', 400, r"malformed JSON"),
    ("/generate", "", 422, r"request body must be a JSON object"),
    ("/generate", {"inputs": "ab", "params": {}}, 422, r"params: unknown field; supported: inputs, parameters, stream"),
    (
        "/generate",
        {"inputs": "ab", "parameters": {"max_tokens": 3}},
        422,
        r"parameters.max_tokens: unknown field; supported: .*max_new_tokens",
    ),
    ("/generate", {"inputs": 5}, 422, r"inputs: Input should be a valid string \(given: 5\)"),
    (
        "/generate",
        {"inputs": "ab", "parameters": {"max_new_tokens": "ten"}},
        422,
        r"parameters.max_new_tokens: Input should be a valid integer \(given: 'ten'\)",
    ),
    (
        "/generate",
        {"inputs": "ab", "parameters": {"do_sample": "yes"}},
        422,
        r"parameters.do_sample: Input should be a valid boolean",
    ),
    ("/generate", {"parameters": {}}, 422, r"inputs: required field missing"),
    ("/generate", {"inputs": ""}, 422, r"the prompt is empty"),
    ("/generate", {"inputs": "x" * 65}, 422, r"the prompt has 65 tokens; this server takes at most 64"),
    (
        "/generate",
        {"inputs": "ab", "parameters": {"max_new_tokens": 0}},
        422,
        r"parameters.max_new_tokens: Input should be greater than or equal to 1 \(given: 0\)",
    ),
    (
        "/generate",
        {"inputs": "ab", "parameters": {"max_new_tokens": 500}},
        422,
        r"max_new_tokens=500 is out of range: .* at most 126 here",
    ),
    (
        "/generate",
        {"inputs": "ab", "parameters": {"temperature": 0}},
        422,
        r"parameters.temperature: Input should be greater than 0 \(given: 0\)",
    ),
    (
        "/generate",
        {"inputs": "ab", "parameters": {"top_p": 1.5}},
        422,
        r"parameters.top_p: Input should be less than or equal to 1",
    ),
    (
        "/generate",
        {"inputs": "ab", "parameters": {"top_k": -2}},
        422,
        r"parameters.top_k: Input should be greater than 0",
    ),
    (
        "/generate",
        {"inputs": "ab", "parameters": {"repetition_penalty": 0}},
        422,
        r"parameters.repetition_penalty: Input should be greater than 0",
    ),
    ("/generate", {"inputs": "ab", "parameters": {"typical_p": 0}}, 422, r"parameters.typical_p"),
    (
        "/generate",
        {"inputs": "ab", "parameters": {"seed": -1}},
        422,
        r"parameters.seed: Input should be greater than or equal to 0",
    ),
    (
        "/generate",
        {"inputs": "ab", "parameters": {"stop": ["a", "b", "c", "d", "e"]}},
        422,
        r"at most 4 stop sequences, got 5",
    ),
    ("/generate", {"inputs": "ab", "parameters": {"best_of": 2}}, 422, r"best_of=2 is not supported by hf_spin"),
    (
        "/generate_stream",
        {"inputs": "ab", "parameters": {"top_p": 0}},
        422,
        r"parameters.top_p: Input should be greater than 0",
    ),
    (
        "/v1/completions",
        {"prompt": "ab", "max_tokens": 0},
        422,
        r"max_tokens: Input should be greater than or equal to 1",
    ),
    (
        "/v1/completions",
        {"prompt": "ab", "temperature": 2.5},
        422,
        r"temperature: Input should be less than or equal to 2",
    ),
    ("/v1/completions", {"prompt": ["a", "b"]}, 422, r"exactly one prompt per request"),
    ("/v1/completions", {"prompt": "ab", "n": 3}, 422, r"n=3 is not supported"),
    ("/v1/completions", {"prompt": "ab", "logprobs": 2}, 422, r"logprobs=2 is not supported"),
    ("/v1/completions", {"prompt": "ab", "top_k": 3}, 422, r"top_k: unknown field"),
    ("/v1/completions", {"prompt": "", "stream": True}, 422, r"the prompt is empty"),
    ("/v1/chat/completions", {"messages": []}, 422, r"messages: List should have at least 1 item"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "robot", "content": "x"}]},
        422,
        r"messages.0.role: Input should be 'system', 'user'",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "text": "x"}]},
        422,
        r"messages.0.text: unknown field; supported: content, name, role",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1000},
        422,
        r"max_new_tokens=1000 is out of range",
    ),
]


@pytest.mark.parametrize("route, body, status, message", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_input_is_refused_with_what_was_wrong(served, route, body, status, message):
    with served.client() as c:
        if isinstance(body, str):
            r = c.post(route, content=body, headers={"content-type": "application/json"})
        else:
            r = c.post(route, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    if route.startswith("/v1/"):
        assert err["type"] == "invalid_request_error"
        err = err["message"]
    else:
        assert r.json()["error_type"] == "validation"
    assert __import__("re").search(message, err), err


def test_api_key(target, tok):
    s = Served(build_app(target, tok, None, api_key="sekret"))
    try:
        with s.client() as c:
            assert c.get("/health").status_code == 200  # open: load balancers probe it
            r = c.post("/generate", json={"inputs": "ab", "parameters": {"max_new_tokens": 2}})
            assert (
                r.status_code == 401
                and "Authorization: Bearer" in r.json()["error"]
                and r.headers["www-authenticate"] == "Bearer"
            )
            r = c.post("/v1/completions", json={"prompt": "ab"}, headers={"Authorization": "Bearer wrong"})
            assert (
                r.status_code == 401
                and r.json()["error"]["type"] == "authentication_error"
                and "wrong API key" in r.json()["error"]["message"]
            )
            assert c.get("/info").status_code == 401 and c.get("/metrics").status_code == 401
            ok = {"Authorization": "Bearer sekret"}
            assert (
                c.post("/generate", json={"inputs": "ab", "parameters": {"max_new_tokens": 2}}, headers=ok).status_code
                == 200
            )
            assert c.get("/info", headers=ok).json()["speculation"] is False
    finally:
        s.stop()


# --- disconnects, the queue limit, faults, shutdown ------------------------------------------------


class SlowDrafter(Drafter):
    """Proposes nothing, slowly: every step takes at least DELAY seconds (time to act between steps)."""

    name = "slow"
    DELAY = 0.03

    def draft(self, request):
        time.sleep(self.DELAY)
        return Draft(tokens=[[] for _ in request.rows], q=[None] * len(request.rows))


def slow_server(target, tok, **kwargs) -> Served:
    """One row at a time, >= 30 ms a step, and no EOS: a request runs until its length or its cancellation."""
    s = Served(
        build_app(
            target,
            tok,
            spin_pool([SlowDrafter()]),
            max_batch_size=1,
            limits=Limits(max_input_tokens=64, max_total_tokens=1024),
            **kwargs,
        )
    )
    s.service.eos_ids = set()
    return s


@pytest.fixture
def slow(target, tok):
    s = slow_server(target, tok, max_queue=1)
    yield s
    s.stop()


def wait_for(predicate, seconds=20.0):
    deadline = time.time() + seconds
    while not predicate():
        assert time.time() < deadline, "timed out"
        time.sleep(0.01)


def test_client_disconnect_mid_stream_frees_its_row(slow, target, tok):
    scheduler = slow.service.scheduler
    body = {"inputs": "ab", "parameters": {"max_new_tokens": 900}}
    with slow.client() as c, c.stream("POST", "/generate_stream", json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert any(line.startswith("data:") for line in got)
        assert scheduler.batch_size == 1
    # the connection is closed: the row leaves at the next step, long before its 900 tokens
    wait_for(lambda: scheduler.batch_size == 0 and not scheduler.engine.rows)
    metrics = slow.service.metrics
    wait_for(lambda: metrics.requests.labels("generate_stream", "cancelled")._value.get() == 1)
    with slow.client() as c:  # and the server goes on
        assert c.post("/generate", json={"inputs": "ab", "parameters": {"max_new_tokens": 3}}).status_code == 200


def test_queue_limit_answers_503_with_retry_after(slow, target, tok):
    """One row decoding, one request waiting: the third is refused at once; the waiting one runs once
    the first client goes away."""
    scheduler = slow.service.scheduler
    prompt = "ab"

    async def go():
        async with slow.async_client() as c:
            async with c.stream(
                "POST", "/generate_stream", json={"inputs": prompt, "parameters": {"max_new_tokens": 900}}
            ) as first:
                lines = first.aiter_lines()  # keep a reference: a dropped line iterator closes the stream
                await lines.__anext__()
                waiting = asyncio.create_task(
                    c.post("/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 3}})
                )
                while scheduler.queue_depth < 1:
                    await asyncio.sleep(0.01)
                refused = await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3})
                refused_tgi = await c.post("/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 3}})
            return refused, refused_tgi, await waiting

    refused, refused_tgi, waiting = asyncio.run(go())
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert (
        refused.json()["error"]["type"] == "server_overloaded" and "queue is full" in refused.json()["error"]["message"]
    )
    assert refused_tgi.status_code == 503 and refused_tgi.json()["error_type"] == "overloaded"
    assert waiting.status_code == 200 and waiting.json()["generated_text"]
    assert 'hf_spin_requests_total{route="generate",status="rejected"} 1.0' in slow.service.metrics.render().decode()


def test_prefill_budget_spreads_a_burst_of_long_prompts_over_steps():
    """TGI's max_batch_prefill_tokens: rows joining in one step x their longest prompt stay within the
    budget; a prompt longer than the budget joins alone; cancelled jobs leave without counting."""
    from hf_spin.serving.scheduler import Job, Scheduler
    from hf_spin.step.rows import Request

    loop = asyncio.new_event_loop()
    try:
        scheduler = Scheduler(lambda: None, max_batch_size=4, max_queue=16, max_batch_prefill_tokens=100)

        def queue(*lengths):
            jobs = [Job(Request(prompt=[1] * n, max_new_tokens=1), loop) for n in lengths]
            scheduler._queue.extend(jobs)
            return jobs

        def admitted():
            with scheduler._wake:
                return [len(j.request.prompt) for j in scheduler._admit() if not j.cancelled]

        queue(30, 30, 30, 50, 500, 10)
        assert admitted() == [30, 30, 30]  # a 4th row would pad 4 x 50 = 200 > 100
        assert admitted() == [50]  # 2 x 500 > 100
        assert admitted() == [500]  # over the budget on its own: joins alone
        cancelled = queue(90)[0]
        cancelled.cancelled = True
        queue(20, 20, 20, 20, 20)
        assert admitted() == [10, 20, 20, 20]  # max_batch_size rows; the cancelled 90 is not counted
        scheduler._running = [object()] * 3  # three rows decoding: one more may join
        assert admitted() == [20]
    finally:
        loop.close()


def test_a_failing_request_fails_alone(target, tok):
    """The target raises on one request's prompt (prefill) and on another's draft (verification): those
    two get a 500 saying why; the requests running beside them are answered exactly."""
    pool = spin_pool([PoisonProposer()])
    s = Served(build_app(PoisonTarget(target), tok, pool, max_batch_size=8))
    poison_char = tok.convert_ids_to_tokens(POISON)
    mark_char = tok.convert_ids_to_tokens(PoisonProposer.MARK)
    prompts = [PROMPTS[0], PROMPTS[1] + poison_char, mark_char + PROMPTS[2], PROMPTS[3]]
    try:

        async def go():
            async with s.async_client() as c:
                return await asyncio.gather(
                    *(
                        c.post("/generate", json={"inputs": p, "parameters": {"max_new_tokens": 12, "details": True}})
                        for p in prompts
                    )
                )

        ok0, bad1, bad2, ok3 = asyncio.run(go())
        for bad in (bad1, bad2):
            assert bad.status_code == 500 and bad.json()["error_type"] == "generation"
            assert "poisoned input (simulated target fault)" in bad.json()["error"]
        for ok, p in ((ok0, prompts[0]), (ok3, prompts[3])):
            assert ok.status_code == 200 and [t["id"] for t in ok.json()["details"]["tokens"]] == plain(
                target, tok, p, 12
            )
        with s.client() as c:
            with c.stream(
                "POST", "/generate_stream", json={"inputs": prompts[1], "parameters": {"max_new_tokens": 4}}
            ) as r:
                events = sse(r.iter_lines())
            assert events[-1]["error_type"] == "generation" and "poisoned" in events[-1]["error"]
            assert c.get("/health").status_code == 200
    finally:
        s.stop()


def test_an_engine_fault_fails_the_running_requests_and_the_server_goes_on(served, monkeypatch):
    scheduler = served.service.scheduler
    engine = scheduler.engine
    original = type(engine).step

    def broken(self):
        monkeypatch.setattr(type(engine), "step", original)  # once
        raise RuntimeError("simulated engine bug")

    monkeypatch.setattr(type(engine), "step", broken)
    with served.client() as c:
        r = c.post("/generate", json={"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 5}})
        assert r.status_code == 500 and "simulated engine bug" in r.json()["error"]
        wait_for(lambda: scheduler.engines_replaced == 1)  # the answer goes out just before the engine is replaced
        assert scheduler.engine is not engine
        assert c.post("/generate", json={"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 5}}).status_code == 200


def test_shutdown_cancels_in_flight_requests_cleanly(target, tok):
    s = slow_server(target, tok, max_queue=4, shutdown_grace_seconds=0.5)
    prompt = "ab"
    results = {}

    def stream():
        with (
            s.client() as c,
            c.stream("POST", "/generate_stream", json={"inputs": prompt, "parameters": {"max_new_tokens": 900}}) as r,
        ):
            results["events"] = sse(r.iter_lines())  # the stream ends normally: no protocol error

    reader = threading.Thread(target=stream)
    reader.start()
    wait_for(lambda: s.service.scheduler.batch_size == 1)
    started = time.time()
    s.stop()
    reader.join(timeout=30)
    assert not reader.is_alive() and not s.thread.is_alive() and not s.service.scheduler.alive
    assert 0.5 <= time.time() - started < 15  # the grace period, then the cancellation
    events = results["events"]
    assert len(events) > 2 and all("token" in e for e in events[:-1])  # tokens while the grace lasted
    assert (
        events[-1]["error"] == "the server is shutting down; this request was cancelled"
    )  # then a last event saying why
