"""Structured output under speculation (forerun.grammar, llguidance): exact, for every method.

Tiny float64 models over a byte-level BPE vocabulary (256 bytes + 3 specials; llguidance reads
its `tokenizers` JSON as it reads a real model's). Properties:
- greedy, with a JSON schema, a regex and a Lark grammar: every method's output (draft model,
  n-gram, Medusa and EAGLE trees), alone and batched, equals plain decoding under the same
  grammar token for token, and the text matches the grammar (the schema validates);
- drafts are cut at their first grammar-invalid token before verification (a chain to its
  valid prefix, a tree to the nodes whose path is valid), checked on hand-built drafts; a
  stop token drafted where the grammar ends (n-gram lookup copying the prompt's) gives plain
  decoding's output, not an error;
- sampling, by exact enumeration: under the regex `[ab][abc][ab]` (T = 3) the output has the
  masked target's exact joint over the 12 strings, for every method, each run's first verify
  step 2 deep after the grammar's cut: the draft model (its q masked by the grammar), n-gram
  lookup (the prompt holds "; aca; bab; "), a deterministic tree drafter whose forbidden
  nodes the engine cuts out of the middle of its tree (`ValidTopTwo`), Medusa and EAGLE trees
  of random heads with a reduced vocabulary of a, b, c. Chi-square at ALPHA = 1e-4 each: the
  module's false-failure probability is 5e-4 (p-values seen: 0.084, 0.063, 0.21, 0.69,
  0.76). The same test fails with every verified row masked in the committed state instead
  (1392 of its 2000 outputs break the grammar);
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
from forerun.propose.base import Draft, Needs
from forerun.propose.ngram import NgramProposer
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


def test_a_drafted_stop_token_where_the_grammar_ends_is_verified_or_cut():
    """n-gram lookup copies "b<|im_end|>" from the prompt after the output's "a": under the
    regex "ab" the stop token completes the output. Greedy n-gram equals plain decoding (found
    on SmolLM2 under a JSON schema, where the prompt's example ended the chat turn: the draft
    `cut` kept the stop token, which `masks` then refused)."""
    eos = min(TOK.stop_ids)
    prompt = [*TOK.encode("say ab: ab"), eos, *TOK.encode(" say ab: ")]
    grammar = Grammar("regex", "ab")
    outputs = []
    for proposer in (None, NgramProposer(1, 4)):
        steps = list(speculative_decode(_runtime(), proposer, proposer and FixedK(4), prompt,
                                        SamplingConfig(grammar=grammar), 8, TOK.stop_ids,
                                        make_generator(0), grammar=state_for(grammar, TOK, V)))
        outputs.append([t for s in steps for t in s.tokens])
    assert outputs[0] == outputs[1] == TOK.encode("ab")


def test_a_grammar_that_does_not_compile_is_a_clear_error():
    for grammar in (Grammar("json_schema", "{not json"), Grammar("grammar", "start: (")):
        with pytest.raises(GrammarError, match="does not"):
            state_for(grammar, TOK, V)


# --- sampling: the masked target's joint, by exact enumeration ----------------------------------

RUNS, HEAD_RUNS, ALPHA, K = 2000, 1000, 1e-4, 2
SMALL = Grammar("regex", "[ab][abc][ab]")
A, B, C = (TOK.encode(x)[0] for x in "abc")
# n-gram lookup finds "; a" and "; b" in it and drafts "ca" and "ab": valid from the first step
SAMPLED_PROMPT = TOK.encode("; aca; bab; ")
SAMPLED = SamplingConfig(temperature=3.0, grammar=SMALL)


class ValidTopTwo:
    """A deterministic two-level tree drafter under the grammar (`Needs.grammar`): after the
    root and after each valid first-level node, the draft model's likeliest forbidden token,
    then its two likeliest allowed ones (q = None). The engine cuts the forbidden nodes before
    verification, a cut that is not a prefix: the tree verified is the 2 x 2 valid one."""

    name, runtime, needs, group = "valid-top-two", None, Needs(grammar=True), None

    def __init__(self, model: TorchRuntime):
        self.model, self.grammar = model, None

    def constrain(self, grammar) -> None:
        self.grammar = grammar

    def prefill(self, prompt):
        pass

    def commit(self, num_final):
        pass

    def _children(self, tokens: list[int], path: list[int]) -> list[int]:
        allowed = self.grammar.draft_mask(path)  # [V], None: nothing may follow `path`
        if allowed is None:
            return []
        self.model.truncate(0)
        logits = self.model.forward(torch.tensor(tokens + path)).logits[-1]  # [V]
        top = logits.masked_fill(~allowed, float("-inf")).topk(2)
        valid = [t for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)
                 if v > float("-inf")]
        return [int(logits.masked_fill(allowed, float("-inf")).argmax()), *valid]

    def propose(self, tokens, k, sampling, generator) -> Draft:
        first = self._children(tokens, []) if k >= 2 else []  # its two levels
        nodes, parents = list(first), [-1] * len(first)
        for i, x in enumerate(first):
            kids = self._children(tokens, [x])  # none under a forbidden x
            nodes += kids
            parents += [i] * len(kids)
        return Draft(torch.tensor(nodes, dtype=torch.long), None, torch.tensor(parents))


def _abc_heads(kind: str):
    """Random heads drafting trees of two children a node (6 nodes), their reduced vocabulary
    (forerun.heads: the ids a head drafts, the frequent ones its training keeps) a, b and c,
    as heads trained on this grammar's outputs would keep: their trees survive the grammar's
    cut, where full-vocabulary random heads' drafts rarely do."""

    def make(target):
        heads = random_heads(kind, target, scale=0.5)
        keep = torch.tensor([A, B, C])
        # as Heads(cfg, keep, io) builds them: the ids, and the target's LM-head rows of them
        heads.vocab_ids, heads.lm_rows = keep, heads.lm_rows[keep].contiguous()
        return HEAD_PROPOSERS[kind](heads, target.capacity, 6, 2)

    return make


