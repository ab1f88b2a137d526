"""The batched llama.cpp runtime: a sequence's logits do not depend on the batch it shares.

Properties, on a random Q4_K/Q6_K GGUF (the K-quants of a Q4_K_M file, whose kernels forerun's
patches make row-exact) and on SmolLM2-135M (real): a member's logits are equal *to the bit*
whether it runs alone or in a batch of 8 with members of other lengths, through prefill,
verify passes of 1 or k+1 rows, rollbacks, releases and admissions, and a collection of the
cache; and they equal plain one-token decoding on the one-sequence runtime. A tree member
beside chains gives the one-sequence tree pass's logits, and `commit` leaves what `keep`
leaves. Greedy `generate_batch` on llama.cpp gives each prompt its solo plain greedy output
(methods none, ngram, draft). The pool refuses what does not fit and `release` frees it.
(On the float32 tiny GGUF of test_llama_cpp, llama.cpp's float32 matmuls round by pass shape,
~1e-6: there batching is equal only to that.)
"""

from __future__ import annotations

import pytest
import torch
from test_batch_session import drain
from tiny_files import SPECIAL, byte_tokens, random_kquant_weights, write_gguf

from forerun import Engine, SpecConfig
from forerun.models.load import open_model
from forerun.tree import TokenTree

pytest.importorskip("llama_cpp")
from forerun.runtime.batch import PackedBatch, PoolFull
from forerun.runtime.llama_batch import BatchLlamaRuntime, kv_bytes_per_token

real = pytest.mark.real
SMOL = "smollm2-135m-instruct"
DIM, LAYERS, HEADS, FFN, CONTEXT = 256, 2, 4, 512, 1024
LENGTHS = (5, 17, 9, 30, 3, 11, 22, 40)  # the 8 members' prompts
CELLS = 2048
ROUNDS = 6
MAX_FEED = 6  # the longest verify pass (k+1 rows)
GHOST_SLOTS = 20


def _kquant_model(folder, seed: int = 0):
    tokens = byte_tokens()[:-len(SPECIAL)]
    tokens = [*tokens, "ab", *[f"<x{i}>" for i in range(-(len(tokens) + 1 + len(SPECIAL)) % 32)],
              *SPECIAL]
    path = folder / f"kquant{seed}.gguf"
    write_gguf(path, random_kquant_weights(len(tokens), DIM, LAYERS, FFN, seed), tokens,
               merges=["a b"], shape=(DIM, LAYERS, HEADS, HEADS, FFN), context=CONTEXT)
    return open_model(str(path))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return _kquant_model(tmp_path_factory.mktemp("kquant"))


@pytest.fixture(scope="module")
def solo(source):
    return source.load(runtime="llama.cpp", context=CONTEXT)


