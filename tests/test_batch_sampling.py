"""Losslessness under sampling in a batch of mixed requests, by exact enumeration.

On a 3-token vocabulary (a tiny float64 transformer as the target) the target's exact joint
distribution of the next NEW tokens under each sampling configuration is enumerable
(tests/exact.py). Every run is ONE batch (the batch step, `run_to_completion`) of mixed
members: a shared draft model's members at temperature 1, an n-gram member under top-k, an
EAGLE tree member under top-p, a plain member at a low temperature, each with its own seeded
generator; each member's sequences over RUNS batches are tested against its own sampling's
joint with a pooled chi-square. NEW >= K + 2, so the draft-model and EAGLE members' first
verify step drafts K tokens deep, the n-gram member's 2 deep in most runs (asserted from its
steps). The members share every target pass, so a member's rows, its q rows and its generator
must stay its own for the test to pass.

False failures: each of the 4 member checks fails by chance with probability ALPHA = 1e-4
(asymptotic chi-square): module total 4e-4.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
from conftest import random_heads, tiny_runtime
from exact import chi_square_pvalue, target_joint
from test_lossless_deep import TEMPERATURE, TOP_K, TOP_P, V, rows

from forerun.batch_engine import Sequence, run_to_completion
from forerun.policy import FixedK
from forerun.propose import HEAD_PROPOSERS
from forerun.propose.draft_batch import SharedDraftModel
from forerun.propose.ngram import NgramProposer
from forerun.runtime.batch import BatchTorchRuntime
from forerun.sampling import SamplingConfig, make_generator

pytestmark = pytest.mark.usefixtures("one_thread")
ALPHA, RUNS, NEW, K = 1e-4, 1500, 5, 3
PROMPT = [1, 2, 0, 1, 2, 0, 1]  # repeats, so n-gram lookup drafts from the first step on
COOL = SamplingConfig(temperature=0.6)
BUDGET = 1 << 20  # bytes of KV per model: the batch's few short sequences, many times over
# member -> (sampling, K drafted at the first verify step); "plain" drafts nothing
MEMBERS = {"draft": (TEMPERATURE, K), "ngram": (TOP_K, K), "eagle-tree": (TOP_P, 2),
           "plain": (COOL, 0)}


def _runtime(**kw):
    return tiny_runtime(0, vocab=V, capacity=64, **kw)


def test_a_mixed_batch_samples_each_members_target_joint():
    target = BatchTorchRuntime(_runtime(), BUDGET)
    shared = SharedDraftModel(BatchTorchRuntime(_runtime(scale=1.0, noise=0.5), BUDGET), V)
    heads = random_heads("eagle", _runtime(), scale=0.5)
    counts = {m: defaultdict(int) for m in MEMBERS}
    first_depth = {m: defaultdict(int) for m in MEMBERS}
    for run in range(RUNS):
        seqs = {}
        for i, (member, (sampling, k)) in enumerate(MEMBERS.items()):
            seq = Sequence(list(PROMPT), sampling, NEW, make_generator(7919 * run + i), ())
            if member == "draft":
                seq.proposer = shared.proposer(len(PROMPT) + NEW + k + 1)
            elif member == "ngram":
                seq.proposer = NgramProposer(1, 4)
            elif member == "eagle-tree":
                seq.proposer = HEAD_PROPOSERS["eagle"](heads, 64, 5, 2)
            if seq.proposer is not None:
                seq.policy, seq.max_k = FixedK(k), 5
            seqs[member] = seq
        run_to_completion(target, list(seqs.values()))
        for member, seq in seqs.items():
            counts[member][tuple(t for s in seq.steps for t in s.tokens)] += 1
            verify = [s for s in seq.steps if not s.prefill]
            first_depth[member][verify[0].drafted] += 1
    assert target.pool.live == 0 and shared.runtime.pool.live == 0
    for member, (sampling, k) in MEMBERS.items():
        if member == "ngram":  # lookup drafts deep where the text continues the period (the
            # prompt's own continuation is 2 long at the first step: measured 839 of 1500 runs)
            assert first_depth[member][2] >= 0.1 * RUNS, first_depth[member]
        else:
            assert first_depth[member][k] == RUNS, (member, first_depth[member])
        joint = target_joint(rows("heads-target", sampling), NEW)
        assert chi_square_pvalue(joint, counts[member]) > ALPHA, member
