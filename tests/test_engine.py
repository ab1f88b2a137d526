"""Greedy losslessness: speculative output == plain output, token for token, for every proposer,
several k, every length policy, prompts with and without n-gram matches, drafts that agree and
drafts that disagree often."""

import pytest
import torch
from conftest import heads_for, tiny_runtime

from forerun.engine import speculative_decode
from forerun.heads import KINDS
from forerun.policy import POLICIES, FixedK
from forerun.propose import PROPOSERS, ProposerContext, SpecConfig
from forerun.reference import plain_decode
from forerun.sampling import SamplingConfig, make_generator
from forerun.stopping import ContextError

PROMPTS = {
    "repetitive": [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3],  # n-gram lookup finds matches
    "no-match": [10, 20, 30, 40, 50, 60],  # all distinct: nothing to look up at first
}
MAX_NEW = 40


def plain(seed=0, prompt=(), max_new=MAX_NEW, stop=(), capacity=256):
    rt = tiny_runtime(seed, capacity=capacity)
    steps = plain_decode(rt, list(prompt), SamplingConfig(), max_new, stop, make_generator(0))
    return [t for s in steps for t in s.tokens]


def speculative(method, k, policy="fixed", prompt=(), draft_seed=0, max_new=MAX_NEW, stop=(),
                capacity=256, target_seed=0, noise=0.05, price=None):
    """Default draft: the target perturbed by noise, so it agrees often but not always.
    `price`: conftest's synthetic_curves, to price the runtimes on synthetic curves."""
    target = tiny_runtime(target_seed, capacity=capacity)
    draft = tiny_runtime(draft_seed, capacity=capacity, noise=noise)
    spec = SpecConfig(method, k, policy)
    if price is not None:
        price(target)  # (a drafter may read the target's curve as it is built: lookahead)
    proposer = PROPOSERS[method](spec, ProposerContext(target, draft, heads_for(method, target)))
    if price is not None:
        price(target, proposer.runtime)
    lengths = POLICIES[policy](spec, target, proposer.runtime)
    steps = list(speculative_decode(target, proposer, lengths, list(prompt),
                                    SamplingConfig(), max_new, stop, make_generator(0)))
    return [t for s in steps for t in s.tokens], steps


# every method x policy x prompt; head methods (also covered in test_heads) at two k only
GRID = [(m, k) for m in PROPOSERS for k in ([1, 2, 5, 8] if m not in KINDS else [2, 5])]


@pytest.mark.parametrize(("method", "k"), GRID)
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_greedy_speculative_equals_plain(method, k, policy, prompt, synthetic_curves):
    """The cost policy prices drafts on synthetic curves (conftest) on which drafting pays, so
    every cell drafts on any machine: a cell that drafted nothing would test nothing."""
    expected = plain(prompt=PROMPTS[prompt])
    got, steps = speculative(method, k, policy, PROMPTS[prompt], price=synthetic_curves)
    assert got == expected
    assert len(got) == MAX_NEW
    assert sum(s.drafted for s in steps) > 0


def test_agreeing_draft_accepts_some_and_rejects_some():
    _got, steps = speculative("draft", 5, prompt=PROMPTS["no-match"])
    accepted, drafted = sum(s.accepted for s in steps), sum(s.drafted for s in steps)
    assert 0 < accepted < drafted


def test_disagreeing_draft_still_exact_and_rejects_often():
    got, steps = speculative("draft", 5, prompt=PROMPTS["no-match"], draft_seed=7)
    assert got == plain(prompt=PROMPTS["no-match"])
    drafted = sum(s.drafted for s in steps)
    assert sum(s.accepted for s in steps) < drafted / 2  # the case really exercises rejection


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_equal_to_target_accepts_everything(temperature):
    target, draft = tiny_runtime(0), tiny_runtime(0)
    sampling = SamplingConfig(temperature=temperature)
    proposer = PROPOSERS["draft"](SpecConfig("draft", 4), ProposerContext(target, draft))
    steps = list(speculative_decode(target, proposer, FixedK(4), PROMPTS["no-match"],
                                    sampling, 41, (), make_generator(0)))
    verify = steps[1:]
    assert all(s.accepted == s.drafted == 4 for s in verify)
    assert sum(len(s.tokens) for s in steps) == 41  # 1 + 8 steps x 5 tokens


def test_stop_token_and_budget_match_plain():
    expected = plain(prompt=PROMPTS["repetitive"], max_new=60)
    stop = {expected[17]}  # a token that occurs mid-generation
    cut_at = expected.index(expected[17])
    got, steps = speculative("ngram", 5, prompt=PROMPTS["repetitive"], max_new=60, stop=stop)
    assert got == expected[:cut_at] == plain(prompt=PROMPTS["repetitive"], max_new=60, stop=stop)
    assert steps[-1].finish_reason == "stop"
    got, steps = speculative("draft", 5, prompt=PROMPTS["repetitive"], max_new=7)
    assert got == expected[:7] and steps[-1].finish_reason == "length"


