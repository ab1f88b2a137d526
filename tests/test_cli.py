"""The `forerun` command as a user runs it (a real subprocess, real SmolLM2 weights)."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.real
SMOL = ["--target", "smollm2-135m-instruct", "--dtype", "float32"]


def forerun(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "forerun.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=300)


def test_generate_json_has_the_documented_fields():
    r = forerun("generate", *SMOL, "--method", "ngram", "-k", "3", "--max-tokens", "12",
                "--json", "Say hello.")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert {"text", "token_ids", "finish_reason", "stats"} <= out.keys()
    assert {"method", "k", "new_tokens", "target_forward_passes", "acceptance_rate",
            "mean_accepted_length", "ttft_s", "tokens_per_s", "wall_s"} <= out["stats"].keys()
    assert out["stats"]["method"] == "ngram" and 0 < out["stats"]["new_tokens"] <= 12


def test_generate_json_carries_logprobs_where_asked():
    r = forerun("generate", *SMOL, "--method", "ngram", "--max-tokens", "6", "--json",
                "--logprobs", "2", "--prompt-logprobs", "1", "--raw", "Say hello.")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["logprobs"]) == len(out["token_ids"])
    assert all(len(lp["top"]) == 2 and lp["logprob"] <= 0 for lp in out["logprobs"])
    assert len(out["prompt_logprobs"]) == out["prompt_tokens"]
    assert out["prompt_logprobs"][0] is None and len(out["prompt_logprobs"][1]["top"]) == 1


def test_compare_json_reports_speedup_and_identity_from_stdin():
    r = forerun("generate", *SMOL, "--method", "draft", "--draft", "smollm2-135m-instruct",
                "--draft-dtype", "float32", "--max-tokens", "16", "--compare", "--json",
                stdin="List three colors.")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert {"plain", "speculative", "speedup", "identical"} <= out.keys()
    assert out["identical"] is True  # draft == target, greedy
    assert out["speculative"]["stats"]["acceptance_rate"] == 1.0


def test_streaming_prints_text_and_stats():
    r = forerun("generate", *SMOL, "--method", "ngram", "--max-tokens", "8", "Say hi.")
    assert r.returncode == 0 and r.stdout.strip()
    assert "tok/s" in r.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--temperature", "-1"], "temperature must be"),
    (["--top-p", "0"], "top_p must be"),
    (["--target", "no-such-model"], "known models: gemma3-270m"),
    (["--target", "./nope.gguf"], "no such file"),
    (["--draft", "gemma3-270m"], "architecture is not supported"),
    (["--presence-penalty", "5"], "presence_penalty must be in [-2, 2]"),
    (["--method", "ngram", "--logit-bias", "999999=1"], "outside the vocabulary"),
    (["--json-schema", "./nope.json"], "No such file"),
    (["--method", "ngram", "--regex", "("], "does not"),
    (["--regex", "a", "--grammar", "g.lark"], "give one of"),
])
def test_bad_input_is_one_clear_line(args, message):
    r = forerun("generate", *SMOL, "--max-tokens", "4", *args, "hi")
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr


def test_structured_output_and_penalties_from_the_command_line():
    import re

    r = forerun("generate", *SMOL, "--method", "ngram", "--max-tokens", "24", "--json",
                "--regex", "(yes|no), [0-9]{2}", "--presence-penalty", "0.5",
                "--logit-bias", "28=-100", "Answer.")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert re.fullmatch("(yes|no), [0-9]{2}", out["text"]) and out["finish_reason"] == "stop"
    r = forerun("generate", *SMOL, "--logit-bias", "x", "hi")
    assert r.returncode == 2 and "expected TOKEN=BIAS" in r.stderr


def test_models_list_json():
    r = forerun("models", "list", "--json")
    names = {m["name"] for m in json.loads(r.stdout)}
    assert {"qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct",
            "smollm2-135m-instruct", "gemma3-270m"} == names