def _prompt(seed: int, n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def _script(seed: int):
    """A member's passes after its prefill: (fed tokens, rows kept) per round, 1 or k+1 rows."""
    g = torch.Generator().manual_seed(100 + seed)
    steps = []
    for r in range(ROUNDS):
        t = 1 if (seed + r) % 3 == 0 else int(torch.randint(2, MAX_FEED + 1, (1,), generator=g))
        steps.append((torch.randint(0, 256, (t,), generator=g),
                      int(torch.randint(1, t + 1, (1,), generator=g))))
    return steps


def _slots(m: int) -> int:
    """The most tokens member m's cache holds: its longest pass's end."""
    length, most = LENGTHS[m], LENGTHS[m]
    for fed, kept in _script(m):
        length, most = length + kept, max(most, length + len(fed))
    return most


def _run(rt: BatchLlamaRuntime, members: list[int], ghosts: bool = False) -> dict:
    """Prefill the members together, then ROUNDS verify passes with rollbacks -> {member:
    [logits of each pass]}. `ghosts`: two more sequences share the passes, one released
    halfway (its cells become garbage) and another admitted in its place."""
    seqs = {m: rt.add(_slots(m)) for m in members}
    ghost = rt.add(GHOST_SLOTS) if ghosts else None
    feeds = [(seqs[m], _prompt(m, LENGTHS[m])) for m in members]
    logits = rt.forward(PackedBatch.of(feeds + ([(ghost, _prompt(98, 13))] if ghosts else []),
                                       last_only=True)).logits
    out = {m: [logits[b]] for b, m in enumerate(members)}
    scripts = {m: _script(m) for m in members}
    for r in range(ROUNDS):
        feeds = [(seqs[m], scripts[m][r][0]) for m in members]
        if ghosts and r == ROUNDS // 2:
            rt.release(ghost)
            ghost = rt.add(GHOST_SLOTS)
            feeds.insert(2, (ghost, _prompt(97, 9)))
        elif ghosts:
            rt.truncate(ghost, rt.length(ghost) - 1)  # one more rejected token of garbage
            feeds.insert(1, (ghost, torch.tensor([r + 1, r + 2])))
        batch = PackedBatch.of(feeds)
        bases = [rt.length(s) for s, _ in feeds]
        logits = rt.forward(batch).logits
        for b, (s, _) in enumerate(feeds):
            m = next((m for m in members if seqs[m] == s), None)
            if m is not None:
                out[m].append(logits[batch.rows_of(b)])
                rt.commit(s, bases[b], list(range(scripts[m][r][1])))
    return out


def _plain(solo, m: int) -> list[torch.Tensor]:
    """The member's passes on the one-sequence runtime, one token per llama_decode."""
    solo.truncate(0)
    prompt = _prompt(m, LENGTHS[m])
    outs = [torch.cat([solo.forward(prompt[i:i + 1]).logits for i in range(len(prompt))])[-1]]
    for fed, kept in _script(m):
        base = solo.length
        outs.append(torch.cat([solo.forward(fed[i:i + 1]).logits for i in range(len(fed))]))
        solo.truncate(base + kept)
    return outs


def test_a_members_logits_are_bit_equal_alone_in_a_batch_of_8_and_one_token_a_pass(solo):
    batched = _run(BatchLlamaRuntime(solo, CELLS), list(range(8)), ghosts=True)
    # cells for the reservations only: the garbage (rejected tokens, the released ghost) fills
    # the cache, which is collected on the way
    tight = BatchLlamaRuntime(solo, sum(map(_slots, range(8))) + GHOST_SLOTS)
    collected = _run(tight, list(range(8)), ghosts=True)
    assert tight.collections >= 1
    for m in range(8):
        alone = _run(BatchLlamaRuntime(solo, CELLS), [m])[m]
        plain = _plain(solo, m)
        assert len(batched[m]) == len(alone) == len(plain) == ROUNDS + 1
        for a, b, p, c in zip(batched[m], alone, plain, collected[m], strict=True):
            assert torch.equal(a, b) and torch.equal(a, p) and torch.equal(a, c), m


def test_a_tree_member_beside_chains_equals_the_one_sequence_tree_pass(source, solo):
    rt = BatchLlamaRuntime(solo, CELLS)
    tree = TokenTree.of(torch.tensor([-1, -1, 0, 0, 2]), 5)  # two roots, node 2 under 0
    feed = torch.cat([torch.tensor([1]), torch.tensor([11, 12, 13, 14, 15])])  # [6]
    p_tree, p_chain = _prompt(3, 12), _prompt(4, 7)
    s_chain, s_tree = rt.add(64), rt.add(64)
    rt.forward(PackedBatch.of([(s_chain, p_chain), (s_tree, p_tree)], last_only=True))
    out = rt.forward(PackedBatch.of([(s_chain, torch.tensor([2, 3])), (s_tree, feed)],
                                    positions=[None, tree.positions(0)],
                                    tree_masks=[None, tree.mask()])).logits
    solo.truncate(0)
    solo.forward(p_tree, last_only=True)
    base = solo.length
    want = solo.forward(feed, positions=tree.positions(base), tree_mask=tree.mask()).logits
    assert torch.equal(out[2:], want)
    rows = [0, 1, 3, 5]  # the pending token, node 0, node 2, node 4: leaf 0 skips rows
    rt.commit(s_tree, len(p_tree), rows)
    rt.commit(s_chain, len(p_chain), [0])
    solo.keep(base, rows)
    after = rt.forward(PackedBatch.of([(s_chain, torch.tensor([5])),
                                       (s_tree, torch.tensor([9, 10]))])).logits
    assert torch.equal(after[1:], solo.forward(torch.tensor([9, 10])).logits)
    assert rt.length(s_tree) == solo.length and rt.length(s_chain) == len(p_chain) + 2
    with pytest.raises(ValueError, match="ancestor mask"):
        rt.forward(PackedBatch.of([(s_tree, torch.tensor([1, 2]))],
                                  tree_masks=[torch.ones(2, 2, dtype=torch.bool)]))


def test_the_pool_is_a_token_budget_that_refuses_and_frees(solo):
    rt = BatchLlamaRuntime(solo, 100, max_seqs=3)
    a, b = rt.add(60), rt.add(40)
    with pytest.raises(PoolFull, match="no room"):
        rt.add(1)
    rt.forward(PackedBatch.of([(a, _prompt(0, 10)), (b, _prompt(1, 5))], last_only=True))
    assert (rt.length(a), rt.reserved(a), rt.length(b)) == (10, 60, 5)
    assert rt.kv_peak_bytes() == 100 * kv_bytes_per_token(solo)
    rt.release(a)
    c = rt.add(60)  # a's reservation is free again, its cells garbage
    assert rt.length(c) == 0
    one = BatchLlamaRuntime(solo, 100, max_seqs=1)
    one.add(1)
    with pytest.raises(PoolFull, match="0 sequence ids free"):
        one.add(1)
    with pytest.raises(ValueError, match="reserved slots"):
        rt.forward(PackedBatch.of([(b, _prompt(2, 36))]))
    with pytest.raises(ValueError, match="exceeds the context"):
        rt.add(10_000)
    with pytest.raises(NotImplementedError, match="hidden"):
        rt.forward(PackedBatch.of([(b, _prompt(2, 1))]), hidden_layers=(-1,))
    assert rt.length(b) == 5  # failed calls change nothing
    assert rt.capabilities.hidden_costs_logits and not rt.capabilities.hidden_layers


def _greedy_batch_equals_solo(engine, prompts, max_tokens, methods, budget=1 << 22, **kw):
    solo = [engine.generate(p, max_tokens=max_tokens, spec=SpecConfig("none"), **kw).token_ids
            for p in prompts]
    for method in methods:
        spec = SpecConfig(method, 3)
        got = engine.generate_batch(prompts, max_tokens=max_tokens, spec=spec,
                                    kv_budget_bytes=budget, **kw)
        assert [c.token_ids for c in got] == solo, method
        assert method == "none" or sum(c.stats.drafted for c in got) > 0, method
    return solo


@pytest.mark.parametrize("draft_seed", [0, 1])  # the target itself (all accepted); another
def test_greedy_generate_batch_on_llama_cpp_equals_solo_plain(source, solo, tmp_path,
                                                              draft_seed):
    draft = (source if draft_seed == 0 else _kquant_model(tmp_path, draft_seed)).load(
        runtime="llama.cpp", context=CONTEXT)
    engine = Engine.from_runtimes(solo, source.tokenizer, draft)
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3], [10, 20, 30, 40, 50, 60], [7, 7, 8],
               [5, 4, 3, 2, 1, 5, 4, 3, 2, 1, 5, 4], [33] * 9]
    out = _greedy_batch_equals_solo(engine, prompts, 24, ("none", "ngram", "draft"))
    assert all(len(t) for t in out)


