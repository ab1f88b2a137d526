"""OpenAI sampling features through `forerun serve` under speculation, with the real `openai`
client: logprobs (streaming and not, chat and completions), presence / frequency / repetition
penalties and logit_bias.

The server is tests/test_serve.py's (the real CLI in a subprocess, draft-model speculation
k = 3 always, tiny float64 models); every answer is checked against plain decoding of the same
prompt with the same options in the library (`Engine.generate`, method none): greedy text
equal, logprobs equal to TOLERANCE (the verify pass's several rows against one-row passes;
tests/test_logprobs.py).
"""

from __future__ import annotations

import pytest
from test_serve import (  # noqa: F401  (fixtures)
    NAME,
    client,
    model_dirs,
    post,
    server,
)

from forerun import Engine, LoadConfig, SpecConfig
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
