"""Early-exit self-speculation: the target's first E layers draft, in the target's own cache.

Properties: greedy output equals plain for every k and E (an exit above layers that change
nothing is the target itself: every draft accepted); sampled output has the target's exact
joint (chi-square at ALPHA against the enumerated joint; with the check test's sampling test,
this file fails by chance with probability below 2 * ALPHA); after a verify the cache's layers
below E at the accepted tokens equal plain decoding's to the bit (float64), and the verify pass
runs the layers below E for the last draft row alone; the adapter saves, loads and fails
clearly; batch members (drafting in their pool regions: tests/test_early_exit_batch.py) get
each sequence's own output; a runtime that cannot resume rows refuses.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from conftest import tiny_runtime
from exact import Recorder, RuntimeTable, chi_square_pvalue, target_joint
from test_engine import word_tokenizer

from forerun import Engine
from forerun.check import PASS, check
from forerun.engine import speculative_decode
from forerun.policy import FixedK
from forerun.propose import PROPOSERS, ProposerContext, SpecConfig
from forerun.propose.early_exit import (
    EarlyExitConfig,
    adapter_file,
    default_layer,
    load_adapter,
    save_adapter,
)
from forerun.reference import plain_decode
from forerun.runtime.base import Resume
from forerun.runtime.early_exit import ExitAdapter, ExitDraft
from forerun.sampling import SamplingConfig, logits_to_probs, make_generator

LAYERS = 6
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
MAX_NEW = 30
ALPHA = 1e-4
GREEDY = SamplingConfig()


def tokens_of(steps) -> list[int]:
    return [t for s in steps for t in s.tokens]


def decode(rt, layer, k, sampling=GREEDY, seed=0, prompt=PROMPT, max_new=MAX_NEW, adapter=None):
    spec = SpecConfig("early-exit", k, exit_layer=layer, exit_adapter=adapter)
    proposer = PROPOSERS["early-exit"](spec, ProposerContext(rt))
    steps = list(speculative_decode(rt, proposer, FixedK(k), prompt, sampling, max_new, (),
                                    make_generator(seed)))
    return tokens_of(steps), steps, proposer


def plain(rt, prompt=PROMPT, max_new=MAX_NEW) -> list[int]:
    return tokens_of(plain_decode(rt, prompt, GREEDY, max_new, (), make_generator(0)))


def idle_above(rt, layer: int):
    """The target with its blocks from `layer` on adding nothing to the residual stream: the
    exit at `layer` is the target itself."""
    with torch.no_grad():
        for block in rt.model.layers[layer:]:
            block.wo.weight.zero_()
            block.w_down.weight.zero_()
    return rt


@pytest.mark.parametrize("k", [1, 2, 4, 7])
@pytest.mark.parametrize("layer", [1, 3, 5, None])
def test_greedy_early_exit_equals_plain(k, layer):
    rt = tiny_runtime(0, n_layers=LAYERS)
    expected = plain(rt)
    got, steps, proposer = decode(rt, layer, k)
    assert got == expected
    assert sum(s.drafted for s in steps) > 0
    assert proposer.runtime.config.n_layers == (layer or default_layer(LAYERS))
    assert proposer.needs.resume  # decoded alone: the target's own cache


@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temperature=1.0)])
def test_an_exit_above_idle_layers_is_the_target_and_is_always_accepted(sampling):
    rt = idle_above(tiny_runtime(1, n_layers=LAYERS), 3)
    got, steps, _ = decode(rt, 3, 4, sampling)
    assert sum(s.accepted for s in steps) == sum(s.drafted for s in steps) > 0
    if sampling.greedy:
        assert got == plain(rt)


def test_a_zero_adapter_is_the_identity_and_a_trained_one_changes_the_draft(tmp_path):
    rt = tiny_runtime(0, n_layers=LAYERS)
    ids = torch.tensor(PROMPT)
    bare = ExitDraft(rt, 2, None, shared=False).forward(ids).logits
    zero = ExitDraft(rt, 2, ExitAdapter(rt.config.dim), shared=False).forward(ids).logits
    assert torch.equal(bare, zero)
    adapter = ExitAdapter(rt.config.dim)
    with torch.no_grad():
        adapter.weight.normal_(0, 0.2)
    path = save_adapter(tmp_path / "a.safetensors", adapter, 2, {"kl": 0.5})
    loaded = load_adapter(path, rt.config.dim, 2)
    assert torch.equal(loaded.weight, adapter.weight)
    moved = ExitDraft(rt, 2, loaded, shared=False).forward(ids).logits
    assert not torch.equal(moved, bare)
    assert plain(rt) == decode(rt, 2, 3, adapter=str(path))[0]  # lossless with any adapter
    small = ExitAdapter(rt.config.dim, torch.tensor([2, 5, 11, 40]))  # scores 4 tokens
    path = save_adapter(tmp_path / "small.safetensors", small, 2, {})
    assert torch.equal(load_adapter(path, rt.config.dim, 2).vocab, small.vocab)
    logits = ExitDraft(rt, 2, small, shared=False).forward(ids).logits  # [T, V]
    assert set(logits.argmax(-1).tolist()) <= {2, 5, 11, 40}
    assert torch.isfinite(logits).sum(-1).tolist() == [4] * len(PROMPT)
    assert plain(rt) == decode(rt, 2, 3, adapter=str(path))[0]
    with pytest.raises(ValueError, match="not layer 3"):
        load_adapter(path, rt.config.dim, 3)
    with pytest.raises(ValueError, match="not an early-exit adapter"):
        load_adapter(tmp_path / "missing.safetensors", rt.config.dim, 2)


def test_the_trained_adapter_is_found_beside_the_model(tmp_path, monkeypatch):
    from conftest import tiny_model

    from forerun.runtime.torch_model import TorchRuntime

    monkeypatch.setenv("FORERUN_HOME", str(tmp_path / "home"))
    weights = tmp_path / "tiny.gguf"
    weights.write_bytes(b"stand-in for the weights file")
    rt = TorchRuntime(tiny_model(0, n_layers=LAYERS), capacity=256, source=weights)
    assert EarlyExitConfig(2).resolve_adapter(rt, 2) is None  # nothing trained: identity
    adapter = ExitAdapter(rt.config.dim)
    with torch.no_grad():
        adapter.weight.fill_(0.01)
    save_adapter(adapter_file(weights, 2), adapter, 2, {})
    assert adapter_file(weights, 2).is_relative_to(tmp_path / "home")
    found = EarlyExitConfig(2).resolve_adapter(rt, 2)
    assert found is not None and torch.equal(found.weight, adapter.weight)
    assert EarlyExitConfig(2, "none").resolve_adapter(rt, 2) is None
    assert EarlyExitConfig(3).resolve_adapter(rt, 3) is None  # another layer's: not this one


def test_the_lower_cache_of_accepted_tokens_is_plain_decodings_to_the_bit():
    """After every verify, slots of final tokens hold at layers 0..E-1 exactly what plain
    decoding wrote there (float64): the draft's K/V are the target's own."""
    layer, k = 3, 4
    ref = tiny_runtime(2, n_layers=LAYERS, scale=0.3)  # flat: drafts accepted sometimes
    expected = plain(ref, max_new=MAX_NEW + 1)
    ref_k, ref_v = ref.k_cache.clone(), ref.v_cache.clone()  # plain decoding's cache
    rt = tiny_runtime(2, n_layers=LAYERS, scale=0.3)
    proposer = PROPOSERS["early-exit"](SpecConfig("early-exit", k, exit_layer=layer),
                                       ProposerContext(rt))
    checked = accepted = 0
    out = []
    for step in speculative_decode(rt, proposer, FixedK(k), PROMPT, GREEDY, MAX_NEW, (),
                                   make_generator(0)):
        n = rt.length  # final tokens in the cache
        assert torch.equal(rt.k_cache[:layer, :, :n], ref_k[:layer, :, :n])
        assert torch.equal(rt.v_cache[:layer, :, :n], ref_v[:layer, :, :n])
        checked, accepted = checked + 1, accepted + step.accepted
        out += step.tokens
    assert checked > 3 and accepted > 0 and out == expected[:MAX_NEW]


def test_the_verify_pass_runs_the_lower_layers_for_the_last_draft_row_alone():
    """Rows each block runs, counted by hooks: a draft step runs blocks 0..E-1 on one row;
    the verify of pending + k nodes runs blocks 0..E-1 on the last node only and E.. on k+1."""
    layer, k = 2, 3
    rt = tiny_runtime(0, n_layers=LAYERS)
    rows: list[tuple[int, int]] = []
    hooks = [block.register_forward_hook(lambda m, a, out, i=i: rows.append((i, out.shape[0])))
             for i, block in enumerate(rt.model.layers)]
    proposer = PROPOSERS["early-exit"](SpecConfig("early-exit", k, exit_layer=layer),
                                       ProposerContext(rt))
    steps = speculative_decode(rt, proposer, FixedK(k), PROMPT, GREEDY, 12, (),
                               make_generator(0))
    next(steps)  # the prefill: every layer over the prompt
    assert rows == [(i, len(PROMPT)) for i in range(LAYERS)]
    rows.clear()
    step = next(steps)
    assert step.drafted == k
    draft = [(i, 1) for _ in range(k) for i in range(layer)]  # pending, nodes 1..k-1
    verify = [*((i, 1) for i in range(layer)), *((i, k + 1) for i in range(layer, LAYERS))]
    assert rows == draft + verify
    for hook in hooks:
        hook.remove()


def test_the_shared_draft_holds_no_cache_or_weights_of_its_own():
    rt = tiny_runtime(0, n_layers=LAYERS)
    draft = ExitDraft(rt, 2)
    assert draft.k_cache.data_ptr() == rt.k_cache.data_ptr()  # the target's first 2 layers
    assert draft.v_cache.data_ptr() == rt.v_cache.data_ptr() and len(draft.k_cache) == 2
    assert [id(b) for b in draft.blocks] == [id(b) for b in rt.model.layers[:2]]
    own = ExitDraft(rt, 2, shared=False, capacity=32)  # a batch member's: a cache of its own
    assert own.k_cache.shape[:3] == (2, rt.config.n_kv_heads, 32)
    assert own.k_cache.data_ptr() != rt.k_cache.data_ptr()


def test_a_resumed_pass_equals_a_full_one():
    """The runtime seam alone: rows whose layer-E states and lower K/V came from a one-row pass
    each give a pass that resumes them the logits and cache of the full pass (float64)."""
    full, part = tiny_runtime(3, n_layers=LAYERS), tiny_runtime(3, n_layers=LAYERS)
    full.forward(torch.tensor(PROMPT[:5]))
    part.forward(torch.tensor(PROMPT[:5]))
    draft = ExitDraft(part, 4)
    draft.align(5)
    for t in PROMPT[5:7]:
        draft.forward(torch.tensor([t]))
    rest = torch.tensor(PROMPT[5:])  # [3]: two resumed rows and one run in full
    want = full.forward(rest).logits
    got = part.forward(rest, resume=draft.resume()).logits
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    assert torch.allclose(part.k_cache[:, :, :8], full.k_cache[:, :, :8], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="resume"):
        part.forward(rest, resume=Resume(LAYERS, draft.resume().hidden))
    with pytest.raises(ValueError, match="resume"):
        part.forward(rest[:1], resume=draft.resume())


def test_batch_members_get_each_sequences_own_output():
    rt = tiny_runtime(0, n_layers=LAYERS)
    engine = Engine.from_runtimes(rt, word_tokenizer(), None,
                                  SpecConfig("early-exit", 3, exit_layer=2))
    prompts = [PROMPT, [7, 7, 8, 9], [1, 2, 3, 1, 2, 3, 1]]
    batch = engine.generate_batch(prompts, max_tokens=20, max_batch=3)
    for prompt, out in zip(prompts, batch, strict=True):
        alone = engine.generate(prompt, max_tokens=20)
        assert out.token_ids == alone.token_ids
        assert out.stats.drafted > 0


def test_early_exit_passes_forerun_check():
    rt = tiny_runtime(0, n_layers=3)
    engine = Engine.from_runtimes(rt, word_tokenizer(), None,
                                  SpecConfig("early-exit", 3, exit_layer=1))
    prompts = [("repeats", [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]), ("mixed", [1, 2, 3, 30])]
    report = check(engine, prompts, max_tokens=24, near_tie=1e-9, contexts=2, samples=300,
                   sampling=SamplingConfig(temperature=1.0), alpha=ALPHA)
    assert (report.greedy.verdict, report.sampling.verdict, report.verdict) == (PASS,) * 3
    assert any(c.drafted for c in report.sampling.contexts)


def test_bad_options_and_runtimes_fail_clearly():
    from exact import TableModel, TableRuntime

    with pytest.raises(ValueError, match=">= 1"):
        SpecConfig("early-exit", exit_layer=0)
    with pytest.raises(ValueError, match=r"1\.\.5"):
        decode(tiny_runtime(0, n_layers=LAYERS), LAYERS, 2)
    table = TableRuntime(TableModel(3, seed=0))  # Capabilities() as llama.cpp's
    with pytest.raises(ValueError, match="--runtime torch"):
        PROPOSERS["early-exit"](SpecConfig("early-exit"), ProposerContext(table))
    assert default_layer(28) == 8 and default_layer(2) == 1


# --- sampling: the exact joint ----------------------------------------------------------------

V, K, NEW, RUNS = 3, 3, 5, 2000  # NEW = K + 2: the first draft after the prefill is K deep
SAMPLED_PROMPT = [1, 2, 0, 1, 2, 0, 1]
SAMPLED = SamplingConfig(temperature=1.0)


def test_sampled_early_exit_matches_the_target_joint(one_thread):
    """Fails by chance with probability ALPHA = 1e-4 (asymptotic chi-square over the exact
    joint of NEW tokens, cells below 5 expected pooled). The draft (2 of 4 layers) has its own
    q: accepted often, not always, so every verify path is exercised."""
    rt = tiny_runtime(5, vocab=V, n_layers=4)
    table = RuntimeTable(tiny_runtime(5, vocab=V, n_layers=4))
    spec = SpecConfig("early-exit", K, exit_layer=2)
    generator, counts = make_generator(11), defaultdict(int)
    recorder = Recorder(PROPOSERS["early-exit"](spec, ProposerContext(rt)))
    accepted = drafted = 0
    for _ in range(RUNS):
        steps = list(speculative_decode(rt, recorder, FixedK(K), SAMPLED_PROMPT, SAMPLED, NEW,
                                        (), generator))
        counts[tuple(tokens_of(steps))] += 1
        accepted += sum(s.accepted for s in steps)
        drafted += sum(s.drafted for s in steps)
    assert 0.2 * drafted < accepted < 0.95 * drafted, (accepted, drafted)
    assert min(recorder.depths[d] for d in range(1, K + 1)) >= RUNS // 2  # deep, not one token

    def row(prefix):
        return logits_to_probs(table.logits((*SAMPLED_PROMPT, *prefix)), SAMPLED)

    assert chi_square_pvalue(target_joint(row, NEW), counts) > ALPHA


def test_training_the_adapter_brings_the_exit_head_closer_to_the_target(tmp_path):
    """Distillation on the target's own windows (layer-E features, top-K teacher): the exit
    head's top-1 agreement with the target rises, and the trained adapter drafts losslessly."""
    from forerun.train import TrainConfig, teacher
    from forerun.train.early_exit import feature_layer, train_adapter

    rt = tiny_runtime(4, n_layers=LAYERS)
    layer = 2
    generator = torch.Generator().manual_seed(0)
    shards = [teacher(rt, torch.randint(0, 64, (48,), generator=generator).tolist(),
                      (feature_layer(layer),)) for _ in range(4)]
    cfg = TrainConfig("early-exit", steps=80, lr=3e-2, held_out=0.0)
    adapter, report = train_adapter(rt, shards, layer, cfg, progress=False)
    assert report["after"] > report["before"] + 0.1, report
    vocab = torch.arange(0, 64, 2)  # half the tokens
    small, reduced = train_adapter(rt, shards, layer, cfg, progress=False, vocab=vocab)
    assert torch.equal(small.vocab, vocab) and reduced["after"] > reduced["before"], reduced
    assert torch.isfinite(small.weight).all()  # tokens outside the vocab: 0 * -inf is no loss
    assert adapter.weight.abs().sum() > 0
    path = save_adapter(tmp_path / "adapter.safetensors", adapter, layer, report)
    rt2 = tiny_runtime(4, n_layers=LAYERS)
    got = decode(rt2, layer, 3, adapter=str(path))[0]
    assert got == plain(tiny_runtime(4, n_layers=LAYERS))


