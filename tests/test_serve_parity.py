"""OpenAI sampling features through `forerun serve` under speculation, with the real `openai`
client: logprobs (streaming and not, chat and completions), presence / frequency / repetition
penalties and logit_bias, structured output (`response_format` json_object / json_schema, a
pydantic model through the client's `parse`, vLLM's `structured_outputs` regex and grammar).

The server is tests/test_serve.py's (the real CLI in a subprocess, draft-model speculation
k = 3 always, tiny float64 models); every answer is checked against plain decoding of the same
prompt with the same options in the library (`Engine.generate`, method none): greedy text
equal, logprobs equal to TOLERANCE (the verify pass's several rows against one-row passes;
tests/test_logprobs.py).
"""

from __future__ import annotations

import json
from typing import Literal

import pytest
from pydantic import BaseModel
from test_serve import (  # noqa: F401  (fixtures)
    NAME,
    client,
    model_dirs,
    post,
    server,
)

from forerun import Engine, LoadConfig, SpecConfig
from forerun.grammar import Grammar
from forerun.processors import Processing
from forerun.sampling import SamplingConfig

TOLERANCE = 1e-9
PROMPTS = ["def f(x):", "abcabcabc", "The quick brown fox"]
MAX_TOKENS = 12
SPECS = [None, {"method": "ngram", "k": 4}, "off"]


@pytest.fixture(scope="module")
def plain(model_dirs):  # noqa: F811
    """plain(ids, **generate kwargs) -> the Completion of plain decoding in the library."""
    engine = Engine(str(model_dirs[0]), None, spec=SpecConfig("none"),
                    load=LoadConfig(dtype="float64"))

    def run(prompt, chat=False, **kw):
        ids = (engine.tokenizer.encode_chat([{"role": "user", "content": prompt}]) if chat
               else engine.tokenizer.encode_prompt(prompt, raw=True))
        return engine.generate(ids, max_tokens=MAX_TOKENS, **kw)

    run.tokenizer = engine.tokenizer
    return run


def _close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(abs(a - b) <= TOLERANCE for a, b in zip(got, want,
                                                                                 strict=True))


