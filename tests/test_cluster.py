"""Scale-out on Ray (`forerun.cluster`): a local Ray cluster, started and stopped here, serving a
tiny model from 2 replicas behind one OpenAI-compatible endpoint on a free 127.0.0.1 port.

The replicas build their engines in their own processes from a picklable factory: the tiny
float64 model of tests/test_serve.py (where greedy speculative output equals plain output
exactly), every forward pass slowed by SLOW_FORWARD_S so that requests last long enough to be
caught mid-run. Every answer is checked against plain `Engine.generate` in this process ("solo").

Without Ray (not installed), the cluster tests are skipped; routing and the ASGI relay are tested
either way. Waits poll a state with a long timeout that only catches a hang.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from tiny_files import byte_tokens, random_hf_weights, write_hf_dir

from forerun import Engine, LoadConfig, SpecConfig
from forerun.cluster.asgi import Forwarded, Start, call_app
from forerun.cluster.routing import PREFIX_CHARS, prefix_key, rank
from forerun.cluster.spec import ClusterConfig, ReplicaSpec, WorkerSettings
from forerun.serve.app import ServeConfig, create_app
from forerun.serve.worker import Worker

NAME = "tiny"
SLOW_FORWARD_S = 0.02  # each replica's forward passes sleep this long: requests last ~2 s
MAX_TOKENS = 64  # of the tiny model's 128-token context (a chat prompt takes ~40)
CLIENTS = 16
HANG_S = 90
PROMPTS = ["Hello there", "def f(x):", "The quick brown fox", "abcabcabc", "1, 2, 3, 4,",
           "Once upon a time", "import numpy as np", "SELECT * FROM"]


# --- without Ray ---------------------------------------------------------------------------------

def test_prefix_key_reads_the_first_block_of_prompt_or_messages():
    long = "x" * PREFIX_CHARS
    body = lambda **f: json.dumps({"model": NAME, **f}).encode()  # noqa: E731
    assert prefix_key("/v1/completions", body(prompt="short")) is None
    assert prefix_key("/v1/completions", body(prompt=long + "a")) == prefix_key(
        "/v1/completions", body(prompt=[long + "b"]))  # the same first block, the same key
    assert prefix_key("/v1/completions", body(prompt=list(range(PREFIX_CHARS // 4)))) is not None
    chat = [{"role": "system", "content": long}, {"role": "user", "content": "hi"}]
    assert prefix_key("/v1/chat/completions", body(messages=chat)) is not None
    assert prefix_key("/v1/chat/completions", b"not json") is None
    assert prefix_key("/v1/models", b"") is None


def test_rank_keeps_a_key_on_its_replica_when_another_leaves():
    replicas = [f"r{i}" for i in range(4)]
    keys = [f"k{i}" for i in range(200)]
    first = {k: rank(k, replicas)[0] for k in keys}
    assert len(set(first.values())) == 4  # keys spread over every replica
    gone = "r2"
    for k in keys:
        after = rank(k, [r for r in replicas if r != gone])[0]
        assert after == first[k] or first[k] == gone  # only the dead replica's keys move


def test_serve_ray_detach_needs_an_address():
    """A local cluster ends with the command, so there is nothing to detach from."""
    out = subprocess.run([sys.executable, "-m", "forerun.cli", "serve", "--ray", "--ray-detach"],
                         capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 2 and "--ray-detach needs --ray-address" in out.stderr


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cluster")
    write_hf_dir(root / "target", random_hf_weights(len(byte_tokens()), seed=0), byte_tokens())
    return root / "target"


@pytest.fixture(scope="module")
def solo(model_dir):
    """solo(prompt, chat=False) -> plain greedy decoding's Completion of MAX_TOKENS tokens
    (one engine: call it from one thread at a time)."""
    engine = Engine(str(model_dir), None, spec=SpecConfig("none"),
                    load=LoadConfig(dtype="float64"))
    cache = {}

    def run(prompt: str, chat: bool = False):
        if (prompt, chat) not in cache:
            ids = (engine.tokenizer.encode_chat([{"role": "user", "content": prompt}]) if chat
                   else engine.tokenizer.encode_prompt(prompt, raw=True))
            cache[prompt, chat] = engine.generate(ids, max_tokens=MAX_TOKENS)
        return cache[prompt, chat]

    return run


def test_call_app_relays_a_stream_event_by_event(model_dir, solo):
    engine = SlowTiny(str(model_dir), 0.0)()
    worker = Worker(engine, slots=2, max_queue=2)
    worker.start()
    body = json.dumps({"model": NAME, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
                       "temperature": 0, "stream": True}).encode()
    request = Forwarded("POST", "/v1/completions", b"",
                        ((b"host", b"x"), (b"content-type", b"application/json")), body)

    async def relay() -> list:
        return [part async for part in call_app(create_app(worker, ServeConfig(NAME)), request,
                                                ((b"x-test", b"1"),))]

    try:
        parts = asyncio.run(relay())
    finally:
        worker.stop()
    assert isinstance(parts[0], Start) and parts[0].status == 200
    assert (b"x-test", b"1") in parts[0].headers
    events = [e for e in sse_events(b"".join(parts[1:]))]
    assert len(parts) > 3 and events[-1] == "[DONE]"  # one part per event, not one blob
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == (
        solo(PROMPTS[0]).text)


# --- a local Ray cluster -------------------------------------------------------------------------

class SlowRuntime:
    """A runtime whose every forward pass sleeps `delay` seconds first."""

    def __init__(self, inner, delay: float):
        self.inner, self.delay = inner, delay

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, tokens, **kw):
        time.sleep(self.delay)
        return self.inner.forward(tokens, **kw)

    def fork(self) -> SlowRuntime:
        return SlowRuntime(self.inner.fork(), self.delay)


@dataclass(frozen=True)
class SlowTiny:
    """The engine factory the replicas call: the tiny model, n-gram speculation, slowed."""

    path: str
    delay: float

    def __call__(self) -> Engine:
        from forerun.models.load import open_model

        src = open_model(self.path)
        return Engine.from_runtimes(SlowRuntime(src.load(dtype="float64"), self.delay),
                                    src.tokenizer, spec=SpecConfig("ngram", 3))


@pytest.fixture(scope="module")
def cluster(model_dir):
    """A local 2-CPU Ray cluster serving 2 replicas (1 CPU each) on a free loopback port."""
    pytest.importorskip("ray")
    from ray import cloudpickle

    from forerun.cluster.deploy import connect, deploy, stop

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # replicas lack tests/
    port = free_port()
    config = ClusterConfig(replicas=2, cores_per_replica=1, port=port, pin=False)
    spec = ReplicaSpec(SlowTiny(str(model_dir), SLOW_FORWARD_S),
                       WorkerSettings(slots=8, max_queue=16, spec_policy="always",
                                      prefix_cache_bytes=16 << 20, calibrate=False),
                       ServeConfig(NAME))
    handle = connect(config)
    try:
        deploy(spec, config)
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: running_replicas(base) == 2)
        yield base
    finally:
        stop(handle)
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def running_replicas(base: str) -> int:
    try:
        r = httpx.get(f"{base}/health", timeout=5)
    except httpx.TransportError:
        return 0
    return r.json()["replicas"].get("RUNNING", 0) if r.status_code in (200, 503) else 0


def wait_until(condition, within: float = HANG_S) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def sse_events(raw: bytes) -> list:
    out = []
    for line in raw.decode().splitlines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_models_health_and_metrics_through_the_ingress(cluster):
    models = openai.OpenAI(base_url=f"{cluster}/v1", api_key="x").models.list()
    assert [m.id for m in models.data] == [NAME]
    health = httpx.get(f"{cluster}/health").json()
    assert health["status"] == "ok" and health["replicas"]["RUNNING"] == 2
    assert "forerun_cluster_requests_total" in httpx.get(f"{cluster}/metrics").text


def test_sixteen_clients_through_two_replicas_each_equal_solo(cluster, solo):
    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="x", max_retries=0, timeout=HANG_S)

    def case(i: int) -> tuple[str, bool, bool]:
        return PROMPTS[i % len(PROMPTS)], i % 4 >= 2, i % 2 == 1  # prompt, chat, stream

    wants = [solo(prompt, chat).text for prompt, chat, _ in map(case, range(CLIENTS))]

    def ask(i: int) -> tuple[str, str]:
        prompt, chat, stream = case(i)
        if chat:
            messages = [{"role": "user", "content": prompt}]
            raw = client.chat.completions.with_raw_response.create(
                model=NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=stream)
            out = raw.parse()
            text = ("".join(c.choices[0].delta.content or "" for c in out if c.choices)
                    if stream else out.choices[0].message.content)
        else:
            raw = client.completions.with_raw_response.create(
                model=NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=stream)
            out = raw.parse()
            text = ("".join(c.choices[0].text for c in out if c.choices) if stream
                    else out.choices[0].text)
        return text, raw.headers["x-forerun-replica"]

    with ThreadPoolExecutor(CLIENTS) as pool:
        answers = list(pool.map(ask, range(CLIENTS)))
    for i, ((got, _), want) in enumerate(zip(answers, wants, strict=True)):
        assert got == want, i
    assert len({replica for _, replica in answers}) == 2  # both replicas served


def test_a_long_shared_prefix_stays_on_one_replica(cluster):
    """Prompts sharing their first block (token ids here: the tiny model's context is short) go
    to one replica, whose prefix cache holds that block."""
    block = [(7 * i) % 200 for i in range(PREFIX_CHARS // 4)]
    replicas = set()
    for tail in range(6):
        r = httpx.post(f"{cluster}/v1/completions", timeout=HANG_S, json={
            "model": NAME, "max_tokens": 4, "temperature": 0, "prompt": [*block, tail]})
        assert r.status_code == 200, r.text
        replicas.add(r.headers["x-forerun-replica"])
    assert len(replicas) == 1


def test_a_killed_replica_fails_only_its_own_streams(cluster, solo):
    """8 streams over both replicas; one replica's actor is killed once every stream has begun:
    its streams end with a replica_died error, the other's complete exactly, and new requests
    are answered by the live replicas."""
    import ray

    prompts = [p for p in PROMPTS if solo(p).finish_reason == "length"]
    assert len(prompts) >= 4, "the tiny model ends too many prompts early"
    streams: list[dict] = []
    began = threading.Barrier(len(prompts) * 2 + 1, timeout=HANG_S)

    def stream(prompt: str) -> None:
        record = {"prompt": prompt, "raw": b""}
        streams.append(record)
        with httpx.stream("POST", f"{cluster}/v1/completions", timeout=HANG_S, json={
                "model": NAME, "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0, "stream": True}) as r:
            record["replica"] = r.headers["x-forerun-replica"]
            chunks = r.iter_raw()
            record["raw"] += next(chunks)
            began.wait()
            for chunk in chunks:
                record["raw"] += chunk

    threads = [threading.Thread(target=stream, args=(p,)) for p in prompts * 2]
    for t in threads:
        t.start()
    began.wait()
    victim = streams[0]["replica"]
    ray.kill(ray.get_actor(f"SERVE_REPLICA::forerun#EngineReplica#{victim}", namespace="serve"),
             no_restart=True)
    for t in threads:
        t.join(HANG_S)
    assert {s["replica"] for s in streams} != {victim}, "every stream went to one replica"
    for s in streams:
        events = sse_events(s["raw"])
        if s["replica"] == victim:
            assert events[-1]["error"]["code"] == "replica_died", events[-1]
            assert "replica serving this request died" in events[-1]["error"]["message"]
        else:
            assert events[-1] == "[DONE]"
            assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == (
                solo(s["prompt"]).text)
    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="x", max_retries=0, timeout=HANG_S)
    for prompt in prompts:  # new requests: answered in full by a live replica
        raw = client.completions.with_raw_response.create(model=NAME, prompt=prompt,
                                                          max_tokens=MAX_TOKENS, temperature=0)
        assert raw.parse().choices[0].text == solo(prompt).text
        assert raw.headers["x-forerun-replica"] != victim
    failed = [line for line in httpx.get(f"{cluster}/metrics").text.splitlines()
              if line.startswith("forerun_cluster_replica_failures_total")]
    assert failed, "the ingress counted no replica failure"
    wait_until(lambda: running_replicas(cluster) == 2)  # Ray Serve replaced the replica
