"""Penalties and logit bias under speculation (forerun.processors): exact, for every method.

Properties:
- the definitions, on hand-computed rows; a packed call equals each row alone; bad options
  and out-of-vocabulary biases are clear errors;
- greedy (tiny float64 models): with penalties and biases, every method's output (draft model,
  n-gram, Medusa and EAGLE trees), alone and in a mixed batch, equals plain greedy decoding
  with the same processing token for token, and the processing changes that output (so the
  equality is not the unprocessed one);
- sampling, by exact enumeration (V = 3): the engine's output with the draft model K = 3 deep,
  n-gram lookup and a deterministic two-level tree (tests/exact.py's table models), and with
  Medusa (3 levels) and EAGLE (2 levels) trees of random heads on a tiny transformer (read as
  a table: exact.RuntimeTable), has the processed target's joint (each position processed
  with the history before it, drafted tokens included); the draft tokens proposed at each
  depth are counted (exact.Recorder) and the drafts are K deep, the head drafts trees. Each of
  the 5 checks fails by chance with probability ALPHA = 1e-4: module total 5e-4 (p-values
  seen: 0.26, 0.19, 0.71, 0.44, 0.84). A verifier that processes a draft's rows with the
  committed history only (the draft's earlier tokens left out) must fail the same test: on
  its seed its p-value is 7.7e-246 (the real verifier's, same seed: 0.26).
"""

from __future__ import annotations

from collections import defaultdict
from functools import cache

import pytest
import torch
from conftest import random_heads, tiny_model, tiny_runtime
from exact import (
    Recorder,
    RuntimeTable,
    TableModel,
    TableRuntime,
    chi_square_pvalue,
    target_joint,
)

import forerun.batch_verify
from forerun.batch_engine import Sequence, run_to_completion
from forerun.engine import speculative_decode
from forerun.policy import POLICIES, FixedK
from forerun.processors import Processing, ProcessingError, process_row, process_rows
from forerun.propose import HEAD_PROPOSERS, PROPOSERS, ProposerContext, SpecConfig
from forerun.propose.base import Draft, Needs
from forerun.propose.draft_batch import SharedDraftModel
from forerun.propose.draft_model import DraftModelProposer
from forerun.propose.ngram import NgramProposer
from forerun.reference import plain_decode
from forerun.runtime.batch import BatchTorchRuntime
from forerun.runtime.torch_model import TorchRuntime
from forerun.sampling import SamplingConfig, logits_to_probs, make_generator

pytestmark = pytest.mark.usefixtures("one_thread")


# --- definitions --------------------------------------------------------------------------------

def test_each_processor_does_what_its_definition_says():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0], dtype=torch.float64)
    history, start = [0, 1, 3, 3, 0], 2  # prompt [0, 1]; generated [3, 3, 0]
    rep = process_row(logits, Processing(repetition_penalty=2.0), history, start)
    assert rep.tolist() == [1.0, -2.0, 0.5, 1.5]  # seen: prompt and output
    pen = process_row(logits, Processing(presence_penalty=0.5, frequency_penalty=0.25),
                      history, start)
    assert pen.tolist() == [2.0 - 0.75, -1.0, 0.5, 3.0 - 1.0]  # output only: 3 twice, 0 once
    bias = process_row(logits, Processing.of(logit_bias={2: 10.0, 0: -100.0}), history, start)
    assert bias.tolist() == [-98.0, -1.0, 10.5, 3.0]
    assert process_row(logits, Processing(), history, start) is logits
    assert logits.tolist() == [2.0, -1.0, 0.5, 3.0]  # never in place