def test_grow_reserves_more_cells_or_refuses(solo):
    rt = BatchLlamaRuntime(solo, 100, max_seqs=3)
    a, b = rt.add(30), rt.add(30)
    rt.grow(a, 60)
    assert rt.reserved(a) == 60 and rt.kv_bytes() == 90 * kv_bytes_per_token(solo)
    with pytest.raises(PoolFull, match="no room to grow"):
        rt.grow(b, 41)
    rt.grow(b, 20)  # never shrinks
    assert rt.reserved(b) == 30 and rt.capabilities.kv_grow and rt.capabilities.kv_copy
    rt.release(a)
    rt.grow(b, 70)
    assert rt.kv_bytes() == 70 * kv_bytes_per_token(solo)


@pytest.mark.parametrize("method", ["none", "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_lazy_llama_cpp_batches_preempt_and_every_output_stays(source, solo, method,
                                                               temperature, monkeypatch):
    """Reservations that start at the prompt and grow overcommit the context's cells: the
    youngest member is preempted and recomputed, and every member gets exactly what it gets
    where the cells hold everyone's worst case (greedy and seeded sampling)."""
    from forerun.batch_session import BatchSession
    from forerun.sampling import SamplingConfig

    monkeypatch.setattr("forerun.batch_session.GROW_TOKENS", 4)
    engine = Engine.from_runtimes(solo, source.tokenizer)
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3], [10, 20, 30, 40, 50, 60], [7, 7, 8, 9],
               [5, 4, 3, 2, 1, 5, 4, 3, 2], [33] * 9]
    budgets = [40, 36, 44, 30, 40]
    per_token = kv_bytes_per_token(solo)

    def run(cells: int, lazy: bool):
        session = BatchSession(engine, cells * per_token, lazy=lazy, max_batch_tokens=16)
        return drain(session, [session.sequence(p, SamplingConfig(temperature=temperature,
                                                                  seed=i), n, SpecConfig(method, 3))
                               for i, (p, n) in enumerate(zip(prompts, budgets, strict=True))])

    roomy, _ = run(4096, lazy=False)
    tight, session = run(150, lazy=True)  # ~2.5 members' worst case
    assert session.lazy and session.preempted > 0
    assert tight == roomy


