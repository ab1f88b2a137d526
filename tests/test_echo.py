"""Prompt logprobs (`echo` on completions): the target's log-probability of every prompt token
given the tokens before it, from the prefill's own rows, under every method.

Properties (tiny float64 models):
- the prompt's logprobs and their top alternatives are the log-softmax of one plain pass over
  the prompt (`_expected`), the first token's None; to TOLERANCE = 1e-12 (seen: 0, bit for bit,
  unchunked; chunked prefills compute the same rows in smaller passes);
- asking for them changes nothing about the output: the same tokens, their logprobs to
  TOLERANCE (the first token's row now comes from a pass that computes every prompt row's
  logits, not the last row's alone: seen 8.9e-16 apart);
- in a batch whose prompts are prefilled in chunks beside other members' decodes, each member
  gets its own prompt's, and the members that did not ask get none;
- the library returns them and checks the count; through the server with the real `openai`
  client, `echo` sends the prompt back before the text, streaming and not, with and without
  logprobs, the prompt's logprobs first (the first null) and the text's offsets after it.
"""

from __future__ import annotations

import pytest
import torch
from conftest import random_heads, tiny_model
from test_serve import (  # noqa: F401  (fixtures)
    NAME,
    client,
    model_dirs,
    server,
)

from forerun import Engine, LoadConfig, SpecConfig
from forerun.batch_engine import Sequence, admit, retire, step
from forerun.engine import speculative_decode
from forerun.policy import FixedK
from forerun.propose import HEAD_PROPOSERS, PROPOSERS, ProposerContext
from forerun.runtime.batch import BatchTorchRuntime
from forerun.runtime.torch_model import TorchRuntime
from forerun.sampling import SamplingConfig, make_generator

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]
NEW, TOP = 12, 3
TOLERANCE = 1e-12  # float64 rows of a chunked prefill against one pass over the whole prompt


def _expected(prompt: list[int]) -> list[tuple[float, list[int], list[float]] | None]:
    """(logprob of each prompt token, its row's TOP alternatives) from one pass over the prompt."""
    logp = TorchRuntime(tiny_model(0), capacity=256).forward(
        torch.tensor(prompt)).logits.double().log_softmax(-1)  # [T, V]
    out: list[tuple[float, list[int], list[float]] | None] = [None]
    for i in range(1, len(prompt)):
        top = logp[i - 1].topk(TOP)
        out.append((float(logp[i - 1, prompt[i]]), top.indices.tolist(), top.values.tolist()))
    return out


def _check(echoed, prompt: list[int]) -> float:
    assert len(echoed) == len(prompt) and echoed[0] is None
    worst = 0.0
    for lp, token, (want, ids, values) in zip(echoed[1:], prompt[1:], _expected(prompt)[1:],
                                              strict=True):
        assert lp.token == token and [t for t, _ in lp.top] == ids
        for got, ref in [(lp.logprob, want), *zip([v for _, v in lp.top], values, strict=True)]:
            worst = max(worst, abs(got - ref))
    assert worst <= TOLERANCE, worst
    return worst


def _proposer(method: str, target: TorchRuntime):
    if method == "none":
        return None, None
    draft = TorchRuntime(tiny_model(0, noise=0.05), capacity=256)
    heads = random_heads(method, target) if method in HEAD_PROPOSERS else None
    spec = SpecConfig(method, 4, tree=6 if heads is not None else 0)
    return PROPOSERS[method](spec, ProposerContext(target, draft, heads)), FixedK(4)


@pytest.mark.parametrize("method", ["none", "draft", "ngram", "medusa"])
def test_prompt_logprobs_are_one_plain_pass_and_change_nothing(method):
    runs = []
    for asked in (TOP, None):
        target = TorchRuntime(tiny_model(0), capacity=256)
        proposer, policy = _proposer(method, target)
        runs.append(list(speculative_decode(target, proposer, policy, PROMPT, SamplingConfig(),
                                            NEW, (), make_generator(0), logprobs=TOP,
                                            prompt_logprobs=asked)))
    echoed, plain = runs
    assert _check(echoed[0].prompt_logprobs, PROMPT) == 0.0  # the same pass, bit for bit
    assert all(s.prompt_logprobs is None for s in echoed[1:] + plain)
    assert [s.tokens for s in echoed] == [s.tokens for s in plain]
    for a, b in zip(echoed, plain, strict=True):  # the first token's row: from a pass over
        for x, y in zip(a.logprobs, b.logprobs, strict=True):  # every row, not the last only
            assert x.token == y.token and abs(x.logprob - y.logprob) <= TOLERANCE