def test_a_packed_call_equals_each_row_alone():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 10, generator=g, dtype=torch.float64)
    cfgs = [Processing(1.3, 0.2, 0.1), Processing(), Processing.of(logit_bias={9: 2.0}),
            Processing(0.8, -0.5, 0.0)]
    histories = [[1, 2, 2], [3], [4, 5], [9, 9, 1, 0]]
    out = process_rows(logits, cfgs, histories, [1, 0, 2, 1])
    for r in range(4):
        assert torch.equal(out[r], process_row(logits[r], cfgs[r], histories[r], [1, 0, 2, 1][r]))
    assert process_rows(logits, [Processing()] * 4, histories, [0] * 4) is logits


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(logit_bias={1: 101.0}), "logit_bias values"),
    (dict(logit_bias={-1: 1.0}), "logit_bias keys"),
])
def test_bad_options_are_clear_errors(kwargs, message):
    with pytest.raises(ProcessingError, match=message):
        Processing.of(**kwargs)


def test_a_bias_outside_the_vocabulary_is_refused_before_decoding():
    from test_engine import word_tokenizer

    from forerun.api import Engine

    engine = Engine.from_runtimes(TorchRuntime(tiny_model(0), capacity=64), word_tokenizer(),
                                  None, SpecConfig("none", 0))
    bad = SamplingConfig(processing=Processing.of(logit_bias={64: 1.0}))
    with pytest.raises(ProcessingError, match="outside the vocabulary"):
        engine.generate([1, 2, 3], sampling=bad, max_tokens=4)


# --- greedy: every method equals plain decoding with the same processing ------------------------

PROMPT = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]
PROCESSED = [
    Processing(repetition_penalty=1.5),
    Processing(presence_penalty=1.0, frequency_penalty=0.5),
    Processing.of(1.2, 0.3, 0.2, {7: 3.0, 4: -100.0}),
]
NEW = 30


def _plain(sampling, prompt=PROMPT, new=NEW):
    rt = TorchRuntime(tiny_model(0), capacity=256)
    steps = plain_decode(rt, list(prompt), sampling, new, (), make_generator(0))
    return [t for s in steps for t in s.tokens]


def _speculative(method, sampling, k=4, prompt=PROMPT, new=NEW):
    target = TorchRuntime(tiny_model(0), capacity=256)
    draft = TorchRuntime(tiny_model(0, noise=0.05), capacity=256)
    heads = random_heads(method, target) if method in HEAD_PROPOSERS else None
    spec = SpecConfig(method, k, tree=6 if heads is not None else 0)
    proposer = PROPOSERS[method](spec, ProposerContext(target, draft, heads))
    steps = list(speculative_decode(target, proposer, FixedK(k), list(prompt), sampling, new, (),
                                    make_generator(0)))
    assert sum(s.drafted for s in steps) > 0
    return [t for s in steps for t in s.tokens]


@pytest.mark.parametrize("method", ["draft", "ngram", "medusa", "eagle"])
@pytest.mark.parametrize("which", range(len(PROCESSED)))
def test_greedy_speculation_equals_plain_greedy_with_processing(method, which):
    sampling = SamplingConfig(processing=PROCESSED[which])
    plain = _plain(sampling)
    assert plain != _plain(SamplingConfig())  # the processing matters here
    assert _speculative(method, sampling) == plain


def test_a_mixed_batch_with_processing_equals_each_members_plain_output():
    target = TorchRuntime(tiny_model(0), capacity=256)
    runtime = BatchTorchRuntime(TorchRuntime(tiny_model(0), capacity=256), 1 << 20)
    prompts = [PROMPT, [10, 20, 30, 40], [7, 7, 8, 7, 7, 8], PROMPT[:6]]
    cfgs = [SamplingConfig(processing=PROCESSED[0]), SamplingConfig(),
            SamplingConfig(processing=PROCESSED[2]), SamplingConfig(processing=PROCESSED[1])]
    methods = ["draft", "ngram", "none", "ngram"]
    seqs = []
    for prompt, cfg, method in zip(prompts, cfgs, methods, strict=True):
        if method == "none":
            seqs.append(Sequence(list(prompt), cfg, 25, make_generator(0), ()))
            continue
        draft = TorchRuntime(tiny_model(0, noise=0.05), capacity=256)
        spec = SpecConfig(method, 3)
        proposer = PROPOSERS[method](spec, ProposerContext(target, draft))
        seqs.append(Sequence(list(prompt), cfg, 25, make_generator(0), (), proposer,
                             POLICIES["fixed"](spec, target, proposer.runtime), max_k=3))
    run_to_completion(runtime, seqs)
    for seq, prompt, cfg in zip(seqs, prompts, cfgs, strict=True):
        assert [t for s in seq.steps for t in s.tokens] == _plain(cfg, prompt, 25)


