"""Tree verification on the llama.cpp runtime (one llama.cpp sequence per leaf): each row of a tree
pass equals the chain forward of its root-to-node path, keep() of a path leaves the cache a chain
decode of that path would, and the limits (leaves, masks, positions) fail clearly.

Tolerances. The tiny GGUF has float32 weights, so llama.cpp quantizes nothing; what can differ is
summation order (logits here have std ~1; argmax equality is checked too, the seeded data has no
near-tie). A small tree row's keys sit in the same relative cell order as its chain's, and the
rows matched to the bit where this was written (1e-6 between batch shapes): TREE_ATOL. One
effect needs more, LOOSE_ATOL (~3x the largest difference seen):
- a pass of 65 rows or more takes other kernels: the first row of a 65-token *chain* differs from
  a 1-token pass by ~7e-3, and the widest tree allowed (65 rows) by as much.
"""

import pytest
import torch
from tiny_files import CTX, SPECIAL, byte_tokens, random_hf_weights, write_gguf

from forerun.models.load import open_model
from forerun.tree import TokenTree

pytest.importorskip("llama_cpp")
from forerun.runtime.llama_cpp import MAX_TREE_LEAVES, LlamaCppRuntime

TREE_ATOL = 1e-4
LOOSE_ATOL = 2e-2
PARENTS = (-1, -1, 0, 0, 2)  # forerun/tree.py's drawing: leaves n1, n3, n4 (rows 2, 4, 5)
TREE = TokenTree(PARENTS)
PROMPT_LEN = 20
NEAR_TIE = 0.02  # log-probability gap under which two runtimes' head choices may differ
PATHS = [[0], [0, 2], [0, 1], [0, 1, 3, 5], [0, 1, 4]]  # rows: root, leaf 0's path, inner, leaves


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    tokens = [*byte_tokens()[:-len(SPECIAL)], "ab", *SPECIAL]  # llama.cpp needs a merge
    path = tmp_path_factory.mktemp("tree") / "tiny.gguf"
    write_gguf(path, random_hf_weights(len(tokens)), tokens, merges=["a b"])
    return open_model(str(path))


@pytest.fixture(scope="module")
def rt(source):
    return source.load(runtime="llama.cpp", context=CTX)


@pytest.fixture(scope="module")
def ref(source):
    """A second runtime for the chain forwards the tree passes are compared with."""
    return source.load(runtime="llama.cpp", context=CTX)


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (PROMPT_LEN,), generator=g)
    feed = torch.randint(0, 256, (len(TREE) + 1,), generator=g)  # [N+1]: the root, then nodes
    return prompt, feed


def rows_to(row: int) -> list[int]:
    """Rows of the root-to-node path ending at `row` (row 0 = the root)."""
    return [0, *(i + 1 for i in TREE.path(row - 1))]


def tree_pass(rt, prompt, feed, tree=TREE, **kw):
    rt.truncate(0)
    rt.forward(prompt)
    return rt.forward(feed, positions=tree.positions(len(prompt)), tree_mask=tree.mask(), **kw)


def chain_last(ref, ids: torch.Tensor, **kw):
    ref.truncate(0)
    return ref.forward(ids, **kw)


def close(a, b, atol):
    return torch.allclose(a, b, atol=atol, rtol=0) and torch.equal(a.argmax(-1), b.argmax(-1))


def test_each_tree_row_equals_the_chain_of_its_path(rt, ref, data):
    prompt, feed = data
    out = tree_pass(rt, prompt, feed, hidden_layers=(-1,))
    assert out.logits.shape == (len(feed), rt.config.vocab_size)
    assert out.hidden[-1].shape == (len(feed), rt.config.dim)
    assert rt.length == PROMPT_LEN + len(feed)
    for row in range(len(feed)):
        want = chain_last(ref, torch.cat([prompt, feed[rows_to(row)]]), hidden_layers=(-1,))
        assert close(out.logits[row], want.logits[-1], TREE_ATOL), row
        assert torch.allclose(out.hidden[-1][row], want.hidden[-1][-1], atol=TREE_ATOL), row
    rt.truncate(PROMPT_LEN)


