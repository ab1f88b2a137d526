"""`forerun check`, the losslessness checker: it passes for every method on tiny float64 models
and fails, in both its tests, when the verifier accepts every draft token.

The sampling test's false-failure rate is ALPHA per check (Bonferroni over its contexts, as
the command states it); with the CHECKS that can fail by chance below, the file's chance of a
false failure is below CHECKS * ALPHA = 9e-4. Seeds are pinned, so a run is reproducible.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import heads_for, tiny_runtime
from scipy.stats import chi2
from test_engine import word_tokenizer
from tiny_files import byte_tokens, random_hf_weights, write_hf_dir

import forerun.batch_verify
import forerun.verify
import forerun.verify_batch
from forerun import Engine
from forerun.check import (
    FAIL,
    NEAR_TIE,
    PASS,
    check,
    chi2_sf,
    chi_square,
    near_tie_margin,
    sample_contexts,
)
from forerun.propose import SpecConfig
from forerun.sampling import SamplingConfig

ALPHA = 1e-4
CHECKS = 9  # checks below that run the sampling test with the engine's verifier
# a repeating prompt (n-gram lookup drafts) and a mixed one
PROMPTS = [("repeats", [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]), ("mixed", [1, 2, 3, 4, 1, 2, 30, 31])]
SPECS = {"none": SpecConfig("none"), "draft": SpecConfig("draft", 3),
         "ngram": SpecConfig("ngram", 3), "medusa": SpecConfig("medusa", 3),
         "hydra": SpecConfig("hydra", 3), "eagle": SpecConfig("eagle", 3),
         "eagle3": SpecConfig("eagle3", 3),
         "eagle-tree": SpecConfig("eagle", 3, tree=7, tree_topk=3),
         "medusa-tree": SpecConfig("medusa", 3, tree=6, tree_topk=2)}


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run ~40x faster on one thread than on two contended ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def engine_for(name: str) -> Engine:
    spec = SPECS[name]
    target = tiny_runtime(0)
    return Engine.from_runtimes(target, word_tokenizer(), tiny_runtime(0, noise=0.5), spec,
                                heads_for(spec.method, target))


def run_check(name: str, verifier: str = "rejection", near_tie: float = 1e-9):
    return check(engine_for(name), PROMPTS, max_tokens=24, near_tie=near_tie, contexts=2,
                 samples=300, sampling=SamplingConfig(temperature=1.0), alpha=ALPHA,
                 verifier=verifier)


@pytest.mark.parametrize("name", list(SPECS))
def test_check_passes_for_every_method(name):
    report = run_check(name)
    assert (report.greedy.verdict, report.sampling.verdict, report.verdict) == (PASS,) * 3
    assert all(r.identical for r in report.greedy.prompts)
    if name != "none":  # a real test: drafts were made and verified
        assert any(c.drafted for c in report.sampling.contexts)
        assert all(c.df >= 1 and c.impossible == 0 for c in report.sampling.contexts)
        assert report.sampling.per_test_alpha == ALPHA / 2


@pytest.mark.parametrize("name", ["draft", "ngram", "hydra", "eagle-tree"])
def test_a_verifier_that_accepts_every_draft_token_fails_both_tests(name):
    report = run_check(name, "accept-all")
    assert (report.greedy.verdict, report.sampling.verdict, report.verdict) == (FAIL,) * 3
    parted = [r for r in report.greedy.prompts if not r.identical]
    assert parted and all(r.divergence["logit_gap"] > 1e-9 for r in parted)
    assert min(c.p_value for c in report.sampling.contexts) < ALPHA / 2
    # the engine's own samplers are back after the self-test
    assert forerun.batch_verify.greedy_accept is forerun.verify.greedy_accept
    assert (forerun.batch_verify.batch_rejection_sample
            is forerun.verify_batch.batch_rejection_sample)


def test_divergences_under_the_threshold_are_near_ties():
    """The same broken greedy run, with a threshold above every margin: near-tie, not fail."""
    engine = engine_for("ngram")
    report = check(engine, PROMPTS, max_tokens=24, near_tie=1e9, contexts=1, samples=50,
                   sampling=SamplingConfig(temperature=1.0), alpha=ALPHA, verifier="accept-all")
    assert report.greedy.verdict == NEAR_TIE
    assert all(r.near_tie for r in report.greedy.prompts if not r.identical)


def test_chi_square_pools_small_bins_and_matches_scipy():
    for x, df in ((0.5, 1), (13.4, 12), (80.0, 20), (3.0, 7)):
        assert chi2_sf(x, df) == pytest.approx(chi2.sf(x, df), rel=1e-9)
    p = torch.tensor([0.5, 0.3, 0.19, 0.006, 0.004], dtype=torch.float64)
    counts = torch.tensor([480, 310, 200, 6, 4])  # n = 1000: the last two pool (expected 10)
    statistic, df, p_value = chi_square(counts, p)
    expected = torch.tensor([500.0, 300.0, 190.0, 10.0])
    observed = torch.tensor([480.0, 310.0, 200.0, 10.0])
    assert df == 3 and statistic == pytest.approx(float(((observed - expected) ** 2
                                                           / expected).sum()))
    assert p_value == pytest.approx(chi2.sf(statistic, 3))
    # a pool under 5 expected joins the smallest bin; a one-bin p cannot be tested
    assert chi_square(torch.tensor([995, 5]), torch.tensor([0.998, 0.002]))[1] == 0


def test_contexts_alternate_between_right_after_prefill_and_mid_reply():
    prompts = [("a", [1, 2]), ("b", [3, 4])]
    plains = [[10, 11, 12, 13], [20, 21, 22, 23]]
    got = sample_contexts(prompts, plains, 4)
    assert [c for _, c in got] == [[1, 2, 10], [3, 4, 20, 21], [1, 2, 10, 11], [3, 4, 20]]
    assert [label for label, _ in got][:2] == ["a +1", "b +2"]
    assert near_tie_margin("llama.cpp", "bfloat16") == 0.6
    assert near_tie_margin("torch", "float64") == 1e-9


def test_the_command_prints_one_json_object_and_exits_by_its_verdict(tmp_path):
    model = tmp_path / "tiny"
    write_hf_dir(model, random_hf_weights(len(byte_tokens()), seed=0), byte_tokens())
    base = [sys.executable, "-m", "forerun.cli", "check", "--target", str(model), "--dtype",
            "float64", "--method", "ngram", "-k", "3", "--max-tokens", "12", "--contexts", "2",
            "--samples", "200", "--alpha", str(ALPHA), "--prompt", "abc abc abc abc",
            "--prompt", "one two one two", "--json"]
    env = os.environ | {"OMP_NUM_THREADS": "1", "FORERUN_CURVE_CACHE": "0"}
    ok = subprocess.run(base, capture_output=True, text=True, timeout=300, env=env)
    assert ok.returncode == 0, ok.stderr
    out = json.loads(ok.stdout)
    assert out["verdict"] == PASS and out["method"] == "ngram"
    assert {"max_tokens", "near_tie_margin", "prompts", "verdict"} <= out["greedy"].keys()
    assert {"samples", "alpha", "per_test_alpha", "contexts", "verdict"} <= out["sampling"].keys()
    assert {"statistic", "df", "p_value", "passed"} <= out["sampling"]["contexts"][0].keys()
    broken = subprocess.run([*base, "--verifier", "accept-all"], capture_output=True,
                            text=True, timeout=300, env=env)
    assert broken.returncode == 1, broken.stderr
    assert json.loads(broken.stdout)["verdict"] == FAIL
