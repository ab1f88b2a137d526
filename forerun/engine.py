"""The speculative decoding loop: prefill, then {propose, verify, commit, adapt, emit} until done.

Owns: the order of those phases and the KV-cache invariant between them. Before each verify step
the target's cache holds every token of the sequence except the last one (the "pending" token);
verification feeds [pending, draft...] in one forward pass, and rollback is a truncate to the
accepted prefix. A tree draft is verified in the same single pass (tree mask and positions)
and its cache compacted to the accepted path. Proposers that draft from the target's features
(heads) name the layers they need in their declared `needs` and are fed them for every token
that enters the cache.
Each verify pass is timed and shown to the target's calibrated cost curve, which prices drafts.
Knows nothing of text: tokens in, tokens out.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator

import torch

from forerun.metrics import Step
from forerun.policy import LengthPolicy
from forerun.profile import observe_pass
from forerun.propose.base import Proposer
from forerun.reference import prefill
from forerun.runtime.base import Runtime
from forerun.sampling import SamplingConfig, logits_to_probs
from forerun.stopping import check_prompt, cut
from forerun.tree import TokenTree
from forerun.verify import greedy_accept, recursive_rejection_sample, rejection_sample


def speculative_decode(target: Runtime, proposer: Proposer, policy: LengthPolicy,
                       prompt: list[int], sampling: SamplingConfig, max_new_tokens: int,
                       stop_ids: Collection[int], generator: torch.Generator) -> Iterator[Step]:
    needs = proposer.needs  # target features a head drafts from, extra verify rows
    layers = needs.hidden_layers
    # 1. Prefill: target and proposer see the prompt; the target samples the first token.
    check_prompt(prompt, target.capacity)  # the target's context message, before the drafter's
    proposer.prefill(prompt)
    wanted = layers if needs.prompt_features else ()
    # the prompt rows whose features it reads (an EAGLE window; Medusa's last row)
    first, hidden = prefill(target, prompt, sampling, generator, wanted,
                            needs.hidden_from(len(prompt)) if wanted else 0)
    if wanted:
        proposer.feed(hidden)  # features of the cached prompt tokens it reads
    tokens = [*prompt, first]
    out, finish = cut(tokens[-1:], stop_ids, max_new_tokens, target.capacity - len(prompt))
    emitted = len(out)
    yield Step(out, 0, 0, time.perf_counter(), finish, prefill=True)
    while not finish:
        # context slots left after the pending token (and the rows the drafter adds to a pass)
        room = target.capacity - len(tokens) - needs.extra_rows
        # 2. Propose up to k tokens deep (never more than could be emitted or fit).
        k = max(0, min(policy.next_k(), max_new_tokens - emitted - 1, room))
        draft = proposer.propose(tokens, k, sampling, generator).fit(room)
        tree = TokenTree.of(draft.parents, len(draft.tokens))
        # 3. Verify: one target pass over the pending token and the draft -> p [N+1, V].
        base = target.length
        feed = torch.cat([torch.tensor(tokens[-1:]), draft.tokens])  # [N+1]
        shape = {} if tree.is_chain else {"positions": tree.positions(base),
                                          "tree_mask": tree.mask()}
        started = time.perf_counter()
        output = target.forward(feed, hidden_layers=layers, **shape)
        if output.logits.device.type == "cpu":  # timed: a GPU's pass may still be running
            observe_pass(target, len(feed), time.perf_counter() - started)
        if sampling.greedy:  # T = 0 of the samplers below, from the argmax alone
            verdict = greedy_accept(tree, draft.tokens, output.logits.argmax(-1))  # [N+1]
        else:
            p = logits_to_probs(output.logits, sampling)  # [N+1, V]
            verdict = (rejection_sample(draft.tokens, p, draft.q, generator) if tree.is_chain
                       else recursive_rejection_sample(tree, draft.tokens, p, draft.q, generator))
        path = verdict.path
        # 4. Commit the accepted path, drop the rest (target and proposer caches).
        rows = [0, *(i + 1 for i in path)]  # the verify pass's rows now final
        if tree.is_chain:
            target.truncate(base + len(rows))
        else:
            target.keep(base, rows)
        tokens.extend(verdict.tokens)
        proposer.commit(len(tokens) - 1)
        if layers:  # a chain's rows are a prefix: a view, not a gather (~0.09 ms a step)
            keep = slice(len(rows)) if tree.is_chain else rows
            proposer.feed({i: h[keep] for i, h in output.hidden.items()})
        # 5. Adapt the draft length, then emit what verification produced.
        drafted = max(tree.depth, default=0)  # tokens deep: a chain's length
        policy.update(drafted, len(path))
        out, finish = cut(verdict.tokens, stop_ids, max_new_tokens - emitted,
                          target.capacity - len(prompt) - emitted)
        emitted += len(out)
        yield Step(out, drafted, len(path), time.perf_counter(), finish)
