"""The long_context workload: every row's stdlib excerpt is the text it was built from (its
SHA-256), within its category's token budget, and renders to prompts the bench reads."""

from __future__ import annotations

import pytest

from forerun.bench.long_context import excerpt, render, rows
from forerun.bench.workloads import sample_workloads

BUDGETS = {"ctx_2k": 2048, "ctx_4k": 4096, "ctx_8k": 8192, "ctx_16k": 16384}


def test_every_row_is_its_built_text_within_its_budget():
    every = rows()
    assert {r["category"] for r in every} == set(BUDGETS)
    for row in every:
        assert excerpt(row)  # raises if the stdlib lines are not the ones hashed
        assert 0.9 * BUDGETS[row["category"]] <= row["tokens"] <= BUDGETS[row["category"]]


def test_a_changed_file_fails_clearly(tmp_path):
    row = {**rows()[0], "sha256": "0" * 64}
    with pytest.raises(ValueError, match="rebuild it"):
        excerpt(row)


def test_rendered_prompts_load_as_a_bench_workload(tmp_path):
    out = tmp_path / "long_context.jsonl"
    assert render(out, ["ctx_2k", "ctx_4k"]) == 6
    prompts = sample_workloads([str(out)], None, 0)
    assert sorted(p.category for p in prompts) == ["ctx_2k"] * 3 + ["ctx_4k"] * 3
    assert all("```python" in p.text and p.text.rstrip().endswith(".") for p in prompts)
