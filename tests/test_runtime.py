"""The torch runtime's KV cache: chains, rollback and tree masks agree with plain forwards."""

import pytest
import torch
from conftest import tiny_model, tiny_runtime

from forerun.runtime.torch_model import TorchRuntime


def test_block_forward_equals_token_by_token():
    tokens = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    a = tiny_runtime(0)
    block = a.forward(tokens).logits  # [8, V]
    b = tiny_runtime(0)
    single = torch.cat([b.forward(t.view(1)).logits for t in tokens])
    assert torch.allclose(block, single, atol=1e-10)
    assert a.length == b.length == 8


def test_truncate_round_trips():
    rt = tiny_runtime(1)
    rt.forward(torch.tensor([1, 2, 3]))
    first = rt.forward(torch.tensor([4, 5])).logits
    rt.truncate(3)
    rt.forward(torch.tensor([7, 7, 7]))  # overwrite the slots with something else
    rt.truncate(3)
    again = rt.forward(torch.tensor([4, 5])).logits
    assert torch.allclose(first, again, atol=1e-12) and rt.length == 5


def test_last_only_and_hidden_states():
    rt = tiny_runtime(2)
    out = rt.forward(torch.tensor([1, 2, 3]), last_only=True, hidden_layers=(0, -1))
    assert out.logits.shape == (1, 64)
    assert out.hidden[0].shape == out.hidden[-1].shape == (3, 32)  # every row, even last_only
    rt.truncate(0)
    tail = rt.forward(torch.tensor([1, 2, 3]), last_only=True, hidden_layers=(0, -1),
                      hidden_from=2)  # the last row's only
    assert all(torch.equal(tail.hidden[i], out.hidden[i][2:]) for i in (0, -1))


def test_tree_mask_with_explicit_positions():
    """Two sibling branches after a shared prefix: each branch sees only its own ancestors."""
    prefix = torch.tensor([5, 6, 7])
    rt = tiny_runtime(3)
    rt.forward(prefix)
    # nodes: 0 = token 8 (depth 0), 1 = token 9 child of 0, 2 = token 10 child of 0 (sibling of 1)
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    tree = rt.forward(torch.tensor([8, 9, 10]), positions=torch.tensor([3, 4, 4]),
                      tree_mask=mask).logits
    for branch, row in (([8, 9], 1), ([8, 10], 2)):
        chain = tiny_runtime(3)
        chain.forward(prefix)
        assert torch.allclose(tree[row], chain.forward(torch.tensor(branch)).logits[-1],
                              atol=1e-10)


