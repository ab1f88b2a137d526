"""`forerun bench` on tiny GGUF models written here: workloads parse and sample, a 2-prompt run
finishes in seconds and writes the table, results.json and the PNG, the last stdout line is JSON,
speculative cells are compared with the baseline of the same run, and peers run on the same
GGUF files."""

import json

import pytest
import torch
from tiny_files import byte_tokens, random_hf_weights, write_gguf

from forerun import cli
from forerun.bench.report import (
    MEAN,
    aggregate,
    ceiling_line,
    divergences,
    markdown,
    prefill_ceilings,
)
from forerun.bench.report import summary as report_summary
from forerun.bench.runner import BASELINE, BenchConfig, Run, median_run
from forerun.bench.workloads import WorkloadError, read_workload, sample_workloads


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A target and a draft that agrees with it often (same tokenizer)."""
    root = tmp_path_factory.mktemp("bench_models")
    tokens = byte_tokens()
    weights = random_hf_weights(len(tokens), seed=0)
    g = torch.Generator().manual_seed(1)
    noisy = {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in weights.items()}
    write_gguf(root / "target.gguf", weights, tokens)
    write_gguf(root / "draft.gguf", noisy, tokens)
    return root / "target.gguf", root / "draft.gguf"


@pytest.fixture
def workload(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(
        json.dumps({"question_id": 1, "category": "writing", "turns": ["abc abc abc", "more"]})
        + "\n" + json.dumps({"task_id": "E/1", "instruction": "Rename x to y.",
                             "input": "x = 1\nprint(x)"}) + "\n")
    return path


def test_builtin_workloads_map_categories():
    spec = read_workload("spec_bench")
    assert len(spec) == 480
    assert {p.category for p in spec} == {"mt_bench", "translation", "summarization", "qa",
                                          "math_reasoning", "rag"}
    edits = read_workload("editeval")
    assert len(edits) == 194 and {p.category for p in edits} == {"editeval"}
    assert "```python" in edits[0].text


def test_sampling_is_per_category_and_seeded():
    a = sample_workloads(["spec_bench", "editeval"], limit=3, seed=7)
    assert len(a) == 7 * 3
    assert a == sample_workloads(["spec_bench", "editeval"], limit=3, seed=7)
    assert a != sample_workloads(["spec_bench", "editeval"], limit=3, seed=8)
    b = sample_workloads(["spec_bench:1", "editeval:4"], limit=3, seed=7)
    assert len(b) == 6 + 4


def test_bad_workloads_fail_clearly(tmp_path):
    with pytest.raises(WorkloadError, match="no such file"):
        read_workload(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no known shape"}\n')
    with pytest.raises(WorkloadError, match="line 1"):
        read_workload(str(bad))
    bad.write_text("not json\n")
    with pytest.raises(WorkloadError, match="not JSON"):
        read_workload(str(bad))


def test_bench_writes_table_json_and_plot(pair, workload, tmp_path, capsys):
    out = tmp_path / "out"
    code = cli.main(["bench", "--target", str(pair[0]), "--draft", str(pair[1]),
                     "--workload", str(workload), "--methods", "draft,ngram", "--ks", "2,4",
                     "--max-tokens", "12", "--dtype", "float64", "--out", str(out)])
    assert code == 0
    stdout = capsys.readouterr().out
    summary = json.loads(stdout.strip().splitlines()[-1])
    speedups = summary["speedup_vs_forerun_plain"]
    assert set(speedups) == {BASELINE, "draft k=2", "draft k=4", "ngram k=2", "ngram k=4"}
    assert set(speedups["draft k=4"]) == {"mt_bench", "editeval", MEAN}
    assert "forerun bench" in stdout and "acc. len" in stdout
    results = json.loads((out / "results.json").read_text())
    runs = results["runs"]
    assert len(runs) == 2 * 5  # 2 prompts x (baseline + 4 cells)
    # float64 tiny models: greedy speculation reproduces the baseline exactly
    assert all(r["identical"] and r["divergence"] is None for r in runs if r["label"] != BASELINE)
    assert all(r["new_tokens"] > 0 and r["wall_s"] > 0 for r in runs)
    assert (out / "bench.png").stat().st_size > 1000
    assert "| 0 | editeval | draft k=4 | 1 |" in (out / "results.md").read_text()
    ceiling = summary["prefill_ceiling"]  # plain wall / plain TTFT, per category and the mean
    assert set(ceiling) == {"mt_bench", "editeval", MEAN} and min(ceiling.values()) >= 1
    assert results["prefill_ceiling"].keys() == ceiling.keys()


def test_verify_curve(pair, tmp_path, capsys):
    out = tmp_path / "curve"
    assert cli.main(["bench", "curve", "--target", str(pair[0]), "--draft",
                     str(pair[1]), "--dtype", "float32", "--out", str(out)]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["target_ms_1"] > 0 and last["target_fwd5_over_fwd1"] > 0
    curves = json.loads((out / "verify_curve.json").read_text())["curves"]
    t = curves["target"]["seconds"]  # the ceiling: the best n·t(1)/t(n) over the sizes
    n = last["ceiling_tokens"]
    assert last["ceiling"] == round(max(m * t[0] / t[m - 1] for m in range(1, 33)), 3)
    assert last["ceiling"] == round(n * t[0] / t[n - 1], 3) >= 1
    assert len(curves["target"]["sizes"]) == 32 and "draft" in curves
    assert (out / "verify_curve.png").exists()


def test_hf_peers_run_on_the_same_gguf(pair, workload, tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "peers"
    assert cli.main(["bench", "--target", str(pair[0]), "--draft", str(pair[1]),
                     "--workload", str(workload), "--methods", "draft", "--max-tokens", "8",
                     "--dtype", "float32", "--peers", "hf", "--out", str(out)]) == 0
    runs = json.loads((out / "results.json").read_text())["runs"]
    labels = {r["label"] for r in runs}
    assert {"hf plain", "hf assisted", "hf prompt_lookup"} <= labels
    hf_plain = [r for r in runs if r["label"] == "hf plain"]
    ours = [r for r in runs if r["label"] == BASELINE]
    # same weights, same prompt ids, greedy: the same tokens as forerun's own plain decoding
    assert [r["token_ids"] for r in hf_plain] == [r["token_ids"] for r in ours]
    capsys.readouterr()


def test_aggregate_ratios_are_against_the_same_runs_baseline():
    def run(label, cat, tokens, wall, baseline=BASELINE, **kw):
        return Run("p", cat, label, baseline, 0.0, 10, tokens, wall, 0.1, [0.1], **kw)

    cells = {(c.category, c.label): c for c in aggregate([
        run(BASELINE, "a", 10, 2.0), run("draft k=4", "a", 10, 1.0, verify_steps=4,
                                         drafted=16, accepted=6),
        run(BASELINE, "b", 10, 1.0), run("draft k=4", "b", 10, 1.0, verify_steps=10,
                                         drafted=40, accepted=0),
        run(BASELINE, "editeval", 10, 3.0), run("draft k=4", "editeval", 10, 1.0)])}
    assert cells["a", "draft k=4"].speedup == pytest.approx(2.0)
    assert cells["a", "draft k=4"].mean_accepted_length == pytest.approx(10 / 4)
    assert cells["a", "draft k=4"].acceptance_rate == pytest.approx(6 / 16)
    assert cells["b", "draft k=4"].speedup == pytest.approx(1.0)
    assert cells["editeval", "draft k=4"].speedup == pytest.approx(3.0)
    # the mean is Spec-Bench's figure: EditEval's category stands apart
    assert cells[MEAN, "draft k=4"].speedup == pytest.approx(1.5)


def test_decode_speedup_leaves_the_prefill_out():
    # the same 4 s prefill in both runs: end to end 10 s vs 7 s (1.43x); after the first
    # token 6 s vs 3 s for the same 10 tokens (2x): the drafter's own figure
    def run(label, wall):
        return Run("p", "a", label, BASELINE, 0.0, 500, 11, wall, 4.0, [0.1])

    cells = {c.label: c for c in aggregate([run(BASELINE, 10.0), run("eagle", 7.0)])}
    assert cells["eagle"].speedup == pytest.approx(10 / 7)
    assert cells["eagle"].decode_speedup == pytest.approx(2.0)
    assert cells[BASELINE].decode_speedup == pytest.approx(1.0)
    assert "2.00x" in markdown(list(cells.values()), "t")


def test_the_prefill_ceiling_is_plain_wall_over_plain_ttft():
    # rag-like: 9 s of a 10 s plain run is prefill, so no drafter passes 10/9 end to end;
    # qa-like: 1 s of 8 s; EditEval stands out of the mean, as it does for speedups
    def run(cat, label, wall, ttft):
        return Run("p", cat, label, BASELINE, 0.0, 800, 18, wall, ttft, [0.1])

    ceilings = prefill_ceilings([
        run("rag", BASELINE, 10.0, 9.0), run("rag", BASELINE, 10.0, 9.0),
        run("rag", "eagle", 9.5, 9.0), run("qa", BASELINE, 8.0, 1.0),
        run("editeval", BASELINE, 4.0, 2.0)])
    assert ceilings["rag"] == pytest.approx(20 / 18)
    assert ceilings["qa"] == pytest.approx(8.0)
    assert ceilings[MEAN] == pytest.approx((20 / 18 + 8.0) / 2)
    assert ceiling_line(ceilings).index("rag 1.11x") < ceiling_line(ceilings).index("qa 8.00x")
    cells = aggregate([run("rag", BASELINE, 10.0, 9.0)])
    assert "Prefill ceiling" in markdown(cells, "t", ceilings=ceilings)
    assert report_summary(cells, ceilings)["prefill_ceiling"]["rag"] == pytest.approx(1.111)
    assert prefill_ceilings([run("rag", "eagle", 1.0, 0.5)]) == {}


def test_repeats_keep_each_cell_s_median_run(pair, workload, tmp_path, capsys):
    """--repeats 3: every cell runs three times per prompt, one run (the median wall's) is kept."""
    def run(wall):
        return Run("p", "a", "x", BASELINE, 0.0, 10, 10, wall, 0.1)

    assert median_run([run(3.0), run(1.0), run(2.0)]).wall_s == 2.0
    assert median_run([run(3.0), run(1.0)]).wall_s == 1.0
    with pytest.raises(ValueError, match="repeats"):
        BenchConfig(repeats=0)
    out = tmp_path / "out"
    assert cli.main(["bench", "--target", str(pair[0]), "--workload", str(workload),
                     "--methods", "ngram", "--repeats", "3", "--max-tokens", "8", "--dtype",
                     "float64", "--out", str(out), "--json"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["config"]["repeats"] == 3
    assert len(results["runs"]) == 2 * 2 and all(r["identical"] for r in results["runs"]
                                                 if r["label"] != BASELINE)
    assert "calibrated_curve" not in results["meta"]  # a fixed k measures no curve


def test_a_divergence_in_any_repeat_is_reported(pair, workload, tmp_path, capsys, monkeypatch):
    """`identical` holds only if every repeat equals the baseline: one repeat of three (not the
    median one) that parts from plain makes the prompt's cell not identical, with its
    divergence."""
    import forerun.bench.runner as runner

    real, calls = runner.run_forerun, {"ngram": 0}

    def one_repeat_parts(engine, ids, spec, sampling, max_tokens):
        trace, stats = real(engine, ids, spec, sampling, max_tokens)
        if spec.method == "ngram":
            calls["ngram"] += 1
            if calls["ngram"] == 2:  # the first prompt's second repeat
                trace.token_ids[-1] = (trace.token_ids[-1] + 1) % 256
                trace.start -= 60.0  # and the slowest: never the median run
        return trace, stats

    monkeypatch.setattr(runner, "run_forerun", one_repeat_parts)
    out = tmp_path / "out"
    assert cli.main(["bench", "--target", str(pair[0]), "--workload", str(workload),
                     "--methods", "ngram", "--repeats", "3", "--max-tokens", "8", "--dtype",
                     "float64", "--out", str(out), "--json"]) == 0
    runs = [r for r in json.loads((out / "results.json").read_text())["runs"]
            if r["label"] != BASELINE]
    assert [r["identical"] for r in runs] == [False, True]
    assert runs[0]["divergence"] is not None and runs[1]["divergence"] is None


def test_the_curve_a_cost_decision_used_is_recorded(pair, workload, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["bench", "--target", str(pair[0]), "--workload", str(workload),
                     "--methods", "ngram", "--ks", "3", "--policies", "cost", "--max-tokens",
                     "8", "--dtype", "float64", "--out", str(out), "--json"]) == 0
    curve = json.loads((out / "results.json").read_text())["meta"]["calibrated_curve"]
    assert curve["sizes"] == [1, 2, 3, 4]  # the cost policy's: up to k + 1
    assert len(curve["seconds"]) == 4 and all(s > 0 for s in curve["seconds"])


def test_a_divergence_is_located_and_plain_s_margin_replayed():
    """A greedy run that parts from plain: where, both tokens, and plain's logit margin there,
    replayed along plain decoding's own path (prompt in one pass, then a token a pass); the
    report lists it under the table."""
    from conftest import tiny_runtime

    from forerun.reference import divergence, plain_decode, plain_logits_at
    from forerun.sampling import SamplingConfig, make_generator

    rt = tiny_runtime(0, vocab=64)
    prompt = [1, 2, 3, 4]
    plain = [t for s in plain_decode(rt, prompt, SamplingConfig(), 12, (), make_generator(0))
             for t in s.tokens]
    assert [int(plain_logits_at(rt, prompt, plain, i).argmax()) for i in range(12)] == plain
    other = [*plain[:5], (plain[5] + 1) % 64, *plain[6:]]
    d = divergence(rt, prompt, plain, other)
    logits = plain_logits_at(rt, prompt, plain, 5)  # [V]
    assert d == {"at": 5, "plain": plain[5], "speculative": other[5],
                 "logit_gap": round(float(logits[plain[5]] - logits[other[5]]), 4)}
    assert d["logit_gap"] > 0  # plain took its argmax
    assert divergence(rt, prompt, plain, plain) is None
    assert divergence(rt, prompt, plain, plain[:7]) == {
        "at": 7, "plain": plain[7], "speculative": None, "logit_gap": None}
    with pytest.raises(ValueError, match="outside"):
        plain_logits_at(rt, prompt, plain, 13)
    runs = [Run("7", "qa", BASELINE, BASELINE, 0.0, 4, 12, 1.0, 0.1, [0.1]),
            Run("7", "qa", "medusa k=4", BASELINE, 0.0, 4, 12, 1.0, 0.1, [0.1],
                identical=False, divergence=d)]
    lines = divergences(runs, decode=lambda ids: f"<{ids[0]}>")
    assert lines == [f"qa/7, medusa k=4: new token 5, plain {plain[5]} '<{plain[5]}>' vs "
                     f"{other[5]} '<{other[5]}>'; plain's logit margin {d['logit_gap']:.3f}"]
    text = markdown(aggregate(runs), "t", lines)
    assert "near-tie" in text and f"- {lines[0]}" in text


def test_generate_compare_locates_a_broken_verifier_s_divergence(pair, monkeypatch, capsys):
    """`generate --compare` on greedy output that parts from plain says where and with what
    margin; a verifier that accepts every draft token parts at a token plain was sure of."""
    import forerun.batch_verify
    from forerun.verify import TreeVerdict

    args = ["generate", "--target", str(pair[0]), "--method", "ngram", "-k", "4", "--dtype",
            "float64", "--max-tokens", "24", "--compare", "--json", "abc abc abc abc"]
    assert cli.main(args) == 0
    fine = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert fine["identical"] and "divergence" not in fine

    def accept_everything(tree, draft_tokens, best):  # greedy verifies from the argmax alone
        n = draft_tokens.shape[0]
        return TreeVerdict([*draft_tokens.tolist(), int(best[-1])], list(range(n)))

    monkeypatch.setattr(forerun.batch_verify, "greedy_accept", accept_everything)
    assert cli.main(args) == 0
    broken = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    d = broken["divergence"]
    plain, spec = broken["plain"]["token_ids"], broken["speculative"]["token_ids"]
    assert not broken["identical"] and plain[:d["at"]] == spec[:d["at"]]
    assert (d["plain"], d["speculative"]) == (plain[d["at"]], spec[d["at"]])
    assert d["logit_gap"] > 0
    assert cli.main([a for a in args if a != "--json"]) == 0
    assert f"they part at new token {d['at']}" in capsys.readouterr().err
