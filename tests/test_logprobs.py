"""Logprobs under speculation: what the verify pass reports equals what plain decoding sees.

Tiny float64 models. For every method (plain, draft model, n-gram, Medusa and EAGLE trees),
alone and in a batch, each emitted token's logprob and its top alternatives are the
log-softmax of the target's logits at that position along plain decoding's path
(`plain_logits_at`: the prompt in one pass, then one token a pass). A verify pass computes
those logits over several rows at once, so they may differ from the one-row pass in the last
bits: the bound is TOLERANCE = 1e-12; the largest difference seen was 9.8e-15 (plain decoding
through the batch step: 0, bit for bit).
"""

from __future__ import annotations

import pytest
import torch
from conftest import random_heads, tiny_model

from forerun.batch_engine import Sequence, run_to_completion
from forerun.engine import speculative_decode
from forerun.policy import POLICIES, FixedK
from forerun.propose import HEAD_PROPOSERS, PROPOSERS, ProposerContext, SpecConfig
from forerun.reference import plain_logits_at
from forerun.runtime.batch import BatchTorchRuntime
from forerun.runtime.torch_model import TorchRuntime
from forerun.sampling import SamplingConfig, make_generator

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]
NEW, TOP = 20, 3
TOLERANCE = 1e-12  # float64 logits of a k-row pass against a one-row pass


def _expected(prompt, tokens):
    """(logprob of each token, its top TOP alternatives) along plain decoding's path."""
    rt, out = TorchRuntime(tiny_model(0), capacity=256), []
    for i, token in enumerate(tokens):
        logp = plain_logits_at(rt, list(prompt), tokens, i).log_softmax(-1)
        top = logp.topk(TOP)
        out.append((float(logp[token]), top.indices.tolist(), top.values.tolist()))
    return out


def _check(logprobs, tokens, prompt):
    assert [lp.token for lp in logprobs] == tokens
    worst = 0.0
    for lp, (want, top_ids, top_values) in zip(logprobs, _expected(prompt, tokens), strict=True):
        assert [t for t, _ in lp.top] == top_ids
        for got, ref in [(lp.logprob, want), *zip([v for _, v in lp.top], top_values, strict=True)]:
            worst = max(worst, abs(got - ref))
    assert worst <= TOLERANCE, worst
    return worst


@pytest.mark.parametrize("method", ["none", "draft", "ngram", "medusa", "eagle"])
def test_every_method_reports_plain_decodings_logprobs(method):
    target = TorchRuntime(tiny_model(0), capacity=256)
    proposer = policy = None
    if method != "none":
        draft = TorchRuntime(tiny_model(0, noise=0.05), capacity=256)
        heads = random_heads(method, target) if method in HEAD_PROPOSERS else None
        spec = SpecConfig(method, 4, tree=6 if heads is not None else 0)
        proposer, policy = PROPOSERS[method](spec, ProposerContext(target, draft, heads)), FixedK(4)
    steps = list(speculative_decode(target, proposer, policy, PROMPT, SamplingConfig(), NEW, (),
                                    make_generator(0), logprobs=TOP))
    if method in ("draft", "ngram", "medusa"):  # several tokens' logprobs from one pass
        assert sum(s.accepted for s in steps) > 0
    if method != "none":  # (random EAGLE heads draft trees the target rejects)
        assert sum(s.drafted for s in steps) > 0
    tokens = [t for s in steps for t in s.tokens]
    _check([lp for s in steps for lp in s.logprobs], tokens, PROMPT)


def test_logprobs_in_a_batch_are_each_members_own():
    target = TorchRuntime(tiny_model(0), capacity=256)
    runtime = BatchTorchRuntime(TorchRuntime(tiny_model(0), capacity=256), 1 << 20)
    prompts = [PROMPT, [10, 20, 30, 40], [7, 7, 8, 7, 7, 8]]
    seqs = []
    for prompt, method in zip(prompts, ["draft", "ngram", "none"], strict=True):
        if method == "none":
            seqs.append(Sequence(list(prompt), SamplingConfig(), NEW, make_generator(0), (),
                                 logprobs=TOP))
            continue
        draft = TorchRuntime(tiny_model(0, noise=0.05), capacity=256)
        spec = SpecConfig(method, 3)
        proposer = PROPOSERS[method](spec, ProposerContext(target, draft))
        seqs.append(Sequence(list(prompt), SamplingConfig(), NEW, make_generator(0), (),
                             proposer, POLICIES["fixed"](spec, target, proposer.runtime),
                             max_k=3, logprobs=TOP))
    seqs.append(Sequence(list(PROMPT), SamplingConfig(), NEW, make_generator(0), ()))  # not asked
    run_to_completion(runtime, seqs)
    for seq, prompt in zip(seqs, prompts, strict=False):
        tokens = [t for s in seq.steps for t in s.tokens]
        _check([lp for s in seq.steps for lp in s.logprobs], tokens, prompt)
    assert all(s.logprobs is None for s in seqs[-1].steps)


def test_sampled_logprobs_are_the_raw_targets_at_the_sampled_tokens():
    """Sampling (temperature 0.7): logprobs stay the target's raw log-softmax at each sampled
    token, whatever the temperature; the sampled path is the one replayed."""
    target = TorchRuntime(tiny_model(0), capacity=256)
    draft = TorchRuntime(tiny_model(0, noise=0.05), capacity=256)
    spec = SpecConfig("draft", 3)
    proposer = PROPOSERS["draft"](spec, ProposerContext(target, draft))
    steps = list(speculative_decode(target, proposer, FixedK(3), PROMPT,
                                    SamplingConfig(temperature=0.7), NEW, (), make_generator(5),
                                    logprobs=TOP))
    tokens = [t for s in steps for t in s.tokens]
    _check([lp for s in steps for lp in s.logprobs], tokens, PROMPT)


def test_the_library_returns_logprobs_and_checks_the_count():
    from test_engine import word_tokenizer

    from forerun.api import Engine

    engine = Engine.from_runtimes(TorchRuntime(tiny_model(0), capacity=256), word_tokenizer(),
                                  TorchRuntime(tiny_model(0, noise=0.05), capacity=256),
                                  SpecConfig("draft", 3))
    out = engine.generate(PROMPT, max_tokens=8, logprobs=2)
    assert len(out.logprobs) == len(out.token_ids) and all(len(lp.top) == 2 for lp in out.logprobs)
    assert "logprobs" in out.to_dict()
    assert engine.generate(PROMPT, max_tokens=8).logprobs is None
    with pytest.raises(ValueError, match="logprobs must be in"):
        engine.generate(PROMPT, max_tokens=8, logprobs=21)
    assert torch.isfinite(torch.tensor([lp.logprob for lp in out.logprobs])).all()
