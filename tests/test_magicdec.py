"""The magicdec method (MagicDec): drafts from a sparse KV cache (sinks + a recent window).

Properties: greedy speculative output equals plain greedy output for several k, with the draft
model and with the target itself as the drafter, on contexts several times longer than sinks +
window (so the cache evicts, and prompts run in chunks); sampled output has the target's exact
joint (chi-square, exact enumeration); every draft query attends to the sinks and its window
and nothing else, and the cache holds a fixed number of positions; a draft step attends to the
same number of positions at any context (counted, not timed); with a window as long as the
context it drafts what the full-cache draft model drafts, token for token and q to the bit;
`forerun check` passes it; the self drafter runs in a batch (over the target's own pool:
test_magicdec_self_batch); a llama.cpp drafter and bad options fail clearly.

Statistical checks: 2 (the exact joint, one per drafter) + 1 (forerun check's sampling test)
at ALPHA = 1e-4 each: the file fails by chance with probability below 3e-4 (seeds pinned).
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from conftest import tiny_runtime
from exact import RuntimeTable, chi_square_pvalue, target_joint
from test_engine import plain, word_tokenizer

from forerun import Engine
from forerun.check import PASS as CHECK_PASS
from forerun.check import check
from forerun.engine import speculative_decode
from forerun.policy import FixedK
from forerun.propose import PROPOSERS, ProposerContext, SpecConfig
from forerun.propose.draft_model import DraftModelProposer
from forerun.propose.magicdec import MagicDecConfig, MagicDecProposer
from forerun.runtime.streaming import StreamingRuntime
from forerun.sampling import SamplingConfig, logits_to_probs, make_generator

pytestmark = pytest.mark.usefixtures("one_thread")
SINKS, WINDOW, PASS, ROLL = 2, 6, 8, 8  # a small view: contexts of 60+ tokens evict
LONG_PROMPT = [(7 * i + 3) % 61 + 1 for i in range(60)]  # 60 tokens, longer than sinks + window
MAX_NEW = 40


def drafter(kind: str, target, window: int = WINDOW) -> MagicDecProposer:
    """A magicdec proposer over the draft model (the target perturbed) or the target itself."""
    base = target if kind == "self" else tiny_runtime(0, noise=0.05)
    view = StreamingRuntime(base, SINKS, window, target.capacity, pass_rows=PASS, rollback=ROLL)
    return MagicDecProposer(view, target.config.vocab_size)


GREEDY = SamplingConfig()


def decode(proposer, target, k: int, prompt, sampling=GREEDY, seed: int = 0,
           max_new: int = MAX_NEW):
    steps = list(speculative_decode(target, proposer, FixedK(k), list(prompt), sampling,
                                    max_new, (), make_generator(seed)))
    return [t for s in steps for t in s.tokens], steps


# --- lossless ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["draft", "self"])
@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_greedy_equals_plain_on_contexts_longer_than_the_view(kind, k):
    target = tiny_runtime(0)
    proposer = drafter(kind, target)
    got, steps = decode(proposer, target, k, LONG_PROMPT)
    assert got == plain(prompt=LONG_PROMPT)
    assert sum(s.drafted for s in steps) > 0 and sum(s.accepted for s in steps) > 0
    assert proposer.runtime.evicted > SINKS  # the window slid: the view really was sparse


def test_the_registered_method_builds_either_drafter_and_equals_plain():
    for drafter_kind in ("draft", "self"):
        target = tiny_runtime(0)
        spec = SpecConfig("magicdec", 3, magicdec_sinks=SINKS, magicdec_window=WINDOW,
                          magicdec_drafter=drafter_kind)
        proposer = PROPOSERS["magicdec"](spec, ProposerContext(target, tiny_runtime(0, noise=0.05)))
        assert (proposer.runtime.base is target) == (drafter_kind == "self")
        assert decode(proposer, target, 3, LONG_PROMPT)[0] == plain(prompt=LONG_PROMPT)
    assert SpecConfig("magicdec").uses_draft
    assert not SpecConfig("magicdec", magicdec_drafter="self").uses_draft


V, NEW, K, RUNS, ALPHA = 4, 4, 3, 2000, 1e-4
SAMPLED_PROMPT = [1, 3, 0, 2, 2, 1, 3, 3, 0, 1]  # 10 tokens: queries past 4 see a window of 3
TEMPERATURE = SamplingConfig(temperature=1.0)


@pytest.mark.parametrize("kind", ["draft", "self"])
def test_sampled_output_has_the_target_joint(kind):
    """Fails by chance with probability ALPHA (asymptotic chi-square over the exact joint of
    NEW tokens, cells below 5 expected pooled). The drafter sees 1 sink + a window of 3, so its
    q differs from the target's p (drafts are rejected, residuals drawn) on either drafter."""
    target = tiny_runtime(0, vocab=V, scale=0.6)
    base = target if kind == "self" else tiny_runtime(0, vocab=V, scale=0.6, noise=0.5)
    view = StreamingRuntime(base, 1, 3, target.capacity, pass_rows=4, rollback=4)
    proposer = MagicDecProposer(view, V)
    generator, counts, drafted, accepted = make_generator(11), defaultdict(int), 0, 0
    for _ in range(RUNS):
        steps = list(speculative_decode(target, proposer, FixedK(K), SAMPLED_PROMPT, TEMPERATURE,
                                        NEW, (), generator))
        counts[tuple(t for s in steps for t in s.tokens)] += 1
        drafted += sum(s.drafted for s in steps)
        accepted += sum(s.accepted for s in steps)
    assert 0 < accepted < drafted  # both outcomes of the verifier were exercised
    table = RuntimeTable(tiny_runtime(0, vocab=V, scale=0.6))

    def row(prefix):
        return logits_to_probs(table.logits((*SAMPLED_PROMPT, *prefix)), TEMPERATURE)

    assert chi_square_pvalue(target_joint(row, NEW), counts) > ALPHA


