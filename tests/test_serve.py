"""`forerun serve` over real HTTP on loopback, driven by the real `openai` client and httpx.

Tiny random models in float64, where arithmetic is exact enough that greedy speculative output
equals greedy plain output (tests/test_engine.py), so every greedy answer of the server, with any
speculation, is checked against plain `Engine.generate` on the same prompt ("solo" output).

Two servers:
- `server`: the real CLI, `python -m forerun.cli serve`, in a subprocess: draft-model speculation
  (k = 3, --spec-policy always: tiny models make drafting cost as much as the target, so the
  adaptive policy would rightly draft nothing) with a draft that is the target plus noise over
  a reduced vocabulary, an API key read
  from a file and required on /metrics too, one extra allowed Host, 8 slots, a 32-request queue;
- `slow_server`: the same app in an in-process uvicorn thread over a runtime whose every forward
  pass sleeps, so that requests last long enough to fill the queue, be shed or be abandoned.

No assertion depends on how fast the machine is: waits poll a state (with a long timeout that
only catches a hang), and "freed early" is shown by what was generated, not by the clock.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from test_stopping import CountingStr, linear_budget
from tiny_files import byte_tokens, random_hf_weights, write_hf_dir

from forerun import Engine, LoadConfig, SpecConfig, profile
from forerun.models import chat_template
from forerun.models.load import open_model
from forerun.runtime.base import Capabilities, ForwardOutput
from forerun.sampling import SamplingConfig
from forerun.serve.app import ServeConfig, create_app
from forerun.serve.limits import MAX_K
from forerun.serve.worker import Busy, Done, Failed, Job, LoadShedding, Stopped, Worker, k_cap

NAME, KEY = "tiny", "test-key"
DRAFT_NOISE = 0.01  # the draft is the target perturbed: it agrees often, not always
DRAFT_VOCAB = 200  # of 259 tokens: the server's draft proposes from a reduced vocabulary
BODY_LIMIT = 64 * 1024
SERVER_MAX_TOKENS = 16  # --max-tokens: what a request without max_tokens gets
STARTUP_S = 120
PROMPTS = ["Hello there", "def f(x):", "The quick brown fox", "abcabcabc", "1, 2, 3, 4,"]
SPECS = [None, "off", {"method": "ngram", "k": 4}, {"method": "draft", "k": 2,
                                                       "policy": "adaptive"}]
CONCURRENT_CLIENTS = 32
SLOW_FORWARD_S = 0.02  # slow_server: each forward pass sleeps this long
HANG_S = 60  # a state awaited longer than this means a hang
PROXY_HOST = "proxy.example"  # the server's --allowed-host


# --- models, reference, servers ------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("serve")
    tokens = byte_tokens()
    weights = random_hf_weights(len(tokens), seed=0)
    write_hf_dir(root / "target", weights, tokens)
    g = torch.Generator().manual_seed(1)
    write_hf_dir(root / "draft", {k: v + DRAFT_NOISE * torch.randn(v.shape, generator=g)
                                  for k, v in weights.items()}, tokens)
    return root / "target", root / "draft"


@pytest.fixture(scope="module")
def reference(model_dirs):
    """solo(prompt, max_tokens, chat=False, stop=()) -> the Completion of plain greedy decoding."""
    engine = Engine(str(model_dirs[0]), None, spec=SpecConfig("none"),
                    load=LoadConfig(dtype="float64"))
    cache = {}

    def solo(prompt: str, max_tokens: int, chat: bool = False, stop: tuple[str, ...] = ()):
        key = (prompt, max_tokens, chat, stop)
        if key not in cache:
            ids = engine.tokenizer.encode_prompt(prompt, raw=not chat)
            cache[key] = engine.generate(ids, max_tokens=max_tokens, stop=stop)
        return cache[key]

    solo.tokenizer = engine.tokenizer
    return solo


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, alive=lambda: True, describe=lambda: "") -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        assert alive(), f"the server exited: {describe()}"
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"no healthy server after {STARTUP_S} s: {describe()}")


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("log") / "serve.log"
    key_file = log.parent / "key"
    key_file.write_text(KEY + "\n")
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "forerun.cli", "serve", "--target", str(model_dirs[0]),
             "--draft", str(model_dirs[1]), "--method", "draft", "-k", "3",
             "--draft-vocab", str(DRAFT_VOCAB), "--spec-policy", "always",
             "--dtype", "float64", "--draft-dtype", "float64", "--port", str(port),
             "--api-key-file", str(key_file), "--metrics-auth", "--allowed-host", PROXY_HOST,
             "--served-model-name", NAME, "--max-concurrent", "8",
             "--max-queue", "32", "--max-tokens", str(SERVER_MAX_TOKENS),
             "--max-body-bytes", str(BODY_LIMIT), "--log-level", "warning"],
            stdout=out, stderr=subprocess.STDOUT,
            env=os.environ | {"OMP_NUM_THREADS": "1"})  # tiny matmuls: threads only cost
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, lambda: proc.poll() is None, log.read_text)
        yield base
    finally:
        proc.terminate()
        proc.wait(30)
    assert "Traceback" not in log.read_text(), log.read_text()


def client(base: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=60, **kw)


class SlowRuntime:
    """A runtime whose every forward pass takes SLOW_FORWARD_S longer: requests that last."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, tokens, **kw):
        time.sleep(SLOW_FORWARD_S)
        return self.inner.forward(tokens, **kw)

    def fork(self) -> SlowRuntime:
        return SlowRuntime(self.inner.fork())


