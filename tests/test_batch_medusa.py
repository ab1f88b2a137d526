"""A batch's Medusa and Hydra members share one call of their heads a step, and draft exactly
what each would draft alone.

Properties (tiny float64 models, random heads): greedy, a batch of medusa (or hydra) members
(chains and trees, one with a lookup branch) among plain, n-gram, draft-model and EAGLE
members gives every member its solo plain output; each head member's drafts, step by step,
are those it drafts alone; the heads' network is called once a step for every member that
drafts with it, as many rows in all as the members' solo runs call it; with an automatic
budget (resting, lookup-only steps) the outputs still equal plain's; a sequence alone gets no
group, a batch's members one per heads object.
"""

from __future__ import annotations

import pytest
from conftest import random_heads, tiny_model
from test_batch_engine import PROMPTS, _batch_runtime, _member, _solo, _tokens
from test_batch_heads import _head_member

import forerun.batch_engine as batch_engine
from forerun.batch_engine import Sequence, run_to_completion
from forerun.policy import POLICIES
from forerun.propose import AUTO_TREE, PROPOSERS, ProposerContext, SpecConfig
from forerun.propose.heads import AUTO_TREE_MAX
from forerun.runtime.torch_model import TorchRuntime
from forerun.sampling import SamplingConfig, make_generator

HEADS = {}  # kind -> random heads of the tiny target, this file's own (their calls are counted)
# (k, tree, lookup, prompt, max_new) of each head member
MEMBERS = [(3, 0, False, 0, 30), (3, 7, False, 1, 25), (3, 0, True, 3, 30),
           (2, 5, False, 4, 20), (3, 6, True, 5, 24)]


def _heads(kind):
    if kind not in HEADS:
        HEADS[kind] = random_heads(kind, TorchRuntime(tiny_model(0), capacity=256))
    return HEADS[kind]


def _medusa_member(kind, k, tree, lookup, p, max_new, batch=None, price=None):
    """A head member of prompt PROMPTS[p], built as a batch builds its members: `batch` the
    dict they share (None = a sequence alone); `price` prices its target's curve (an automatic
    budget's)."""
    prompt = PROMPTS[p]
    spec = SpecConfig(kind, k, tree=tree, tree_topk=2, lookup=lookup)
    target = TorchRuntime(tiny_model(0), capacity=256)  # a solo view for the factory
    if price is not None:
        price(target, per_token=0)  # a flat curve, on which random heads' trees pay
    ctx = ProposerContext(target, heads=_heads(kind), capacity=len(prompt) + max_new + 32,
                          batch=batch)
    nodes = (AUTO_TREE_MAX if tree == AUTO_TREE else tree or k) + (k if lookup else 0)
    return Sequence(list(prompt), SamplingConfig(), max_new, make_generator(0), (),
                    PROPOSERS[kind](spec, ctx), POLICIES["fixed"](spec, target, None),
                    max_k=nodes)



def _record(seq):
    """Every draft the member's proposer returns, as (tokens, parents) lists."""
    drafts, inner = [], seq.proposer.propose

    def propose(*args, **kwargs):
        draft = inner(*args, **kwargs)
        drafts.append((draft.tokens.tolist(),
                       None if draft.parents is None else draft.parents.tolist()))
        return draft

    seq.proposer.propose = propose
    return drafts


def _count_roots(monkeypatch, kind):
    """The rows of every root call of the kind's heads (Medusa: every head at once; Hydra:
    its first head's step; its later steps grow one member's tree)."""
    heads, rows = _heads(kind), []
    if kind == "medusa":
        inner = heads.medusa

        def medusa(f):
            rows.append(f.shape[0])
            return inner(f)

        monkeypatch.setattr(heads, "medusa", medusa)
    else:
        inner = heads.hydra_step

        def hydra_step(i, z, token):
            if i == 0:
                rows.append(z.shape[0])
            return inner(i, z, token)

        monkeypatch.setattr(heads, "hydra_step", hydra_step)
    return rows