def test_a_draft_equal_to_the_target_is_shaped_alike_and_always_accepted():
    """The drafter applies the same processing with its drafted history: a draft model equal
    to the target then agrees at every position (solo drafter, and the batch's shared one)."""
    sampling = SamplingConfig(processing=PROCESSED[2])
    target = TorchRuntime(tiny_model(0), capacity=256)
    spec = SpecConfig("draft", 4)
    proposer = PROPOSERS["draft"](spec, ProposerContext(target, TorchRuntime(tiny_model(0),
                                                                             capacity=256)))
    steps = list(speculative_decode(target, proposer, FixedK(4), PROMPT, sampling, NEW, (),
                                    make_generator(0)))
    assert sum(s.accepted for s in steps) == sum(s.drafted for s in steps) > 0
    assert [t for s in steps for t in s.tokens] == _plain(sampling)
    runtime = BatchTorchRuntime(TorchRuntime(tiny_model(0), capacity=256), 1 << 20)
    shared = SharedDraftModel(BatchTorchRuntime(TorchRuntime(tiny_model(0), capacity=256),
                                                1 << 20), 64)
    seqs = [Sequence(list(p), sampling, NEW, make_generator(0), (), shared.proposer(256),
                     FixedK(4), max_k=4) for p in (PROMPT, PROMPT[:7])]
    run_to_completion(runtime, seqs)
    for seq, p in zip(seqs, (PROMPT, PROMPT[:7]), strict=True):
        assert sum(s.accepted for s in seq.steps) == sum(s.drafted for s in seq.steps) > 0
        assert [t for s in seq.steps for t in s.tokens] == _plain(sampling, p)


# --- sampling: the processed target's joint, by exact enumeration --------------------------------

V, ALPHA, RUNS, HEAD_RUNS = 3, 1e-4, 2000, 1000
TABLE_PROMPT = (1, 2, 0, 1, 2, 0, 1)
TARGET, DRAFT = TableModel(V, seed=1), TableModel(V, seed=1, noise=1.0)
# strong enough that the history decides: a token's second use is far less likely
SAMPLED = SamplingConfig(temperature=1.0, processing=Processing.of(1.3, 0.8, 0.6, {2: 0.5}))


def target_runtime(model: str):
    """The engine's target: the "table" (TARGET), or the "transformer" heads draft from (its
    features), a tiny one."""
    return TableRuntime(TARGET) if model == "table" else tiny_runtime(0, vocab=V)


@cache
def transformer_table() -> RuntimeTable:
    return RuntimeTable(target_runtime("transformer"))


@cache
def processed_row(model: str, prefix: tuple[int, ...]) -> torch.Tensor:
    """The processed distribution of the target `model` after TABLE_PROMPT + prefix
    (generated): the transformer read as a table (one pass a prefix)."""
    table = TARGET if model == "table" else transformer_table()
    history = (*TABLE_PROMPT, *prefix)
    logits = process_row(table.logits(history), SAMPLED.processing, history, len(TABLE_PROMPT))
    return logits_to_probs(logits, SAMPLED)


