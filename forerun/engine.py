"""The speculative decoding loop: prefill, then {propose, verify, commit, adapt, emit} until done.

Owns: the order of those phases and the KV-cache invariant between them. Before each verify step
the target's cache holds every token of the sequence except the last one (the "pending" token);
verification feeds [pending, draft...] in one forward pass, and rollback is a truncate to the
accepted prefix. Knows nothing of text: tokens in, tokens out.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator

import torch

from forerun.metrics import Step
from forerun.policy import LengthPolicy
from forerun.propose.base import Proposer
from forerun.reference import prefill
from forerun.runtime.base import Runtime
from forerun.sampling import SamplingConfig, logits_to_probs
from forerun.stopping import cut
from forerun.verify import rejection_sample


def speculative_decode(target: Runtime, proposer: Proposer, policy: LengthPolicy,
                       prompt: list[int], sampling: SamplingConfig, max_new_tokens: int,
                       stop_ids: Collection[int], generator: torch.Generator) -> Iterator[Step]:
    # 1. Prefill: target and proposer see the prompt; the target samples the first token.
    proposer.prefill(prompt)
    tokens = [*prompt, prefill(target, prompt, sampling, generator)]
    out, finish = cut(tokens[-1:], stop_ids, max_new_tokens, target.capacity - len(prompt))
    emitted = len(out)
    yield Step(out, 0, 0, time.perf_counter(), finish, prefill=True)
    while not finish:
        room = target.capacity - len(tokens)  # context slots left after the pending token
        # 2. Propose up to k tokens (never more than could be emitted or fit).
        k = max(0, min(policy.next_k(), max_new_tokens - emitted - 1, room))
        draft = proposer.propose(tokens, k, sampling, generator)
        # 3. Verify: one target pass over the pending token and the draft -> p [K+1, V].
        base = target.length
        logits = target.forward(torch.cat([torch.tensor(tokens[-1:]), draft.tokens])).logits
        verdict = rejection_sample(draft.tokens, logits_to_probs(logits, sampling), draft.q,
                                   generator)
        # 4. Commit the accepted prefix, roll back the rest (target and proposer caches).
        target.truncate(base + 1 + verdict.num_accepted)
        tokens.extend(verdict.tokens)
        proposer.commit(len(tokens) - 1)
        # 5. Adapt the draft length, then emit what verification produced.
        policy.update(len(draft.tokens), verdict.num_accepted)
        out, finish = cut(verdict.tokens, stop_ids, max_new_tokens - emitted,
                          target.capacity - len(prompt) - emitted)
        emitted += len(out)
        yield Step(out, len(draft.tokens), verdict.num_accepted, time.perf_counter(), finish)
