"""The speculative decoding loop of one sequence: a batch of one through the batch step.

Owns: `speculative_decode`, the one-sequence entry point (the library's `generate`, the chat,
the server's slots, the benchmarks). The sequence is one `Sequence` record, its runtime a
`SoloBatch` (the runtime's own cache as the one member), and every step is
`forerun.batch_engine.step` over that batch: propose, one target pass, verify, commit, adapt,
emit, with the cache invariant stated there (before each verify the target's cache holds every
token of the sequence but the pending one). A drafter that reads the target's features (heads)
declares its layers in `needs` and is fed them for every token that enters the cache; each
verify pass is timed and shown to the target's calibrated cost curve (`SoloBatch`), which
prices drafts. Knows nothing of text: tokens in, tokens out.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator

import torch

from forerun.batch_engine import Sequence, admit, retire, step
from forerun.grammar import GrammarState
from forerun.metrics import Step
from forerun.policy import LengthPolicy
from forerun.propose.base import Proposer
from forerun.runtime.base import Runtime
from forerun.runtime.solo import SoloBatch
from forerun.sampling import SamplingConfig


def speculative_decode(target: Runtime, proposer: Proposer | None, policy: LengthPolicy | None,
                       prompt: list[int], sampling: SamplingConfig, max_new_tokens: int,
                       stop_ids: Collection[int], generator: torch.Generator,
                       logprobs: int | None = None, grammar: GrammarState | None = None,
                       prompt_logprobs: int | None = None, shadow: bool = False
                       ) -> Iterator[Step]:
    """Decode `prompt` on `target` with `proposer` drafting (None: plain decoding through the
    same step) and `policy` choosing each step's k -> its Steps as they happen (the first is
    the prefill's token); `logprobs`: each Step carries its tokens' logprobs with that many
    alternatives (None: none); `grammar`: the output is held to it (structured output);
    `prompt_logprobs`: the first Step carries the prompt's own logprobs (echo); `shadow`:
    drafts are verified and scored, one token a pass emitted (see `SpecConfig.shadow`)."""
    solo = SoloBatch(target)
    seq = Sequence(prompt, sampling, max_new_tokens, generator, stop_ids, proposer, policy,
                   max_k=target.capacity,  # a solo sequence's drafts are bounded by its room
                   logprobs=logprobs, grammar=grammar, prompt_logprobs=prompt_logprobs,
                   shadow=shadow)
    admit(solo, seq)
    try:
        while not seq.finish:
            yield from step(solo, [seq])
    finally:  # also when the caller stops reading (a client gone, Ctrl-C)
        retire(solo, seq)
