"""The batched sampling path against the per-member one it replaces: `logits_to_probs_rows`
equals `logits_to_probs` of every row bit for bit, and `batch_rejection_sample` gives every
member the tokens `rejection_sample` gives it alone and leaves its generator where that leaves
it, whatever the member is batched with (so seeded requests reproduce in any batch)."""

import math
import random

import pytest
import torch

from forerun.sampling import (
    SamplingConfig,
    SamplingError,
    logits_to_probs,
    logits_to_probs_rows,
    make_generator,
    row_sums,
)
from forerun.verify import rejection_sample
from forerun.verify_batch import batch_rejection_sample

TRIALS = 300  # random batches per property
BIG_V = 40_000  # past a sum's threading threshold (32,768 elements): a lone row is split


def _old_logits_to_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """`logits_to_probs` before the batched path (its final sum a plain `.sum`): the oracle
    for 'seeded outputs do not change'. Equal to today's wherever a sum is not split across
    threads (one thread, or more than one row)."""
    if cfg.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    temperature = max(cfg.temperature, torch.finfo(logits.dtype).tiny)
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = logits.topk(cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = logits.softmax(-1)
    if cfg.top_p < 1:
        sorted_p, order = probs.sort(-1, descending=True)
        drop_sorted = sorted_p.cumsum(-1) - sorted_p >= cfg.top_p
        probs = probs.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), 0.0)
    if cfg.min_p > 0:
        probs = probs.masked_fill(probs < cfg.min_p * probs.amax(-1, keepdim=True), 0.0)
    return probs / probs.sum(-1, keepdim=True)


def _config(rng: random.Random, V: int) -> SamplingConfig:
    return SamplingConfig(
        temperature=rng.choice([0.0, 1.0, 1.0, 0.7, 1.3, 1e-3, 1e-40]),
        top_k=rng.choice([0, 0, 1, 2, 5, V - 1, V, V + 3]),
        top_p=rng.choice([1.0, 1.0, 0.9, 0.5, 1e-3]),
        min_p=rng.choice([0.0, 0.0, 0.05]))


def _logits(rng: random.Random, R: int, V: int, dtype: torch.dtype) -> torch.Tensor:
    g = make_generator(rng.randrange(2**31))
    logits = torch.randn(R, V, generator=g, dtype=dtype) * rng.choice([0.5, 3.0, 20.0])
    if rng.random() < 0.3:  # ties, as a bfloat16 head makes them
        logits = (logits * 2).round() / 2
    if rng.random() < 0.3:  # a reduced vocabulary's -inf ids
        logits[:, rng.randrange(V)] = -math.inf
    return logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rows_equal_logits_to_probs_bit_for_bit(dtype):
    rng = random.Random(0)
    for _ in range(TRIALS):
        V = rng.choice([2, 7, 50, 300])
        configs = [_config(rng, V) for _ in range(rng.randrange(1, 9))]
        logits = _logits(rng, len(configs), V, dtype)
        probs = logits_to_probs_rows(logits, configs)
        assert probs.dtype == dtype
        for row, cfg, got in zip(logits, configs, probs, strict=True):
            assert torch.equal(got, logits_to_probs(row, cfg)), cfg


def test_rows_equal_each_members_block_on_a_big_vocabulary():
    """As the step calls them: every member's block of rows alone (one row, a prefill's or a
    plain step's, included) equals its rows of the whole batch, at a vocabulary whose lone-row
    sum the threads split."""
    rng = random.Random(1)
    for _ in range(12):
        sizes = [rng.randrange(1, 4) for _ in range(rng.randrange(1, 5))]
        configs = [_config(rng, BIG_V) for _ in sizes]
        logits = _logits(rng, sum(sizes), BIG_V, torch.float32)
        probs = logits_to_probs_rows(logits, [c for c, n in zip(configs, sizes, strict=True)
                                              for _ in range(n)])
        start = 0
        for cfg, n in zip(configs, sizes, strict=True):
            block = slice(start, start + n)
            assert torch.equal(probs[block], logits_to_probs(logits[block], cfg))
            start += n


