"""Drafting with a draft model of another vocabulary (forerun.propose.cross_vocab, cross_draft).

Tiny float64 models over tiny byte-level BPE tokenizers built here: the target's and the
draft's share an alphabet and differ in their merges and in their ids. Properties: greedy
output equals plain greedy for every k, alone and batched (string-level drafting); the target
as its own draft under a permuted vocabulary has every draft accepted, greedy and sampled; the
sampled output has the target's exact joint under token-level intersection (chi-square at
ALPHA against the enumerated joint: this file fails by chance with probability ALPHA); the
bridge's maps (bytes, intersection, scatter) are what they say, for byte-level BPE and
SentencePiece tokens; the draft's context spells the target's text through growth and
rollbacks; a pair that shares too few
tokens, or a tokenizer whose tokens cannot be read as text, fails clearly.
"""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
import torch
from conftest import tiny_runtime
from exact import RuntimeTable, chi_square_pvalue, target_joint
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE, WordLevel

from forerun import Engine
from forerun.engine import speculative_decode
from forerun.models.catalog import ModelError
from forerun.models.tokenizer import TextTokenizer
from forerun.policy import FixedK
from forerun.propose import PROPOSERS, ProposerContext, SpecConfig
from forerun.propose.cross_draft import CrossVocabProposer
from forerun.propose.cross_vocab import byte_alphabet, token_bytes, vocab_bridge
from forerun.reference import plain_decode
from forerun.sampling import SamplingConfig, logits_to_probs, make_generator

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors; a busy 2-core machine
ALPHA = 1e-4
GREEDY = SamplingConfig()


def byte_char(c: str) -> str:
    """The byte-level alphabet's character for an ASCII character (space -> 'Ġ', ...)."""
    return byte_alphabet()[ord(c)]


def bpe(alphabet: str, merges: list[tuple[str, str]], seed: int | None = None) -> TextTokenizer:
    """A byte-level BPE over `alphabet` (text characters) and `merges` (text pairs, applied in
    order); `seed`: its ids shuffled."""
    pieces = [byte_char(c) for c in alphabet]
    pairs = [("".join(map(byte_char, a)), "".join(map(byte_char, b))) for a, b in merges]
    tokens = pieces + [a + b for a, b in pairs]
    if seed is not None:
        random.Random(seed).shuffle(tokens)
    tok = Tokenizer(BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=pairs))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return TextTokenizer(tok, None, None, None, False, frozenset())


ALPHABET = "abcdefgh .\n"
TARGET_TOK = bpe(ALPHABET, [("a", "b"), ("c", "d"), (" ", "a"), ("e", "f"), ("ab", "c"),
                            (" ", "g"), ("h", ".")])
DRAFT_TOK = bpe(ALPHABET, [("b", "c"), (" ", "b"), ("d", "e"), ("g", "h"), ("a", "a"),
                           (".", "\n")], seed=3)
PROMPT_TEXT = "abc cd ef gh. ab\nba"


def vocab(tok: TextTokenizer) -> int:
    return tok.tokenizer.get_vocab_size()


def decode(target, proposer, prompt, k, sampling=GREEDY, seed=0, max_new=40):
    steps = list(speculative_decode(target, proposer, FixedK(k), prompt, sampling, max_new, (),
                                    make_generator(seed)))
    return [t for s in steps for t in s.tokens], steps


def cross(target, draft, target_tok=TARGET_TOK, draft_tok=DRAFT_TOK, k=3):
    bridge = vocab_bridge(target_tok, draft_tok, target.config.vocab_size,
                          draft.config.vocab_size)
    return PROPOSERS["draft"](SpecConfig("draft", k), ProposerContext(target, draft,
                                                                      bridge=bridge))


# --- greedy: string-level exact match ----------------------------------------------------------

@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_with_a_draft_of_another_vocabulary_equals_plain(k):
    target = tiny_runtime(0, vocab=vocab(TARGET_TOK))
    draft = tiny_runtime(7, vocab=vocab(DRAFT_TOK))
    prompt = TARGET_TOK.encode(PROMPT_TEXT)
    plain = [t for s in plain_decode(target, prompt, GREEDY, 40, (), make_generator(0))
             for t in s.tokens]
    proposer = cross(target, draft, k=k)
    assert isinstance(proposer, CrossVocabProposer)
    got, steps = decode(target, proposer, prompt, k)
    assert got == plain
    assert sum(s.drafted for s in steps) > 0  # it drafted (in the target's ids)


def permuted_pair(seed: int, alphabet: str = ALPHABET, noise: float = 0.0):
    """A char-level target and the same model under shuffled ids (a draft of another
    vocabulary that predicts exactly what the target does, `noise` > 0: nearly)."""
    target_tok, draft_tok = bpe(alphabet, []), bpe(alphabet, [], seed=seed)
    v = vocab(target_tok)
    target = tiny_runtime(0, vocab=v, scale=0.5)
    draft = tiny_runtime(0, vocab=v, scale=0.5, noise=noise)
    order = torch.tensor([draft_tok.tokenizer.token_to_id(target_tok.tokenizer.id_to_token(i))
                          for i in range(v)])  # target id -> draft id
    with torch.no_grad():
        model = draft.model
        model.embed.weight[order] = model.embed.weight.clone()
        model.lm_head.weight[order] = model.lm_head.weight.clone()
    return target, draft, target_tok, draft_tok