def test_chunked_prefills_in_a_batch_echo_each_members_own_prompt():
    runtime = BatchTorchRuntime(TorchRuntime(tiny_model(0), capacity=256), 1 << 20)
    target = TorchRuntime(tiny_model(0), capacity=256)
    prompts = [PROMPT, [9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 8, 7, 6, 5, 4, 3, 2], [5, 6], [4, 4, 4]]
    seqs = []
    for i, prompt in enumerate(prompts):
        proposer, policy = _proposer(("ngram", "draft", "none", "ngram")[i], target)
        seqs.append(Sequence(list(prompt), SamplingConfig(), NEW, make_generator(0), (),
                             proposer, policy, max_k=4 if proposer else 0,
                             prompt_logprobs=None if i == 3 else TOP))
    live = []
    for s in seqs:
        admit(runtime, s)
        live.append(s)
    passes = 0
    while live:
        step(runtime, live, max_tokens=5)  # prompts fed 5 rows a pass, beside decodes
        passes += 1
        for s in [s for s in live if s.finish]:
            retire(runtime, s)
            live.remove(s)
    assert passes > NEW  # the long prompts took several passes
    for s, prompt in zip(seqs[:3], prompts, strict=False):
        _check(s.steps[0].prompt_logprobs, prompt)
        assert sum(st.prompt_logprobs is not None for st in s.steps) == 1
    assert all(st.prompt_logprobs is None for st in seqs[3].steps)


def test_the_library_returns_prompt_logprobs_and_checks_the_count():
    from test_engine import word_tokenizer

    engine = Engine.from_runtimes(TorchRuntime(tiny_model(0), capacity=256), word_tokenizer(),
                                  TorchRuntime(tiny_model(0, noise=0.05), capacity=256),
                                  SpecConfig("draft", 3))
    out = engine.generate(PROMPT, max_tokens=8, prompt_logprobs=2)
    assert len(out.prompt_logprobs) == len(PROMPT) and out.prompt_logprobs[0] is None
    assert all(len(lp.top) == 2 for lp in out.prompt_logprobs[1:])
    assert out.to_dict()["prompt_logprobs"][0] is None and out.logprobs is None
    assert engine.generate(PROMPT, max_tokens=8).prompt_logprobs is None
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        engine.generate(PROMPT, max_tokens=8, prompt_logprobs=21)


# --- through the server, with the real openai client --------------------------------------------

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def plain(model_dirs):  # noqa: F811
    engine = Engine(str(model_dirs[0]), None, spec=SpecConfig("none"),
                    load=LoadConfig(dtype="float64"))

    def run(prompt, **kw):
        ids = engine.tokenizer.encode_prompt(prompt, raw=True)
        return engine.generate(ids, max_tokens=MAX_TOKENS, **kw), ids

    run.tokenizer = engine.tokenizer
    return run


def _close(got, want) -> bool:
    return len(got) == len(want) and all(
        (a is None and b is None) or abs(a - b) <= 1e-9 for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("stream", [False, True])
def test_echo_sends_the_prompt_and_its_logprobs_first(server, plain, stream):  # noqa: F811
    c, prompt = client(server), "abcabcabc"
    want, ids = plain(prompt, logprobs=2, prompt_logprobs=2)
    args = dict(model=NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=2,
                echo=True, extra_body={"speculation": {"method": "ngram", "k": 4}})
    if stream:
        chunks = [ch.choices[0] for ch in c.completions.create(stream=True, **args)
                  if ch.choices]
        text = "".join(ch.text for ch in chunks)
        cols = [ch.logprobs for ch in chunks if ch.logprobs]
        tokens = [t for col in cols for t in col.tokens]
        logprobs = [lp for col in cols for lp in col.token_logprobs]
        tops = [t for col in cols for t in col.top_logprobs]
        offsets = [o for col in cols for o in col.text_offset]
    else:
        col = c.completions.create(**args).choices[0]
        text, lps = col.text, col.logprobs
        tokens, logprobs, tops, offsets = (lps.tokens, lps.token_logprobs, lps.top_logprobs,
                                           lps.text_offset)
    assert text == prompt + want.text
    assert tokens == [plain.tokenizer.token_text(t) for t in ids + want.token_ids]
    expected = [None if lp is None else lp.logprob for lp in want.prompt_logprobs] + [
        lp.logprob for lp in want.logprobs]
    assert _close(logprobs, expected) and tops[0] is None
    assert len(tops) == len(expected) and all(len(t) >= 1 for t in tops[1:])
    assert offsets[0] == 0 and offsets[len(ids)] == len(prompt)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_without_logprobs_is_the_prompt_then_the_text(server, plain, stream):  # noqa: F811
    c, prompt = client(server), "def f(x):"
    want, _ = plain(prompt)
    args = dict(model=NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, echo=True)
    if stream:
        chunks = [ch.choices[0] for ch in c.completions.create(stream=True, **args)
                  if ch.choices]
        assert chunks[0].text == prompt and all(ch.logprobs is None for ch in chunks)
        text = "".join(ch.text for ch in chunks)
    else:
        choice = c.completions.create(**args).choices[0]
        text = choice.text
        assert choice.logprobs is None
    assert text == prompt + want.text