def test_context_limit_ends_generation_identically():
    prompt = PROMPTS["no-match"]
    expected = plain(prompt=prompt, capacity=20)
    got, steps = speculative("draft", 5, prompt=prompt, capacity=20, noise=0.0)
    assert got == expected and len(prompt) + len(got) == 20
    assert steps[-1].finish_reason == "length"


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_prompt_longer_than_context_fails_clearly(method):
    """The target's message, before a draft model's own cache could refuse the prompt."""
    with pytest.raises(ContextError, match="the prompt has 30 tokens"):
        speculative(method, 3, prompt=list(range(30)), capacity=16)


def test_seeded_sampling_reproduces():
    def run():
        target, draft = tiny_runtime(0), tiny_runtime(1)
        proposer = PROPOSERS["draft"](SpecConfig("draft", 3), ProposerContext(target, draft))
        steps = speculative_decode(target, proposer, FixedK(3), [1, 2, 3],
                                   SamplingConfig(temperature=1.0), 30, (), make_generator(5))
        return [t for s in steps for t in s.tokens]
    assert run() == run()


def test_unknown_method_is_rejected():
    with pytest.raises(ValueError, match="unknown method"):
        SpecConfig("no-such-method")


def test_tiny_model_logits_are_float64():
    assert tiny_runtime(0).forward(torch.tensor([1])).logits.dtype == torch.float64


def test_stop_strings_across_chunks_are_held_back_and_cut():
    from forerun.api import _find_stop, _stop_prefix

    assert _stop_prefix("hello wor", ("world",)) == 3
    assert _stop_prefix("hello", ("world",)) == 0
    assert _find_stop("abc STOP def", ("STOP",), 0) == 4
    assert _find_stop("abc STOP def", ("STOP",), 5) is None


def word_tokenizer(vocab: int = 64):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from forerun.models.tokenizer import TextTokenizer

    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(vocab)}, unk_token=None))
    return TextTokenizer(tok, None, None, None, False, frozenset())


@pytest.mark.parametrize("method", ["none", *PROPOSERS])
def test_engine_cuts_text_at_a_stop_string_spanning_tokens(method):
    from forerun import Engine

    target = tiny_runtime(0)
    engine = Engine.from_runtimes(target, word_tokenizer(), tiny_runtime(0, noise=0.05),
                                  SpecConfig(method, 4), heads_for(method, target))
    prompt = PROMPTS["no-match"]
    full = engine.generate(prompt, max_tokens=30).text
    words = full.split(" ")
    stop = f"{words[10]} {words[11][:1]}"  # spans two tokens, ends mid-token
    out = engine.generate(prompt, max_tokens=30, stop=(stop,))
    assert out.text == full[: full.index(stop)] and out.finish_reason == "stop"
    streamed = "".join(c.text for c in engine.stream(prompt, max_tokens=30, stop=(stop,)))
    assert streamed == out.text


@pytest.mark.parametrize("temperature", [0.0])
def test_reduced_draft_vocabulary_stays_lossless(temperature):
    """A draft that can only propose half the vocabulary: output still equals plain greedy."""
    expected = plain(prompt=PROMPTS["no-match"])
    target, draft = tiny_runtime(0), tiny_runtime(0, noise=0.05)
    draft.limit_vocab(range(32))
    proposer = PROPOSERS["draft"](SpecConfig("draft", 4), ProposerContext(target, draft))
    steps = list(speculative_decode(target, proposer, FixedK(4), PROMPTS["no-match"],
                                    SamplingConfig(temperature=temperature), MAX_NEW, (),
                                    make_generator(0)))
    assert [t for s in steps for t in s.tokens] == expected
    assert all(t < 32 for s in steps[1:] for t in s.tokens[:s.accepted])  # drafts from the subset


@pytest.mark.parametrize(("method", "tree", "spans"), [
    ("draft", 0, False), ("ngram", 0, False), ("eagle", 6, False), ("medusa", 6, False),
    ("draft", 0, True), ("eagle", 6, True)])
def test_static_passes_stay_lossless(method, tree, spans):
    """Target and draft in the static-shape passes a GPU replays as CUDA graphs (run eagerly
    here): greedy speculative output equals eager plain decoding, chains and trees, also with
    attention over spans of a larger cache (spans=True)."""
    from conftest import tiny_model

    from forerun.runtime.torch_model import TorchRuntime

    prompt = PROMPTS["repetitive"]
    capacity = 1024 if spans else 256
    target = TorchRuntime(tiny_model(0), capacity=capacity, static=True, spans=spans)
    draft = TorchRuntime(tiny_model(0, noise=0.05), capacity=capacity, static=True,
                         spans=spans)
    spec = SpecConfig(method, 5, tree=tree, tree_topk=2)
    proposer = PROPOSERS[method](spec, ProposerContext(target, draft, heads_for(method, target)))
    steps = list(speculative_decode(target, proposer, FixedK(5), prompt, SamplingConfig(),
                                    MAX_NEW, (), make_generator(0)))
    assert [t for s in steps for t in s.tokens] == plain(prompt=prompt)
    assert sum(s.accepted for s in steps) > 0 or method in ("eagle", "medusa")
