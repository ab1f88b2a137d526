"""Structured output under speculation (forerun.grammar, llguidance): exact, for every method.

Tiny float64 models over a byte-level BPE vocabulary (256 bytes + 3 specials; llguidance reads
its `tokenizers` JSON as it reads a real model's). Properties:
- greedy, with a JSON schema, a regex and a Lark grammar: every method's output (draft model,
  n-gram, Medusa and EAGLE trees), alone and batched, equals plain decoding under the same
  grammar token for token, and the text matches the grammar (the schema validates);
- drafts are cut at their first grammar-invalid token before verification (a chain to its
  valid prefix, a tree to the nodes whose path is valid), checked on hand-built drafts;
- sampling, by exact enumeration: under the regex `[ab][abc][ab]` the output has the masked
  target's exact joint over the 12 strings (draft model K = 2; chi-square, ALPHA = 1e-4: the
  module's false-failure probability; seen p = 0.33); the same test fails with every verified
  row masked in the committed state instead (1748 of its 2000 outputs break the grammar);
- a grammar that does not compile is a clear GrammarError before decoding.
"""

from __future__ import annotations

import itertools
import json
from collections import defaultdict

import pytest
import torch
from conftest import random_heads, tiny_model
from exact import chi_square_pvalue
from tiny_files import SPECIAL, byte_tokens
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

import forerun.batch_engine
from forerun.batch_engine import Sequence, run_to_completion
from forerun.engine import speculative_decode
from forerun.grammar import Grammar, GrammarError, apply_masks, state_for
from forerun.models.tokenizer import TextTokenizer
from forerun.policy import POLICIES, FixedK
from forerun.propose import HEAD_PROPOSERS, PROPOSERS, ProposerContext, SpecConfig
from forerun.runtime.batch import BatchTorchRuntime
from forerun.runtime.torch_model import TorchRuntime
from forerun.sampling import SamplingConfig, logits_to_probs, make_generator

pytestmark = pytest.mark.usefixtures("one_thread")
TOKENS = byte_tokens()
V = len(TOKENS)


