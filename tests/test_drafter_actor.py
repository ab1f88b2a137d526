"""The drafter worker of `--disaggregate` as a Ray actor placed by a placement group
(`forerun.cluster.drafter_actor`): greedy output equals plain greedy token for token, a drafter
actor killed mid-request leaves the request decoding plainly, and the group's bundles are the
cores asked for.

The actor's mailboxes are tested in this process without Ray; the rest on a local 2-CPU Ray
cluster started and stopped here (loopback only), the tiny float64 models of
tests/test_disaggregate.py, each drafter actor on one CPU beside the target's one. Without Ray
(not installed) those tests are skipped.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import tiny_runtime
from test_disaggregate import GREEDY_V, greedy_run

from forerun import Engine, LoadConfig, SpecConfig
from forerun.cluster.drafter_actor import (
    DRAFTER_BUNDLE,
    ENDED,
    TARGET_BUNDLE,
    DrafterActor,
    DrafterPlacement,
)
from forerun.cluster.spec import EngineRecipe
from forerun.engine import speculative_decode
from forerun.policy import FixedK
from forerun.propose.disaggregate import AsyncDraftProposer, DisaggregateConfig
from forerun.propose.drafter_worker import Begin, Drafted, Prefill, Ready, Rooted, Shutdown, Verdict
from forerun.reference import plain_decode
from forerun.sampling import SamplingConfig, make_generator

HANG_S = 60  # a wait this long only catches a hang
PROMPT, MAX_TOKENS = "Write a sort.", 16  # a request to a replica
CORES = sorted(os.sched_getaffinity(0))


@pytest.fixture(autouse=True)
def one_thread():
    """The target on one thread beside a drafter on a core of its own (2 cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_build(noise: float = 0.3):
    return functools.partial(tiny_runtime, 0, vocab=GREEDY_V, noise=noise)


# --- without Ray --------------------------------------------------------------------------------

def test_placement_bundles_and_bad_strategies():
    placement = DrafterPlacement(draft_cores=1, target_cores=2, strategy="SPREAD")
    assert placement.bundles() == [{"CPU": 2.0}, {"CPU": 1.0}]
    assert placement.bundles("10.0.0.1")[TARGET_BUNDLE]["node:10.0.0.1"] > 0
    with pytest.raises(ValueError, match="PACK, SPREAD"):
        DrafterPlacement(1, 1, "EVERYWHERE")
    with pytest.raises(ValueError, match=">= 1"):
        DrafterPlacement(0, 1)


def fetch_until(actor: DrafterActor, kind: type, within: float = HANG_S) -> list:
    """Every message fetched until one of `kind` (ENDED ends it too)."""
    got, deadline = [], time.monotonic() + within
    while time.monotonic() < deadline:
        got += actor.fetch(0.2)
        if any(isinstance(m, kind) or m == ENDED for m in got):
            return got
    raise AssertionError(f"no {kind.__name__} in {within} s: {got}")


def test_the_actor_runs_the_worker_loop_and_orders_its_puts():
    """The actor's class in this process: puts that arrive out of order reach the loop in
    their numbers' order; a verdict comes back as Rooted after the drafted nodes."""
    actor = DrafterActor(tiny_build(0.0), GREEDY_V, (CORES[-1],), 1)
    assert isinstance(fetch_until(actor, Ready)[0], Ready)
    prompt = [1, 2, 3, 4]
    actor.put(1, [Begin(1, prompt, SamplingConfig(), 0, ahead=4)])  # before its Prefill
    actor.put(0, [Prefill(1, prompt[:-1])])
    drafted = [m for m in fetch_until(actor, Drafted) if isinstance(m, Drafted)]
    assert drafted[0].session == 1 and drafted[0].parent == -1
    actor.put(2, [Verdict(1, [drafted[0].token])])
    assert any(isinstance(m, Rooted) for m in fetch_until(actor, Rooted))
    actor.put(3, [Shutdown()])
    assert fetch_until(actor, type(None))[-1] == ENDED
    actor.thread.join(HANG_S)


# --- on a local Ray cluster ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    from tiny_files import byte_tokens, random_hf_weights, write_hf_dir

    root, tokens = tmp_path_factory.mktemp("drafter_actor_models"), byte_tokens()
    for name, seed in (("target", 0), ("draft", 1)):
        write_hf_dir(root / name, random_hf_weights(len(tokens), seed), tokens)
    return root


def test_generate_disaggregate_ray_equals_plain(pair_dirs):
    """The command on its own local cluster (started and stopped by it)."""
    pytest.importorskip("ray")
    r = subprocess.run([sys.executable, "-m", "forerun.cli", "generate", "--target",
                        str(pair_dirs / "target"), "--draft", str(pair_dirs / "draft"),
                        "--dtype", "float64", "--draft-dtype", "float64", "--disaggregate",
                        "--ray", "--max-tokens", "16", "--compare", "--json", "Write a sort."],
                       capture_output=True, text=True, timeout=3 * HANG_S)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["identical"] and report["speculative"]["stats"]["method"] == "draft"
    assert report["speculative"]["stats"]["drafted"] > 0


@pytest.fixture(scope="module")
def ray_cluster():
    """A local 2-CPU Ray cluster; the test modules' tiny models travel by value."""
    ray = pytest.importorskip("ray")
    import conftest
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(conftest)  # the actors lack tests/
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=128 << 20)
    try:
        yield ray
    finally:
        ray.shutdown()
        cloudpickle.unregister_pickle_by_value(conftest)


