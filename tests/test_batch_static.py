"""The batched runtime's static passes (forerun.runtime.batch_static), run eagerly on the CPU:
the same logits as the eager batched forward, so their padding and device-built masks are
checked without a GPU (CUDA graph capture itself is only exercised on a GPU).

Properties (tiny float64 models): a static pass over chains of different lengths, a tree
member with its mask, members at different cache lengths and padded rows gives the eager
pass's logits and final hidden states (to 1e-12) and the same cache afterwards; its padding
writes no slot but the pool's spare one; greedy decoding through static passes (members
admitted as others finish; draft-model, n-gram and head tree members; generate_batch) equals
each member's solo plain greedy output; passes the static sizes do not hold (more rows than
the largest size, a prompt-sized member, hidden layers other than the final one) run eagerly.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from test_batch_engine import MIX, PROMPTS, _member, _solo, _tokens

from forerun.batch_engine import run_to_completion
from forerun.runtime.batch import BatchTorchRuntime, PackedBatch
from forerun.runtime.batch_static import BATCH_SIZES, MAX_MEMBER_ROWS, BatchStaticPasses
from forerun.runtime.torch_model import TorchRuntime
from forerun.tree import TokenTree

TOL = 1e-12
BUDGET = 1 << 20  # bytes: ~2,000 slots of the tiny model


@pytest.fixture
def static_calls(monkeypatch) -> list[int]:
    """Rows of every pass that ran static (appended as they run)."""
    calls: list[int] = []
    forward = BatchStaticPasses.forward

    def counted(self, batch, starts):
        calls.append(len(batch.tokens))
        return forward(self, batch, starts)

    monkeypatch.setattr(BatchStaticPasses, "forward", counted)
    return calls


def _runtimes(seed: int = 0) -> tuple[BatchTorchRuntime, BatchTorchRuntime]:
    """(eager, static) batched views of one model."""
    model = tiny_model(seed)
    return (BatchTorchRuntime(TorchRuntime(model, capacity=256), BUDGET, static=False),
            BatchTorchRuntime(TorchRuntime(model, capacity=256), BUDGET, static=True))


def _prompt(seed: int, n: int) -> torch.Tensor:
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed))


def _both(eager, static, batch, hidden_layers=(-1,)):
    a, b = eager.forward(batch, hidden_layers), static.forward(batch, hidden_layers)
    assert a.logits.shape == b.logits.shape
    assert torch.allclose(a.logits, b.logits, atol=TOL, rtol=0)
    for layer in hidden_layers:
        assert torch.allclose(a.hidden[layer], b.hidden[layer], atol=TOL, rtol=0)
    return a


def test_capabilities_declare_static_passes_and_no_graphs_on_the_cpu():
    eager, static = _runtimes()
    assert static.capabilities.static_passes and not static.capabilities.cuda_graphs
    assert not eager.capabilities.static_passes and not eager.capabilities.cuda_graphs
    default = BatchTorchRuntime(TorchRuntime(tiny_model(0), capacity=256), BUDGET)
    assert not default.capabilities.static_passes  # the CPU's default: eager
    forced = BatchTorchRuntime(TorchRuntime(tiny_model(0), capacity=256, static=True), BUDGET)
    assert forced.capabilities.static_passes  # as its one-sequence runtime does


def test_mixed_members_equal_the_eager_pass(static_calls):
    eager, static = _runtimes(1)
    lengths = (5, 17, 9, 30)  # members at different cache lengths
    prompts = [_prompt(i, n) for i, n in enumerate(lengths)]
    seqs = [[rt.add(80) for _ in prompts] for rt in (eager, static)]
    assert seqs[0] == seqs[1]
    _both(eager, static, PackedBatch.of(list(zip(seqs[1], prompts, strict=True)),
                                        last_only=True))  # a prefill's wanted rows
    tree = TokenTree.of(torch.tensor([-1, -1, 0, 0, 2, 1]), 6)  # two roots, depth 3
    for step in range(3):
        feeds = [torch.tensor([1 + step]),  # one token
                 torch.tensor([2, 11, 12, 13, 14, 15, 16]),  # a tree member, pending + 6
                 torch.tensor([3, 4, 5, 6, 7][:2 + step]),  # a chain of 2, 3, 4
                 torch.tensor([8, 9])]
        batch = PackedBatch.of(list(zip(seqs[1], feeds, strict=True)),
                               positions=[None, tree.positions(0), None, None],
                               tree_masks=[None, tree.mask(), None, None])
        assert len(batch.tokens) not in BATCH_SIZES  # padded rows
        _both(eager, static, batch)
        for rt, s in zip((eager, static), seqs, strict=True):  # the tree keeps a path
            rt.commit(s[1], rt.length(s[1]) - 7, [0, 1, 3, 5])
    assert [eager.length(s) for s in seqs[0]] == [static.length(s) for s in seqs[1]]
    _both(eager, static, PackedBatch.of([(s, torch.tensor([5, 6])) for s in seqs[1]]))
    assert len(static_calls) == 5
    used = max(r.start + r.length for r in (static.pool.region(s) for s in seqs[1]))
    assert torch.allclose(eager.pool.k[:, :, :used], static.pool.k[:, :, :used], atol=TOL, rtol=0)
    assert not static.pool.k[:, :, used:static.pool.slots].any()  # padding: the spare slot only


def test_a_member_does_not_see_another_members_cache():
    _, static = _runtimes(2)
    alone = BatchTorchRuntime(TorchRuntime(tiny_model(2), capacity=256), BUDGET, static=True)
    a, b = static.add(40), static.add(40)
    static.forward(PackedBatch.of([(a, _prompt(7, 20)), (b, _prompt(8, 11))]))
    c = alone.add(40)
    alone.forward(PackedBatch.of([(c, _prompt(8, 11))]))
    both = static.forward(PackedBatch.of([(a, torch.tensor([1, 2])), (b, torch.tensor([3]))]))
    one = alone.forward(PackedBatch.of([(c, torch.tensor([3]))]))
    assert torch.allclose(both.logits[2:], one.logits, atol=TOL, rtol=0)


def test_passes_the_static_sizes_do_not_hold_run_eagerly(static_calls):
    eager, static = _runtimes(3)
    width, n = MAX_MEMBER_ROWS, BATCH_SIZES[-1] // MAX_MEMBER_ROWS + 1  # past the largest size
    for rt in (eager, static):
        for _ in range(n):
            rt.add(3 * width)
    members = [(s, _prompt(10 + s, width)) for s in range(n)]
    _both(eager, static, PackedBatch.of(members))
    prompt = [(0, _prompt(20, MAX_MEMBER_ROWS + 1))]  # one prompt-sized member
    _both(eager, static, PackedBatch.of(prompt, last_only=True))
    assert static_calls == []
    _both(eager, static, PackedBatch.of([(1, torch.tensor([4, 5]))]), hidden_layers=(0, -1))
    assert static_calls == []  # a block's output: eager
    _both(eager, static, PackedBatch.of([(1, torch.tensor([6]))]))
    assert static_calls == [1]


@pytest.mark.parametrize("max_batch", [2, 4])
def test_greedy_through_static_passes_equals_solo_plain(static_calls, max_batch):
    runtime = BatchTorchRuntime(TorchRuntime(tiny_model(0), capacity=256), BUDGET, static=True)
    seqs = [_member(m, k, PROMPTS[p], n) for m, k, p, n in MIX]
    run_to_completion(runtime, seqs, max_batch=max_batch)  # admitted as others finish
    for seq, (method, _k, p, n) in zip(seqs, MIX, strict=True):
        assert _tokens(seq) == _solo(PROMPTS[p], n), method
    assert static_calls and runtime.pool.live == 0


def test_generate_batch_through_static_passes_equals_solo_plain(static_calls):
    from test_engine import word_tokenizer

    from forerun import Engine
    from forerun.propose import SpecConfig

    target = TorchRuntime(tiny_model(0), capacity=256, static=True)
    draft = TorchRuntime(tiny_model(0, noise=0.05), capacity=256, static=True)
    engine = Engine.from_runtimes(target, word_tokenizer(), draft, SpecConfig("draft", 4))
    budgets = [30, 12, 25, 40]
    got = engine.generate_batch(PROMPTS[:4], max_tokens=budgets, max_batch=3)
    for prompt, budget, out in zip(PROMPTS[:4], budgets, got, strict=True):
        assert out.token_ids == _solo(prompt, budget)
    assert static_calls  # the target's and the draft's batched passes


def test_head_tree_members_through_static_passes_equal_solo_plain(static_calls):
    from test_batch_heads import _head_member

    runtime = BatchTorchRuntime(TorchRuntime(tiny_model(0), capacity=256), BUDGET, static=True)
    mix = [("hydra", 3, 7, 1, 25), ("eagle", 3, 8, 3, 33), ("medusa", 3, 0, 0, 20)]
    seqs = [_head_member(kind, k, PROMPTS[p], n, tree=tree) for kind, k, tree, p, n in mix]
    seqs.append(_member("ngram", 4, PROMPTS[4], 22))
    run_to_completion(runtime, seqs, max_batch=3)
    for seq, (kind, _k, _tree, p, n) in zip(seqs[:-1], mix, strict=True):
        assert _tokens(seq) == _solo(PROMPTS[p], n), kind
        assert sum(s.drafted for s in seq.steps) > 0, kind
    assert _tokens(seqs[-1]) == _solo(PROMPTS[4], 22)
    assert static_calls  # trees and the final hidden state the heads read, static
