"""Heads in a batch: Medusa, Hydra and EAGLE members draft from the features of the batch's one
target pass, and each member still gets exactly its solo output.

Properties (tiny float64 models, random heads): greedy, every head member (chains and trees,
with a lookup branch) equals its own plain greedy decoding whatever it is batched with (plain,
n-gram and draft-model members, members admitted as others finish), and every head member
drafted; a seeded sampled EAGLE member gives the same tokens alone and in a batch, and the same
as its one-sequence `speculative_decode`; `generate_batch` with heads equals `generate` one
prompt at a time; in `generate_batch`, a step calls Medusa's (Hydra's first) head once for all
the members that draft in it, members admitted as others finish included; an EAGLE head's
layer runs once for every member's catch-up and once a tree level for all of them (a step's
layer calls never exceed its deepest tree), and each member drafts what it drafts alone (the
same drafts and acceptance as in batches of one).
"""

from __future__ import annotations

import pytest
import torch
from conftest import random_heads, tiny_model
from test_batch_engine import PROMPTS, _batch_runtime, _member, _solo, _tokens

import forerun.batch_session as batch_session
from forerun.batch_engine import Sequence, run_to_completion
from forerun.engine import speculative_decode
from forerun.policy import POLICIES
from forerun.propose import PROPOSERS, ProposerContext, SpecConfig
from forerun.runtime.torch_model import TorchRuntime
from forerun.sampling import SamplingConfig, make_generator

HEADS = {}  # kind -> random heads of the tiny target (built once: weights are read-only)


def _heads(kind):
    if kind not in HEADS:
        HEADS[kind] = random_heads(kind, TorchRuntime(tiny_model(0), capacity=256))
    return HEADS[kind]


def _head_member(kind, k, prompt, max_new, *, tree=0, lookup=False, sampling=None, seed=0):
    spec = SpecConfig(kind, k, tree=tree, tree_topk=2, lookup=lookup)
    target = TorchRuntime(tiny_model(0), capacity=256)  # a solo view for the factory
    proposer = PROPOSERS[kind](spec, ProposerContext(target, heads=_heads(kind),
                                                     capacity=len(prompt) + max_new + 32))
    return Sequence(list(prompt), sampling or SamplingConfig(), max_new, make_generator(seed),
                    (), proposer, POLICIES["fixed"](spec, target, None),
                    max_k=(tree or k) + (k if lookup else 0))


HEAD_MIX = [("medusa", 3, 0, 0, 30), ("hydra", 3, 7, 1, 25), ("eagle", 4, 0, 2, 40),
            ("eagle", 3, 8, 3, 33), ("eagle3", 3, 0, 4, 21), ("hydra", 2, 0, 5, 28)]


@pytest.mark.parametrize("max_batch", [None, 3])
def test_head_members_equal_their_solo_plain_output_in_a_mixed_batch(max_batch):
    heads = [_head_member(kind, k, PROMPTS[p], n, tree=tree) for kind, k, tree, p, n in HEAD_MIX]
    others = [_member("ngram", 4, PROMPTS[0], 22), _member("none", 0, PROMPTS[1], 15),
              _member("draft", 3, PROMPTS[2], 26)]
    seqs = [heads[0], others[0], *heads[1:3], others[1], *heads[3:], others[2]]
    runtime = _batch_runtime()
    run_to_completion(runtime, seqs, max_batch=max_batch)
    for seq, (kind, _k, _tree, p, n) in zip(heads, HEAD_MIX, strict=True):
        assert _tokens(seq) == _solo(PROMPTS[p], n), kind
        assert sum(s.drafted for s in seq.steps) > 0, kind
    for seq, (p, n) in zip(others, ((0, 22), (1, 15), (2, 26)), strict=True):
        assert _tokens(seq) == _solo(PROMPTS[p], n)
    assert runtime.pool.live == 0


