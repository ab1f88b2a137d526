"""Losslessness under sampling, by exact enumeration.

On a 6-token vocabulary we compute the target's exact joint distribution of the next
NEW_TOKENS tokens (under each sampling configuration) and compare it with the empirical
distribution of speculative decoding over RUNS seeded runs, with a chi-square test (cells whose
expected count is below 5 pooled). Each check fails by chance with probability ALPHA = 1e-4;
with the 8 checks of the real verifier below the module's false-failure probability is below
1e-3. A deliberately broken verifier (accept every draft token) must fail the same test.

With NEW_TOKENS = 3 every draft here is at most one token deep (the engine caps a draft at
max_new - emitted - 1 after the prefill's token): these cases check the sampling
configurations and policies end to end, not deep drafts. Drafts K = 2..4 deep, trees of two
and three levels and verifier mutants with computed power are in test_lossless_deep (engine)
and test_verify_power (one verify step, exact).

The whole suite's statistical checks, each seeded (a run is reproducible; the rate is the
chance that a correct change which reshuffles the random draws fails one): here 8 x 1e-4;
test_heads 7 x 1e-4 (its joint and first-token checks at this ALPHA); test_sampling 1e-4;
test_verify 3 x 1e-6; test_check 9e-4; test_verify_power 2 x 1e-4 + 8 mutants' escapes
(< 5e-8); test_lossless_deep 9 x 1e-4 + 7 mutants' escapes (< 5e-11); test_batch_sampling 4 x 1e-4;
test_processors 5 x 1e-4; test_grammar 5 x 1e-4; test_shadow, test_suffix and test_lookahead
1e-4 each; test_multi < 7e-4; test_spectr 1e-4 + 2e-15; test_layer_skip < 2e-4;
test_magicdec < 3e-4; test_qspec < 2e-4; test_cross_vocab 1e-4; test_disaggregate 1e-4. Total
< 7.1e-3.
"""

import itertools

import pytest
import torch
from conftest import tiny_runtime
from scipy.stats import chisquare

import forerun.batch_verify
from forerun.engine import speculative_decode
from forerun.policy import AdaptiveK, CostModelK, FixedK
from forerun.profile import ForwardCurve
from forerun.propose import PROPOSERS, ProposerContext, SpecConfig
from forerun.sampling import SamplingConfig, logits_to_probs, make_generator
from forerun.verify import Verdict
from forerun.verify_batch import each_member

V, NEW_TOKENS, RUNS, ALPHA = 6, 3, 3000, 1e-4
PROMPT = [1, 2, 3, 1, 2]  # repeats, so n-gram lookup proposes something


def target_model():
    return tiny_runtime(0, vocab=V, scale=0.4)


def draft_model():
    return tiny_runtime(0, vocab=V, scale=0.4, noise=0.5)


def exact_joint(sampling: SamplingConfig) -> dict[tuple, float]:
    rt, joint = target_model(), {}
    cond = {}
    for n in range(NEW_TOKENS):
        for prefix in itertools.product(range(V), repeat=n):
            rt.truncate(0)
            logits = rt.forward(torch.tensor(PROMPT + list(prefix))).logits[-1]
            cond[prefix] = logits_to_probs(logits, sampling)
    for seq in itertools.product(range(V), repeat=NEW_TOKENS):
        prob = 1.0
        for i, tok in enumerate(seq):
            prob *= float(cond[seq[:i]][tok])
        joint[seq] = prob
    return joint


def empirical(method: str, k: int, sampling: SamplingConfig, policy=FixedK,
              seed: int = 2024) -> dict[tuple, int]:
    target, draft = target_model(), draft_model()
    proposer = PROPOSERS[method](SpecConfig(method, k), ProposerContext(target, draft))
    generator, counts = make_generator(seed), {}
    for _ in range(RUNS):
        steps = speculative_decode(target, proposer, policy(k), PROMPT, sampling, NEW_TOKENS,
                                   (), generator)
        seq = tuple(t for s in steps for t in s.tokens)
        counts[seq] = counts.get(seq, 0) + 1
    return counts


def chi_square_pvalue(joint: dict, counts: dict) -> float:
    observed, expected, pooled_o, pooled_e = [], [], 0.0, 0.0
    for seq, prob in joint.items():
        if prob * RUNS >= 5:
            observed.append(counts.get(seq, 0))
            expected.append(prob * RUNS)
        else:
            pooled_o += counts.get(seq, 0)
            pooled_e += prob * RUNS
    impossible = sum(c for seq, c in counts.items() if joint[seq] == 0)
    assert impossible == 0, "sampled a sequence the target gives probability 0"
    if pooled_e > 0:
        observed.append(pooled_o)
        expected.append(pooled_e)
    assert sum(observed) == RUNS
    return chisquare(observed, expected).pvalue


SAMPLINGS = {
    "temperature": SamplingConfig(temperature=1.0),
    "low-temperature+top-p": SamplingConfig(temperature=0.7, top_p=0.8),
    "top-k": SamplingConfig(temperature=1.3, top_k=3),
}
CASES = [("draft", 2, "temperature"), ("draft", 3, "low-temperature+top-p"),
         ("draft", 2, "top-k"), ("ngram", 2, "temperature"), ("ngram", 3, "top-k"),
         ("ngram", 2, "low-temperature+top-p")]


@pytest.mark.parametrize(("method", "k", "sampling"), CASES)
def test_speculative_sampling_matches_target_joint(method, k, sampling):
    cfg = SAMPLINGS[sampling]
    assert chi_square_pvalue(exact_joint(cfg), empirical(method, k, cfg)) > ALPHA


def test_draft_matches_target_joint_with_adaptive_k():
    cfg = SAMPLINGS["temperature"]
    counts = empirical("draft", 1, cfg, policy=AdaptiveK, seed=7)
    assert chi_square_pvalue(exact_joint(cfg), counts) > ALPHA


def test_draft_matches_target_joint_with_cost_policy():
    """On this curve the cost policy drafts 1 at the prior and turns off after a rejection: the
    draft length depends on earlier outcomes, and the output must not."""
    verify = ForwardCurve((1, 2, 3, 4), (1.0, 1.3, 1.6, 1.9))
    cfg = SAMPLINGS["temperature"]
    counts = empirical("draft", 3, cfg, policy=lambda k: CostModelK(k, verify, 0.1), seed=11)
    assert chi_square_pvalue(exact_joint(cfg), counts) > ALPHA


def test_a_broken_verifier_fails_the_same_test(monkeypatch):
    def accept_everything(draft_tokens, p, q, generator):
        bonus = int(torch.multinomial(p[-1], 1, generator=generator))
        return Verdict([*draft_tokens.tolist(), bonus], draft_tokens.shape[0])

    monkeypatch.setattr(forerun.batch_verify, "batch_rejection_sample",
                        each_member(accept_everything))
    cfg = SAMPLINGS["temperature"]
    assert chi_square_pvalue(exact_joint(cfg), empirical("draft", 2, cfg)) < ALPHA