@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temperature=1.0, seed=5)],
                         ids=["greedy", "sampled"])
def test_the_target_drafting_for_itself_under_other_ids_is_always_accepted(sampling):
    target, draft, target_tok, draft_tok = permuted_pair(seed=11)
    proposer = cross(target, draft, target_tok, draft_tok, k=4)
    _, steps = decode(target, proposer, target_tok.encode(PROMPT_TEXT), 4, sampling)
    drafted, accepted = sum(s.drafted for s in steps), sum(s.accepted for s in steps)
    assert drafted > 20 and accepted == drafted


def test_batched_greedy_with_a_draft_of_another_vocabulary_equals_each_plain():
    target = tiny_runtime(0, vocab=vocab(TARGET_TOK))
    draft = tiny_runtime(7, vocab=vocab(DRAFT_TOK))
    prompts = [TARGET_TOK.encode(t) for t in (PROMPT_TEXT, "ef ab", "h. gh. cd\n", "a")]
    engine = Engine.from_runtimes(target, TARGET_TOK, draft, SpecConfig("draft", 3),
                                  draft_tokenizer=DRAFT_TOK)
    assert engine.bridge is not None
    budgets = [30, 12, 25, 18]
    got = engine.generate_batch(prompts, max_tokens=budgets, kv_budget_bytes=1 << 20)
    for prompt, budget, out in zip(prompts, budgets, got, strict=True):
        plain = engine.generate(prompt, max_tokens=budget, spec=SpecConfig("none"))
        assert out.token_ids == plain.token_ids
    assert sum(out.stats.drafted for out in got) > 0
    solo = engine.generate(prompts[0], max_tokens=budgets[0])  # alone, through the bridge
    assert solo.token_ids == got[0].token_ids


# --- sampling: token-level intersection, the exact joint ---------------------------------------

TLI_TARGET = bpe("abc", [("a", "b")])  # a b c ab
TLI_DRAFT = bpe("abc", [("b", "c"), ("c", "a")], seed=1)  # shared: a b c
TLI_PROMPT_TEXT = "abcab"
K, NEW, RUNS = 3, 5, 2000
SAMPLED = SamplingConfig(temperature=1.0)


def test_sampled_tli_matches_the_target_joint():
    """Fails by chance with probability ALPHA = 1e-4 (asymptotic chi-square over the exact
    joint of NEW tokens, cells below 5 expected pooled). The draft drafts only the shared
    tokens a, b, c; the target's own "ab" comes from the residual."""
    target = tiny_runtime(0, vocab=vocab(TLI_TARGET), scale=0.5)
    draft = tiny_runtime(4, vocab=vocab(TLI_DRAFT), scale=0.5)
    table = RuntimeTable(tiny_runtime(0, vocab=vocab(TLI_TARGET), scale=0.5))
    prompt = TLI_TARGET.encode(TLI_PROMPT_TEXT)
    proposer = cross(target, draft, TLI_TARGET, TLI_DRAFT, k=K)
    ab = TLI_TARGET.tokenizer.token_to_id("ab")
    generator, counts = make_generator(11), defaultdict(int)
    accepted = drafted = 0
    for _ in range(RUNS):
        steps = list(speculative_decode(target, proposer, FixedK(K), prompt, SAMPLED, NEW, (),
                                        generator))
        counts[tuple(t for s in steps for t in s.tokens)] += 1
        accepted += sum(s.accepted for s in steps)
        drafted += sum(s.drafted for s in steps)
    assert 0.2 * drafted < accepted < 0.95 * drafted, (accepted, drafted)
    assert any(ab in seq for seq in counts)  # the unshared token is emitted (recovered)

    def row(prefix):
        return logits_to_probs(table.logits((*prompt, *prefix)), SAMPLED)

    assert chi_square_pvalue(target_joint(row, NEW), counts) > ALPHA


# --- the bridge --------------------------------------------------------------------------------