def test_heads_with_a_lookup_branch_in_a_batch():
    seqs = [_head_member("eagle", 3, PROMPTS[0], 30, tree=6, lookup=True),
            _head_member("medusa", 3, PROMPTS[3], 30, lookup=True),
            _member("ngram", 3, PROMPTS[4], 20)]
    run_to_completion(_batch_runtime(), seqs)
    for seq, (p, n) in zip(seqs, ((0, 30), (3, 30), (4, 20)), strict=True):
        assert _tokens(seq) == _solo(PROMPTS[p], n)
        assert sum(s.drafted for s in seq.steps) > 0


def test_a_seeded_sampled_eagle_member_is_the_same_alone_in_a_batch_and_solo():
    hot = SamplingConfig(temperature=1.0)
    alone = _head_member("eagle", 3, PROMPTS[1], 25, tree=6, sampling=hot, seed=4)
    run_to_completion(_batch_runtime(), [alone])
    crowd = [_member("draft", 3, PROMPTS[0], 30, sampling=SamplingConfig(temperature=0.8),
                     seed=2),
             _head_member("eagle", 3, PROMPTS[1], 25, tree=6, sampling=hot, seed=4),
             _head_member("medusa", 2, PROMPTS[2], 18)]
    run_to_completion(_batch_runtime(), crowd)
    assert _tokens(crowd[1]) == _tokens(alone)
    assert len(_tokens(alone)) == 25
    # the one-sequence loop is a batch of one over the runtime's own cache: the same draws
    solo = _head_member("eagle", 3, PROMPTS[1], 25, tree=6, sampling=hot, seed=4)
    target = TorchRuntime(tiny_model(0), capacity=256)
    steps = speculative_decode(target, solo.proposer, solo.policy, solo.prompt, hot, 25, (),
                               make_generator(4))
    assert [t for s in steps for t in s.tokens] == _tokens(alone)


@pytest.mark.parametrize(("kind", "tree"), [("medusa", 0), ("eagle", 0), ("eagle", 8)])
def test_generate_batch_with_heads_equals_generate(kind, tree):
    from test_engine import word_tokenizer

    from forerun import Engine

    target = TorchRuntime(tiny_model(0), capacity=256)
    spec = SpecConfig(kind, 3, tree=tree, tree_topk=2)
    engine = Engine.from_runtimes(target, word_tokenizer(), None, spec,
                                  heads=random_heads(kind, target))
    budgets = [30, 12, 25]
    got = engine.generate_batch(PROMPTS[:3], max_tokens=budgets, max_batch=2)
    for prompt, budget, out in zip(PROMPTS[:3], budgets, got, strict=True):
        alone = engine.generate(prompt, max_tokens=budget)
        assert out.token_ids == alone.token_ids == _solo(prompt, budget)
        assert out.stats.drafted > 0


def _per_step(rows: list[int], monkeypatch) -> list[tuple[list[int], list]]:
    """Each batch step's (the `rows` appended during it, its members' Steps), filled as
    `generate_batch` runs."""
    calls, inner = [], batch_session.step

    def step(*args, **kwargs):
        before = len(rows)
        results = inner(*args, **kwargs)
        calls.append((rows[before:], [r for r in results if r is not None]))
        return results

    monkeypatch.setattr(batch_session, "step", step)  # the step generate_batch's session runs
    return calls


@pytest.mark.parametrize(("kind", "tree"), [("medusa", 0), ("medusa", 6), ("hydra", 0),
                                            ("hydra", 5)])
