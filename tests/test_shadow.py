"""Shadow speculation (`SpecConfig.shadow`, `speculation: {"shadow": true}`): drafts are verified
and scored, one token a pass is emitted.

Properties:
- greedy (tiny float64 models): every method's shadow output is plain greedy decoding's, token
  for token, alone and in a mixed batch, with one target pass a token; its stats count what
  speculation would have accepted (a draft equal to the target: every draft token), flagged
  `shadow`;
- sampled: the output has the target's exact joint (a shadow emits a verify's first token,
  which rejection sampling draws from p): 2,000 runs of 5 tokens, a table-model target with a
  draft model K = 3 deep, against the enumerated joint, chi-square at ALPHA = 1e-4 (its
  false-failure rate);
- through the server with the real `openai` client: a shadow request's text is plain's, its
  stats say shadow and count draft tokens; shadow with method none is a 400 naming the field.
"""

from __future__ import annotations

from collections import defaultdict

import openai
import pytest
from conftest import random_heads, tiny_model
from exact import TableModel, TableRuntime, chi_square_pvalue, target_joint
from test_serve import (  # noqa: F401  (fixtures)
    NAME,
    client,
    model_dirs,
    server,
)

from forerun import Engine, LoadConfig, SpecConfig
from forerun.batch_engine import Sequence, run_to_completion
from forerun.engine import speculative_decode
from forerun.metrics import GenerationStats
from forerun.policy import FixedK
from forerun.propose import HEAD_PROPOSERS, PROPOSERS, ProposerContext
from forerun.propose.draft_model import DraftModelProposer
from forerun.reference import plain_decode
from forerun.runtime.batch import BatchTorchRuntime
from forerun.runtime.torch_model import TorchRuntime
from forerun.sampling import SamplingConfig, logits_to_probs, make_generator

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]
NEW = 16


def _plain(prompt=PROMPT) -> list[int]:
    steps = plain_decode(TorchRuntime(tiny_model(0), capacity=256), list(prompt),
                         SamplingConfig(), NEW, (), make_generator(0))
    return [t for s in steps for t in s.tokens]


def _proposer(method: str, target: TorchRuntime, noise: float = 0.05):
    draft = TorchRuntime(tiny_model(0, noise=noise), capacity=256)
    heads = random_heads(method, target) if method in HEAD_PROPOSERS else None
    spec = SpecConfig(method, 4, tree=6 if heads is not None else 0, shadow=True)
    return PROPOSERS[method](spec, ProposerContext(target, draft, heads))


@pytest.mark.parametrize("method", ["draft", "ngram", "medusa", "eagle"])
def test_a_shadow_emits_plain_greedy_tokens_one_a_pass(method):
    target = TorchRuntime(tiny_model(0), capacity=256)
    steps = list(speculative_decode(target, _proposer(method, target), FixedK(4), PROMPT,
                                    SamplingConfig(), NEW, (), make_generator(0), shadow=True))
    assert [t for s in steps for t in s.tokens] == _plain()
    assert all(len(s.tokens) == 1 for s in steps)  # one token a pass
    assert sum(s.drafted for s in steps) > 0
    if method in ("draft", "ngram"):  # (random heads' trees are rarely right)
        assert sum(s.accepted for s in steps) > 0  # what it would have accepted


def test_a_shadow_of_the_target_itself_would_accept_everything():
    target = TorchRuntime(tiny_model(0), capacity=256)
    steps = list(speculative_decode(target, _proposer("draft", target, noise=0.0), FixedK(4),
                                    PROMPT, SamplingConfig(), NEW, (), make_generator(0),
                                    shadow=True))
    stats = GenerationStats.from_steps("draft", 4, 0.0, steps, shadow=True)
    assert stats.shadow and stats.acceptance_rate == 1.0 and stats.mean_accepted_length > 4
    assert all(s.accepted == s.drafted for s in steps)  # (drafts shorten near max tokens)
    assert stats.target_forward_passes == stats.new_tokens == NEW


def test_shadow_members_of_a_mixed_batch_emit_plain_tokens():
    target = TorchRuntime(tiny_model(0), capacity=256)
    runtime = BatchTorchRuntime(TorchRuntime(tiny_model(0), capacity=256), 1 << 20)
    prompts = [PROMPT, [10, 20, 30, 40], [7, 7, 8, 7, 7, 8]]
    seqs = [Sequence(list(p), SamplingConfig(), NEW, make_generator(0), (),
                     _proposer(m, target), FixedK(3), max_k=3, shadow=shadow)
            for p, m, shadow in zip(prompts, ["draft", "ngram", "ngram"], [True, True, False],
                                    strict=True)]
    run_to_completion(runtime, seqs)
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert [t for s in seq.steps for t in s.tokens] == _plain(prompt)
    assert all(len(s.tokens) == 1 for seq in seqs[:2] for s in seq.steps)
    assert sum(s.drafted for s in seqs[0].steps) > 0


# --- sampled: the target's exact joint ------------------------------------------------------------

V, ALPHA, RUNS, K, NEW_SAMPLED = 3, 1e-4, 2000, 3, 5
TABLE_PROMPT = (1, 2, 0, 1, 2, 0, 1)
TARGET, DRAFT = TableModel(V, seed=1), TableModel(V, seed=1, noise=1.0)
SAMPLED = SamplingConfig(temperature=1.0)


def test_sampled_shadow_output_has_the_targets_joint():
    """Fails by chance with probability ALPHA."""
    target, proposer = TableRuntime(TARGET), DraftModelProposer(TableRuntime(DRAFT), V)
    generator, counts, drafted = make_generator(2024), defaultdict(int), 0
    for _ in range(RUNS):
        steps = list(speculative_decode(target, proposer, FixedK(K), list(TABLE_PROMPT),
                                        SAMPLED, NEW_SAMPLED, (), generator, shadow=True))
        drafted = max(drafted, *(s.drafted for s in steps))
        counts[tuple(t for s in steps for t in s.tokens)] += 1
    assert drafted == K

    def row(prefix):
        return logits_to_probs(TARGET.logits((*TABLE_PROMPT, *prefix)), SAMPLED)

    assert chi_square_pvalue(target_joint(row, NEW_SAMPLED), counts) > ALPHA


# --- through the server ------------------------------------------------------------------------

def test_a_shadow_request_is_plain_text_with_speculation_stats(server, model_dirs):  # noqa: F811
    engine = Engine(str(model_dirs[0]), None, spec=SpecConfig("none"),
                    load=LoadConfig(dtype="float64"))
    ids = engine.tokenizer.encode_prompt("abcabcabc", raw=True)
    want = engine.generate(ids, max_tokens=12)
    c = client(server)
    out = c.completions.create(model=NAME, prompt="abcabcabc", max_tokens=12, temperature=0,
                               extra_body={"speculation": {"method": "ngram", "k": 4,
                                                           "shadow": True}})
    choice = out.choices[0]
    assert choice.text == want.text
    stats = choice.model_extra["speculation"]
    assert stats["shadow"] is True and stats["drafted"] > 0
    assert stats["target_forward_passes"] == stats["new_tokens"]
    with pytest.raises(openai.BadRequestError, match="shadow"):
        c.completions.create(model=NAME, prompt="abc", max_tokens=4,
                             extra_body={"speculation": {"method": "none", "shadow": True}})