def start(noise: float = 0.3, strategy: str = "PACK"):
    from forerun.cluster.drafter_actor import start_ray_drafter

    return start_ray_drafter(tiny_build(noise), GREEDY_V, DisaggregateConfig(wait_s=1.0, ahead=8),
                             strategy, set(CORES))


def test_greedy_equals_plain_with_the_drafter_a_ray_actor(ray_cluster):
    from ray.util.placement_group import placement_group_table

    worker, target_cores = start()
    try:
        table = placement_group_table(worker.group)
        assert table["strategy"] == "PACK" and table["state"] == "CREATED"
        bundles = table["bundles"]
        assert bundles[DRAFTER_BUNDLE] == {"CPU": 1.0}
        assert bundles[TARGET_BUNDLE]["CPU"] == 1.0 and any(
            k.startswith("node:") for k in bundles[TARGET_BUNDLE])  # tied to this node
        if len(CORES) > 1:
            assert worker.cores == (CORES[-1],) and target_cores == tuple(CORES[:-1])
        proposer = AsyncDraftProposer(worker, DisaggregateConfig(wait_s=1.0, ahead=8))
        for prompt, k in (([1, 2, 3, 4], 4), ([5, 9, 5, 9, 5], 2), ([7], 6)):
            plain, steps = greedy_run(proposer, prompt, k)
            assert [t for s in steps for t in s.tokens] == plain
            assert sum(s.drafted for s in steps) > 0
        assert proposer.failure is None
    finally:
        worker.close()
    assert placement_group_table(worker.group)["state"] == "REMOVED"


def test_a_killed_drafter_actor_leaves_the_request_plain(ray_cluster):
    worker, _ = start()
    target, greedy, prompt = tiny_runtime(0, vocab=GREEDY_V), SamplingConfig(), [3, 1, 4, 1, 5]
    plain = [t for s in plain_decode(target, prompt, greedy, 30, (), make_generator(0))
             for t in s.tokens]
    proposer = AsyncDraftProposer(worker, DisaggregateConfig(wait_s=1.0, ahead=8))
    started, out = time.perf_counter(), []
    try:
        with pytest.warns(RuntimeWarning, match="without drafts"):
            for i, step in enumerate(speculative_decode(target, proposer, FixedK(4), prompt,
                                                        greedy, 30, (), make_generator(0))):
                out.extend(step.tokens)
                if i == 2:
                    ray_cluster.kill(worker.actor)
        assert out == plain
        assert proposer.failure is not None and not worker.alive
        assert time.perf_counter() - started < HANG_S / 2
    finally:
        worker.close()


