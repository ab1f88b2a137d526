"""Plain autoregressive decoding: the oracle every speculative method must match, and the
baseline every speedup is measured against. Deliberately the obvious loop (penalties and logit
bias applied to each position's logits with the history so far). Also replays its
path to show what it saw where another greedy decoding parted from it (`divergence`).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator

import torch

from forerun.metrics import Step
from forerun.processors import process_row
from forerun.runtime.base import Runtime
from forerun.sampling import SamplingConfig, next_token
from forerun.stopping import check_prompt, cut


def prefill(target: Runtime, prompt: list[int], sampling: SamplingConfig,
            generator: torch.Generator, hidden_layers: tuple[int, ...] = (),
            hidden_from: int = 0) -> tuple[int, dict[int, torch.Tensor]]:
    """Fill the target's cache with the prompt and sample the first new token; also return
    the hidden states `hidden_layers` of the prompt's tokens from `hidden_from` on (layer ->
    [P - hidden_from, D])."""
    check_prompt(prompt, target.capacity)
    target.truncate(0)
    out = target.forward(torch.tensor(prompt), last_only=True, hidden_layers=hidden_layers,
                         hidden_from=hidden_from)
    logits = process_row(out.logits[-1], sampling.processing, prompt, len(prompt))  # [V]
    return next_token(logits, sampling, generator), out.hidden


def plain_decode(target: Runtime, prompt: list[int], sampling: SamplingConfig,
                 max_new_tokens: int, stop_ids: Collection[int],
                 generator: torch.Generator) -> Iterator[Step]:
    token, _ = prefill(target, prompt, sampling, generator)
    emitted, is_prefill, history = 0, True, [*prompt]
    while True:
        room = target.capacity - len(prompt) - emitted
        out, finish = cut([token], stop_ids, max_new_tokens - emitted, room)
        emitted += len(out)
        yield Step(out, 0, 0, time.perf_counter(), finish, prefill=is_prefill)
        if finish:
            return
        history.append(token)
        logits = target.forward(torch.tensor([token])).logits  # [1, V]
        logits = process_row(logits[-1], sampling.processing, history, len(prompt))  # [V]
        token, is_prefill = next_token(logits, sampling, generator), False


def plain_logits_at(target: Runtime, prompt: list[int], tokens: list[int], position: int
                    ) -> torch.Tensor:
    """The target's logits [V] for new token `position` along plain decoding's own path: the
    prompt in one pass, then tokens[:position] one per pass, as `plain_decode` fed them (so on a
    deterministic runtime these are the logits plain decoding chose tokens[position] from)."""
    check_prompt(prompt, target.capacity)
    if not 0 <= position <= len(tokens):
        raise ValueError(f"position {position} is outside the {len(tokens)} tokens given")
    target.truncate(0)
    logits = target.forward(torch.tensor(prompt), last_only=True).logits  # [1, V]
    for token in tokens[:position]:
        logits = target.forward(torch.tensor([token])).logits  # [1, V]
    return logits[-1]


def divergence(target: Runtime, prompt: list[int], plain: list[int], other: list[int]
               ) -> dict | None:
    """Where greedy output `other` first parts from plain greedy output `plain`, and plain's
    logit margin there (its token's logit minus the other's, replayed): {"at", "plain",
    "speculative", "logit_gap"}, None if they are equal. A margin of the runtime's batch-shape
    rounding is a near-tie (README, "What lossless means here"); a large one would be a bug."""
    if plain == other:
        return None
    pairs = zip(plain, other, strict=False)
    at = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(plain), len(other)))
    mine, theirs = (seq[at] if at < len(seq) else None for seq in (plain, other))
    gap = None  # one stopped (a stop token) where the other went on: no choice to replay
    if mine is not None and theirs is not None:
        logits = plain_logits_at(target, prompt, plain, at)  # [V]
        gap = round(float(logits[mine] - logits[theirs]), 4)
    return {"at": at, "plain": mine, "speculative": theirs, "logit_gap": gap}