SAMPLED_CASES = {  # name -> (its proposer on the target, runs)
    "draft-k2": (lambda t: PROPOSERS["draft"](SpecConfig("draft", K), ProposerContext(
        t, _runtime(0.5))), RUNS),
    "ngram-k2": (lambda t: NgramProposer(1, 4), RUNS),
    "tree-2-levels": (lambda t: ValidTopTwo(_runtime(0.5)), RUNS),
    "medusa-tree": (_abc_heads("medusa"), HEAD_RUNS),
    "eagle-tree": (_abc_heads("eagle"), HEAD_RUNS),
}


def _exact_joint() -> dict[tuple[int, ...], float]:
    """The masked target's probability of each of the 12 words, position by position."""
    rt, state = _runtime(), state_for(SMALL, TOK, V)
    joint = {}
    for word in itertools.product((A, B), (A, B, C), (A, B)):
        prob = 1.0
        for i, token in enumerate(word):
            rt.truncate(0)
            logits = rt.forward(torch.tensor(SAMPLED_PROMPT + list(word[:i]))).logits[-1:]  # [1, V]
            allowed = state.masks(list(word), [list(range(i))] if i else [])[-1:]  # [1, V]
            prob *= float(logits_to_probs(apply_masks(logits, allowed), SAMPLED)[0, token])
        joint[word] = prob
    return joint


def _empirical(name: str, seed=2024) -> tuple[dict[tuple[int, ...], int], int]:
    """-> (counts of the generated words, runs whose first verify step drafted K deep after
    the grammar's cut)."""
    make, runs = SAMPLED_CASES[name]
    target = _runtime()
    proposer, generator = make(target), make_generator(seed)
    counts, deep = defaultdict(int), 0
    for _ in range(runs):
        steps = list(speculative_decode(target, proposer, FixedK(K), SAMPLED_PROMPT, SAMPLED, 8,
                                        TOK.stop_ids, generator, grammar=state_for(SMALL, TOK, V)))
        deep += steps[1].drafted == K
        counts[tuple(t for s in steps for t in s.tokens)] += 1
    return counts, deep


@pytest.mark.parametrize("name", list(SAMPLED_CASES))
def test_sampling_under_a_grammar_has_the_masked_targets_joint(name):
    """Fails by chance with probability ALPHA. Every run's first verify step drafts K = 2
    deep after the grammar's cut (the prefill emitted the word's first letter)."""
    joint = _exact_joint()
    assert abs(sum(joint.values()) - 1) < 1e-9
    counts, deep = _empirical(name)
    assert deep == SAMPLED_CASES[name][1], deep
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
    counts, _ = _empirical("draft-k2")
    monkeypatch.undo()
    assert chi_square_pvalue(_exact_joint(), counts) < ALPHA