def test_logits_to_probs_is_unchanged(one_thread):
    """The per-row transform's bits are the ones before the batched path (one thread, where a
    lone row's sum was not split)."""
    rng = random.Random(2)
    for _ in range(TRIALS // 3):
        V = rng.choice([7, 300, BIG_V])
        cfg = _config(rng, V)
        logits = _logits(rng, rng.randrange(1, 4), V, torch.float32)
        assert torch.equal(logits_to_probs(logits, cfg), _old_logits_to_probs(logits, cfg))
        assert torch.equal(logits_to_probs(logits[0], cfg), _old_logits_to_probs(logits[0], cfg))


def test_row_sums_do_not_depend_on_the_rows_beside_them():
    x = torch.rand(5, BIG_V, generator=make_generator(3)).softmax(-1)
    whole = row_sums(x)  # [5, 1]
    for r in range(5):
        assert torch.equal(row_sums(x[r]), whole[r])
        assert torch.equal(row_sums(x[r:r + 1]), whole[r:r + 1])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(row_sums(x[2]), x[2].sum().reshape(1))  # serial: a plain sum
    finally:
        torch.set_num_threads(threads)


def test_rows_reject_a_wrong_number_of_configs():
    with pytest.raises(SamplingError):
        logits_to_probs_rows(torch.zeros(2, 3), [SamplingConfig()])


def _member(rng: random.Random, V: int, dtype: torch.dtype):
    """A chain to verify: K draft tokens, p [K+1, V] (of a random sampling configuration),
    q [K, V] or None, and a seed. Draft tokens come from q (or near p's top when q is None),
    so members accept, reject and take the bonus."""
    K = rng.choice([0, 0, 1, 2, 3, 5])
    cfg = _config(rng, V)
    p = logits_to_probs(_logits(rng, K + 1, V, dtype), cfg)  # [K+1, V]
    g = make_generator(rng.randrange(2**31))
    kind = rng.choice(["none", "random", "equal"])
    if kind == "none":
        q = None
        tokens = torch.tensor([int(p[i].argmax()) if rng.random() < 0.7 else rng.randrange(V)
                               for i in range(K)], dtype=torch.long)
    else:
        q = (p[:K].clone() if kind == "equal" else
             torch.rand(K, V, generator=g, dtype=dtype).softmax(-1))
        tokens = (torch.multinomial(q, 1, generator=g).flatten() if K else
                  torch.empty(0, dtype=torch.long))
    return tokens, p, q, rng.randrange(2**31)


def _together(members, generators):
    """`batch_rejection_sample` of the members packed."""
    return batch_rejection_sample([t for t, *_ in members], torch.cat([p for _, p, *_ in members]),
                                  [q for _, _, q, _ in members], generators)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batch_rejection_sample_is_each_members_rejection_sample(dtype):
    rng = random.Random(4)
    counts = {"bonus": 0, "rejected": 0}
    for _ in range(TRIALS):
        V = rng.choice([2, 7, 50])
        members = [_member(rng, V, dtype) for _ in range(rng.randrange(1, 7))]
        alone = [make_generator(seed) for *_, seed in members]
        together = [make_generator(seed) for *_, seed in members]
        got = _together(members, together)
        for (tokens, p, q, _), verdict, g_alone, g_together in zip(members, got, alone, together,
                                                                   strict=True):
            want = rejection_sample(tokens, p, q, g_alone)
            assert verdict == want
            assert torch.equal(g_alone.get_state(), g_together.get_state())  # the same draws
            counts["bonus" if want.num_accepted == len(tokens) else "rejected"] += 1
    assert min(counts.values()) > TRIALS // 10  # both ends of the chain were exercised


def test_batch_rejection_sample_on_a_big_vocabulary():
    rng = random.Random(5)
    for _ in range(8):
        members = [_member(rng, BIG_V, torch.float32) for _ in range(rng.randrange(1, 4))]
        got = _together(members, [make_generator(seed) for *_, seed in members])
        for (tokens, p, q, seed), verdict in zip(members, got, strict=True):
            assert verdict == rejection_sample(tokens, p, q, make_generator(seed))


def test_batch_rejection_sample_wants_one_generator_per_member():
    g = make_generator(0)
    p = torch.full((2, 3), 1 / 3)
    empty = torch.empty(0, dtype=torch.long)
    with pytest.raises(ValueError):
        batch_rejection_sample([empty, empty], p, [None, None], [g, g])
    assert batch_rejection_sample([], p[:0], [], []) == []