def test_the_bridge_maps_bytes_shared_tokens_and_rows():
    bridge = vocab_bridge(TLI_TARGET, TLI_DRAFT, vocab(TLI_TARGET), vocab(TLI_DRAFT))
    t, d = TLI_TARGET.tokenizer.token_to_id, TLI_DRAFT.tokenizer.token_to_id
    assert bridge.draft_of == {t(c): d(c) for c in "abc"}
    assert bridge.text([t("ab"), t("c")]) == b"abc"
    assert bridge.to_target(b"abcab") == [t("ab"), t("c"), t("ab")]
    assert bridge.to_draft(b"abca") == [d("a"), d("bc"), d("a")]
    row = torch.arange(vocab(TLI_DRAFT), dtype=torch.float64)  # [V_draft]
    out = bridge.scatter(row)  # [V]
    assert out[t("ab")] == float("-inf")
    assert all(out[t(c)] == row[d(c)] for c in "abc")
    assert sorted(bridge.extensions(b"c").tolist()) == sorted([d("c"), d("ca")])  # healing
    assert bridge.extensions(b"bc").tolist() == [d("bc")]
    assert vocab_bridge(TLI_TARGET, TLI_TARGET, 4) is None  # one vocabulary: no bridge
    assert vocab_bridge(TLI_TARGET, TLI_DRAFT, 4, 5) is bridge  # built once per pair


def test_text_split_inside_a_character_waits_for_the_rest():
    from forerun.propose.cross_draft import CrossState

    tok = bpe("abc", [])  # byte-level: the two bytes of "é" are tokens of their own here
    pieces = [byte_char(c) for c in "abc"] + ["Ã", "©"]  # b"\xc3", b"\xa9"
    hf = Tokenizer(BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[]))
    hf.pre_tokenizer, hf.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), \
        decoders.ByteLevel()
    target = TextTokenizer(hf, None, None, None, False, frozenset())
    bridge = vocab_bridge(target, tok, 5, 3)
    state = CrossState(bridge)
    assert state.draft_ids([0, 3]) is None  # "a" + half of "é"
    assert bridge.to_target(b"ab\xc3") == [0, 1]  # a proposal ends on a whole character


def test_pairs_that_cannot_be_bridged_fail_clearly():
    few = bpe("abcdefgh", [])
    other = bpe("xyz", [])
    other_v = vocab(other)
    with pytest.raises(ModelError, match="share 0 tokens"):
        vocab_bridge(few, other, vocab(few), other_v)
    words = TextTokenizer(Tokenizer(WordLevel({"hello": 0, "<unk>": 1}, unk_token="<unk>")),
                          None, None, None, False, frozenset())
    with pytest.raises(ModelError, match="does not give its tokens' text back"):
        vocab_bridge(few, words, vocab(few), 2)


def test_sentencepiece_tokens_read_as_their_bytes():
    """'▁' is a space, <0xNN> byte-fallback tokens are their byte, added tokens their text."""
    from tokenizers import normalizers

    vocab = {"<unk>": 0, "<0x0A>": 1, "<0xC3>": 2, "<0xA9>": 3, "▁": 4, "a": 5, "b": 6,
             "▁a": 7, "<eos>": 8}
    hf = Tokenizer(BPE(vocab=vocab, merges=[("▁", "a")], byte_fallback=True, unk_token="<unk>"))
    hf.normalizer = normalizers.Replace(" ", "▁")
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                    decoders.Fuse()])
    hf.add_special_tokens(["<eos>"])
    tok = TextTokenizer(hf, None, None, "<eos>", False, frozenset({8}))
    table, special = token_bytes(tok, 9)
    assert table[1:8] == [b"\n", b"\xc3", b"\xa9", b" ", b"a", b"b", b" a"]
    assert table[8] == b"<eos>" and special == {8}
    ids = tok.encode("ab a\né", add_special=False)
    assert b"".join(table[i] for i in ids) == "ab a\né".encode()


def test_magicdec_refuses_a_draft_of_another_vocabulary():
    target = tiny_runtime(0, vocab=vocab(TARGET_TOK))
    draft = tiny_runtime(7, vocab=vocab(DRAFT_TOK))
    bridge = vocab_bridge(TARGET_TOK, DRAFT_TOK, vocab(TARGET_TOK), vocab(DRAFT_TOK))
    with pytest.raises(ValueError, match="tokenizer differs"):
        PROPOSERS["magicdec"](SpecConfig("magicdec"), ProposerContext(target, draft,
                                                                      bridge=bridge))


def test_the_drafts_context_always_spells_the_targets_text():
    """Re-tokenized after an anchor (the tokens far from the end kept), through growth and
    rollbacks: the draft's tokens are always the target's text, byte for byte."""
    from forerun.propose.cross_draft import CrossState

    bridge = vocab_bridge(TARGET_TOK, DRAFT_TOK, vocab(TARGET_TOK), vocab(DRAFT_TOK))
    state, rng = CrossState(bridge), random.Random(0)
    tokens = TARGET_TOK.encode(PROMPT_TEXT)
    for _ in range(200):
        if rng.random() < 0.2:
            del tokens[len(tokens) - rng.randrange(1, 4):]  # a rejected tail
        tokens += [rng.randrange(vocab(TARGET_TOK)) for _ in range(rng.randrange(1, 4))]
        ids = state.draft_ids(tokens)
        assert b"".join(bridge.draft_bytes[i] for i in ids) == bridge.text(tokens)
    assert state.anchor > 0  # the anchor moved: most of the text was not re-tokenized