class ThreadServer:
    """uvicorn serving an app on a free loopback port, in a thread of this process."""

    def __init__(self, app):
        self.base = f"http://127.0.0.1:{free_port()}"
        port = int(self.base.rsplit(":", 1)[1])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        wait_healthy(self.base, self.thread.is_alive)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def slow_server(model_dirs):
    """2 slots + 1 queued request, n-gram speculation turned off above 1 request in flight."""
    src = open_model(str(model_dirs[0]))
    engine = Engine.from_runtimes(SlowRuntime(src.load(dtype="float64")), src.tokenizer,
                                  spec=SpecConfig("ngram", 3))
    worker = Worker(engine, slots=2, max_queue=1, shedding=LoadShedding(off_above=1))
    with ThreadServer(create_app(worker, ServeConfig(NAME))) as s:
        yield s.base


def health(base: str) -> dict:
    return httpx.get(f"{base}/health").json()


def wait_until(condition, within: float = HANG_S) -> None:
    """Poll until `condition()` holds; fails after `within` seconds (a hang)."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not so after {within} s")
        time.sleep(0.02)


def wait_idle(base: str) -> None:
    """Until no request runs or waits."""
    wait_until(lambda: (h := health(base))["running"] == h["waiting"] == 0)


def metric(base: str, name: str, **labels) -> float:
    text = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def extra(obj, key: str):
    return (obj.model_extra or {}).get(key)


# --- the OpenAI API, greedy, against solo output --------------------------------------------------

def test_models_and_health(server):
    assert [m.id for m in client(server).models.list().data] == [NAME]
    assert health(server)["status"] == "ok"


@pytest.mark.parametrize("speculation", SPECS, ids=["server-default", "off", "ngram", "draft"])
def test_completion_equals_solo_greedy_output(server, reference, speculation):
    body = {} if speculation is None else {"speculation": speculation}
    for prompt in PROMPTS[:3]:
        out = client(server).completions.create(model=NAME, prompt=prompt, max_tokens=24,
                                                temperature=0, extra_body=body)
        want = reference(prompt, 24)
        choice = out.choices[0]
        assert choice.text == want.text and choice.finish_reason == want.finish_reason
        assert out.usage.prompt_tokens == len(reference.tokenizer.encode_prompt(prompt, raw=True))
        assert out.usage.completion_tokens == len(want.token_ids)
        stats = extra(choice, "speculation")
        assert stats["new_tokens"] == len(want.token_ids)
        method = {None: "draft", "off": "none"}.get(speculation) if not isinstance(
            speculation, dict) else speculation["method"]
        assert stats["method"] == method
        if method == "none":
            assert stats["drafted"] == 0 and stats["target_forward_passes"] == len(want.token_ids)
        else:
            assert 0 <= stats["acceptance_rate"] <= 1 and stats["mean_accepted_length"] >= 1


def test_streaming_completion_text_usage_and_stats(server, reference):
    chunks = list(client(server).completions.create(
        model=NAME, prompt=PROMPTS[1], max_tokens=30, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    want = reference(PROMPTS[1], 30)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(final) == 1 and final[0].choices[0].finish_reason == want.finish_reason
    stats = extra(final[0].choices[0], "speculation")
    assert stats["method"] == "draft" and stats["drafted"] > 0
    assert stats["accepted"] > 0  # the draft is the target plus a little noise
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_solo_chat_output(server, reference, stream):
    for prompt in PROMPTS[2:4]:
        want = reference(prompt, 20, chat=True)
        out = client(server).chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": prompt}], max_tokens=20,
            temperature=0, stream=stream)
        if stream:
            chunks = list(out)
            assert chunks[0].choices[0].delta.role == "assistant"
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            text, finish = out.choices[0].message.content, out.choices[0].finish_reason
            assert out.usage.completion_tokens == len(want.token_ids)
        assert text == want.text and finish == want.finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_text(server, reference, stream):
    full = reference(PROMPTS[0], 24).text
    stop = full[6:8]
    want = reference(PROMPTS[0], 24, stop=(stop,))
    assert want.finish_reason == "stop" and want.text == full[:full.index(stop)]
    out = client(server).completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=24,
                                            temperature=0, stop=[stop, "never-seen"],
                                            stream=stream)
    if stream:
        chunks = list(out)
        text = "".join(c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        text, finish = out.choices[0].text, out.choices[0].finish_reason
    assert (text, finish) == (want.text, "stop")


def test_speculation_stats_in_every_chunk_when_asked(server):
    chunks = list(client(server).completions.create(
        model=NAME, prompt=PROMPTS[3], max_tokens=24, temperature=0, stream=True,
        extra_body={"speculation": {"method": "ngram", "k": 4, "stream_stats": True}}))
    running = [extra(c.choices[0], "speculation") for c in chunks[:-1]]
    passes = [s["target_forward_passes"] for s in running]
    assert passes == list(range(1, len(passes) + 1))  # one chunk per target forward pass
    final = extra(chunks[-1].choices[0], "speculation")
    assert final["method"] == "ngram" and final["target_forward_passes"] == passes[-1]
    assert running[-1]["new_tokens"] == final["new_tokens"] > 0
    assert running[-1]["drafted"] == final["drafted"] > 0  # the prompt repeats: n-grams match


def test_default_max_tokens_and_seeded_sampling_with_n(server):
    def sample():
        out = client(server).completions.create(model=NAME, prompt=PROMPTS[0], n=3, seed=7,
                                                temperature=1.0, top_p=0.9)
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)], out.usage

    texts, use = sample()
    assert len(texts) == 3 and sample()[0] == texts  # the seed reproduces every choice
    assert len(set(texts)) > 1  # choice i samples with seed + i
    assert use.completion_tokens <= 3 * SERVER_MAX_TOKENS


# --- refusals: clear 4xx, OpenAI-shaped, and the server keeps serving ----------------------------

def post(base: str, path: str, body, *, key: str | None = KEY, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, dict | list):
        return httpx.post(f"{base}{path}", json=body, headers=headers, timeout=60, **kw)
    headers["Content-Type"] = "application/json"
    return httpx.post(f"{base}{path}", content=body, headers=headers, timeout=60, **kw)


def assert_error(r: httpx.Response, status: int, param: str | None = None,
                 code: str | None = None, text: str = "") -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and text in error["message"]
    if code is not None:
        assert error["code"] == code


def completion(**fields) -> dict:
    return {"model": NAME, "prompt": "hi", "max_tokens": 4} | fields


@pytest.mark.parametrize(("body", "status", "param", "code", "text"), [
    (b"{not json", 400, None, "invalid_json", "not valid JSON"),
    (b"[" * 5000 + b"]" * 5000, 400, None, None, ""),
    (completion(model="gpt-4"), 404, "model", "model_not_found", "does not exist"),
    (completion(prompt="x" * 200), 400, "prompt", "context_length_exceeded", "context holds"),
    (completion(max_tokens=200), 400, "max_tokens", "context_length_exceeded", "asks for"),
    (completion(max_tokens=0), 400, "max_tokens", None, "greater than or equal to 1"),
    (completion(temperature=-1), 400, "temperature", None, ""),
    (completion(top_p=0), 400, "top_p", None, ""),
    (completion(n=100), 400, "n", None, ""),
    (completion(seed=-1), 400, "seed", None, ""),
    (completion(stop=["a", "b", "c", "d", "e"]), 400, "stop", None, "at most 4"),
    (completion(logprobs=21), 400, "logprobs", None, "must be in [0, 20]"),
    (completion(presence_penalty=2.5), 400, "presence_penalty", None, "must be in [-2, 2]"),
    (completion(repetition_penalty=0), 400, "repetition_penalty", None, "> 0"),
    (completion(logit_bias={"x": 1}), 400, "logit_bias", None, "token ids"),
    (completion(logit_bias={"999": 1}), 400, "logit_bias", None, "token ids in [0, 259)"),
    (completion(logit_bias={"5": 101}), 400, "logit_bias", None, "[-100, 100]"),
    (completion(suffix="x"), 400, "suffix", "unsupported_parameter", "not supported"),
    (completion(prompt=""), 400, "prompt", None, "empty"),
    (completion(prompt=[1, 2, 10**6]), 400, "prompt", None, "token ids"),
    (completion(prompt=["a", "b"]), 400, "prompt", None, "one prompt"),
    (completion(speculation="on"), 400, "speculation", None, 'must be "off"'),
    (completion(speculation={"method": "medusa"}), 400, "speculation.method", None, "medusa"),
    (completion(speculation={"k": 99}), 400, "speculation.k", None, ""),
    (completion(speculation={"policy": "x"}), 400, "speculation.policy", None, ""),
    (completion(speculation={"kk": 1}), 400, "speculation.kk", None, ""),
    ({"model": NAME}, 400, "prompt", None, "Field required"),
])
def test_bad_completion_requests_are_clear_4xx(server, body, status, param, code, text):
    assert_error(post(server, "/v1/completions", body), status, param, code, text)


@pytest.mark.parametrize(("body", "param", "text"), [
    ({"model": NAME, "messages": []}, "messages", ""),
    ({"model": NAME, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", ""),
    ({"model": NAME, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     None, ""),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "top_logprobs", "needs logprobs: true"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "tools": [{}]},
     "tools.0.function", "function.name"),
])
def test_bad_chat_requests_are_clear_400s(server, body, param, text):
    r = post(server, "/v1/chat/completions", body)
    if param is None:
        param = r.json()["error"]["param"]
        assert param.startswith("messages.0.content")
    assert_error(r, 400, param, None, text)


def test_key_size_and_route_refusals(server):
    assert_error(post(server, "/v1/completions", completion(), key=None), 401, None,
                 "invalid_api_key")
    assert_error(post(server, "/v1/completions", completion(), key="wrong"), 401, None,
                 "invalid_api_key")
    assert_error(post(server, "/v1/completions", completion(prompt="x" * BODY_LIMIT)), 413,
                 None, "request_too_large")

    def chunked():  # no Content-Length: the limit applies as the body arrives
        yield json.dumps(completion(prompt="y" * BODY_LIMIT)).encode()

    assert_error(post(server, "/v1/completions", chunked()), 413, None, "request_too_large")
    auth = {"Authorization": f"Bearer {KEY}"}
    assert_error(httpx.get(f"{server}/v1/nothing-here", headers=auth), 404)
    assert_error(httpx.get(f"{server}/nothing-here"), 404)
    assert_error(httpx.get(f"{server}/v1/completions", headers=auth), 405)
    assert client(server).completions.create(model=NAME, prompt="ok", max_tokens=2).choices


def test_host_header_outside_the_allow_list_is_refused(server):
    """DNS rebinding: a page on evil.example resolving to 127.0.0.1 sends Host: evil.example."""
    port = server.rsplit(":", 1)[1]
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1:1", PROXY_HOST + ".evil"):
        assert_error(httpx.get(f"{server}/health", headers={"Host": host}), 421, None,
                     "host_not_allowed", "does not answer")
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", PROXY_HOST):
        assert httpx.get(f"{server}/health", headers={"Host": host}).status_code == 200, host


def test_metrics_need_the_key_with_metrics_auth(server):
    assert_error(httpx.get(f"{server}/metrics"), 401, None, "invalid_api_key")
    assert_error(httpx.get(f"{server}/metrics", headers={"Authorization": "Bearer no"}), 401)
    ok = httpx.get(f"{server}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and "forerun_slots" in ok.text
    assert httpx.get(f"{server}/health").status_code == 200  # probes need no key


def test_api_key_file_sets_the_key(server):
    """The server got its key only from --api-key-file (not on its command line)."""
    assert client(server).models.list().data
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key=KEY + "x", max_retries=0).models.list()


def test_a_100k_character_stop_string_is_refused(slow_server):
    body = completion(stop=["x" * 100_000])  # slow_server's body limit is the default, 1 MiB
    assert_error(post(slow_server, "/v1/completions", body, key=None), 400, "stop", None,
                 "at most 256 characters")
    ok = completion(stop=["x" * 256])
    assert post(slow_server, "/v1/completions", ok, key=None).status_code == 200


def test_openai_client_raises_its_own_errors(server):
    with pytest.raises(openai.NotFoundError):
        client(server).completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError) as e:
        client(server).chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "z" * 300}])
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="bad", max_retries=0).models.list()


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "top_k", "min_p", "n", "stream", "stream_options", "stop", "seed", "logprobs",
          "speculation", "echo", "suffix", "best_of", "logit_bias", "response_format"]
VALUES = (JSON | st.integers(-2**70, 2**70) | st.sampled_from(
    ["off", "", "\x00", "\ud800", [1, 2], [[1]], {"method": "ngram", "k": 0},
     {"include_usage": True}, [{"role": "user", "content": "hi"}]]))
BODIES = st.one_of(
    JSON,
    st.fixed_dictionaries({"model": st.just(NAME)}, optional={
        f: VALUES for f in FIELDS}),
    st.fixed_dictionaries({"model": st.just(NAME), "prompt": st.text(max_size=40),
                           "max_tokens": st.integers(1, 8)}, optional={
        f: VALUES for f in FIELDS if f not in ("prompt", "max_tokens")}))


@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(body=BODIES, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_hostile_bodies_never_5xx(server, body, path):
    r = post(server, path, json.dumps(body).encode())  # lone surrogates go as \ud800 escapes
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


# --- load: concurrent streams, each exactly its solo output ---------------------------------------

def sampled(i: int) -> bool:
    """Every fourth client samples (seeded): it must get what it gets alone."""
    return i % 4 == 3


def test_concurrent_streams_each_equal_their_solo_output(server, reference):
    """32 clients at once, greedy and seeded-sampled, with every speculation a request can ask
    for, in one batch: each greedy one gets its solo greedy text, each sampled one the text it
    gets when it runs alone afterwards."""
    def body(i: int) -> dict:
        spec = SPECS[i % len(SPECS)]
        return dict(model=NAME, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=12 + i % 7,
                    temperature=0.9 if sampled(i) else 0, seed=i if sampled(i) else None,
                    extra_body={} if spec is None else {"speculation": spec})

    async def one(api: openai.AsyncOpenAI, i: int) -> tuple[str, str, int]:
        stream = await api.completions.create(**body(i), stream=True,
                                              stream_options={"include_usage": True})
        text, usage = [], None
        async for chunk in stream:
            text += [c.text for c in chunk.choices]
            usage = chunk.usage or usage
        return "".join(text), chunk.id, usage.completion_tokens

    async def all_of_them():
        api = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0,
                                 timeout=120)
        async with api:
            return await asyncio.gather(*(one(api, i) for i in range(CONCURRENT_CLIENTS)))

    before = metric(server, "forerun_sequences_finished_total", reason="length")
    passes = metric(server, "forerun_batch_size_per_pass_count")
    alone = metric(server, "forerun_batch_size_per_pass_bucket", le="1.0")
    results = asyncio.run(asyncio.wait_for(all_of_them(), 180))
    assert len({rid for _, rid, _ in results}) == CONCURRENT_CLIENTS
    for i, (text, _, tokens) in enumerate(results):
        if sampled(i):
            want = client(server).completions.create(**body(i)).choices[0].text
            assert text == want, f"client {i} (sampled)"
            continue
        want = reference(PROMPTS[i % len(PROMPTS)], 12 + i % 7)
        assert text == want.text, f"client {i}"
        assert tokens == len(want.token_ids)
    finished = sum(metric(server, "forerun_sequences_finished_total", reason=r)
                   for r in ("stop", "length"))
    assert finished >= CONCURRENT_CLIENTS + before
    # they were batched: some passes held more than one request
    more = (metric(server, "forerun_batch_size_per_pass_count") - passes) - (
        metric(server, "forerun_batch_size_per_pass_bucket", le="1.0") - alone)
    assert more > 0
    wait_idle(server)


def test_metrics_exposition(server):
    client(server).completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=8)
    text = httpx.get(f"{server}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"forerun_requests", "forerun_prompt_tokens", "forerun_generation_tokens",
            "forerun_draft_tokens", "forerun_accepted_tokens", "forerun_acceptance_rate",
            "forerun_mean_accepted_length", "forerun_acceptance_by_position",
            "forerun_time_to_first_token_seconds", "forerun_inter_token_latency_seconds",
            "forerun_queue_depth", "forerun_requests_running", "forerun_speculation_mode",
            "forerun_slots", "forerun_batch_size", "forerun_batch_size_per_pass",
            "forerun_draft_tokens_last_pass", "forerun_draft_tokens_per_pass",
            "forerun_batch_passes", "forerun_spec_policy", "forerun_kv_cache_budget_bytes"} <= names
    assert metric(server, "forerun_generation_tokens_total") > 0
    assert metric(server, "forerun_requests_total", path="/v1/completions", status="200") > 0
    assert metric(server, "forerun_time_to_first_token_seconds_count") > 0
    assert 0 < metric(server, "forerun_acceptance_rate") <= 1
    assert metric(server, "forerun_mean_accepted_length") >= 1
    assert metric(server, "forerun_acceptance_by_position", position="0") > 0
    assert metric(server, "forerun_slots") == 8
    assert metric(server, "forerun_speculation_mode", forerun_speculation_mode="full") == 1
    assert metric(server, "forerun_spec_policy", forerun_spec_policy="always") == 1
    assert metric(server, "forerun_batch_passes_total", speculation="full") > 0


# --- a slow server: queue limits, shedding speculation, clients that leave ------------------------

def open_stream(http: httpx.Client, max_tokens: int, prompt: str = PROMPTS[3]):
    body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    return http.stream("POST", "/v1/completions", json=body)


def test_full_server_answers_429_and_sheds_speculation(slow_server, reference):
    with httpx.Client(base_url=slow_server, timeout=60) as http:
        streams = [open_stream(http, 60) for _ in range(3)]  # 2 slots + 1 queued
        responses = [s.__enter__() for s in streams]
        assert [r.status_code for r in responses] == [200, 200, 200]
        wait_until(lambda: health(slow_server)["running"] == 2)  # admitted at a round
        h = health(slow_server)
        assert (h["running"], h["waiting"], h["speculation_mode"]) == (2, 1, "off")
        assert metric(slow_server, "forerun_speculation_mode",
                      forerun_speculation_mode="off") == 1
        assert metric(slow_server, "forerun_queue_depth") == 1
        r = http.post("/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 2})
        assert_error(r, 429, None, "server_busy", "retry later")
        assert r.json()["error"]["type"] == "rate_limit_error"
        # speculation was off, or reduced to nothing, for part of the way: still exact
        text = "".join(json.loads(line[6:])["choices"][0]["text"]
                       for line in responses[0].iter_lines()
                       if line.startswith("data: {"))
        assert text == reference(PROMPTS[3], 60).text
        for s in streams:
            s.__exit__(None, None, None)
    wait_idle(slow_server)
    assert health(slow_server)["speculation_mode"] == "full"
    out = client(slow_server).completions.create(model=NAME, prompt=PROMPTS[4], max_tokens=8,
                                                 temperature=0)
    assert out.choices[0].text == reference(PROMPTS[4], 8).text
    assert extra(out.choices[0], "speculation")["method"] == "ngram"


def test_client_leaving_mid_stream_frees_its_slot_at_once(slow_server):
    wait_idle(slow_server)
    cancelled = metric(slow_server, "forerun_sequences_finished_total", reason="cancelled")
    tokens = metric(slow_server, "forerun_generation_tokens_total")
    with httpx.Client(base_url=slow_server, timeout=60) as http, open_stream(http, 100) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        assert health(slow_server)["running"] == 1
    wait_idle(slow_server)
    # freed by the cancellation, not by running to its end: far fewer than 100 tokens were made
    assert metric(slow_server, "forerun_sequences_finished_total",
                  reason="cancelled") == cancelled + 1
    assert metric(slow_server, "forerun_generation_tokens_total") - tokens < 100


def test_clients_leaving_at_once_free_every_cache(slow_server):
    # 2 running + 1 queued, all gone at once: every request is cancelled and the KV memory
    # in use returns to its idle level
    wait_idle(slow_server)
    idle = metric(slow_server, "forerun_kv_cache_bytes_in_use")
    cancelled = metric(slow_server, "forerun_sequences_finished_total", reason="cancelled")
    with httpx.Client(base_url=slow_server, timeout=60) as http:
        streams = [open_stream(http, 100, prompt) for prompt in PROMPTS[:3]]
        lines = [s.__enter__().iter_lines() for s in streams]
        wait_until(lambda: health(slow_server)["running"] == 2)
        for first in lines[:2]:
            assert next(line for line in first if line.startswith("data: {"))
        # (this runtime forks one cache per member, outside the pool the gauge reads)
        for s in streams:
            s.__exit__(None, None, None)
    wait_idle(slow_server)
    assert metric(slow_server, "forerun_kv_cache_bytes_in_use") == idle == 0
    assert metric(slow_server, "forerun_sequences_finished_total",
                  reason="cancelled") == cancelled + 3


def test_client_leaving_a_non_streaming_request_frees_its_slot(slow_server, reference):
    # greedy, no speculation, and a prompt whose greedy text runs long (float64: the same on
    # every machine): the request lasts >= 60 forward passes (1.2 s), well past the timeout
    assert len(reference("x", 120).token_ids) >= 60
    wait_idle(slow_server)
    cancelled = metric(slow_server, "forerun_sequences_finished_total", reason="cancelled")
    tokens = metric(slow_server, "forerun_generation_tokens_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{slow_server}/v1/completions", timeout=0.3,
                   json={"model": NAME, "prompt": "x", "max_tokens": 120,
                         "temperature": 0, "speculation": "off"})
    wait_idle(slow_server)
    # noticed by the disconnect checks and cancelled, not run to its 120 tokens
    assert metric(slow_server, "forerun_sequences_finished_total",
                  reason="cancelled") == cancelled + 1
    assert metric(slow_server, "forerun_generation_tokens_total") - tokens < len(
        reference("x", 120).token_ids)


class ScriptedRuntime:
    """A "model" that writes a script: after a prompt of `prompt_len` tokens it predicts
    script[0], script[1], ... whatever it is fed, then the stop token."""

    capabilities, curve = Capabilities(), None

    def __init__(self, script: list[int], prompt_len: int, vocab: int, stop: int):
        self.script, self.prompt_len, self.stop, self.length = script, prompt_len, stop, 0
        self.config, self.capacity = SimpleNamespace(vocab_size=vocab), 128

    def forward(self, tokens, *, last_only=False, **_) -> ForwardOutput:
        positions = range(self.length, self.length + len(tokens))
        self.length += len(tokens)
        nexts = [self.script[p] if 0 <= p < len(self.script) else self.stop
                 for p in (q + 1 - self.prompt_len for q in positions)]
        logits = torch.zeros(len(nexts), self.config.vocab_size, dtype=torch.float64)
        logits[range(len(nexts)), nexts] = 1.0
        return ForwardOutput(logits[-1:] if last_only else logits)

    def truncate(self, length: int) -> None:
        self.length = length

    def fork(self) -> ScriptedRuntime:
        return ScriptedRuntime(self.script, self.prompt_len, self.config.vocab_size, self.stop)


@pytest.mark.parametrize("speculation", ["off", {"method": "ngram", "k": 3}])
def test_streamed_text_never_splits_a_utf8_character(model_dirs, speculation):
    """Byte-level tokens: every multi-byte character arrives in pieces, and no SSE chunk may
    carry half of one; the raw stream is `data: {json}` events ending with `data: [DONE]`."""
    tokenizer = open_model(str(model_dirs[0])).tokenizer
    text = "é世界ü! ok é世界ü!"
    script = tokenizer.encode(text, add_special=False)
    assert len(script) > len(text)  # several tokens per character
    prompt = [1, 2, 3]
    runtime = ScriptedRuntime(script, len(prompt), len(tokenizer.vocab),
                              tokenizer.tokenizer.token_to_id("<|im_end|>"))
    worker = Worker(Engine.from_runtimes(runtime, tokenizer, spec=SpecConfig("none")), slots=1,
                    max_queue=1)
    with ThreadServer(create_app(worker, ServeConfig(NAME))) as s:
        r = httpx.post(f"{s.base}/v1/completions", json={
            "model": NAME, "prompt": prompt, "max_tokens": 64, "temperature": 0, "stream": True,
            "speculation": speculation})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [line for line in r.text.split("\n") if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:])["choices"][0] for e in events[:-1]]
    pieces = [c["text"] for c in chunks if c["text"]]
    assert "".join(pieces) == text and len(pieces) > 3
    assert not any("\ufffd" in p for p in pieces)
    assert chunks[-1]["finish_reason"] == "stop"


class BrokenRuntime(ScriptedRuntime):
    """Fails on its fifth forward pass, as a runtime with a bug or a dead device would."""

    calls = 0

    def forward(self, tokens, **kw) -> ForwardOutput:
        BrokenRuntime.calls += 1
        if BrokenRuntime.calls == 5:
            raise RuntimeError("device lost")
        return super().forward(tokens, **kw)

    def fork(self) -> BrokenRuntime:
        return BrokenRuntime(self.script, self.prompt_len, self.config.vocab_size, self.stop)


def test_a_failing_generation_is_an_error_and_the_server_keeps_serving(model_dirs):
    tokenizer = open_model(str(model_dirs[0])).tokenizer
    script = tokenizer.encode("0123456789", add_special=False)
    runtime = BrokenRuntime(script, 3, len(tokenizer.vocab), 0)
    worker = Worker(Engine.from_runtimes(runtime, tokenizer, spec=SpecConfig("none")), slots=1,
                    max_queue=1)
    body = {"model": NAME, "prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0}
    with ThreadServer(create_app(worker, ServeConfig(NAME))) as s:
        BrokenRuntime.calls = 0
        assert_error(httpx.post(f"{s.base}/v1/completions", json=body), 500, None, None,
                     "device lost")
        BrokenRuntime.calls = 0
        r = httpx.post(f"{s.base}/v1/completions", json=body | {"stream": True})
        events = [line for line in r.text.split("\n") if line]
        assert "device lost" in json.loads(events[-2][6:])["error"]["message"]
        assert events[-1] == "data: [DONE]"
        ok = httpx.post(f"{s.base}/v1/completions", json=body)  # calls > 5: healthy again
        assert ok.json()["choices"][0]["text"] == "01234567"
        assert health(s.base)["status"] == "ok"


# --- the worker alone ----------------------------------------------------------------------------

def test_load_shedding_modes_and_caps():
    shed = LoadShedding(reduce_above=2, off_above=4)
    assert [shed.mode(n) for n in range(7)] == ["full"] * 3 + ["reduced"] * 2 + ["off"] * 2
    assert LoadShedding().mode(1000) == "full"
    assert k_cap("reduced", 4) == 2 and k_cap("reduced", 1) == 1 and k_cap("off", 8) == 0
    assert k_cap("full", 4) > 16  # no cap: an adaptive policy may grow past its start value


def test_submit_is_all_or_nothing_and_cancel_unqueues(model_dirs):
    src = open_model(str(model_dirs[0]))
    engine = Engine.from_runtimes(src.load(dtype="float64"), src.tokenizer, spec=SpecConfig(
        "ngram", 2))
    worker = Worker(engine, slots=1, max_queue=2)  # not started: jobs stay queued

    def job() -> Job:
        return Job([1, 2, 3], SamplingConfig(), 4, (), engine.spec, emit=lambda e: None)

    first, second = job(), job()
    worker.submit([first, second])
    with pytest.raises(Busy):
        worker.submit([job(), job()])
    assert worker.in_flight == (0, 2)
    worker.cancel(first)
    assert worker.in_flight == (0, 1)
    worker.submit([job(), job()])
    worker.start()
    worker.stop()
    with pytest.raises(Stopped):
        worker.submit([job()])


def test_worker_interleaves_jobs_each_as_if_alone(model_dirs, reference):
    """Three jobs in two slots, stepped in turn: each gets exactly its solo tokens."""
    src = open_model(str(model_dirs[0]))
    engine = Engine.from_runtimes(src.load(dtype="float64"), src.tokenizer, spec=SpecConfig(
        "ngram", 3))
    worker = Worker(engine, slots=2, max_queue=4)
    events: dict[int, list] = {0: [], 1: [], 2: []}
    done = threading.Event()

    def emit_for(i):
        def emit(event):
            events[i].append(event)
            if all(any(isinstance(e, Done) for e in evs) for evs in events.values()):
                done.set()
        return emit

    jobs = [Job(src.tokenizer.encode_prompt(PROMPTS[i], raw=True), SamplingConfig(), 20, (),
                SpecConfig(["ngram", "none", "ngram"][i], 3), emit_for(i)) for i in range(3)]
    worker.submit(jobs)
    worker.start()
    try:
        assert done.wait(60)
    finally:
        worker.stop()
    for i in range(3):
        text = "".join(e.text for e in events[i] if not isinstance(e, Done))
        assert text == reference(PROMPTS[i], 20).text


def test_a_long_stop_string_in_the_library_costs_linear_work(model_dirs):
    """Engine.generate with a 100k-character stop string: the stop string is read O(stop + text)
    times in all (CountingStr fails past that budget), not O(stop) times at every step."""
    engine = Engine(str(model_dirs[0]), None, spec=SpecConfig("none"),
                    load=LoadConfig(dtype="float64"))
    stop = CountingStr("a" * 100_000)
    CountingStr.reads, CountingStr.budget = 0, linear_budget(len(stop), 24 * 8)
    try:
        out = engine.generate(PROMPTS[0], raw=True, max_tokens=24, stop=(stop,))
    finally:
        CountingStr.budget = None
    assert len(out.token_ids) == 24 and out.finish_reason == "length"


def chat_server(model_dirs, template: str) -> ThreadServer:
    tokenizer = replace(open_model(str(model_dirs[0])).tokenizer, chat_template=template,
                        _template=None)
    runtime = ScriptedRuntime([], 0, len(tokenizer.vocab), 0)
    worker = Worker(Engine.from_runtimes(runtime, tokenizer, spec=SpecConfig("none")), slots=1,
                    max_queue=1)
    return ThreadServer(create_app(worker, ServeConfig(NAME)))


@pytest.mark.parametrize(("template", "message"), [
    ("{% for m in messages %}{% for i in range(100000) %}{% for j in range(100000) %}"
     "{% endfor %}{% endfor %}{% endfor %}", "loop iterations"),
    ("{{ messages[0].content * 10**10 }}", "repetition"),
])
def test_hostile_chat_template_fails_the_request_clearly(model_dirs, template, message,
                                                        monkeypatch):
    # the loop budget (a count) must be what stops it, however loaded the machine
    monkeypatch.setattr(chat_template, "RENDER_DEADLINE_S", 3600.0)
    with chat_server(model_dirs, template) as s:
        api = openai.OpenAI(base_url=f"{s.base}/v1", api_key="none", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as e:
            api.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}])
        assert e.value.param == "messages" and message in e.value.message
        assert health(s.base)["status"] == "ok"


def test_worker_restarts_after_a_crash_of_its_loop(model_dirs, monkeypatch):
    """A bug outside any job's generation (here in the step bookkeeping) fails the jobs running
    then; the loop restarts and serves the next job; after MAX_RESTARTS it stops for good."""
    src = open_model(str(model_dirs[0]))
    engine = Engine.from_runtimes(src.load(dtype="float64"), src.tokenizer,
                                  spec=SpecConfig("none"))
    fatal = threading.Event()
    worker = Worker(engine, slots=1, max_queue=4, on_fatal=fatal.set)
    crashes = []
    observe = worker._observe

    def crash_once(run, step):
        if not crashes:
            crashes.append(step)
            raise ValueError("a bug in the bookkeeping")
        observe(run, step)

    monkeypatch.setattr(worker, "_observe", crash_once)

    def run_job() -> list:
        events, over = [], threading.Event()

        def emit(event):
            events.append(event)
            if isinstance(event, Done | Failed):
                over.set()

        worker.submit([Job([1, 2, 3], SamplingConfig(), 4, (), engine.spec, emit)])
        assert over.wait(HANG_S)
        return events

    worker.start()
    try:
        assert isinstance(run_job()[-1], Failed) and worker.restarts == 1
        assert isinstance(run_job()[-1], Done) and worker.alive and worker.restarts == 1
        monkeypatch.setattr("forerun.serve.worker.MAX_RESTARTS", 1)
        crashes.clear()
        assert isinstance(run_job()[-1], Failed)
        assert fatal.wait(HANG_S)
        worker._thread.join(HANG_S)
        assert not worker.alive
        with pytest.raises(Stopped):
            worker.submit([Job([1, 2, 3], SamplingConfig(), 4, (), engine.spec, print)])
    finally:
        worker.stop()


def test_calibration_at_start_up_measures_one_slot_once(model_dirs, monkeypatch):
    """After `calibrate`, a cost-policy request in any slot (any k up to MAX_K) measures
    nothing: it would otherwise time dozens of passes inside its first step."""
    measured = []
    measure = profile.measure_forward_curve

    def spy(runtime, *args, **kw):
        measured.append(runtime)
        return measure(runtime, *args, **kw)

    monkeypatch.setattr(profile, "measure_forward_curve", spy)
    src = open_model(str(model_dirs[0]))
    engine = Engine.from_runtimes(src.load(dtype="float64"), src.tokenizer,
                                  spec=SpecConfig("ngram", 3, "cost"))
    worker = Worker(engine, slots=3, max_queue=3)
    worker.calibrate()
    assert len(measured) == 1  # one slot's target (n-gram drafting runs no model)
    done = threading.Semaphore(0)
    jobs = [Job(src.tokenizer.encode_prompt(PROMPTS[3], raw=True), SamplingConfig(), 8, (),
                SpecConfig("ngram", k, "cost"),
                lambda e: done.release() if isinstance(e, Done | Failed) else None)
            for k in (1, 8, MAX_K)]
    worker.submit(jobs)
    worker.start()
    try:
        for _ in jobs:
            assert done.acquire(timeout=HANG_S)
    finally:
        worker.stop()
    assert len(measured) == 1


def test_a_requests_speculation_keeps_every_methods_own_server_options():
    """A request's `speculation` sets method, k, policy, n-gram sizes and shadow; every other
    option (the tree, suffix, multi, lookahead, layer-skip, magicdec, qspec, early-exit) is
    the server's, whichever method the request names."""
    from forerun.serve.app import resolve_spec
    from forerun.serve.protocol import Speculation

    server = SpecConfig("draft", 4, tree=7, skip_layers=(1, 3), magicdec_sinks=2,
                        magicdec_window=64, magicdec_drafter="self", qspec_bits=4,
                        qspec_runtime="torch", exit_layer=2, exit_adapter="none",
                        suffix_factor=2.0, lookahead_window=3)
    for method in ("layer-skip", "magicdec", "qspec", "early-exit", "ngram"):
        spec, _ = resolve_spec(Speculation(method=method, k=2, policy="cost"), server,
                               has_draft=True)
        assert spec == replace(server, method=method, k=2, policy="cost"), method