def test_a_one_branch_tree_is_the_chain_forward(rt, data):
    prompt, feed = data
    chain = TokenTree.chain(len(feed) - 1)
    as_tree = tree_pass(rt, prompt, feed, tree=chain).logits
    assert rt.length == PROMPT_LEN + len(feed)
    rt.forward(feed[:1])  # a chain leaves nothing to resolve
    rt.truncate(PROMPT_LEN)
    assert torch.equal(as_tree, rt.forward(feed).logits)
    rt.truncate(PROMPT_LEN)


@pytest.mark.parametrize("rows", PATHS)
def test_keep_leaves_the_cache_of_a_chain_decode_of_the_path(rt, ref, data, rows):
    prompt, feed = data
    nxt = torch.tensor([42])
    tree_pass(rt, prompt, feed)
    rt.keep(PROMPT_LEN, rows)
    assert rt.length == PROMPT_LEN + len(rows)
    got = rt.forward(nxt).logits[-1]
    chain_last(ref, prompt)
    ref.forward(feed[rows])
    want = ref.forward(nxt).logits[-1]
    assert close(got, want, TREE_ATOL)


def test_after_keep_the_cell_layout_is_plain_decoding_s(rt, data):
    """The same path kept from two trees, one with a dropped branch between its rows (holes
    between the path's cells) and one with the dropped branch after them: the passes that
    follow give the same logits to the bit (keep() compacts the cells; without it the next
    tokens land in the holes and flash attention's half-precision sums in cell order move
    them by ~1e-3 here)."""
    prompt, feed = data
    pending, a, b, x, y = (int(t) for t in feed[:5])
    after = feed[5:]  # one token at a time

    def decode(nodes, parents, rows):
        rt.truncate(0)
        rt.forward(prompt)
        tree = TokenTree(parents)
        rt.forward(torch.tensor([pending, *nodes]), positions=tree.positions(PROMPT_LEN),
                   tree_mask=tree.mask())
        rt.keep(PROMPT_LEN, rows)
        return [rt.forward(after[i:i + 1]).logits[-1] for i in range(len(after))]

    holes = decode([a, x, b, y], (-1, -1, 0, 1), [0, 1, 3])  # path a, b: nodes 0 and 2
    ordered = decode([a, b, x, y], (-1, 0, -1, 2), [0, 1, 2])  # path a, b: nodes 0 and 1
    assert all(torch.equal(h, o) for h, o in zip(holes, ordered, strict=True))


def test_truncate_into_and_before_a_tree_pass(rt, ref, data):
    prompt, feed = data
    nxt = torch.tensor([42])
    tree_pass(rt, prompt, feed)
    rt.truncate(PROMPT_LEN + 2)  # rows 0, 1 are a path: keep(start, [0, 1])
    got = rt.forward(nxt).logits[-1]
    want = chain_last(ref, torch.cat([prompt, feed[:2], nxt])).logits[-1]
    assert close(got, want, LOOSE_ATOL)
    tree_pass(rt, prompt, feed)
    with pytest.raises(ValueError, match="root-to-node path"):
        rt.truncate(PROMPT_LEN + 3)  # rows 0, 1, 2: siblings 1 and 2 are no path
    rt.truncate(PROMPT_LEN)  # the whole pass goes
    assert close(rt.forward(nxt).logits[-1],
                 chain_last(ref, torch.cat([prompt, nxt])).logits[-1], TREE_ATOL)


