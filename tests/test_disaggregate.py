"""The asynchronous draft/target pipeline (`--disaggregate`): re-rooting on hand-built trees;
greedy identity and exact sampling with the drafter in another process; a drafter that dies.

The sampling check: on a 3-token vocabulary the target's exact joint over NEW_TOKENS tokens
against RUNS requests decoded with the spawned drafter, a chi-square test (cells below 5
expected pooled) that fails by chance with probability ALPHA = 1e-4. NEW_TOKENS = 5 with
k = 1 lets a subtree drafted ahead be verified (the second pass's draft): the test asserts
some were.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import tiny_runtime
from scipy.stats import chisquare

from forerun.engine import speculative_decode
from forerun.policy import FixedK
from forerun.propose.disaggregate import (
    AsyncDraftProposer,
    DisaggregateConfig,
    parse_cores,
)
from forerun.propose.drafter_worker import DrafterGone, DrafterProcess
from forerun.propose.reroot import AheadNode, AheadTree
from forerun.reference import plain_decode
from forerun.sampling import SamplingConfig, logits_to_probs, make_generator

V, NEW_TOKENS, RUNS, ALPHA = 3, 5, 2000, 1e-4
PROMPT = [1, 2, 0, 1]
GREEDY_V = 64
DRAFT_CORES = (max(os.sched_getaffinity(0)),)


# --- re-rooting, pure -------------------------------------------------------------------------

def hand_tree() -> AheadTree:
    """root -1: 0 (a=10) -> 1 (b=11) -> 2 (d=13) -> 3 (e=14); 4 (c=12) under the root;
    5 (f=15) under 1, a sibling of 2; 6 (g=16) under 5."""
    tree = AheadTree(-1)
    for node, parent, token in [(0, -1, 10), (1, 0, 11), (2, 1, 13), (3, 2, 14), (4, -1, 12),
                                (5, 1, 15), (6, 5, 16)]:
        assert tree.add(node, AheadNode(parent, token))
    return tree


def test_reroot_keeps_exactly_the_subtree_under_the_committed_path():
    tree = hand_tree().reroot([10, 11], fresh=-2)  # a accepted, bonus b
    assert tree.root == 1
    assert {i: (n.parent, n.token) for i, n in tree.nodes.items()} == {
        2: (1, 13), 3: (2, 14), 5: (1, 15), 6: (5, 16)}
    deeper = tree.reroot([15], fresh=-3)  # then f
    assert deeper.root == 5 and set(deeper.nodes) == {6}
    assert hand_tree().reroot([12], fresh=-2).nodes == {}  # c: a leaf, nothing under it
    assert hand_tree().reroot([], fresh=-2).nodes == hand_tree().nodes  # nothing committed


def test_reroot_off_the_tree_starts_empty_under_a_fresh_root():
    for tokens in ([11], [10, 12], [10, 11, 13, 14, 99]):
        tree = hand_tree().reroot(tokens, fresh=-7)
        assert tree.root == -7 and not len(tree)
        assert tree.add(20, AheadNode(-7, 3)) and len(tree) == 1


def test_late_nodes_join_only_under_what_was_kept():
    tree = hand_tree().reroot([10, 11], fresh=-2)
    assert not tree.add(7, AheadNode(4, 1))  # under c, dropped: the worker drafted it earlier
    assert not tree.add(8, AheadNode(0, 1))  # under a, now committed (not the root)
    assert tree.add(9, AheadNode(3, 2))  # under e, kept
    assert tree.add(10, AheadNode(1, 3))  # under the new root
    assert tree.tip() == (9, [13, 14, 2])


def test_draft_takes_the_first_nodes_as_a_tree():
    tree = hand_tree().reroot([10, 11], fresh=-2)
    ids, tokens, parents = tree.draft(3)
    assert ids == [2, 3, 5] and tokens == [13, 14, 15] and parents == [-1, 0, -1]
    assert tree.draft(0) == ([], [], [])


def under(tree: AheadTree, node: int, top: int) -> bool:
    """Whether `top` is an ancestor of `node` (walked up by hand)."""
    while node != -1:
        node = tree.nodes[node].parent
        if node == top:
            return True
    return False


def test_reroot_matches_descendants_on_random_trees():
    rng = random.Random(0)
    for _ in range(200):
        tree = AheadTree(-1)
        for node in range(rng.randint(0, 12)):
            parent = rng.choice([-1, *tree.nodes])
            tree.add(node, AheadNode(parent, rng.randint(0, 3)))
        path = [rng.randint(0, 3) for _ in range(rng.randint(0, 4))]
        new = tree.reroot(path, fresh=-9)
        node = -1  # walk the path by hand: first-drafted child with each token
        for token in path:
            node = next((i for i in sorted(tree.nodes) if tree.nodes[i].parent == node and
                         tree.nodes[i].token == token), None)
            if node is None:
                break
        if node is None:
            assert new.root == -9 and not len(new)
            continue
        assert new.root == node
        assert set(new.nodes) == {i for i in tree.nodes if i != node and under(tree, i, node)}


def test_placement_and_cores():
    assert parse_cores("0,2-3") == (0, 2, 3)
    assert DisaggregateConfig().placement({0, 1}) == ((1,), (0,))
    assert DisaggregateConfig().placement({0}) == ((0,), (0,))
    assert DisaggregateConfig((0,), (1,)).placement({0, 1}) == ((0,), (1,))
    with pytest.raises(ValueError, match="overlap"):
        DisaggregateConfig((0,), (0, 1))
    with pytest.raises(ValueError, match="not among"):
        DisaggregateConfig((5,)).placement({0, 1})


# --- the pipeline, the drafter in another process ---------------------------------------------

@pytest.fixture(autouse=True)
def one_thread():
    """The target on one thread, the worker on one core of its own: two processes spinning
    two OpenMP threads each on a 2-core machine run ten times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def spawn(noise: float, vocab: int = GREEDY_V, scale: float = 1.0) -> DrafterProcess:
    """A drafter worker in its own process over a tiny model (noise 0: the target itself)."""
    return DrafterProcess(functools.partial(tiny_runtime, 0, vocab=vocab, noise=noise,
                                            scale=scale), vocab, DRAFT_CORES)