@pytest.mark.parametrize("method", ["none", "ngram"])
@pytest.mark.parametrize("chunk", [None, 8])
def test_llama_cpp_prefix_cache_feeds_a_repeated_prefix_once_and_outputs_stay(source, solo,
                                                                              method, chunk):
    """Saved cells restored into a later member equal, to the bit, what its prefill would
    write: its tokens (greedy and seeded sampling) are those of the same prompt without the
    cache, and only the prompt's tail is fed."""
    from forerun.batch_session import BatchSession
    from forerun.prefix_cache import BLOCK_TOKENS
    from forerun.sampling import SamplingConfig

    engine = Engine.from_runtimes(solo, source.tokenizer)
    system = [(i * 11) % 47 + 2 for i in range(3 * BLOCK_TOKENS + 5)]
    prompts = [[*system, 3, 4, 5], [*system, 9, 8, 7, 6], [*system, 9, 8, 7, 6]]
    budget = 4096 * kv_bytes_per_token(solo)

    def run(prefix_bytes: int):
        session = BatchSession(engine, budget, max_batch_tokens=chunk,
                               prefix_cache_bytes=prefix_bytes)
        out, fed, rows, forward = [], [], [], session.target.forward

        def counted(batch, *args, **kw):
            rows.append(len(batch.tokens))
            return forward(batch, *args, **kw)

        session.target.forward = counted
        for i, p in enumerate(prompts):
            rows.clear()
            seq = session.sequence(p, SamplingConfig(temperature=0.8 * (i == 2), seed=i), 12,
                                   SpecConfig(method, 3))
            session.add(seq)
            while not seq.steps:
                session.step()
            fed.append(sum(rows))
            while not session.idle:
                session.step()
            assert seq.error is None, seq.error
            out.append([t for st in seq.steps for t in st.tokens])
        return out, fed, session

    plain, _, _ = run(0)
    cached, fed, session = run(budget)
    assert cached == plain
    assert session.prefix is not None and session.prefix.hits == 2 * 3 * BLOCK_TOKENS
    assert fed[0] == len(prompts[0]) and fed[1] == fed[2] == len(prompts[1]) - 3 * BLOCK_TOKENS