def test_bfloat16_top_logits_are_refined_in_float32():
    from forerun.runtime.torch_model import REFINE_TOP, refine_top_logits

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, generator=g).bfloat16()  # [T, D]
    weight = torch.randn(50, 16, generator=g).bfloat16()  # [V, D]
    refined = refine_top_logits(torch.nn.functional.linear(x, weight), x, weight)
    exact = x.float() @ weight.float().T  # [T, V]
    assert refined.dtype == torch.float32
    top = refined.topk(REFINE_TOP, dim=-1)
    assert torch.allclose(top.values, exact.gather(-1, top.indices), atol=1e-5, rtol=0)
    assert torch.equal(refined.argmax(-1), exact.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepacked_weights_compute_the_same_logits(dtype):
    from conftest import tiny_model

    from forerun.runtime.torch_model import TorchRuntime, can_prepack

    if not can_prepack(dtype, torch.device("cpu")):
        pytest.skip("oneDNN prepacking not available in this torch build")
    tokens = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    packed = TorchRuntime(tiny_model(0).to(dtype), capacity=64, prepack=True)
    plain = TorchRuntime(tiny_model(0).to(dtype), capacity=64, prepack=False)
    assert packed.prepacked and not plain.prepacked
    a, b = packed.forward(tokens).logits, plain.forward(tokens).logits
    tol = 1e-4 if dtype == torch.float32 else 0.1
    assert torch.allclose(a, b, atol=tol, rtol=tol)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.75


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_limit_vocab_keeps_the_kept_logits_and_masks_the_rest(dtype):
    from conftest import tiny_model

    from forerun.runtime.torch_model import TorchRuntime

    tokens, kept = torch.tensor([3, 1, 4, 1, 5]), torch.tensor([0, 2, 5, 9, 33, 63])
    full = TorchRuntime(tiny_model(0).to(dtype), capacity=64).forward(tokens).logits  # [T, V]
    small = TorchRuntime(tiny_model(0).to(dtype), capacity=64)
    small.limit_vocab([*kept.tolist(), 5])  # duplicates are fine
    got = small.forward(tokens).logits
    assert got.shape == full.shape
    tol = 1e-12 if dtype == torch.float64 else 0.1  # a smaller matmul: other rounding
    assert torch.allclose(got[:, kept], full[:, kept], atol=tol, rtol=0)
    rest = torch.ones(64, dtype=torch.bool).index_fill_(0, kept, False)
    assert torch.isneginf(got[:, rest]).all()
    with pytest.raises(ValueError, match="vocabulary ids"):
        small.limit_vocab([64])


def test_fork_shares_weights_and_keeps_a_cache_of_its_own():
    """Two sequences stepped in turn on a runtime and its fork: each as if alone."""
    first = tiny_runtime(4)
    second = first.fork()
    assert second.model is first.model and second.length == 0
    x, y = torch.tensor([3, 1, 4, 1, 5]), torch.tensor([2, 7, 1])
    first.forward(x)
    second.forward(y)
    first_next = first.forward(torch.tensor([9])).logits
    second_next = second.forward(torch.tensor([9])).logits
    alone = tiny_runtime(4)
    want = alone.forward(torch.cat([x, torch.tensor([9])])).logits[-1:]
    assert torch.allclose(want, first_next, atol=1e-10)
    alone.truncate(0)
    want = alone.forward(torch.cat([y, torch.tensor([9])])).logits[-1:]
    assert torch.allclose(want, second_next, atol=1e-10)


def static_runtime(seed: int, capacity: int = 256, vocab: int = 64,
                   spans: bool = False) -> TorchRuntime:
    """The static-shape passes a GPU replays as CUDA graphs, run eagerly on the CPU."""
    return TorchRuntime(tiny_model(seed, vocab), capacity=capacity, static=True, spans=spans)


@pytest.mark.parametrize("spans", [False, True])
def test_static_passes_equal_the_eager_forward(spans):
    """Chains of every padded size, hidden states, last_only, a tree pass and its compaction:
    the static pass (K/V at slots given as data, attention over the whole cache, or with
    spans over its first 256 of 1,024 slots, under a mask built from `start` and the new
    tokens' mask, rows padded to a captured size) computes what the eager forward computes;
    prompts past the largest size take the eager forward."""
    eager, static = tiny_runtime(7), static_runtime(7, 1024 if spans else 256, spans=spans)
    tokens = torch.randint(0, 64, (120,), generator=torch.Generator().manual_seed(0))
    for rt in (eager, static):
        rt.forward(tokens[:70])  # 70 > STATIC_SIZES[-1]: the eager path in both
    at = 70
    for n in (1, 2, 3, 5, 9, 17, 33):  # padded to 1, 2, 4, 8, 16, 32, 64
        a, b = (rt.forward(tokens[at - 60:at - 60 + n], hidden_layers=(-1,))
                for rt in (eager, static))
        assert torch.allclose(a.logits, b.logits, atol=1e-10) and b.logits.shape == (n, 64)
        assert torch.allclose(a.hidden[-1], b.hidden[-1], atol=1e-10)
        at += n
    assert eager.length == static.length == at
    a, b = (rt.forward(tokens[:4], last_only=True) for rt in (eager, static))
    assert b.logits.shape == (1, 64) and torch.allclose(a.logits, b.logits, atol=1e-10)
    start = eager.length
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]).bool()
    positions = torch.tensor([start, start + 1, start + 1, start + 2])
    a, b = (rt.forward(tokens[10:14], positions=positions, tree_mask=mask)
            for rt in (eager, static))
    assert torch.allclose(a.logits, b.logits, atol=1e-10)
    for rt in (eager, static):
        rt.keep(start, [0, 2, 3])
    a, b = (rt.forward(tokens[20:21]) for rt in (eager, static))
    assert torch.allclose(a.logits, b.logits, atol=1e-10)
    keys = list(static._static._sized)  # (size, span) with spans, else sizes
    assert {k[1] for k in keys} == {256} if spans else all(isinstance(k, int) for k in keys)


