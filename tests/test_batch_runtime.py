"""The batched runtime: a packed pass over several sequences gives every member what a pass of
its own would (tiny float64 models), and the cache pool hands out and takes back regions.

Properties: prefill, chain and tree passes of members of different lengths, batched in any
mix, give each member the logits a one-sequence runtime gives it (float64: equal to 1e-12, and
the same argmax; decode-sized rows attend in plain matmuls, prompts through SDPA); `commit` after
  a tree pass equals `keep` on the one-sequence runtime; the
pool refuses what does not fit, frees and merges regions, is not resident until written, and a
member never sees another's cache.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import tiny_model

from forerun.bench.serving import rss_bytes
from forerun.runtime.batch import BatchTorchRuntime, CachePool, PackedBatch, PoolFull
from forerun.runtime.torch_model import TorchRuntime
from forerun.tree import TokenTree

TOL = 1e-12
BUDGET = 1 << 20  # bytes: ~1,000 tokens of the tiny model


def _pair(seed: int = 0) -> tuple[BatchTorchRuntime, TorchRuntime]:
    model = tiny_model(seed)
    solo = TorchRuntime(model, capacity=256)
    return BatchTorchRuntime(TorchRuntime(model, capacity=256), BUDGET), solo


def _prompt(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (n,), generator=g)


def test_batched_prefill_and_decode_equal_each_sequence_alone():
    batch_rt, solo = _pair()
    prompts = [_prompt(i, n) for i, n in enumerate((5, 17, 9))]
    seqs = [batch_rt.add(64) for _ in prompts]
    out = batch_rt.forward(PackedBatch.of(list(zip(seqs, prompts, strict=True)), last_only=True))
    assert out.logits.shape == (3, 64)
    nxt = []
    for b, p in enumerate(prompts):
        solo.truncate(0)
        ref = solo.forward(p, last_only=True).logits[-1]
        assert torch.allclose(out.logits[b], ref, atol=TOL, rtol=0)
        nxt.append(int(ref.argmax()))
    # decode: member 0 one token, member 1 a 4-token chain, member 2 two tokens
    feeds = [torch.tensor([nxt[0]]), torch.tensor([nxt[1], 3, 4, 5]), torch.tensor([nxt[2], 7])]
    out = batch_rt.forward(PackedBatch.of(list(zip(seqs, feeds, strict=True))))
    assert out.logits.shape == (7, 64)
    row = 0
    for p, f in zip(prompts, feeds, strict=True):
        solo.truncate(0)
        solo.forward(p, last_only=True)
        ref = solo.forward(f).logits
        assert torch.allclose(out.logits[row:row + len(f)], ref, atol=TOL, rtol=0)
        row += len(f)
    assert [batch_rt.length(s) for s in seqs] == [6, 21, 11]


def test_a_tree_member_beside_chains_then_commit_equals_keep():
    batch_rt, solo = _pair(1)
    parents = torch.tensor([-1, -1, 0, 0, 2])  # two roots; node 2 under 0; node 4 under 2
    tree = TokenTree.of(parents, 5)
    draft = torch.tensor([11, 12, 13, 14, 15])
    p_tree, p_chain = _prompt(3, 12), _prompt(4, 7)
    s_tree, s_chain = batch_rt.add(64), batch_rt.add(64)
    batch_rt.forward(PackedBatch.of([(s_tree, p_tree), (s_chain, p_chain)], last_only=True))
    feed = torch.cat([torch.tensor([1]), draft])  # [6]: pending token + tree
    rel = tree.positions(0)  # depths of [root, nodes...] from 0
    mask = tree.mask()
    out = batch_rt.forward(PackedBatch.of([(s_chain, torch.tensor([2, 3])), (s_tree, feed)],
                                          positions=[None, rel], tree_masks=[None, mask]))
    solo.forward(p_tree, last_only=True)
    base = solo.length
    ref = solo.forward(feed, positions=tree.positions(base), tree_mask=mask).logits
    assert torch.allclose(out.logits[2:], ref, atol=TOL, rtol=0)
    rows = [0, 1, 3, 5]  # the pending token, node 0, node 2, node 4
    batch_rt.commit(s_tree, len(p_tree), rows)
    solo.keep(base, rows)
    after_b = batch_rt.forward(PackedBatch.of([(s_tree, torch.tensor([9, 10]))])).logits
    after_s = solo.forward(torch.tensor([9, 10])).logits
    assert torch.allclose(after_b, after_s, atol=TOL, rtol=0)
    assert batch_rt.length(s_tree) == solo.length


def test_hidden_states_and_wanted_rows():
    batch_rt, solo = _pair(2)
    a, b = batch_rt.add(32), batch_rt.add(32)
    pa, pb = _prompt(5, 6), _prompt(6, 3)
    out = batch_rt.forward(PackedBatch.of([(a, pa), (b, pb)]), hidden_layers=(0, -1))
    ref = solo.forward(pb, hidden_layers=(0, -1))
    assert torch.allclose(out.hidden[-1][6:], ref.hidden[-1], atol=TOL, rtol=0)
    assert torch.allclose(out.hidden[0][6:], ref.hidden[0], atol=TOL, rtol=0)
    assert torch.allclose(out.logits[6:], ref.logits, atol=TOL, rtol=0)


def test_the_pool_is_a_byte_budget_that_refuses_frees_and_merges():
    pool = CachePool(n_layers=2, n_kv_heads=2, head_dim=8, budget_bytes=2 * 2 * 2 * 8 * 8 * 100,
                     dtype=torch.float64)
    assert pool.slots == 100
    a, b, c = pool.allocate(40), pool.allocate(40), pool.allocate(20)
    with pytest.raises(PoolFull, match="no free cache region of 1 slots"):
        pool.allocate(1)
    pool.release(a)
    pool.release(b)  # a and b merge: 80 contiguous slots
    d = pool.allocate(80)
    assert pool.region(d).start == 0 and pool.free_slots == 0
    pool.release(c)
    pool.release(d)
    assert pool.free_slots == 100 and pool.live == 0
    with pytest.raises(ValueError, match="holds no token"):
        CachePool(2, 2, 8, 10, torch.float64)


def test_the_pool_budget_is_not_resident_until_written():
    """A 2 GiB pool costs next to no RSS at idle (calloc'd zero pages), reads as zeros, and
    only the written slots' pages become resident."""
    rss = lambda: rss_bytes(os.getpid())  # noqa: E731
    before = rss()
    pool = CachePool(n_layers=4, n_kv_heads=2, head_dim=64, budget_bytes=2 << 30,
                     dtype=torch.bfloat16)
    assert pool.k.nbytes + pool.v.nbytes >= 2 << 30
    assert rss() - before < 64 << 20
    assert not pool.k[:, :, -100:].any() and not pool.v[:, :, :100].any()
    pool.k[:, :, :1000] = 1.0  # 1,000 of ~1M slots: 8 strips of 2 MiB pages at most
    assert rss() - before < 256 << 20


def test_a_freed_region_leaves_rss_and_its_neighbours_keep_their_kv():
    """Releasing a member drops its region's whole pages (RSS follows the KV in use, not the
    peak): they read as zeros; the regions on either side keep every value."""
    if os.uname().sysname != "Linux":
        pytest.skip("madvise(MADV_DONTNEED) semantics are Linux's")
    pool = CachePool(n_layers=4, n_kv_heads=2, head_dim=64, budget_bytes=1 << 30,
                     dtype=torch.bfloat16)
    left, mid, right = (pool.allocate(n) for n in (1000, 200_000, 1000))
    spans = {h: slice(pool.region(h).start, pool.region(h).start + pool.region(h).size)
             for h in (left, mid, right)}
    for value, h in enumerate((left, mid, right), start=1):
        pool.k[:, :, spans[h]] = value
        pool.v[:, :, spans[h]] = -value
    before = rss_bytes(os.getpid())
    pool.release(mid)  # 200k slots x 4 layers x 2 heads x 64 x 2 bytes x (K, V): ~400 MB
    assert rss_bytes(os.getpid()) < before - (300 << 20)
    inner = slice(spans[mid].start + 32, spans[mid].stop - 32)  # a 4 KiB page holds 32 slots
    assert not pool.k[:, :, inner].any() and not pool.v[:, :, inner].any()
    for value, h in ((1, left), (3, right)):
        assert (pool.k[:, :, spans[h]] == value).all() and (pool.v[:, :, spans[h]] == -value).all()
    again = pool.allocate(200_000)  # the slots serve the next member as before
    pool.k[:, :, pool.region(again).start] = 7.0
    assert (pool.k[:, :, spans[right]] == 3).all()


def test_a_member_over_its_reservation_or_the_context_is_refused():
    batch_rt, _ = _pair()
    s = batch_rt.add(4)
    with pytest.raises(ValueError, match="reserved slots"):
        batch_rt.forward(PackedBatch.of([(s, _prompt(0, 5))]))
    with pytest.raises(ValueError, match="exceeds the context"):
        batch_rt.add(10_000)


def test_freed_heap_memory_goes_back_to_the_os():
    """Many small freed buffers stay mapped by glibc until malloc_trim returns them: RSS drops
    after `return_free_memory` (on glibc; elsewhere it says it did nothing)."""
    import ctypes.util

    from forerun.runtime.memory import return_free_memory

    if ctypes.util.find_library("c") is None or os.uname().sysname != "Linux":
        assert return_free_memory() in (True, False)
        return
    chunks = [bytearray(64 * 1024 - 64) for _ in range(4000)]  # ~256 MB below mmap's threshold
    for c in chunks[:-1:2]:
        c[::4096] = b"x" * len(c[::4096])
    keep = chunks[-1]
    del chunks
    before = rss_bytes(os.getpid())
    assert return_free_memory()
    assert rss_bytes(os.getpid()) < before - (32 << 20), "malloc_trim returned nothing"
    assert keep