def greedy_run(proposer: AsyncDraftProposer, prompt: list[int], k: int, n: int = 40):
    target = tiny_runtime(0, vocab=GREEDY_V)
    plain = [t for s in plain_decode(target, prompt, SamplingConfig(), n, (), make_generator(0))
             for t in s.tokens]
    steps = list(speculative_decode(target, proposer, FixedK(k), prompt, SamplingConfig(), n,
                                    (), make_generator(0)))
    return plain, steps


@pytest.mark.parametrize("lookup", [0, 6])
def test_greedy_equals_plain_greedy(lookup):
    worker = spawn(noise=0.3)  # rejections: the worker starts again from new roots
    try:
        proposer = AsyncDraftProposer(worker, DisaggregateConfig(wait_s=1.0, ahead=8,
                                                                 lookup=lookup))
        for prompt, k in (([1, 2, 3, 4], 4), ([5, 9, 5, 9, 5], 2), ([7], 6)):
            plain, steps = greedy_run(proposer, prompt, k)
            assert [t for s in steps for t in s.tokens] == plain
            assert sum(s.drafted for s in steps) > 0
        assert proposer.failure is None
    finally:
        worker.close()


@pytest.mark.parametrize("lookup", [0, 6])
def test_draft_equals_target_accepts_everything_drafted_ahead(lookup):
    """With lookup, the guesses the draft agrees with are its own greedy tokens: still all
    accepted (a repeating prompt gives lookup something to guess)."""
    worker = spawn(noise=0.0)
    try:
        proposer = AsyncDraftProposer(worker, DisaggregateConfig(wait_s=1.0, ahead=8,
                                                                 lookup=lookup))
        plain, steps = greedy_run(proposer, [2, 7, 1, 8, 2, 7, 1, 8, 2, 7], 4)
        assert [t for s in steps for t in s.tokens] == plain
        assert all(s.accepted == s.drafted for s in steps)
        assert proposer.ahead_used > 0  # nodes drafted while the target verified were used
    finally:
        worker.close()