# --- the view: what it attends to, what it holds, what it costs -------------------------------

def test_every_query_attends_to_the_sinks_and_its_window_only():
    view = StreamingRuntime(tiny_runtime(0), SINKS, WINDOW, pass_rows=PASS, rollback=ROLL)
    for n in range(1, 90):  # one token at a time, and a multi-row pass every 10
        rows = 3 if n % 10 == 0 else 1
        view.forward(torch.arange(rows) % 64)
        held = view.held()  # slot order: the keys the pass's mask columns stand for
        assert len(held) <= view.slots and len(held) == view.last_mask.shape[1]  # fixed memory
        for r, mask_row in enumerate(view.last_mask.tolist()):
            p = view.length - rows + r
            seen = {held[c] for c, on in enumerate(mask_row) if on}
            assert seen == {j for j in range(p + 1) if j < SINKS or j > p - WINDOW}, (n, r)


def test_a_draft_step_attends_to_the_same_positions_at_any_context():
    """Attended (query, key) pairs of one propose of K tokens, at contexts from 20 to 200:
    flat for the view, growing with the context for the full cache."""
    per_context = []
    for length in (20, 60, 120, 200):
        target = tiny_runtime(0, capacity=256)
        proposer = drafter("draft", target)
        tokens = [(5 * i + 1) % 63 + 1 for i in range(length)]
        proposer.prefill(tokens)
        before = proposer.runtime.attended
        proposer.propose(tokens, 4, SamplingConfig(), make_generator(0))
        per_context.append(proposer.runtime.attended - before)
        assert len(proposer.runtime.held()) <= SINKS + WINDOW + ROLL + PASS
    assert per_context == [4 * (SINKS + WINDOW)] * 4  # 4 one-row passes, each sinks + window