class TopTwo:
    """A deterministic two-level tree: the draft table's two likeliest tokens, each with its
    own two likeliest children (q = None)."""

    name, runtime, needs, group = "top-two", None, Needs(), None

    def prefill(self, prompt):
        pass

    def propose(self, tokens, k, sampling, generator) -> Draft:
        if k < 2:
            return Draft.empty()
        first = DRAFT.logits(tuple(tokens)).topk(2).indices.tolist()
        kids = [t for x in first for t in DRAFT.logits((*tokens, x)).topk(2).indices.tolist()]
        return Draft(torch.tensor([*first, *kids]), None, torch.tensor((-1, -1, 0, 0, 1, 1)))

    def commit(self, num_final):
        pass


def _heads(kind: str, budget: int):
    """Random heads on the transformer target: trees of two children a node, cut to the
    node budget, as test_lossless_deep's head cases."""

    def make(target):
        heads = random_heads(kind, target, scale=0.5)
        return HEAD_PROPOSERS[kind](heads, target.capacity, budget, 2)

    return make


SAMPLED_CASES = {  # name -> (target model, proposer on its runtime, K, new tokens, runs)
    "draft-k3": ("table", lambda t: DraftModelProposer(TableRuntime(DRAFT), V), 3, 5, RUNS),
    "ngram-k3": ("table", lambda t: NgramProposer(1, 4), 3, 5, RUNS),
    "tree-2-levels": ("table", lambda t: TopTwo(), 2, 4, RUNS),
    "medusa-tree-3-levels": ("transformer", _heads("medusa", 6), 3, 5, HEAD_RUNS),
    "eagle-tree-2-levels": ("transformer", _heads("eagle", 5), 2, 4, HEAD_RUNS),
}


def _empirical(name, seed=2024):
    """-> (counts of the generated sequences, draft tokens proposed at each depth)."""
    model, make, K, new, runs = SAMPLED_CASES[name]
    target = target_runtime(model)
    proposer = Recorder(make(target))
    generator, counts = make_generator(seed), defaultdict(int)
    for _ in range(runs):
        steps = speculative_decode(target, proposer, FixedK(K), list(TABLE_PROMPT), SAMPLED, new,
                                   (), generator)
        counts[tuple(t for s in steps for t in s.tokens)] += 1
    return counts, proposer.depths


def _exact(name):
    model, _, _, new, _ = SAMPLED_CASES[name]
    return target_joint(lambda prefix: processed_row(model, prefix), new)


@pytest.mark.parametrize("name", list(SAMPLED_CASES))
def test_sampled_speculation_has_the_processed_targets_joint(name):
    """Fails by chance with probability ALPHA. Drafts really are K deep: every run's first
    step drafts K (NEW >= K + 2; n-gram lookup where the text continues the prompt's period),
    and the trees have more nodes than a chain's K a step."""
    _, _, K, _, runs = SAMPLED_CASES[name]
    counts, depths = _empirical(name)
    assert max(depths) == K, depths
    if not name.startswith("ngram"):
        assert all(depths[d] >= runs for d in range(1, K + 1)), depths
    if not name.startswith(("draft", "ngram")):
        assert sum(depths.values()) > runs * K, depths  # trees, not chains
    assert chi_square_pvalue(_exact(name), counts) > ALPHA


def _stale_history(live, drafts, trees, spans, logits):
    """The bug: every row of a verify processed with the committed tokens only."""
    return process_rows(logits, [s.sampling.processing for s, sp in zip(live, spans, strict=True)
                                 for _ in sp],
                        [s.tokens or s.prompt for s, sp in zip(live, spans, strict=True)
                         for _ in sp],
                        [len(s.prompt) for s, sp in zip(live, spans, strict=True) for _ in sp])


def test_processing_rows_without_the_drafts_history_fails_the_same_test(monkeypatch):
    monkeypatch.setattr(forerun.batch_verify, "processed", _stale_history)
    counts, _ = _empirical("draft-k3")
    assert chi_square_pvalue(_exact("draft-k3"), counts) < ALPHA