def test_a_tree_pass_must_be_resolved_and_rows_must_be_a_path(rt, data):
    prompt, feed = data
    tree_pass(rt, prompt, feed)
    with pytest.raises(ValueError, match="unresolved"):
        rt.forward(feed[:1])
    for rows in ([1], [0, 2, 4], [0, 3], [0, 9]):  # no root; not a path; skips a depth; no row
        with pytest.raises(ValueError, match="root-to-node path"):
            rt.keep(PROMPT_LEN, rows)
    with pytest.raises(ValueError, match="root-to-node path"):
        rt.keep(PROMPT_LEN - 1, [0])
    assert rt.length == PROMPT_LEN + len(feed)  # failed calls change nothing
    rt.keep(PROMPT_LEN, [0, 1, 3])
    assert rt.length == PROMPT_LEN + 3


def test_keep_after_a_chain_pass_is_truncate(rt, data):
    prompt, feed = data
    nxt = torch.tensor([42])
    rt.truncate(0)
    rt.forward(prompt)
    rt.forward(feed)
    rt.keep(PROMPT_LEN, [0, 1, 2])
    assert rt.length == PROMPT_LEN + 3
    kept = rt.forward(nxt).logits
    rt.truncate(PROMPT_LEN + 3)
    assert torch.equal(kept, rt.forward(nxt).logits)
    with pytest.raises(ValueError, match=r"only rows 0\.\.n-1"):
        rt.keep(PROMPT_LEN, [0, 2])
    with pytest.raises(ValueError, match=r"only rows 0\.\.n-1"):
        rt.keep(PROMPT_LEN, list(range(10)))  # past the cache


def test_freed_branches_do_not_fill_the_cache(rt, data):
    """Each pass writes len(feed) cells; were the dropped branches not freed, a few dozen passes
    would overflow the KV cache (CTX cells, padded by llama.cpp to at most a few hundred)."""
    prompt, feed = data
    rt.truncate(0)
    rt.forward(prompt)
    for _ in range(200):
        rt.forward(feed, positions=TREE.positions(PROMPT_LEN), tree_mask=TREE.mask())
        rt.keep(PROMPT_LEN, [0, 1, 4])
        rt.truncate(PROMPT_LEN)
    assert rt.length == PROMPT_LEN


def test_the_leaf_limit_holds_and_the_runtime_still_works(rt, ref, data):
    prompt = data[0]
    nxt = torch.tensor([42])
    widest = TokenTree((-1,) * MAX_TREE_LEAVES)  # the root and MAX_TREE_LEAVES children
    ids = torch.arange(len(widest) + 1) % 256
    out = tree_pass(rt, prompt, ids, tree=widest).logits
    last = chain_last(ref, torch.cat([prompt, ids[[0, -1]]])).logits[-1]
    assert close(out[-1], last, LOOSE_ATOL)
    rt.truncate(PROMPT_LEN)
    too_wide = TokenTree((-1,) * (MAX_TREE_LEAVES + 1))
    ids = torch.arange(len(too_wide) + 1) % 256
    with pytest.raises(ValueError, match=f"at most {MAX_TREE_LEAVES} leaves"):
        rt.forward(ids, positions=too_wide.positions(PROMPT_LEN), tree_mask=too_wide.mask())
    assert rt.length == PROMPT_LEN
    got = rt.forward(nxt).logits[-1]
    assert close(got, chain_last(ref, torch.cat([prompt, nxt])).logits[-1], TREE_ATOL)


def test_bad_masks_and_positions_fail_clearly(rt, data):
    prompt, feed = data
    rt.truncate(0)
    rt.forward(prompt)
    T = len(feed)
    good = TREE.positions(PROMPT_LEN)
    not_tree = TREE.mask().clone()
    not_tree[5, 2] = True  # row 5 would see rows 2 and 3, which are siblings
    for mask in (torch.ones(T, T, dtype=torch.bool), not_tree,
                 TREE.mask() & ~torch.eye(T, dtype=torch.bool)):
        with pytest.raises(ValueError, match="ancestor mask"):
            rt.forward(feed, positions=good, tree_mask=mask)
    with pytest.raises(ValueError, match="for 6 tokens"):
        rt.forward(feed, positions=good, tree_mask=TREE.mask()[:5, :5])
    with pytest.raises(NotImplementedError, match="start \\+ its depth"):
        rt.forward(feed, tree_mask=TREE.mask())  # default positions: the slots, not depths
    with pytest.raises(NotImplementedError, match="start \\+ its depth"):
        rt.forward(feed, positions=good)  # tree positions without the tree
    assert rt.length == PROMPT_LEN