def exact_joint(sampling: SamplingConfig) -> dict[tuple, float]:
    rt, cond = tiny_runtime(0, vocab=V, scale=0.4), {}
    for n in range(NEW_TOKENS):
        for prefix in itertools.product(range(V), repeat=n):
            rt.truncate(0)
            cond[prefix] = logits_to_probs(rt.forward(torch.tensor(PROMPT + list(prefix))
                                                      ).logits[-1], sampling)
    joint = {}
    for seq in itertools.product(range(V), repeat=NEW_TOKENS):
        joint[seq] = 1.0
        for i, tok in enumerate(seq):
            joint[seq] *= float(cond[seq[:i]][tok])
    return joint


def test_sampling_is_exact_with_the_drafter_in_another_process():
    sampling = SamplingConfig(temperature=1.0)
    worker = spawn(noise=0.5, vocab=V, scale=0.4)
    try:
        target = tiny_runtime(0, vocab=V, scale=0.4)
        proposer = AsyncDraftProposer(worker, DisaggregateConfig(wait_s=1.0, ahead=4))
        generator, counts = make_generator(2026), {}
        for _ in range(RUNS):
            steps = speculative_decode(target, proposer, FixedK(1), PROMPT, sampling,
                                       NEW_TOKENS, (), generator)
            seq = tuple(t for s in steps for t in s.tokens)
            counts[seq] = counts.get(seq, 0) + 1
    finally:
        worker.close()
    assert proposer.failure is None and proposer.ahead_used > RUNS // 20
    joint = exact_joint(sampling)
    cells = sorted(joint, key=joint.get, reverse=True)
    big = [c for c in cells if joint[c] * RUNS >= 5]
    small = [c for c in cells if joint[c] * RUNS < 5]
    observed = [counts.get(c, 0) for c in big] + [sum(counts.get(c, 0) for c in small)]
    expected = [joint[c] * RUNS for c in big] + [sum(joint[c] for c in small) * RUNS]
    if not small:
        observed, expected = observed[:-1], expected[:-1]
    assert sum(counts.values()) == RUNS
    assert chisquare(observed, expected).pvalue > ALPHA


# --- a drafter that dies ----------------------------------------------------------------------

def test_a_drafter_killed_mid_request_falls_back_to_plain():
    worker = spawn(noise=0.3)
    target, greedy, prompt = tiny_runtime(0, vocab=GREEDY_V), SamplingConfig(), [3, 1, 4, 1, 5]
    plain = [t for s in plain_decode(target, prompt, greedy, 30, (), make_generator(0))
             for t in s.tokens]
    proposer = AsyncDraftProposer(worker, DisaggregateConfig(wait_s=1.0, ahead=8))
    started, out = time.perf_counter(), []
    with pytest.warns(RuntimeWarning, match="without drafts"):
        for i, step in enumerate(speculative_decode(target, proposer, FixedK(4), prompt, greedy,
                                                    30, (), make_generator(0))):
            out.extend(step.tokens)
            if i == 2:
                os.kill(worker.pid, signal.SIGKILL)
    assert out == plain
    assert proposer.failure is not None and time.perf_counter() - started < 10
    worker.close()
    # the next request on the same proposer decodes plainly from the start, at once
    again = [t for s in speculative_decode(target, proposer, FixedK(4), prompt, greedy, 30, (),
                                           make_generator(0)) for t in s.tokens]
    assert again == plain


