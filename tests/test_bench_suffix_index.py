"""`forerun bench --suffix-index cold,warm` on tiny GGUF models: a suffix cell per state of the
global index; cold drafts from the request alone; warm from the outputs of the prompts before,
never its own prompt's (not another repeat's, not another cell's); conversations reach the
runtime with every turn."""

import json

import pytest
import torch
from test_bench import pair  # noqa: F401  (fixture: a tiny target and a draft)

from forerun import cli
from forerun.api import Engine
from forerun.bench.runner import BASELINE, BenchConfig, encode, start_index
from forerun.bench.workloads import Prompt
from forerun.propose import SpecConfig
from forerun.propose.suffix import STORE


def test_a_cell_per_state_and_cold_has_no_global_index():
    cells = dict(BenchConfig(methods=("ngram", "suffix"), ks=(4,), policies=("cost",),
                             suffix_index=("cold", "warm")).cells())
    assert list(cells) == [BASELINE, "ngram k=4 cost", "suffix k=4 cost cold",
                           "suffix k=4 cost warm"]
    assert cells["suffix k=4 cost cold"].suffix_cache_tokens == 0
    assert cells["suffix k=4 cost warm"].suffix_cache_tokens > 0
    assert "suffix k=4 warm" in dict(BenchConfig(methods=("suffix",)).cells())  # the default
    for bad in (("hot",), ()):
        with pytest.raises(ValueError, match="suffix index states"):
            BenchConfig(suffix_index=bad)


def test_a_warm_run_starts_from_earlier_outputs_only(pair):  # noqa: F811
    engine = Engine(str(pair[0]), None, spec=SpecConfig("none"))
    engine.proposers.shared[STORE] = "untouched"
    start_index(engine, SpecConfig("suffix", suffix_cache_tokens=0), [[5, 6, 7]])  # cold
    start_index(engine, SpecConfig("ngram"), [[5, 6, 7]])
    assert engine.proposers.shared[STORE] == "untouched"
    start_index(engine, SpecConfig("suffix", suffix_cache_tokens=1024), [[5, 6, 7], [8, 9]])
    index = engine.proposers.shared[STORE]
    assert index.capacity == 1024
    assert index.lookup([5, 6]).length == 2
    assert index.lookup([7, 8]).length == 1  # no match across two documents
    start_index(engine, SpecConfig("suffix", suffix_cache_tokens=1024), [])
    assert engine.proposers.shared[STORE] is not index and engine.proposers.shared[STORE].total == 0


def test_warm_drafts_from_the_prompts_before_never_its_own(pair, tmp_path):  # noqa: F811
    """Two identical prompts: the first's warm runs draft exactly as its cold ones (its index is
    empty, whatever ran before in its round or an earlier repeat); the second's warm runs
    draft from the first's output."""
    workload = tmp_path / "w.jsonl"
    text = "abc abd abc abd hello"
    workload.write_text("".join(json.dumps({"id": i, "category": "c", "prompt": text}) + "\n"
                                for i in ("first", "second")))
    out = tmp_path / "out"
    assert cli.main(["bench", "--target", str(pair[0]), "--workload", str(workload),
                     "--methods", "suffix", "--ks", "2,4", "--suffix-index", "cold,warm",
                     "--repeats", "2", "--max-tokens", "16", "--dtype", "float64",
                     "--limit", "0", "--out", str(out), "--json"]) == 0
    runs = {(r["prompt_id"], r["label"]): r
            for r in json.loads((out / "results.json").read_text())["runs"]}
    assert len(runs) == 2 * 5
    assert all(r["identical"] for r in runs.values() if r["label"] != BASELINE)
    for k in (2, 4):
        cold, warm = runs["first", f"suffix k={k} cold"], runs["first", f"suffix k={k} warm"]
        assert (warm["drafted"], warm["accepted"]) == (cold["drafted"], cold["accepted"])
        cold, warm = runs["second", f"suffix k={k} cold"], runs["second", f"suffix k={k} warm"]
        assert warm["accepted"] > cold["accepted"]
        assert warm["verify_steps"] < cold["verify_steps"]


def test_a_conversation_is_encoded_with_every_turn(pair):  # noqa: F811
    engine = Engine(str(pair[0]), None, spec=SpecConfig("none"))
    lone = Prompt("a", "c", ({"role": "user", "content": "hi"},))
    assert encode(engine.tokenizer, lone) == engine.tokenizer.encode_prompt("hi")
    turns = Prompt("b/2", "c", ({"role": "user", "content": "hi"},
                                {"role": "assistant", "content": "yo"},
                                {"role": "user", "content": "again"}), "b")
    text = engine.tokenizer.decode(encode(engine.tokenizer, turns))
    assert text.index("hi") < text.index("yo") < text.index("again")
    assert torch.tensor(encode(engine.tokenizer, turns)).numel() > len("hiyoagain")