def test_a_tree_longer_than_the_batch_is_chunked(source, rt, data):
    prompt, feed = data
    small = LlamaCppRuntime(source.path, source.config, CTX, batch=4)
    chunked = tree_pass(small, prompt, feed).logits  # rows 0-3, then 4-5
    whole = tree_pass(rt, prompt, feed).logits
    assert close(chunked, whole, TREE_ATOL)
    rt.truncate(PROMPT_LEN)


def test_forks_do_tree_passes_of_their_own(rt, ref, data):
    prompt, feed = data
    nxt = torch.tensor([42])
    first, second = rt.fork(), rt.fork()
    other = prompt.flip(0)
    first.forward(prompt)
    second.forward(other)
    a = first.forward(feed, positions=TREE.positions(PROMPT_LEN), tree_mask=TREE.mask()).logits
    b = second.forward(feed, positions=TREE.positions(PROMPT_LEN), tree_mask=TREE.mask()).logits
    first.keep(PROMPT_LEN, [0, 1, 3, 5])
    second.keep(PROMPT_LEN, [0, 2])
    a_next, b_next = first.forward(nxt).logits[-1], second.forward(nxt).logits[-1]
    for ctx, out, rows, after in ((prompt, a, [0, 1, 3, 5], a_next), (other, b, [0, 2], b_next)):
        assert close(out[rows[-1]], chain_last(ref, torch.cat([ctx, feed[rows]])).logits[-1],
                     TREE_ATOL)
        assert close(after, chain_last(ref, torch.cat([ctx, feed[rows], nxt])).logits[-1],
                     TREE_ATOL)
    assert first.length == PROMPT_LEN + 5 and second.length == PROMPT_LEN + 3


# --- heads on llama.cpp: the features they draft from -------------------------------------

def test_prefill_returns_every_row_s_hidden_state(rt, data):
    """The Runtime contract: hidden states of every row, even under last_only (an EAGLE head
    fills its cache from the whole prompt's features)."""
    prompt, _ = data
    rt.truncate(0)
    last = rt.forward(prompt, last_only=True, hidden_layers=(-1,))
    rt.truncate(0)
    every = rt.forward(prompt, hidden_layers=(-1,))
    assert last.logits.shape[0] == 1 and last.hidden[-1].shape == (PROMPT_LEN, rt.dim)
    assert torch.allclose(last.hidden[-1], every.hidden[-1], atol=TREE_ATOL, rtol=0)
    rt.truncate(0)


@pytest.mark.parametrize(("kind", "tree", "prompt_features"), [
    ("medusa", 0, True), ("hydra", 5, True), ("eagle", 0, True), ("eagle", 0, False)])