def test_spread_is_asked_of_the_cluster(ray_cluster):
    """One node: SPREAD is a preference, so both bundles land here; the group says SPREAD.
    The drafter the target itself: every node is accepted, some drafted while it verified."""
    from ray.util.placement_group import placement_group_table

    worker, _ = start(noise=0.0, strategy="SPREAD")
    try:
        assert placement_group_table(worker.group)["strategy"] == "SPREAD"
        proposer = AsyncDraftProposer(worker, DisaggregateConfig(wait_s=1.0, ahead=8))
        plain, steps = greedy_run(proposer, [2, 7, 1, 8, 2, 7, 1, 8, 2, 7], 4)
        assert [t for s in steps for t in s.tokens] == plain  # draft = target: all accepted
        assert all(s.accepted == s.drafted for s in steps)
        assert proposer.ahead_used > 0  # nodes drafted while the target verified were used
    finally:
        worker.close()


# --- a Ray Serve replica's drafter bundle -------------------------------------------------------

@dataclass(frozen=True)
class ReportingRecipe:
    """A replica's engine: `recipe`'s, its drafter a Ray actor; before it serves, where the
    drafter went and one greedy request through it (drafted, equal to plain) go to `report`."""

    recipe: EngineRecipe
    report: str

    def __call__(self) -> Engine:
        from ray.util import get_current_placement_group
        from ray.util.placement_group import placement_group_table

        engine = self.recipe()
        drafter, ids = engine.drafter, engine.tokenizer.encode_prompt(PROMPT, raw=True)
        spec = engine.generate(ids, max_tokens=MAX_TOKENS)
        plain = engine.generate(ids, max_tokens=MAX_TOKENS, spec=SpecConfig("none"))
        Path(self.report).write_text(json.dumps({
            "identical": spec.token_ids == plain.token_ids, "drafted": spec.stats.drafted,
            "own_group": drafter.owns_group,
            "same_group": drafter.group.id == get_current_placement_group().id,
            "bundles": {str(k): v for k, v in placement_group_table(drafter.group)["bundles"]
                        .items()}}))
        return engine


def test_serve_ray_disaggregate_drafts_from_the_replicas_own_bundle(ray_cluster, pair_dirs,
                                                                     tmp_path):
    """`forerun serve --ray --disaggregate`'s layout: the replica deployed in a placement
    group of its target's and its drafter's bundle, its engine's drafter actor in the second;
    requests through the ingress equal plain greedy."""
    import httpx
    from ray import cloudpickle, serve

    from forerun.cluster.deploy import deploy
    from forerun.cluster.spec import APP_NAME, ClusterConfig, ReplicaSpec, WorkerSettings
    from forerun.serve.app import ServeConfig

    load = LoadConfig(dtype="float64", draft_dtype="float64")
    recipe = EngineRecipe(str(pair_dirs / "target"), str(pair_dirs / "draft"),
                          SpecConfig("draft", 3, disaggregate=True, drafter_placement="PACK"),
                          load)
    report, port = tmp_path / "replica.json", free_port()
    config = ClusterConfig(replicas=1, cores_per_replica=1, port=port, pin=False, draft_cores=1)
    spec = ReplicaSpec(ReportingRecipe(recipe, str(report)),
                       WorkerSettings(slots=2, max_queue=2, spec_policy="always",
                                      calibrate=False), ServeConfig("tiny"))
    solo = Engine(str(pair_dirs / "target"), None, spec=SpecConfig("none"), load=load)
    want = [solo.generate(solo.tokenizer.encode_prompt(p, raw=True), max_tokens=MAX_TOKENS).text
            for p in (PROMPT, "def f(x):")]
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the replica lacks tests/
    try:
        deploy(spec, config)
        got = [httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=HANG_S, json={
            "model": "tiny", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0}
        ).json()["choices"][0]["text"] for p in (PROMPT, "def f(x):")]
        seen = json.loads(report.read_text())
    finally:
        with contextlib.suppress(Exception):
            serve.delete(APP_NAME)
        serve.shutdown()
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    assert got == want
    assert seen["identical"] and seen["drafted"] > 0
    assert seen["same_group"] and not seen["own_group"]
    assert seen["bundles"] == {str(TARGET_BUNDLE): {"CPU": 1.0}, str(DRAFTER_BUNDLE): {"CPU": 1.0}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
