"""OpenAI parity under speculation on real weights (SmolLM2-135M-Instruct): structured output
and logprobs, for every method.

- Greedy under a JSON schema (float64 target; the draft model its float32 copy; random Medusa
  and EAGLE heads with the prompt-lookup branch, since random heads' own nodes rarely survive
  the grammar's cut): every method's output is plain constrained greedy's token for token,
  parses, and validates against the schema (checked by hand: no jsonschema dependency); every
  method drafted and had drafts accepted. Two prompts: a description the model turns into an
  object, and one with an example object the model copies (n-gram lookup then drafts the
  example's end and the chat turn's stop token after it).
- Logprobs (float32, a raw code prompt, 48 tokens): every method's `logprobs=5` (the same
  speculation as above; every method has drafts accepted, so tokens come from deep rows of
  chain and tree passes) against plain decoding's (spec none: the batch step, one token a
  pass). A verify pass computes several rows in one matmul, so its float32 logits differ from
  a one-row pass in the last bits: same tokens, same top alternatives in the same order, every
  logprob within TOLERANCE = 5e-4. Seen: at most 5.9e-5 (draft model 5.9e-5, n-gram 5.7e-5,
  Medusa and EAGLE 5.3e-5); the closest two neighbouring alternatives of plain's were 4.8e-3
  apart, 80x that, so no rank flips.
"""

import json

import pytest
from conftest import random_heads

from forerun import Engine, SamplingConfig, SpecConfig
from forerun.grammar import Grammar
from forerun.models.load import open_model

pytestmark = [pytest.mark.real, pytest.mark.usefixtures("one_thread")]
SMOL = "smollm2-135m-instruct"
LANGUAGES = ["Python", "Rust", "Go", "C"]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "languages": {"type": "array", "items": {"type": "string", "enum": LANGUAGES},
                  "maxItems": 3},
    "employed": {"type": "boolean"}},
    "required": ["name", "age", "languages", "employed"], "additionalProperties": False}
DESCRIBE = "Ada is a 36 year old engineer who writes Python and Rust and has a job."
SCHEMA_PROMPTS = {
    "description": f"{DESCRIBE} Describe her as a JSON object.",
    "example": f'{DESCRIBE} Describe her as a JSON object like this one: {{"name": "Bob", '
               '"age": 41, "languages": ["Go"], "employed": false}',
}
STRUCTURED = SamplingConfig(grammar=Grammar("json_schema", json.dumps(SCHEMA)))
METHODS = {  # method -> its speculation; head trees of 8 nodes, plus the lookup branch
    "draft": SpecConfig("draft", 4),
    "ngram": SpecConfig("ngram", 4),
    "medusa": SpecConfig("medusa", 4, tree=8, lookup=True),
    "eagle": SpecConfig("eagle", 4, tree=8, lookup=True),
}
MAX_TOKENS = 64
TOLERANCE = 5e-4  # float32 logprobs of a several-row verify pass against a one-row pass
LOGPROB_PROMPT = ("class Stack:\n    def __init__(self):\n        self.items = []\n\n"
                  "    def push(self, x):\n        self.items.append(x)\n\n")
LOGPROB_TOKENS, TOP = 48, 5


def _engines(dtype: str) -> dict[str, Engine]:
    """method -> an engine on one SmolLM2 target in `dtype` (the draft model: its float32
    copy; each head method: random heads of its kind on the target)."""
    src = open_model(SMOL)
    target = src.load(dtype=dtype)
    engine = Engine.from_runtimes(target, src.tokenizer, src.load(dtype="float32"))
    heads = {kind: Engine.from_runtimes(target, src.tokenizer, None,
                                        heads=random_heads(kind, target))
             for kind in ("medusa", "eagle")}
    return {"none": engine, "draft": engine, "ngram": engine, **heads}


@pytest.fixture(scope="module")
def float64_engines():
    return _engines("float64")


@pytest.fixture(scope="module")
def float32_engines():
    return _engines("float32")


def check_schema(value) -> None:
    """`value` is valid for SCHEMA."""
    assert isinstance(value, dict) and set(value) == set(SCHEMA["required"]), value
    assert isinstance(value["name"], str) and len(value["name"]) <= 24
    assert type(value["age"]) is int and 0 <= value["age"] <= 150
    assert isinstance(value["languages"], list) and len(value["languages"]) <= 3
    assert all(lang in LANGUAGES for lang in value["languages"])
    assert type(value["employed"]) is bool


@pytest.mark.parametrize("prompt", list(SCHEMA_PROMPTS))
def test_greedy_under_a_json_schema_equals_plain_for_every_method(float64_engines, prompt):
    plain = float64_engines["none"].generate(SCHEMA_PROMPTS[prompt], max_tokens=MAX_TOKENS,
                                             sampling=STRUCTURED, spec=SpecConfig("none"))
    assert plain.finish_reason == "stop"  # the object is complete
    check_schema(json.loads(plain.text))
    for method, spec in METHODS.items():
        out = float64_engines[method].generate(SCHEMA_PROMPTS[prompt], max_tokens=MAX_TOKENS,
                                               sampling=STRUCTURED, spec=spec)
        assert out.token_ids == plain.token_ids, method
        assert out.text == plain.text
        assert out.stats.accepted > 0, (method, out.stats)


def test_every_methods_logprobs_equal_plain_decodings_within_float32_rounding(float32_engines):
    def run(method, spec):
        return float32_engines[method].generate(LOGPROB_PROMPT, raw=True,
                                                max_tokens=LOGPROB_TOKENS, spec=spec,
                                                logprobs=TOP)

    plain = run("none", SpecConfig("none"))
    assert len(plain.logprobs) == LOGPROB_TOKENS
    for method, spec in METHODS.items():
        out = run(method, spec)
        assert out.token_ids == plain.token_ids, method
        assert out.stats.accepted > 0, (method, out.stats)
        for got, want in zip(out.logprobs, plain.logprobs, strict=True):
            assert got.token == want.token
            assert [t for t, _ in got.top] == [t for t, _ in want.top], method
            assert abs(got.logprob - want.logprob) <= TOLERANCE, method
            for (_, a), (_, b) in zip(got.top, want.top, strict=True):
                assert abs(a - b) <= TOLERANCE, method
