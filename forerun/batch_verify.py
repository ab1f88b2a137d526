"""Phase 4 of the batch step (`forerun.batch_engine`): every member verified on its own rows.

Owns `verify_all` and what it runs first, `processed`: each member's penalties, logit bias and
grammar mask applied to its rows, each row under its own history (its draft path included).
Greedy members read one argmax over the batch; sampled members go through one probability
transform and one batched rejection sampler (chains), or their tree verifier, each with its own
generator. The argmaxes come back too: a drafter that learns from the target's choices on its
rows (Lookahead, `Needs.observe`) is shown them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from forerun.grammar import apply_masks
from forerun.processors import process_rows
from forerun.propose.base import Draft
from forerun.sampling import logits_to_probs_rows
from forerun.tree import TokenTree
from forerun.verify import TreeVerdict, Verdict, greedy_accept
from forerun.verify_batch import batch_rejection_sample
from forerun.verify_spectr import TREE_VERIFIERS

if TYPE_CHECKING:
    from forerun.batch_engine import Sequence


def verify_all(live: list[Sequence], drafts: list[Draft | None], trees: list[TokenTree | None],
               spans: list[range], logits: torch.Tensor
               ) -> tuple[list[Verdict | TreeVerdict | None], list[int]]:
    """Every member's verdict from its `spans` of the pass's wanted rows `logits` [R, V] (None
    for a prompt chunk that is not the last: it wants no row). Greedy members read
    one argmax over the batch (one host sync); sampled members' rows go to the host in one
    copy, through one probability transform (each row under its member's sampling), and the
    chains among them (a prefill or a plain step is a chain of no draft tokens) through one
    batched rejection sampler, each drawing from its own generator; trees walk their own rows.
    The transform runs on the host as each member's did alone: its bits are then the same in
    any batch (a device's reductions round by the batch's shape). Penalties and logit bias come
    first, each row under its own history (`processed`). Also returns every row's argmax
    after them (for a drafter's `observe`)."""
    logits = processed(live, drafts, trees, spans, logits)  # [R, V]
    best = logits.argmax(-1).tolist()  # [R]
    verdicts: list[Verdict | TreeVerdict | None] = [None] * len(live)
    sampled = []
    for b, (s, d, tree) in enumerate(zip(live, drafts, trees, strict=True)):
        if not spans[b]:
            continue
        if not s.sampling.greedy:
            sampled.append(b)
        elif d is None or s.proposer is None:  # the argmax, as plain decoding takes it
            verdicts[b] = TreeVerdict([best[spans[b].start]], [])
        else:
            verdicts[b] = greedy_accept(tree, d.tokens, torch.tensor(best[spans[b].start:
                                                                          spans[b].stop]))
    if sampled:
        rows = [r for b in sampled for r in spans[b]]
        p = logits_to_probs_rows(logits[rows].cpu(), [live[b].sampling for b in sampled
                                                      for _ in spans[b]])  # [R_s, V]
        at, start = {}, 0
        for b in sampled:  # member b's rows of p
            at[b], start = slice(start, start + len(spans[b])), start + len(spans[b])
        chains = [b for b in sampled if trees[b] is None or trees[b].is_chain]
        if chains:  # (every sampled member may be a tree)
            for b, v in zip(chains, batch_rejection_sample(
                    [draft_tokens(drafts[b]) for b in chains],
                    torch.cat([p[at[b]] for b in chains]),
                    [None if drafts[b] is None else drafts[b].q for b in chains],
                    [live[b].generator for b in chains]), strict=True):
                verdicts[b] = v
        for b in (b for b in sampled if verdicts[b] is None):  # the trees
            d = drafts[b]
            verify_tree = TREE_VERIFIERS[live[b].proposer.needs.tree_verifier]
            verdicts[b] = verify_tree(trees[b], d.tokens, p[at[b]], d.q, live[b].generator)
    return verdicts, best


def processed(live: list[Sequence], drafts: list[Draft | None], trees: list[TokenTree | None],
               spans: list[range], logits: torch.Tensor) -> torch.Tensor:
    """The wanted rows' logits [R, V] through each member's `forerun.processors` options and
    its grammar's mask (`forerun.grammar`), a verify's row under the committed tokens plus the
    draft's path to it (as if the path had been generated), a prompt's last row under the
    prompt."""
    if not any(s.sampling.processing.active or s.grammar for s in live):
        return logits
    configs, histories, starts, allowed = [], [], [], []
    for s, d, tree, span in zip(live, drafts, trees, spans, strict=True):
        cfg = s.sampling.processing
        if not cfg.active:
            rows: list[list[int]] = [[]] * len(span)
        elif d is None:
            rows = [s.prompt] * len(span)  # a prompt's last row: its first token
        else:
            drafted = d.tokens.tolist()
            rows = [s.tokens, *(s.tokens + [drafted[j] for j in tree.path(i)]
                                for i in range(len(tree)))]
        configs += [cfg] * len(span)
        histories += rows
        starts += [len(s.prompt)] * len(span)
        if s.grammar is None or not span:
            allowed.append(torch.ones(len(span), logits.shape[-1], dtype=torch.bool))
        else:  # the grammar's mask at each row, the draft's path to it consumed
            allowed.append(s.grammar.masks([] if d is None else d.tokens.tolist(),
                                           [] if d is None else [tree.path(i) for i in
                                                                 range(len(tree))]))
    logits = process_rows(logits, configs, histories, starts)  # [R, V]
    if not any(s.grammar for s in live):
        return logits
    return apply_masks(logits, torch.cat(allowed))


def draft_tokens(d: Draft | None) -> torch.Tensor:
    """A chain's draft tokens [K] (none for a prefill)."""
    return torch.empty(0, dtype=torch.long) if d is None else d.tokens