def test_heads_draft_on_llama_cpp_what_they_draft_on_torch(source, rt, data, kind, tree,
                                                           prompt_features, monkeypatch):
    """Same float32 weights, same random head: every step's draft is the same on both runtimes
    (so the features line up with the tokens, with or without the prompt's), and both outputs
    are plain greedy's. The two runtimes' features differ by up to ~3e-3 from the prompt's
    rows on, and a random head's choices can nearly tie: the drafts may part only where the
    head's two best log-probabilities on llama.cpp were within NEAR_TIE, after 10 equal
    steps. (Traced: an EAGLE tree, step 10 of 22 kept node 126 (-3.977) over 66 (-3.982) on
    torch and the other way round on llama.cpp (-3.969 vs -3.975); an EAGLE chain with a
    16-token window, step 14's second token 136 (-1.9440) over 106 (-1.9511) on torch, 106
    (-1.9476) over 136 (-1.9489) on llama.cpp: numerics, not a defect.)"""
    from conftest import random_heads

    import forerun.propose.heads as head_module
    from forerun.engine import speculative_decode
    from forerun.policy import FixedK
    from forerun.propose import HEAD_PROPOSERS
    from forerun.reference import plain_decode
    from forerun.sampling import SamplingConfig, make_generator

    margins: list[float] = []  # the current step's top-2 log-probability gap at each level
    growing = head_module.growing

    def gaps(lp: torch.Tensor) -> torch.Tensor:
        top = lp.topk(2, dim=-1).values  # [..., 2]
        margins.append(float((top[..., 0] - top[..., 1]).min()))
        return lp

    def measured(root, **kw):  # `growing`, each level's log-probabilities measured
        grow = growing(gaps(root), **kw)
        try:
            asked = next(grow)
            while True:
                asked = grow.send(gaps((yield asked)))
        except StopIteration as done:
            return done.value

    monkeypatch.setattr(head_module, "growing", measured)

    greedy, prompt = SamplingConfig(temperature=0), data[0].tolist()
    reference = source.load(dtype="float32", context=CTX)
    heads = random_heads(kind, reference)
    plain = [t for s in plain_decode(reference, prompt, greedy, 24, (), make_generator(0))
             for t in s.tokens]
    runs = []
    for target in (reference, rt):
        proposer = HEAD_PROPOSERS[kind](heads, CTX, tree, 2, None, prompt_features)
        drafts, least = [], []  # each step's draft, its smallest top-2 gap

        def recorded(*args, propose=proposer.propose, drafts=drafts, least=least):
            margins.clear()
            drafts.append(propose(*args))
            least.append(min(margins, default=float("inf")))
            return drafts[-1]

        proposer.propose = recorded
        out = [t for s in speculative_decode(target, proposer, FixedK(3), prompt, greedy, 24, (),
                                              make_generator(0)) for t in s.tokens]
        runs.append((out, [d.tokens.tolist() for d in drafts], least))
    rt.truncate(0)
    assert runs[0][0] == runs[1][0] == plain
    (_, torch_drafts, _), (_, llama_drafts, llama_margins) = runs
    assert any(torch_drafts)
    parted = next((i for i, (a, b) in enumerate(zip(torch_drafts, llama_drafts, strict=False))
                   if a != b), None)
    if parted is not None:  # only at a near-tie, and not early
        assert parted >= 10 and llama_margins[parted] < NEAR_TIE, (parted, llama_margins[parted])
    else:
        assert torch_drafts == llama_drafts


@pytest.mark.parametrize("batch", [None, 8])
def test_prefill_hidden_states_cost_no_logits_and_change_none(source, rt, data, batch):
    """With forerun's patch (patches/*-hidden.patch) a last_only prefill reads every row's
    hidden state without computing their logits: the last row's logits are those of the same
    prefill without hidden states, to the bit, and the states those of an every-row pass; in
    one llama_decode and in chunks (batch 8 < the 20-token prompt)."""
    if rt.hidden_rows_cost_logits:
        pytest.skip("llama-cpp-python built without forerun's -hidden patch")
    if batch:
        rt = LlamaCppRuntime(source.path, rt.config, rt.capacity, batch=batch)
    prompt, _ = data
    rt.truncate(0)
    plain = rt.forward(prompt, last_only=True)
    rt.truncate(0)
    last = rt.forward(prompt, last_only=True, hidden_layers=(-1,))
    rt.truncate(0)
    every = rt.forward(prompt, hidden_layers=(-1,))
    rt.truncate(0)
    assert last.hidden[-1].shape == (PROMPT_LEN, rt.dim)
    assert torch.equal(last.logits, plain.logits)
    assert torch.allclose(last.hidden[-1], every.hidden[-1], atol=TREE_ATOL, rtol=0)
    # a head that reads the last rows only: chunks before them compute no hidden rows, nor
    # (the patch's forerun_hidden_rows_from) the rows before it in its own chunk, whose last
    # layer's FFN then runs over fewer rows: the same states up to the kernels' rounding
    for hidden_from in (0, 5, PROMPT_LEN - 3, PROMPT_LEN - 1, PROMPT_LEN):
        rt.truncate(0)
        tail = rt.forward(prompt, last_only=True, hidden_layers=(-1,), hidden_from=hidden_from)
        assert torch.equal(tail.logits, plain.logits)
        assert tail.hidden[-1].shape == (PROMPT_LEN - hidden_from, rt.dim)
        assert torch.allclose(tail.hidden[-1], last.hidden[-1][hidden_from:], atol=TREE_ATOL,
                              rtol=0)
    rt.truncate(0)