def test_rolling_back_past_the_reserve_fails_clearly():
    view = StreamingRuntime(tiny_runtime(0), SINKS, WINDOW, pass_rows=PASS, rollback=ROLL)
    view.forward(torch.arange(60) % 64)
    view.truncate(view.length - ROLL)  # within the reserve
    with pytest.raises(ValueError, match="evicted"):
        view.truncate(SINKS + 1)
    view.truncate(0)  # the empty cache is always reachable
    assert view.held() == []


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_window_as_long_as_the_context_drafts_what_the_full_cache_drafts(temperature):
    """Same draft model, same generator: every draft token and every q row equal, to the bit."""
    sampling = SamplingConfig(temperature=temperature)
    draft = tiny_runtime(0, noise=0.05)
    full = DraftModelProposer(draft.fork(), 64)
    view = MagicDecProposer(StreamingRuntime(draft, SINKS, 10_000), 64)
    tokens = list(LONG_PROMPT)
    full.prefill(tokens)
    view.prefill(tokens)
    g_full, g_view = make_generator(3), make_generator(3)
    for step in range(12):
        a = full.propose(tokens, 4, sampling, g_full)
        b = view.propose(tokens, 4, sampling, g_view)
        assert torch.equal(a.tokens, b.tokens), step
        assert (a.q is None and b.q is None) or torch.equal(a.q, b.q), step
        tokens += [*a.tokens[: 1 + step % 3].tolist(), step % 50 + 1]  # keep some, add one
        for proposer in (full, view):
            proposer.commit(len(tokens) - 1)


# --- the method in the tools -------------------------------------------------------------------

def test_forerun_check_passes_magicdec():
    spec = SpecConfig("magicdec", 3, magicdec_sinks=SINKS, magicdec_window=WINDOW)
    engine = Engine.from_runtimes(tiny_runtime(0), word_tokenizer(), tiny_runtime(0, noise=0.5),
                                  spec)
    prompts = [("long", LONG_PROMPT[:30]), ("mixed", [1, 2, 3, 4, 1, 2, 30, 31])]
    report = check(engine, prompts, max_tokens=24, near_tie=1e-9, contexts=2, samples=300,
                   sampling=SamplingConfig(temperature=1.0), alpha=ALPHA)
    assert report.verdict == CHECK_PASS and any(c.drafted for c in report.sampling.contexts)


def test_the_cli_exposes_the_magicdec_options():
    import argparse

    from forerun.commands.options import add_spec_args, spec_config

    p = argparse.ArgumentParser()
    add_spec_args(p)
    args = p.parse_args(["--method", "magicdec", "--magicdec-sinks", "8", "--magicdec-window",
                         "512", "--magicdec-drafter", "self"])
    spec = spec_config(args)
    assert spec.magicdec() == MagicDecConfig(8, 512, "self")


@pytest.mark.parametrize(("options", "message"), [
    (dict(magicdec_window=0), "window >= 1"),
    (dict(magicdec_sinks=-1), "sinks >= 0"),
    (dict(magicdec_drafter="eagle"), "drafter must be one of"),
])
def test_bad_options_fail_clearly(options, message):
    with pytest.raises(ValueError, match=message):
        SpecConfig("magicdec", **options)


def test_a_drafter_not_on_the_torch_runtime_fails_clearly():
    from exact import TableModel, TableRuntime

    target = TableRuntime(TableModel(64, seed=0))
    for drafter_kind, draft in (("self", None), ("draft", TableRuntime(TableModel(64, seed=1)))):
        spec = SpecConfig("magicdec", magicdec_drafter=drafter_kind)
        with pytest.raises(ValueError, match="--runtime torch"):
            PROPOSERS["magicdec"](spec, ProposerContext(target, draft))
    with pytest.raises(ValueError, match="needs a draft model"):
        PROPOSERS["magicdec"](SpecConfig("magicdec"), ProposerContext(tiny_runtime(0)))


def test_the_view_never_touches_the_targets_cache():
    target = tiny_runtime(0)
    target.forward(torch.tensor(LONG_PROMPT[:20]))
    k_before = target.k_cache.clone()
    proposer = drafter("self", target)
    proposer.prefill(LONG_PROMPT)
    proposer.propose(LONG_PROMPT, 4, SamplingConfig(), make_generator(0))
    assert target.length == 20 and torch.equal(target.k_cache, k_before)



def test_the_self_drafter_runs_in_a_batch():
    spec = SpecConfig("magicdec", 3, magicdec_sinks=SINKS, magicdec_window=WINDOW,
                      magicdec_drafter="self")
    engine = Engine.from_runtimes(tiny_runtime(0), word_tokenizer(), None, spec)
    prompts = [LONG_PROMPT, LONG_PROMPT[:40]]
    outs = engine.generate_batch(prompts, max_tokens=20)
    assert [o.token_ids for o in outs] == [plain(prompt=p, max_new=20) for p in prompts]
    assert all(o.stats.drafted > 0 for o in outs)