@pytest.mark.parametrize("speculation", SPECS)
@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_equal_plain_decodings(server, plain, speculation, stream):  # noqa: F811
    c = client(server)
    extra = {} if speculation is None else {"speculation": speculation}
    for prompt in PROMPTS:
        want = plain(prompt, logprobs=2)
        args = dict(model=NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=2,
                    extra_body=extra)
        if stream:
            chunks = [ch.choices[0] for ch in c.completions.create(stream=True, **args)
                      if ch.choices]
            text = "".join(ch.text for ch in chunks)
            logprobs = [lp for ch in chunks if ch.logprobs for lp in ch.logprobs.token_logprobs]
            tops = [t for ch in chunks if ch.logprobs for t in ch.logprobs.top_logprobs]
        else:
            choice = c.completions.create(**args).choices[0]
            text, logprobs = choice.text, choice.logprobs.token_logprobs
            tops = choice.logprobs.top_logprobs
            assert len(choice.logprobs.tokens) == len(logprobs)
            assert choice.logprobs.text_offset[0] == 0
        assert text == want.text
        assert _close(logprobs, [lp.logprob for lp in want.logprobs])
        assert len(tops) == len(want.logprobs)
        for top, lp in zip(tops, want.logprobs, strict=True):  # text keys: likeliest per text
            texts = {plain.tokenizer.token_text(t): v for t, v in reversed(lp.top)}
            assert set(top) == set(texts) and _close([top[t] for t in texts], list(texts.values()))


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_with_top_alternatives(server, plain, stream):  # noqa: F811
    c = client(server)
    want = plain("hello", chat=True, logprobs=3)
    args = dict(model=NAME, messages=[{"role": "user", "content": "hello"}],
                max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=3)
    if stream:
        content = [e for ch in c.chat.completions.create(stream=True, **args) if ch.choices
                   and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    else:
        content = c.chat.completions.create(**args).choices[0].logprobs.content
    assert _close([e.logprob for e in content], [lp.logprob for lp in want.logprobs])
    assert [e.token for e in content] == [plain.tokenizer.token_text(lp.token)
                                          for lp in want.logprobs]
    for e, lp in zip(content, want.logprobs, strict=True):
        assert len(e.top_logprobs) == 3 and bytes(e.bytes).decode() == e.token
        assert _close([t.logprob for t in e.top_logprobs], [v for _, v in lp.top])


PROCESSING = {  # request fields -> the library's options
    "penalties": ({"presence_penalty": 1.0, "frequency_penalty": 0.5},
                  Processing(presence_penalty=1.0, frequency_penalty=0.5)),
    "repetition": ({"extra_body": {"repetition_penalty": 1.4}}, Processing(1.4)),
    "bias": ({"logit_bias": {"100": 8.0, "101": -100}}, Processing.of(logit_bias={100: 8.0,
                                                                                 101: -100})),
}


@pytest.mark.parametrize("name", list(PROCESSING))
@pytest.mark.parametrize("speculation", SPECS)
def test_penalties_and_bias_equal_plain_decoding_with_them(server, plain, name,  # noqa: F811
                                                           speculation):
    fields, processing = PROCESSING[name]
    c, changed = client(server), False
    extra = dict(fields.get("extra_body", {}))
    if speculation is not None:
        extra["speculation"] = speculation
    for prompt in PROMPTS:
        want = plain(prompt, sampling=SamplingConfig(processing=processing))
        got = c.completions.create(model=NAME, prompt=prompt, max_tokens=MAX_TOKENS,
                                   temperature=0, extra_body=extra,
                                   **{k: v for k, v in fields.items() if k != "extra_body"})
        assert got.choices[0].text == want.text
        changed |= want.text != plain(prompt).text
    assert changed  # the options change the output on some prompt


def test_a_strong_bias_forces_its_token(server, plain):  # noqa: F811
    token = 120
    text = plain.tokenizer.token_text(token)
    r = post(server, "/v1/completions", {"model": NAME, "prompt": "abc", "max_tokens": 6,
                                         "temperature": 0, "logit_bias": {str(token): 100}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == text * 6


# --- structured output: response_format and structured_outputs ----------------------------------

class Pet(BaseModel):
    kind: Literal["cat", "dog", "owl"]
    legs: Literal[2, 4]
    indoor: bool


REGEX = r"(ab|ba)+c[0-9]{2}"


def test_a_pydantic_response_format_comes_back_parsed(server):  # noqa: F811
    """The openai client's `parse` (a strict json_schema): the parsed object, under the
    server's draft speculation."""
    c = client(server)
    for prompt in ("a pet", "another pet"):
        out = c.chat.completions.parse(model=NAME, response_format=Pet, max_tokens=90,
                                       temperature=0,
                                       messages=[{"role": "user", "content": prompt}])
        assert isinstance(out.choices[0].message.parsed, Pet)
        assert out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("speculation", SPECS)
def test_structured_outputs_equal_plain_decoding_under_the_same_grammar(server, plain,  # noqa: F811
                                                                        speculation):
    import re

    c = client(server)
    extra = {"structured_outputs": {"regex": REGEX}}
    if speculation is not None:
        extra["speculation"] = speculation
    for prompt in PROMPTS:
        want = plain(prompt, sampling=SamplingConfig(grammar=Grammar("regex", REGEX)))
        got = c.completions.create(model=NAME, prompt=prompt, max_tokens=MAX_TOKENS,
                                   temperature=0, extra_body=extra).choices[0]
        assert got.text == want.text
        if got.finish_reason == "stop":  # (else cut by max_tokens: a prefix of a match)
            assert re.fullmatch(REGEX, got.text)


def test_json_object_and_schema_on_completions_and_chat(server):  # noqa: F811
    c = client(server)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}
    r = c.completions.create(model=NAME, prompt="{", max_tokens=30, temperature=0,
                             extra_body={"response_format": {"type": "json_schema",
                                                             "json_schema": {"name": "x",
                                                                             "schema": schema}}})
    assert json.loads(r.choices[0].text) in ({"ok": True}, {"ok": False})
    stream = c.chat.completions.create(model=NAME, max_tokens=MAX_TOKENS, temperature=0,
                                       messages=[{"role": "user", "content": "json"}],
                                       response_format={"type": "json_object"}, stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text.startswith("{")


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "not one of"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs", "does not"),
    ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs", "does not"),
    ({"structured_outputs": {"regex": "a", "grammar": "start: \"a\""}}, "structured_outputs",
     "exactly one"),
    ({"structured_outputs": {"choice": ["a"]}}, "structured_outputs.choice", ""),
])
def test_bad_structured_output_requests_are_clear_400s(server, fields, param, message):  # noqa: F811
    r = post(server, "/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 4} | fields)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"]
    assert post(server, "/v1/completions", {"model": NAME, "prompt": "x",
                                            "max_tokens": 2}).status_code == 200
