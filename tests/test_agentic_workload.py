"""The agentic workload (`--workload agentic`) and conversations as a workload shape: every user
turn is one prompt carrying the turns before it, in order; a category of conversations is
sampled by whole conversations; the shipped file is the one its SOURCE.md describes. No
models."""

import ast
import hashlib
import itertools
import json
import re

import pytest

from forerun.bench.workloads import BUILTIN, WorkloadError, read_workload, sample_workloads

CATEGORIES = {"tool_calls", "sql", "edits"}
MAX_BYTES = 300_000  # the workload ships inside the package: small


@pytest.fixture(scope="module")
def agentic():
    return read_workload("agentic")


def test_every_user_turn_is_a_prompt_with_the_turns_before_it(agentic):
    assert {p.category for p in agentic} == CATEGORIES
    by_conversation = {}
    for p in agentic:
        by_conversation.setdefault(p.conversation, []).append(p)
    assert len(by_conversation) == 49 and len(agentic) == 58 + 65 + 33
    for cid, turns in by_conversation.items():
        assert [p.id for p in turns] == [f"{cid}/{n}" for n in range(1, len(turns) + 1)]
        assert len(turns) >= 2
        for before, after in itertools.pairwise(turns):
            # the next prompt = this one + the assistant's answer + the next user turn
            assert after.messages[:len(before.messages)] == before.messages
            assert [m["role"] for m in after.messages[len(before.messages):]] == [
                "assistant", "user"]
        for p in turns:
            assert p.messages[0]["role"] == "system" and p.messages[-1]["role"] == "user"
            assert p.text == p.messages[-1]["content"]


def test_assistant_turns_have_the_category_s_shape(agentic):
    last = {}
    for p in agentic:
        last[p.conversation] = p
    for p in last.values():
        answers = [m["content"] for m in p.messages if m["role"] == "assistant"]
        for answer in answers:
            if p.category == "tool_calls":
                calls = json.loads(answer)
                assert calls and all(set(c) == {"name", "arguments"} for c in calls)
            elif p.category == "sql":
                assert re.match(r"(SELECT|INSERT|UPDATE|DELETE|CREATE) ", answer)
                assert answer.endswith(";")
            else:
                assert answer.startswith("```python\n") and answer.endswith("\n```")
                ast.parse(answer[len("```python\n"):-len("\n```")])


def test_edits_rename_one_identifier_a_turn(agentic):
    p = next(p for p in reversed(agentic) if p.category == "edits" and p.id.endswith("/3"))
    codes = [m["content"] for m in p.messages if m["role"] == "assistant"]
    asked = [re.search(r"rename `(\w+)` to `(\w+)`", m["content"], re.I).groups()
             for m in p.messages if m["role"] == "user"]
    for code, (old, new) in zip(codes, asked, strict=False):
        assert re.search(rf"\b{new}\b", code)
        names = {n.id for n in ast.walk(ast.parse(code.strip("`").removeprefix("python\n")))
                 if isinstance(n, ast.Name)}
        assert old not in names


def test_sampling_keeps_conversations_whole_and_in_order():
    chosen = sample_workloads(["agentic:6"], None, seed=0)
    assert len(chosen) == 3 * 6
    assert chosen == sample_workloads(["agentic:6"], None, seed=0)
    assert chosen != sample_workloads(["agentic:6"], None, seed=1)
    for category in CATEGORIES:
        ids = [p.id for p in chosen if p.category == category]
        turns = {}
        for pid in ids:
            cid, n = pid.rsplit("/", 1)
            turns.setdefault(cid, []).append(int(n))
        # each conversation from its first turn, its turns consecutive and in order
        assert all(ns == list(range(1, len(ns) + 1)) for ns in turns.values())
        assert [p.id for p in chosen if p.category == category] == [
            f"{c}/{n}" for c, ns in turns.items() for n in ns]
    everything = sample_workloads(["agentic"], None, seed=0)
    assert everything == read_workload("agentic")  # no limit: file order


def test_a_conversation_file_reads_and_bad_ones_fail_clearly(tmp_path):
    path = tmp_path / "c.jsonl"
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"}]
    path.write_text(json.dumps({"id": "x", "category": "chat", "messages": messages}) + "\n"
                    + json.dumps({"messages": messages[:1]}) + "\n")
    first, second, lone = read_workload(str(path))
    assert (first.id, second.id, lone.id) == ("x/1", "x/2", "2/1")
    assert second.messages == tuple(messages) and lone.category == "c"
    for bad, match in ((messages[1:2], "no user turn"),
                       ([{"role": "robot", "content": "a"}], "messages must be"),
                       ("hello", "messages must be")):
        path.write_text(json.dumps({"messages": bad}) + "\n")
        with pytest.raises(WorkloadError, match=match):
            read_workload(str(path))


def test_the_shipped_file_is_small_and_the_one_source_md_names():
    path = BUILTIN["agentic"]
    data = path.read_bytes()
    assert len(data) < MAX_BYTES
    source = (path.parent / "SOURCE.md").read_text()
    assert hashlib.sha256(data).hexdigest() in source
    assert "Apache License" in (path.parent / "LICENSE.upstream").read_text()
