"""The suffix method (SuffixDecoding): its index, its trees, and that it is lossless.

Properties: the index finds the longest earlier match a brute-force scan finds, and only live
tokens (eviction keeps it at its configured size, its memory fixed); the tree's probabilities
are continuation frequencies, parents first, within budget and floor; greedy speculative output
equals plain greedy output token for token (alone, chains and trees; in a mixed batch; through
an Engine whose global index holds earlier outputs); a request that repeats an earlier one's
output drafts it from the global index and has it accepted (also after concurrent requests
through the server, each still plain's); sampled output has the target's
exact joint (chi-square) with drafts that really are trees, while the global index learns from
every earlier run; bad options fail clearly.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict

import numpy as np
import pytest
import torch
from conftest import tiny_model, tiny_runtime
from exact import Recorder, TableModel, TableRuntime, chi_square_pvalue, target_joint
from test_engine import plain, word_tokenizer
from test_serve import (  # noqa: F401  (fixtures)
    NAME,
    client,
    model_dirs,
    reference,
    server,
)

from forerun import Engine
from forerun.batch_engine import Sequence, run_to_completion
from forerun.engine import speculative_decode
from forerun.policy import FixedK
from forerun.propose import PROPOSERS, ProposerContext, SpecConfig
from forerun.propose.suffix import SuffixConfig, SuffixProposer, grow_tree
from forerun.propose.suffix_index import MAX_MATCH, TokenIndex
from forerun.runtime.batch import BatchTorchRuntime
from forerun.runtime.torch_model import TorchRuntime
from forerun.sampling import SamplingConfig, logits_to_probs, make_generator

pytestmark = pytest.mark.usefixtures("one_thread")
# "1 2" three times with three continuations: the first drafts are trees
BRANCHY = [1, 2, 3, 7, 1, 2, 4, 8, 1, 2, 5, 6, 1, 2]
REPETITIVE = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]


class TreeCounter:
    """A proposer as it is, counting the drafts it makes that are trees (not chains)."""

    def __init__(self, inner):
        self.inner, self.trees, self.drafts = inner, 0, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, tokens, k, sampling, generator):
        draft = self.inner.propose(tokens, k, sampling, generator)
        self.drafts += len(draft.tokens) > 0
        self.trees += draft.parents is not None
        return draft


# --- the index ---------------------------------------------------------------------------------

def brute_match(docs: list[list[int]], context: list[int]) -> tuple[int, set[int]]:
    """The longest suffix of context (<= MAX_MATCH) ending at a position of the documents
    (joined with one separator between them) that a token of its document follows; its ends."""
    flat: list[int] = []
    for d in docs:
        flat += ([-1] if flat else []) + d
    tail, best, ends = context[-MAX_MATCH:], 0, set()
    for e in range(len(flat) - 1):
        if flat[e + 1] == -1:
            continue
        n = 0
        while n < len(tail) and e - n >= 0 and flat[e - n] == tail[-1 - n]:
            n += 1
        if n > best:
            best, ends = n, {e}
        elif n == best and n:
            ends.add(e)
    return best, ends


def test_lookup_finds_the_longest_earlier_match():
    """Random documents over 40 tokens (few occurrences of any n-gram: no chain is cut short):
    the index's match length and ends are the scan's; contexts copied from a document match
    as far back as the copy goes."""
    rng = random.Random(0)
    for _ in range(200):
        index, docs = TokenIndex(4096), []
        for _ in range(rng.randint(1, 5)):
            docs.append([rng.randrange(40) for _ in range(rng.randint(1, 150))])
            index.add_document(docs[-1])
        source = rng.choice(docs)
        cut = rng.randint(1, len(source))
        context = ([rng.randrange(40)] if rng.random() < 0.5 else []) + source[:cut]
        if rng.random() < 0.3:
            context = [rng.randrange(40) for _ in range(rng.randint(1, 10))]
        found = index.lookup(context)
        length, ends = brute_match(docs, context)
        assert found.length == length
        assert set(found.ends.tolist()) <= ends and (len(found.ends) > 0) == (length > 0)


def test_eviction_keeps_the_index_at_its_size_and_forgets_the_oldest_first():
    capacity = 1000
    index = TokenIndex(capacity)
    nbytes = index.nbytes
    docs = [list(range(100 * i, 100 * i + 100)) * 2 for i in range(12)]  # disjoint tokens
    for d in docs:
        index.add_document(d)
        assert index.held <= capacity and index.nbytes == nbytes
    assert index.held == capacity and index.total > 2 * capacity
    assert index.lookup(docs[-1][:50]).length == 50  # the newest: found in full
    assert index.lookup(docs[0][:50]).length == 0  # the oldest: evicted
    assert index.continuations(index.lookup(docs[-1][:50]).ends, 5) == [docs[-1][50:55]] * 2


def test_an_index_too_small_is_a_clear_error():
    with pytest.raises(ValueError, match="a suffix index needs at least 32 tokens, got 8"):
        TokenIndex(8)


# --- the tree ----------------------------------------------------------------------------------

def test_tree_nodes_carry_continuation_frequencies_parents_first():
    conts = [[1, 2, 3], [1, 2, 4], [1, 5], [6]]
    tree = grow_tree(conts, budget=10, min_prob=0.1)
    assert tree.tokens == [1, 2, 6, 5, 3, 4]  # ties: the shallower first
    assert tree.parents == [-1, 0, -1, 0, 1, 1]
    assert tree.probs == pytest.approx([0.75, 0.5, 0.25, 0.25, 0.25, 0.25])
    assert tree.score == pytest.approx(2.25)
    assert grow_tree(conts, budget=3, min_prob=0.1).tokens == [1, 2, 6]  # the budget
    assert grow_tree(conts, budget=10, min_prob=0.3).tokens == [1, 2]  # the floor
    rng = random.Random(1)
    for _ in range(100):  # any trie: a topological order, probabilities non-increasing
        conts = [[rng.randrange(3) for _ in range(rng.randint(0, 5))] for _ in range(7)]
        if not any(conts):
            continue
        tree = grow_tree(conts, rng.randint(1, 12), 0.0)
        assert all(p < i for i, p in enumerate(tree.parents))
        assert all(a >= b for a, b in zip(tree.probs, tree.probs[1:], strict=False))


def test_draft_size_follows_the_match_length():
    """min(k, factor * m) nodes from a match of m tokens (the paper's MAX_SPEC = alpha * p)."""
    text = list(range(10, 40))
    for factor, k, context, want in ((1.0, 16, [13, 14, 15], 3), (2.0, 16, [13, 14, 15], 6),
                                     (1.0, 2, [13, 14, 15], 2), (0.5, 16, [14, 15], 1)):
        proposer = SuffixProposer(SuffixConfig(factor=factor), 256)
        proposer.prefill(text)
        draft = proposer.propose([*text, 99, *context], k, SamplingConfig(), make_generator(0))
        assert draft.tokens.tolist() == list(range(context[-1] + 1, context[-1] + 1 + want))


# --- greedy: speculative == plain --------------------------------------------------------------

@pytest.mark.parametrize("k", [2, 5, 8])
@pytest.mark.parametrize("prompt", [BRANCHY, REPETITIVE, [10, 20, 30, 40, 50, 60]])
def test_greedy_suffix_equals_plain(k, prompt):
    target = tiny_runtime(0)
    spec = SpecConfig("suffix", k, suffix_factor=2.0)
    proposer = TreeCounter(PROPOSERS["suffix"](spec, ProposerContext(target)))
    steps = list(speculative_decode(target, proposer, FixedK(k), list(prompt), SamplingConfig(),
                                    40, (), make_generator(0)))
    assert [t for s in steps for t in s.tokens] == plain(prompt=prompt)
    if prompt is BRANCHY:
        assert proposer.trees > 0  # its first drafts are trees
    if prompt is REPETITIVE:
        assert proposer.drafts > proposer.trees  # and chains: one continuation


def _member(spec, prompt, max_new, shared, method=None):
    target = TorchRuntime(tiny_model(0), capacity=256)  # a solo view for the factories
    spec = spec if method is None else SpecConfig(method, spec.k)
    proposer = PROPOSERS[spec.method](spec, ProposerContext(target, shared=shared))
    return Sequence(list(prompt), SamplingConfig(), max_new, make_generator(0), (), proposer,
                    FixedK(spec.k), max_k=spec.k)


def test_suffix_members_of_a_mixed_batch_equal_their_plain_output():
    """Suffix members (chains and trees) beside n-gram and plain members, twice over one
    global index: the second batch drafts from the first's outputs, and still every member
    gets exactly its plain greedy output."""
    shared: dict = {}
    spec = SpecConfig("suffix", 6, suffix_factor=2.0, suffix_cache_tokens=4096)
    for _ in range(2):
        runtime = BatchTorchRuntime(TorchRuntime(tiny_model(0), capacity=256), 1 << 20)
        seqs = [_member(spec, BRANCHY, 40, shared), _member(spec, REPETITIVE, 30, shared),
                _member(spec, [10, 20, 30], 25, shared, "ngram"),
                Sequence([7, 7, 8], SamplingConfig(), 20, make_generator(0), ()),
                _member(SpecConfig("suffix", 3), [5, 4, 3, 5, 4, 3], 35, shared)]
        counters = [TreeCounter(s.proposer) if s.proposer else None for s in seqs]
        for s, c in zip(seqs, counters, strict=True):
            s.proposer = c
        run_to_completion(runtime, seqs, max_batch=3)
        for s in seqs:
            assert [t for st in s.steps for t in st.tokens] == plain(prompt=s.prompt,
                                                                     max_new=s.max_new_tokens)
        assert counters[0].trees > 0 and all(c.drafts > 0 for c in counters if c)
    assert shared["suffix"].held > 0


# --- the global index: shared by an engine's requests ------------------------------------------

def _engine(k=8, **suffix):
    return Engine.from_runtimes(tiny_runtime(0), word_tokenizer(), None,
                                SpecConfig("suffix", k, **suffix))


def test_a_repeated_request_drafts_the_earlier_output_and_has_it_accepted():
    """A prompt with nothing to look up: the first request drafts little; the second, the
    same, finds the first's output in the global index and drafts nearly all of it, accepted
    (the first steps' matches are short, and may pick a wrong continuation of a token the
    output repeats; then each match is the whole output so far). Both are plain's output."""
    prompt, n = [10, 20, 30, 40, 50, 60], 60
    engine = _engine()
    first = engine.generate(prompt, max_tokens=n)
    second = engine.generate(prompt, max_tokens=n)
    assert first.token_ids == second.token_ids == plain(prompt=prompt, max_new=n)
    assert second.stats.accepted >= n - 10 and second.stats.drafted <= second.stats.accepted + 2
    assert second.stats.accepted >= 3 * first.stats.accepted
    assert second.stats.target_forward_passes <= n // 4
    # a fork (one per sequence of a server's slots) shares the engine's index
    third = engine.fork().generate(prompt, max_tokens=n)
    assert third.stats.accepted >= n - 10
    # generate_batch's members too, and their outputs join it as they finish
    batch = engine.generate_batch([prompt, [11, 21, 31]], max_tokens=n)
    assert batch[0].stats.accepted >= n - 10 and batch[0].token_ids == first.token_ids
    fresh = _engine().generate(prompt, max_tokens=n)  # another engine: nothing to share
    assert fresh.stats.accepted == first.stats.accepted


def test_the_global_index_stays_at_its_configured_size():
    engine = _engine(suffix_cache_tokens=100)
    engine.generate([1, 2, 3], max_tokens=40)
    index = engine.proposers.shared["suffix"]
    nbytes = index.nbytes
    for prompt in ([4, 5], [6, 7, 8], [9], [10, 11], [12, 13, 14]):
        out = engine.generate(prompt, max_tokens=40)
        assert out.token_ids == plain(prompt=prompt)
        assert index.held <= 100 and index.nbytes == nbytes
    assert index.total > 200 and index.held == 100


def test_cache_tokens_zero_turns_the_global_index_off():
    engine = _engine(suffix_cache_tokens=0)
    first = engine.generate([10, 20, 30], max_tokens=40)
    second = engine.generate([10, 20, 30], max_tokens=40)
    assert "suffix" not in engine.proposers.shared
    assert second.stats.accepted == first.stats.accepted


def test_a_saved_index_loads_as_it_was(tmp_path):
    rng = random.Random(2)
    index = TokenIndex(500)
    for _ in range(9):  # past its size: the ring has wrapped
        index.add_document([rng.randrange(30) for _ in range(rng.randint(20, 120))])
    index.save(tmp_path / "i.npz")
    loaded = TokenIndex.load(tmp_path / "i.npz", 500)
    assert (loaded.total, loaded.start, loaded.nbytes) == (index.total, index.start, index.nbytes)
    for _ in range(50):
        context = [rng.randrange(30) for _ in range(rng.randint(1, 8))]
        a, b = index.lookup(context), loaded.lookup(context)
        assert a.length == b.length and a.ends.tolist() == b.ends.tolist()
    assert TokenIndex.load(tmp_path / "i.npz", 600) is None  # another size: start afresh
    assert TokenIndex.load(tmp_path / "none.npz", 500) is None


def test_the_global_index_outlives_the_process_in_its_cache_dir(tmp_path):
    """Two engines one after the other (two server runs) with one --suffix-cache-dir: the
    second drafts the first's output; `save_indexes` is what runs at exit."""
    from forerun.propose.suffix import save_indexes

    prompt, n, where = [10, 20, 30, 40, 50, 60], 60, str(tmp_path / "cache")
    first = _engine(suffix_cache_dir=where).generate(prompt, max_tokens=n)
    save_indexes()
    second = _engine(suffix_cache_dir=where).generate(prompt, max_tokens=n)
    assert first.token_ids == second.token_ids
    assert second.stats.accepted >= n - 10 > first.stats.accepted


def test_a_server_request_for_suffix_keeps_the_servers_suffix_options():
    from forerun.serve.app import resolve_spec
    from forerun.serve.protocol import Speculation

    flags = SpecConfig("ngram", 4, suffix_cache_tokens=5000, suffix_factor=2.0,
                       suffix_min_prob=0.2, suffix_cache_dir="/tmp/x")
    spec, _ = resolve_spec(Speculation(method="suffix", k=16), flags, has_draft=False)
    assert (spec.method, spec.k, spec.suffix()) == ("suffix", 16, flags.suffix())


def test_the_servers_global_index_is_safe_under_concurrent_requests(server, reference):  # noqa: F811
    """Twelve suffix requests at once from threads (the real `openai` client), the same
    prompts twice over: every text is plain's (whatever the index held as each step drafted,
    which the concurrent ones fill as they finish), and a request after them drafts from
    their outputs, nearly all of it accepted."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = ["the cat sat on", "abcabcabc", "1, 2, 3, 4,", "def f(x):", "xyz xyz", "hello"] * 2
    speculation = {"method": "suffix", "k": 16}
    c = client(server)

    def ask(prompt: str):
        return c.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0,
                                    extra_body={"speculation": speculation})

    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(ask, prompts))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.choices[0].text == reference(prompt, 24).text
    again = ask("the cat sat on")  # its earlier output is in the index now
    stats = again.choices[0].model_extra["speculation"]
    assert again.choices[0].text == reference("the cat sat on", 24).text
    assert stats["accepted"] >= stats["new_tokens"] - 8, stats


@pytest.mark.parametrize(("options", "message"), [
    ({"suffix_cache_tokens": -1}, "suffix cache tokens must be 0 .* or at least 32"),
    ({"suffix_cache_tokens": 10}, "suffix cache tokens must be 0 .* or at least 32"),
    ({"suffix_factor": 0.0}, "suffix factor must be a positive number"),
    ({"suffix_factor": float("nan")}, "suffix factor must be a positive number"),
    ({"suffix_min_prob": 1.5}, r"suffix min prob must be in \[0, 1\]"),
])
def test_bad_suffix_options_are_clear_errors(options, message):
    with pytest.raises(ValueError, match=message):
        SpecConfig("suffix", 8, **options)


def test_generate_twice_with_a_cache_dir_drafts_the_first_runs_output(tmp_path):
    """`forerun generate --method suffix --suffix-cache-dir`, two processes: the first writes
    its index at exit, the second loads it and drafts the first's reply, accepted."""
    import json
    import subprocess
    import sys

    from tiny_files import byte_tokens, random_hf_weights, write_hf_dir

    tokens = byte_tokens()
    write_hf_dir(tmp_path / "target", random_hf_weights(len(tokens), 0), tokens)
    args = [sys.executable, "-m", "forerun.cli", "generate", "--target", str(tmp_path / "target"),
            "--dtype", "float32", "--method", "suffix", "-k", "8", "--max-tokens", "40",
            "--suffix-cache-dir", str(tmp_path / "cache"), "--json", "Write a sort."]
    runs = []
    for _ in range(2):
        done = subprocess.run(args, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        runs.append(json.loads(done.stdout))
    assert (tmp_path / "cache" / "suffix-index.npz").exists()
    assert runs[0]["token_ids"] == runs[1]["token_ids"]
    n = len(runs[1]["token_ids"])
    assert runs[1]["stats"]["accepted"] >= n - 10 > runs[0]["stats"]["accepted"], runs


def test_a_bad_suffix_option_on_the_command_line_is_one_clear_line():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "forerun.cli", "generate", "--method", "suffix",
                           "--suffix-min-prob", "2", "hello"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip() == "error: suffix min prob must be in [0, 1], got 2.0"


def test_the_cli_exposes_the_suffix_options():
    import argparse

    from forerun.commands.options import add_spec_args, spec_config

    p = argparse.ArgumentParser()
    add_spec_args(p)
    args = p.parse_args(["--method", "suffix", "--suffix-cache-tokens", "5000",
                         "--suffix-factor", "2", "--suffix-min-prob", "0.2",
                         "--suffix-cache-dir", "/tmp/x"])
    spec = spec_config(args)
    assert (spec.method, spec.suffix_cache_tokens, spec.suffix_factor, spec.suffix_min_prob,
            spec.suffix_cache_dir) == ("suffix", 5000, 2.0, 0.2, "/tmp/x")


# --- sampling: the target's exact joint, with deep tree drafts ---------------------------------

V, ALPHA, RUNS, K, NEW = 3, 1e-4, 2000, 4, 6
# searched for: after it, whichever token comes first, the text's last tokens matched earlier
# with several continuations, so the local index drafts a tree 2 or 3 deep
SAMPLED_PROMPT = [1, 1, 2, 1, 0, 2, 2, 1, 1, 2, 1, 2, 1, 0, 1]
TEMPERATURE = SamplingConfig(temperature=1.0)
TARGET = TableModel(V, seed=3)


def test_sampled_suffix_drafts_match_the_target_joint():
    """Fails by chance with probability ALPHA = 1e-4 (asymptotic chi-square over the exact
    joint of NEW tokens, cells below 5 expected pooled). The drafter is deterministic and
    drafts trees (several continuations of the text's last tokens, each estimated from its
    frequency) K deep at the first step of every run: every bigram occurs twice in the prompt
    with different continuations. The global index (200 tokens, so it also evicts) learns
    each run's output: a run's drafts depend on the earlier runs, never on its own future,
    so every run is still an exact draw from the target's joint and the runs independent.
    Measured: 2,690 tree drafts in 2,000 runs; 2,141 nodes 3 deep."""
    target = TableRuntime(TARGET)
    shared: dict = {}
    spec = SpecConfig("suffix", K, suffix_factor=3.0, suffix_min_prob=0.0,
                      suffix_cache_tokens=200)
    generator, counts = make_generator(7), defaultdict(int)
    trees, depths = 0, Counter()
    for _ in range(RUNS):
        proposer = TreeCounter(PROPOSERS["suffix"](spec, ProposerContext(target, shared=shared)))
        recorder = Recorder(proposer)
        steps = speculative_decode(target, recorder, FixedK(K), SAMPLED_PROMPT, TEMPERATURE,
                                   NEW, (), generator)
        counts[tuple(t for s in steps for t in s.tokens)] += 1
        trees += proposer.trees
        depths.update(recorder.depths)
    assert trees >= RUNS and max(depths) >= 3 and depths[3] >= RUNS // 2, (trees, depths)
    assert shared["suffix"].total > 200  # it evicted

    def row(prefix):
        return logits_to_probs(TARGET.logits((*SAMPLED_PROMPT, *prefix)), TEMPERATURE)

    assert chi_square_pvalue(target_joint(row, NEW), counts) > ALPHA


def test_suffix_tree_draft_is_a_valid_draft():
    """The Draft a tree step returns: tokens, no q, parents in topological order."""
    proposer = SuffixProposer(SuffixConfig(factor=2.0), 256)
    proposer.prefill(BRANCHY)
    draft = proposer.propose(BRANCHY, 8, SamplingConfig(), make_generator(0))
    assert draft.q is None and draft.parents is not None
    parents = draft.parents.tolist()
    assert parents[:3] == [-1, -1, -1] and all(p < i for i, p in enumerate(parents))
    assert sorted(draft.tokens[:3].tolist()) == [3, 4, 5]
    assert torch.equal(draft.tokens, draft.tokens.long()) and np.all(np.array(parents) < 8)