def test_saved_cells_restore_to_the_same_logits(solo):
    rt = BatchLlamaRuntime(solo, 512, max_seqs=3)
    prompt = _prompt(3, 40)
    a = rt.add(60)
    rt.forward(PackedBatch.of([(a, prompt)], last_only=True))
    blocks = [rt.read_kv(a, 0, 16), rt.read_kv(a, 16, 32)]
    b = rt.add(60)
    rt.write_kv(b, blocks)
    assert rt.length(b) == 32 and blocks[0].nbytes > 0
    fed = rt.forward(PackedBatch.of([(b, prompt[32:])], last_only=True)).logits
    c = rt.add(60)
    fresh = rt.forward(PackedBatch.of([(c, prompt)], last_only=True)).logits
    assert torch.equal(fed, fresh)
    with pytest.raises(ValueError, match="empty member"):
        rt.write_kv(b, blocks)


@real
def test_greedy_generate_batch_on_smollm2_llama_cpp_equals_solo_plain():
    smol = open_model(SMOL)
    target = smol.load(runtime="llama.cpp", context=512)
    engine = Engine.from_runtimes(target, smol.tokenizer, smol.load(runtime="llama.cpp",
                                                                     context=512))
    prompts = ["Write a Python function that checks whether a string is a palindrome.",
               "Name three primes.", "What is the capital of France? Answer in one word.",
               "class Stack:\n    def __init__(self):\n        self.items = []\n"]
    _greedy_batch_equals_solo(engine, prompts, 32, ("none", "ngram", "draft"))


@real
def test_a_long_prompt_decodes_alike_alone_and_in_a_batch_on_smollm2():
    """A prompt over llama.cpp's 64-row flash-attention tile: fed whole in one call its KV
    rounds unlike the batched runtime's 48-row calls, and the two decodings parted on long
    Spec-Bench prompts (the 1.5B target: 8 of 32 by 64 tokens). Both prefill in EXACT_ROWS."""
    smol = open_model(SMOL)
    target = smol.load(runtime="llama.cpp", context=1024)
    engine = Engine.from_runtimes(target, smol.tokenizer)
    story = " ".join(f"Step {i}: the robot moved the red block onto the blue one."
                     for i in range(20))
    prompts = [f"Summarise this log in one sentence.\n{story}", "Name three primes.",
               f"{story}\nWhat did the robot move last?"]
    assert min(len(smol.tokenizer.encode_prompt(p)) for p in prompts[::2]) > 200
    prefill = target.forward(torch.tensor(smol.tokenizer.encode_prompt(prompts[0])),
                             last_only=True).logits
    target.truncate(0)
    rt = BatchLlamaRuntime(target, 4096)
    ids = torch.tensor(smol.tokenizer.encode_prompt(prompts[0]))
    h = rt.add(len(ids))
    assert torch.equal(rt.forward(PackedBatch.of([(h, ids)], last_only=True)).logits, prefill)
    _greedy_batch_equals_solo(engine, prompts, 24, ("none",), budget=1 << 25)


@real
def test_smollm2_rows_stay_bit_equal_after_a_neighbour_rolls_back():
    """A neighbour's rejected tokens free no cells (they become garbage), so llama.cpp never puts
    a member's next tokens before its earlier ones; freed and reused, this pass's logits moved
    by ~0.97 here (the flash attention sums a sequence's cells in cell order)."""
    smol = open_model(SMOL)
    solo = smol.load(runtime="llama.cpp", context=512)
    rt = BatchLlamaRuntime(solo, 2048)
    ids = [torch.randint(0, 40_000, (n,), generator=torch.Generator().manual_seed(s))
           for s, n in ((1, 40), (2, 40), (3, 30))]
    a, b = rt.add(100), rt.add(100)
    rt.forward(PackedBatch.of([(a, ids[0]), (b, ids[1])]))
    rt.truncate(a, 5)
    got = rt.forward(PackedBatch.of([(b, ids[2]), (a, ids[2][:3])])).logits[:30]
    solo.truncate(0)
    want = torch.cat([solo.forward(t.view(1)).logits for t in torch.cat(ids[1:])])[40:]
    assert torch.equal(got, want)