def test_train_early_exit_command_then_generate_finds_the_adapter(tmp_path):
    """`forerun train early-exit --layer 1` on a tiny HF target writes the adapter beside the
    model; `forerun generate --method early-exit --exit-layer 1` finds it and equals plain."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tiny_files import byte_tokens, random_hf_weights, write_hf_dir

    target = tmp_path / "target"
    write_hf_dir(target, random_hf_weights(len(byte_tokens()), seed=0), byte_tokens())
    env = {**os.environ, "FORERUN_HOME": str(tmp_path / "home")}
    base = [sys.executable, "-m", "forerun.cli"]
    common = ["--target", str(target), "--draft", str(target), "--dtype", "float32",
              "--runtime", "torch"]
    r = subprocess.run([*base, "train", "early-exit", "--layer", "1", *common, "--replies",
                        "torch", "--max-tokens", "96", "--seq-len", "32", "--chat", "1",
                        "--chat-tokens", "8", "--steps", "5", "--head-vocab", "0", "--json"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout.splitlines()[-1])
    out = Path(report["out"])
    assert out.is_file() and out.is_relative_to(tmp_path / "home") and out.name.endswith(
        "-exit1.safetensors")
    r = subprocess.run([*base, "generate", *common, "--method", "early-exit", "--exit-layer", "1",
                        "-k", "3", "--max-tokens", "12", "--raw", "--compare", "--json", "hello"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["identical"] is True