def _calls_per_step(monkeypatch, rows):
    """How many root calls each batch step made."""
    per_step, inner = [], batch_engine.step

    def step(*args, **kwargs):
        before = len(rows)
        out = inner(*args, **kwargs)
        per_step.append(len(rows) - before)
        return out

    monkeypatch.setattr(batch_engine, "step", step)
    return per_step


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_a_batch_drafts_as_its_members_alone_in_one_head_call_a_step(kind, monkeypatch):
    rows = _count_roots(monkeypatch, kind)
    alone, alone_rows = [], []
    for member in MEMBERS:
        seq = _medusa_member(kind, *member)
        assert seq.proposer.group is None  # a sequence alone drafts alone
        alone.append(_record(seq))
        before = len(rows)
        run_to_completion(_batch_runtime(), [seq])
        alone_rows.extend(rows[before:])
        assert _tokens(seq) == _solo(PROMPTS[member[3]], member[4])
    assert set(alone_rows) == {1}
    del rows[:]

    batch = {}
    heads = [_medusa_member(kind, *member, batch=batch) for member in MEMBERS]
    assert len({id(s.proposer.group) for s in heads}) == 1
    assert heads[0].proposer.group is not None
    drafts = [_record(s) for s in heads]
    others = [_member("ngram", 4, PROMPTS[0], 22), _member("none", 0, PROMPTS[1], 15),
              _member("draft", 3, PROMPTS[2], 26),
              _head_member("eagle", 3, PROMPTS[3], 20, tree=6)]
    per_step = _calls_per_step(monkeypatch, rows)
    runtime = _batch_runtime()
    run_to_completion(runtime, [heads[0], others[0], heads[1], others[1], *heads[2:4],
                                others[2], heads[4], others[3]])
    for seq, member, got, mine in zip(heads, MEMBERS, drafts, alone, strict=True):
        assert _tokens(seq) == _solo(PROMPTS[member[3]], member[4]), member
        assert sum(s.drafted for s in seq.steps) > 0, member
        assert got == mine, member  # every draft, as the member drafts alone
    for seq, (p, n) in zip(others, ((0, 22), (1, 15), (2, 26), (3, 20)), strict=True):
        assert _tokens(seq) == _solo(PROMPTS[p], n)
    assert max(per_step) == 1  # one call a step for every member drafting with the heads
    assert max(rows) == len(MEMBERS)  # all of them in one call while all draft
    assert sum(rows) == len(alone_rows)  # as many roots as the members alone computed
    assert runtime.pool.live == 0


def test_an_automatic_budget_in_a_batch_equals_plain(synthetic_curves):
    batch = {}
    members = [(3, AUTO_TREE, True, 0, 30), (3, AUTO_TREE, False, 3, 25), (2, 0, False, 1, 20)]
    seqs = [_medusa_member("medusa", *m, batch=batch, price=synthetic_curves) for m in members]
    run_to_completion(_batch_runtime(), [*seqs, _member("ngram", 3, PROMPTS[4], 20)])
    for seq, (_k, _tree, _lookup, p, n) in zip(seqs, members, strict=True):
        assert _tokens(seq) == _solo(PROMPTS[p], n)
        assert sum(s.drafted for s in seq.steps) > 0
        assert seq.proposer.head_seconds > 0  # its share of the batched calls, priced


def test_members_share_a_group_per_heads_object():
    batch = {}
    first = _medusa_member("medusa", 3, 0, False, 0, 10, batch=batch).proposer
    same = _medusa_member("medusa", 2, 4, False, 1, 10, batch=batch).proposer
    target = TorchRuntime(tiny_model(0), capacity=256)
    other = PROPOSERS["medusa"](SpecConfig("medusa", 3), ProposerContext(
        target, heads=random_heads("medusa", target, seed=1), batch=batch))
    assert first.group is same.group and other.group is not first.group
    assert other.group.heads is other.heads