def test_heads_read_the_prompt_features_where_they_cost_no_logits(rt, monkeypatch):
    """The factory's heads read the prompt's features on torch and on a patched llama.cpp;
    where each hidden row would cost an LM-head row (llama.cpp without the patch) they skip
    them, and the prefill stays plain's one pass."""
    from dataclasses import replace

    from conftest import random_heads, tiny_runtime

    from forerun.propose import PROPOSERS, ProposerContext, SpecConfig

    for kind in ("medusa", "eagle"):
        heads, spec = random_heads(kind, tiny_runtime(0)), SpecConfig(kind, 3)
        torch_ctx = ProposerContext(tiny_runtime(0), heads=heads)
        ctx = ProposerContext(rt, heads=heads)
        assert PROPOSERS[kind](spec, torch_ctx).needs.prompt_features is True
        assert PROPOSERS[kind](spec, ctx).needs.prompt_features is (
            not rt.capabilities.hidden_costs_logits)
        with monkeypatch.context() as m:
            m.setattr(rt, "capabilities", replace(rt.capabilities, hidden_costs_logits=True))
            assert PROPOSERS[kind](spec, ctx).needs.prompt_features is False


def test_train_collects_features_on_llama_cpp(source, tmp_path):
    """`forerun train --runtime llama.cpp`: the shards hold llama.cpp's features and
    distributions (on float32 weights, torch's up to summation order), the heads then draft on
    llama.cpp with unchanged output; EAGLE-3's middle layers are refused clearly."""
    import json
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    from forerun.train import teacher

    env = {**os.environ, "FORERUN_HOME": str(tmp_path / "home")}
    base = [sys.executable, "-m", "forerun.cli"]
    common = ["--target", source.path.as_posix(), "--runtime", "llama.cpp"]
    shape = ["--max-tokens", "64", "--seq-len", "32", "--chat", "1", "--chat-tokens", "8",
             "--steps", "3", "--head-vocab", "0", "--ffn-dim", "32", "--json"]
    r = subprocess.run([*base, "train", "eagle", *common, *shape], capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout.splitlines()[-1])
    data = tmp_path / "home" / "train-data" / "tiny-llama.cpp-L-1-T32-C1x8"
    shards = sorted(data.glob("window-*.safetensors"))
    assert report["data_tokens"] == 64 and len(shards) == 2
    assert report["out"] == str(tmp_path / "home" / "heads" / "tiny" / "eagle-llamacpp")
    torch_rt = source.load(dtype="float32", context=CTX)
    for path in shards:
        shard = load_file(str(path))
        again = teacher(torch_rt, shard["tokens"].tolist(), (-1,))
        assert torch.equal(shard["top_ids"][:, 0], again["top_ids"][:, 0])
        assert torch.allclose(shard["h-1"].float(), again["h-1"].float(), atol=2e-2, rtol=0)
    r = subprocess.run([*base, "generate", *common, "--heads", report["out"], "--method",
                        "eagle", "--max-tokens", "12", "--raw", "--compare", "--json", "hello"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["identical"] is True
    r = subprocess.run([*base, "train", "eagle3", *common, *shape], capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 2 and "only the torch runtime" in r.stderr