def byte_tokenizer() -> TextTokenizer:
    tok = Tokenizer(BPE(vocab={t: i for i, t in enumerate(TOKENS)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL)
    return TextTokenizer(tok, None, None, "<|im_end|>", False,
                         frozenset({tok.token_to_id("<|im_end|>")}))


TOK = byte_tokenizer()
PROMPT = TOK.encode("name: ab, age: 3; name: ab, age: 3;")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
GRAMMARS = {
    "json-schema": Grammar("json_schema", json.dumps(SCHEMA)),
    "regex": Grammar("regex", r"(ab|ba)+c[0-9]{2,4}"),
    "lark": Grammar("grammar", 'start: "x" item (", " item)*\nitem: /[a-d]+/ "!"'),
}
NEW = 40


def _runtime(noise: float = 0.0, seed: int = 0) -> TorchRuntime:
    return TorchRuntime(tiny_model(seed, vocab=V, noise=noise, scale=2.0), capacity=256)


def _decode(method, grammar, sampling=None, k=4, seed=0):
    target = _runtime()
    sampling = SamplingConfig(grammar=grammar) if sampling is None else sampling
    proposer = policy = None
    if method != "none":
        heads = random_heads(method, target) if method in HEAD_PROPOSERS else None
        spec = SpecConfig(method, k, tree=6 if heads is not None else 0)
        proposer = PROPOSERS[method](spec, ProposerContext(target, _runtime(0.05), heads))
        policy = FixedK(k)
    steps = list(speculative_decode(target, proposer, policy, PROMPT, sampling, NEW,
                                    TOK.stop_ids, make_generator(seed),
                                    grammar=state_for(sampling.grammar, TOK, V)))
    return [t for s in steps for t in s.tokens], steps


def _matches(name, text):
    if name == "json-schema":
        value = json.loads(text)
        assert set(value) == {"name", "age"} and isinstance(value["age"], int)
        assert isinstance(value["name"], str) and len(value["name"]) <= 6
    elif name == "regex":
        import re
        assert re.fullmatch(r"(ab|ba)+c[0-9]{2,4}", text), text
    else:
        import re
        assert re.fullmatch(r"x[a-d]+!(, [a-d]+!)*", text), text


@pytest.mark.parametrize("method", ["draft", "ngram", "medusa", "eagle"])
@pytest.mark.parametrize("name", list(GRAMMARS))
def test_greedy_speculation_equals_plain_under_a_grammar(method, name):
    plain, plain_steps = _decode("none", GRAMMARS[name])
    unconstrained, _ = _decode("none", None, SamplingConfig())
    assert plain != unconstrained
    if plain_steps[-1].finish_reason == "stop":  # ended inside NEW: the whole text matches
        _matches(name, TOK.decode(plain))
    tokens, steps = _decode(method, GRAMMARS[name])
    assert tokens == plain
    if method == "draft":  # (random heads' and n-gram drafts may all be cut by the grammar)
        assert sum(s.accepted for s in steps) > 0


def test_a_mixed_batch_under_grammars_equals_each_members_plain_output():
    target = _runtime()
    runtime = BatchTorchRuntime(_runtime(), 1 << 22)
    plan = [("draft", "json-schema"), ("ngram", "regex"), ("none", "lark"), ("draft", None)]
    seqs = []
    for method, name in plan:
        grammar = GRAMMARS.get(name)
        sampling = SamplingConfig(grammar=grammar)
        state = state_for(grammar, TOK, V)
        if method == "none":
            seqs.append(Sequence(list(PROMPT), sampling, NEW, make_generator(0), TOK.stop_ids,
                                 grammar=state))
            continue
        spec = SpecConfig(method, 3)
        proposer = PROPOSERS[method](spec, ProposerContext(target, _runtime(0.05)))
        seqs.append(Sequence(list(PROMPT), sampling, NEW, make_generator(0), TOK.stop_ids,
                             proposer, POLICIES["fixed"](spec, target, proposer.runtime),
                             max_k=3, grammar=state))
    run_to_completion(runtime, seqs)
    for seq, (_, name) in zip(seqs, plan, strict=True):
        want, _ = _decode("none", GRAMMARS.get(name), SamplingConfig(grammar=GRAMMARS.get(name)))
        assert [t for s in seq.steps for t in s.tokens] == want


def test_drafts_are_cut_at_their_first_invalid_token():
    state = state_for(Grammar("regex", "ab+c"), TOK, V)
    a, b, c, d = (TOK.encode(x)[0] for x in "abcd")
    assert state.cut([a, b, b, d, c], None) == [0, 1, 2]
    assert state.cut([b, a], None) == []
    # tree: root -> a (0) -> {b (1) -> c (3), d (2) -> b (4)}, root -> c (5)
    assert state.cut([a, b, d, c, b, c], [-1, 0, 0, 1, 2, -1]) == [0, 1, 3]
    cut = forerun.batch_engine._grammar_cut(
        Sequence([1], SamplingConfig(), 4, make_generator(0), (), grammar=state),
        forerun.batch_engine.Draft(torch.tensor([a, b, d, c, b, c]), None,
                                   torch.tensor([-1, 0, 0, 1, 2, -1])))
    assert cut.tokens.tolist() == [a, b, c] and cut.parents.tolist() == [-1, 0, 1]


def test_a_grammar_that_does_not_compile_is_a_clear_error():
    for grammar in (Grammar("json_schema", "{not json"), Grammar("grammar", "start: (")):
        with pytest.raises(GrammarError, match="does not"):
            state_for(grammar, TOK, V)


# --- sampling: the masked target's joint, by exact enumeration ----------------------------------

RUNS, ALPHA = 2000, 1e-4
SMALL = Grammar("regex", "[ab][abc][ab]")
SAMPLED = SamplingConfig(temperature=1.5, grammar=SMALL)


def _exact_joint() -> dict[tuple[int, ...], float]:
    rt, state = _runtime(), state_for(SMALL, TOK, V)
    a, b, c = (TOK.encode(x)[0] for x in "abc")
    joint = {}
    for word in itertools.product((a, b), (a, b, c), (a, b)):
        prob = 1.0
        for i, token in enumerate(word):
            rt.truncate(0)
            logits = rt.forward(torch.tensor(PROMPT + list(word[:i]))).logits[-1:]  # [1, V]
            allowed = state.masks(list(word), [list(range(i))] if i else [])[-1:]  # [1, V]
            prob *= float(logits_to_probs(apply_masks(logits, allowed), SAMPLED)[0, token])
        joint[word] = prob
    return joint


def _empirical(seed=2024) -> dict[tuple[int, ...], int]:
    target, generator, counts = _runtime(), make_generator(seed), defaultdict(int)
    proposer = PROPOSERS["draft"](SpecConfig("draft", 2), ProposerContext(target,
                                                                          _runtime(0.5)))
    drafted = 0
    for _ in range(RUNS):
        steps = list(speculative_decode(target, proposer, FixedK(2), PROMPT, SAMPLED, 8,
                                        TOK.stop_ids, generator, grammar=state_for(SMALL, TOK, V)))
        drafted = max(drafted, *(s.drafted for s in steps))
        counts[tuple(t for s in steps for t in s.tokens)] += 1
    assert drafted == 2
    return counts


def test_sampling_under_a_grammar_has_the_masked_targets_joint():
    """Fails by chance with probability ALPHA."""
    joint = _exact_joint()
    assert abs(sum(joint.values()) - 1) < 1e-9
    counts = _empirical()
    assert set(counts) <= set(joint), "an output the grammar forbids"
    assert chi_square_pvalue(joint, counts) > ALPHA


def test_masking_draft_rows_in_the_committed_state_fails_the_same_test(monkeypatch):
    real = forerun.grammar.GrammarState.masks

    def stale(self, tokens, paths):  # every row in the state before the draft
        rows = real(self, tokens, [])
        return rows.expand(1 + len(paths), -1)

    monkeypatch.setattr(forerun.grammar.GrammarState, "masks", stale)
    monkeypatch.setattr(forerun.grammar.GrammarState, "commit", lambda self, tokens: (
        self.matcher.try_consume_tokens(tokens)))
    counts = _empirical()
    monkeypatch.undo()
    assert chi_square_pvalue(_exact_joint(), counts) < ALPHA