def test_warm_up_records_every_size_and_keeps_the_cache():
    """warm_up() runs each padded size's static pass now (a GPU records its graphs there, not
    in a request) and leaves the cache as it was: the next passes give what they give without
    it. Only the sizes that fit; a runtime without static passes does nothing."""
    from forerun.runtime.static import STATIC_SIZES

    tokens = torch.randint(0, 64, (90,), generator=torch.Generator().manual_seed(3))
    cold, warm = static_runtime(9), static_runtime(9)
    for rt in (cold, warm):
        rt.forward(tokens[:70])  # past the largest size: the eager forward
    assert warm.warm_up() == len(STATIC_SIZES) and warm.length == 70
    assert set(warm._static._sized) == set(STATIC_SIZES) and not cold._static._sized
    for n in (1, 3, 8):
        a, b = (rt.forward(tokens[70:70 + n]) for rt in (cold, warm))
        assert torch.equal(a.logits, b.logits)
        for rt in (cold, warm):
            rt.truncate(70)
    near_end = static_runtime(9, capacity=48)
    near_end.forward(tokens[:40])
    assert near_end.warm_up() == 4 and near_end.length == 40  # sizes 1, 2, 4, 8 fit in 48
    assert static_runtime(9).warm_up(max_tokens=4) == 3
    assert tiny_runtime(9).warm_up() == 0  # no static passes (the CPU's default)


def test_engine_and_server_slots_warm_up_their_runtimes():
    """Engine.warm_up records the target's and the draft's passes; a server's Worker (one
    batch over one engine, no per-slot forks) warms that engine before serving."""
    from forerun.api import Engine
    from forerun.runtime.static import STATIC_SIZES
    from forerun.serve.worker import Worker

    engine = Engine.from_runtimes(static_runtime(1), None, static_runtime(2))
    assert engine.warm_up() == 2 * len(STATIC_SIZES)
    assert Engine.from_runtimes(tiny_runtime(1), None).warm_up() == 0
    worker = Worker(Engine.from_runtimes(static_runtime(1), None), slots=2, max_queue=0)
    assert worker.warm_up() == len(STATIC_SIZES)


def test_static_passes_near_the_end_of_the_cache_and_in_a_fork():
    """A pass whose padded rows would run past the cache takes the eager forward; a fork
    records its own passes (they write its cache, not the original's)."""
    eager, static = tiny_runtime(8, capacity=40), static_runtime(8, capacity=40)
    tokens = torch.arange(1, 50)
    for rt in (eager, static):
        rt.forward(tokens[:37])
    assert not static._static.fits(37, 3, ())  # padded to 4: slot 40 is past the cache
    a, b = (rt.forward(tokens[37:40]) for rt in (eager, static))  # so: eager
    assert torch.allclose(a.logits, b.logits, atol=1e-10) and static.length == 40
    for rt in (eager, static):
        rt.truncate(35)
    assert static._static.fits(35, 3, ())
    a, b = (rt.forward(tokens[:3]) for rt in (eager, static))  # 35 + 4 <= 40: static
    assert torch.allclose(a.logits, b.logits, atol=1e-10)
    twin = static.fork()
    assert twin._static is not static._static
    first = twin.forward(torch.tensor([5, 6, 7])).logits
    static.truncate(0)
    assert torch.allclose(static.forward(torch.tensor([5, 6, 7])).logits, first, atol=1e-12)