def test_a_stalled_drafter_costs_at_most_the_wait_a_pass():
    """A worker that stops answering (SIGSTOP) leaves each pass waiting `wait_s` at most, then
    running plain: the request finishes, as plain's."""
    worker = spawn(noise=0.3)
    target, greedy, prompt = tiny_runtime(0, vocab=GREEDY_V), SamplingConfig(), [2, 7, 1, 8]
    plain = [t for s in plain_decode(target, prompt, greedy, 20, (), make_generator(0))
             for t in s.tokens]
    proposer = AsyncDraftProposer(worker, DisaggregateConfig(wait_s=0.05, ahead=8))
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        started = time.perf_counter()
        out = [t for s in speculative_decode(target, proposer, FixedK(4), prompt, greedy, 20,
                                             (), make_generator(0)) for t in s.tokens]
        assert out == plain and time.perf_counter() - started < 20 * 0.05 + 5
        assert proposer.empty > 0
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        worker.close()


def _broken() -> None:
    raise OSError("no such model file")


def test_a_drafter_that_cannot_load_fails_clearly():
    with pytest.raises(DrafterGone, match="could not load its model: no such model file"):
        DrafterProcess(_broken, 8)


# --- the command line ---------------------------------------------------------------------------

def test_options_build_the_pipeline_spec_and_refuse_other_methods():
    import argparse

    from forerun.commands.options import add_spec_args, spec_config

    parser = argparse.ArgumentParser()
    add_spec_args(parser)
    spec = spec_config(parser.parse_args(["--disaggregate", "--draft-cores", "1",
                                          "--target-cores", "0", "--disaggregate-wait", "0.5"]))
    assert spec.disaggregate and spec.disaggregated() == DisaggregateConfig((1,), (0,), 0.5)
    with pytest.raises(ValueError, match="--method draft"):
        spec_config(parser.parse_args(["--disaggregate", "--method", "ngram"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--draft-cores", "one"])


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    from tiny_files import byte_tokens, random_hf_weights, write_hf_dir

    root, tokens = tmp_path_factory.mktemp("disaggregate_models"), byte_tokens()
    for name, seed in (("target", 0), ("draft", 1)):
        write_hf_dir(root / name, random_hf_weights(len(tokens), seed), tokens)
    return root


def cli(*args: str) -> subprocess.CompletedProcess:
    """The command in its own process (--disaggregate pins the process's cores)."""
    return subprocess.run([sys.executable, "-m", "forerun.cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_generate_disaggregated_equals_plain(pair_dirs):
    cores = sorted(os.sched_getaffinity(0))
    r = cli("generate", "--target", str(pair_dirs / "target"), "--draft", str(pair_dirs / "draft"),
            "--dtype", "float64", "--draft-dtype", "float64", "--disaggregate", "--draft-cores",
            str(cores[-1]), "--max-tokens", "16", "--compare", "--json", "Write a sort.")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["identical"] and report["speculative"]["stats"]["method"] == "draft"


def test_bench_disaggregated_cells_equal_plain(pair_dirs, tmp_path):
    workload = tmp_path / "w.jsonl"
    workload.write_text(json.dumps({"question_id": 1, "category": "writing",
                                    "turns": ["abc abc abc"]}) + "\n")
    r = cli("bench", "--target", str(pair_dirs / "target"), "--draft", str(pair_dirs / "draft"),
            "--workload", str(workload), "--methods", "draft", "--ks", "3", "--max-tokens", "12",
            "--dtype", "float64", "--draft-dtype", "float64", "--disaggregate", "--out",
            str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    runs = json.loads((tmp_path / "out" / "results.json").read_text())["runs"]
    assert {run["label"] for run in runs} == {"forerun plain", "draft k=3 disaggregated"}
    assert all(run["identical"] for run in runs if run["label"] != "forerun plain")