def test_generate_batch_calls_the_heads_once_a_step_for_every_drafting_member(kind, tree,
                                                                              monkeypatch):
    from test_engine import word_tokenizer

    from forerun import Engine

    target = TorchRuntime(tiny_model(0), capacity=256)
    heads = random_heads(kind, target)
    engine = Engine.from_runtimes(target, word_tokenizer(), None,
                                  SpecConfig(kind, 3, tree=tree, tree_topk=2), heads=heads)
    rows = []  # the rows of every call of the first head (Medusa: all heads; Hydra: the root)

    def count(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        rows.append(args[0].shape[0])  # f (Medusa) or z (Hydra) [B, D]

    calls = _per_step(rows, monkeypatch)
    hook = heads.blocks[0].register_forward_hook(count)
    budgets = [30, 9, 25, 14, 20]
    try:  # three at a time: the fourth and fifth join as the first ones finish
        got = engine.generate_batch(PROMPTS[:5], max_tokens=budgets, max_batch=3)
    finally:
        hook.remove()
    for prompt, budget, out in zip(PROMPTS[:5], budgets, got, strict=True):
        assert out.token_ids == _solo(prompt, budget)
        assert out.stats.drafted > 0
    for step_rows, results in calls:  # one call a step, holding every drafting member's row
        drafting = sum(1 for r in results if r.drafted > 0)
        assert step_rows == ([drafting] if drafting else [])
    assert max(r for step_rows, _ in calls for r in step_rows) == 3
    # a member prefilled while others drafted: admitted later, it joined the shared call
    assert any(any(r.prefill for r in results) and any(r.drafted for r in results)
               for _, results in calls)


def _eagle_engine(kind, tree):
    from test_engine import word_tokenizer

    from forerun import Engine

    target = TorchRuntime(tiny_model(0), capacity=256)
    heads = random_heads(kind, target)
    engine = Engine.from_runtimes(target, word_tokenizer(), None,
                                  SpecConfig(kind, 3, tree=tree, tree_topk=2), heads=heads)
    return engine, heads


@pytest.mark.parametrize(("kind", "tree"), [("eagle", 0), ("eagle", 6), ("eagle3", 0),
                                            ("eagle3", 5)])
def test_generate_batch_steps_the_eagle_layer_once_a_level_for_every_drafting_member(
        kind, tree, monkeypatch):
    engine, heads = _eagle_engine(kind, tree)
    rows, layer = [], heads.layer.forward_parts  # the rows of every call of the EAGLE layer

    def count(x, *args):
        rows.append(x.shape[0])  # x [R, D]
        return layer(x, *args)

    calls = _per_step(rows, monkeypatch)
    monkeypatch.setattr(heads.layer, "forward_parts", count)
    budgets = [30, 9, 25, 14, 20]
    # three at a time: the fourth and fifth join as the first ones finish
    got = engine.generate_batch(PROMPTS[:5], max_tokens=budgets, max_batch=3)
    for prompt, budget, out in zip(PROMPTS[:5], budgets, got, strict=True):
        assert out.token_ids == _solo(prompt, budget)
        assert out.stats.drafted > 0
    # a draft of 3 levels: one catch-up call and at most two level calls a step, however many
    # members draft in it (drafting one by one, 3 members would make up to 9)
    assert all(len(step_rows) <= 3 for step_rows, _ in calls)
    shared = [(step_rows, results) for step_rows, results in calls
              if sum(r.drafted > 0 for r in results) >= 2]
    assert shared  # steps where several members drafted: their rows shared each call
    assert all(step_rows[0] >= sum(r.drafted > 0 for r in results)
               for step_rows, results in shared)


@pytest.mark.parametrize(("kind", "tree"), [("eagle", 0), ("eagle", 6), ("eagle3", 4)])
def test_an_eagle_member_drafts_in_a_batch_what_it_drafts_alone(kind, tree):
    engine, _ = _eagle_engine(kind, tree)
    budgets = [30, 12, 25, 18]
    together = engine.generate_batch(PROMPTS[:4], max_tokens=budgets)
    alone = engine.generate_batch(PROMPTS[:4], max_tokens=budgets, max_batch=1)
    for a, b, prompt, budget in zip(together, alone, PROMPTS[:4], budgets, strict=True):
        assert a.token_ids == b.token_ids == _solo(prompt, budget)
        assert (a.stats.target_forward_passes, a.stats.drafted, a.stats.accepted) == (
            b.stats.target_forward_passes, b.stats.drafted, b.stats.accepted)
        assert a.stats.per_position_acceptance == b.stats.per_position_acceptance
