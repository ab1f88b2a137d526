"""Prefix caching (`forerun.prefix_cache`): prompt blocks' KV reused by later prompts.

Properties (tiny float64 models, greedy): a prompt that begins like an earlier one feeds only
the rest (its pass rows show it) and still gets exactly its solo tokens, for plain, draft and
n-gram members, whole or in chunks; a block matches only after the very same prefix; at least
the last prompt token is always fed; the byte budget holds, least recently used blocks going
first and a chain's root last.
"""

from __future__ import annotations

import pytest
import torch
from test_batch_engine import BUDGET, _batch_runtime, _engine, _solo

from forerun.batch_session import BatchSession
from forerun.prefix_cache import BLOCK_TOKENS, PrefixCache
from forerun.propose import SpecConfig
from forerun.runtime.batch import KVCopy
from forerun.sampling import SamplingConfig

SYSTEM = [(i * 11) % 47 + 2 for i in range(3 * BLOCK_TOKENS + 5)]  # a shared "system prompt"


def _rows_spy(session: BatchSession) -> list[int]:
    rows, forward = [], session.target.forward

    def counted(batch, *args, **kw):
        rows.append(len(batch.tokens))
        return forward(batch, *args, **kw)

    session.target.forward = counted
    return rows


def _run(session: BatchSession, rows: list[int], prompt: list[int], max_new: int,
         method: str) -> tuple[list[int], int]:
    """Decode `prompt` alone in the session -> its tokens, and the rows its prefill fed."""
    seq = session.sequence(prompt, SamplingConfig(), max_new, SpecConfig(method, 3))
    session.add(seq)
    rows.clear()
    while not seq.steps:
        session.step()
    fed = sum(rows)
    while not session.idle:
        session.step()
    assert seq.error is None, seq.error
    return [t for s in seq.steps for t in s.tokens], fed


@pytest.mark.parametrize("method", ["none", "draft", "ngram"])
@pytest.mark.parametrize("chunk", [None, 8])
def test_a_repeated_prefix_is_fed_once_and_outputs_stay_exact(method, chunk):
    engine = _engine(method, k=3)
    session = BatchSession(engine, BUDGET, max_batch_tokens=chunk, prefix_cache_bytes=BUDGET)
    rows = _rows_spy(session)
    first, second = [*SYSTEM, 3, 4, 5], [*SYSTEM, 9, 8, 7, 6]
    tokens, fed = _run(session, rows, first, 12, method)
    assert tokens == _solo(first, 12) and fed == len(first)
    tokens, fed = _run(session, rows, second, 12, method)
    assert tokens == _solo(second, 12)
    reused = 3 * BLOCK_TOKENS  # the shared blocks (the rest of SYSTEM is a partial block)
    assert session.prefix.hits == reused and fed == len(second) - reused


def test_a_block_matches_only_after_the_same_prefix():
    rt = _batch_runtime()
    cache = PrefixCache(BUDGET)
    a = list(range(1, 2 * BLOCK_TOKENS + 2))
    seq = rt.add(len(a) + 4)
    rt.write_kv(seq, [KVCopy(*(torch.randn(x.shape[0], x.shape[1], len(a), x.shape[3],
                                           dtype=x.dtype) for x in (rt.pool.k, rt.pool.v)))])
    cache.store(rt, seq, a)
    assert len(cache) == 2
    other = rt.add(len(a) + 4)
    # same second block, different first: nothing matches
    b = [99, *a[1:]]
    assert cache.load(rt, other, b) == 0
    # the whole of a: both blocks, but never its last token
    assert cache.load(rt, other, a) == 2 * BLOCK_TOKENS
    assert torch.equal(rt.read_kv(other, 0, 2 * BLOCK_TOKENS).k,
                       rt.read_kv(seq, 0, 2 * BLOCK_TOKENS).k)
    # exactly two blocks long: its last token is fed, so only the first block comes back
    rt.truncate(other, 0)
    assert cache.load(rt, other, a[:2 * BLOCK_TOKENS]) == BLOCK_TOKENS


def test_the_budget_holds_and_the_least_recently_used_go_first():
    rt = _batch_runtime()
    one = 2 * rt.pool.bytes_per_token * BLOCK_TOKENS // 2  # K and V of one block
    cache = PrefixCache(3 * one)
    prompts = [[p] * (2 * BLOCK_TOKENS + 1) for p in (1, 2, 3)]
    for p in prompts:
        seq = rt.add(len(p))
        rt.write_kv(seq, [KVCopy(*(torch.zeros(x.shape[0], x.shape[1], len(p), x.shape[3],
                                               dtype=x.dtype) for x in (rt.pool.k, rt.pool.v)))])
        cache.store(rt, seq, p)
        rt.release(seq)
        assert cache.bytes <= cache.budget
    # the newest prompt's two blocks stay; of the older ones, the leaves went before the roots
    probe = rt.add(2 * BLOCK_TOKENS + 1)
    assert cache.load(rt, probe, prompts[2]) == 2 * BLOCK_TOKENS
    rt.truncate(probe, 0)
    assert cache.load(rt, probe, prompts[1]) == BLOCK_TOKENS  # its root, not its leaf
    rt.truncate(probe, 0)
    assert cache.load(rt, probe, prompts[0]) == 0
