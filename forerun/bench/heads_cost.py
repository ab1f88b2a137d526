"""What a head's drafting costs against a target pass: `forerun profile heads`, and the heads
part of `forerun profile gpu`.

Owns: `TimedProposer` (any proposer, its `propose` calls timed, everything else its own) and
`propose_cost`, the median seconds of one drafting step inside a real greedy decode, with the
one-token target pass it is compared with. The decode is the engine's own loop: the head takes
in what verification accepted and drafts as it would for a user; no proposer state is touched
from here. Knows nothing of text.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from time import perf_counter

import torch

from forerun.engine import speculative_decode
from forerun.policy import FixedK
from forerun.profile import measure_forward_curve
from forerun.propose import PROPOSERS, ProposerContext, SpecConfig
from forerun.propose.base import Draft, Proposer
from forerun.runtime.base import Runtime
from forerun.sampling import SamplingConfig, make_generator

FORWARD_REPS = 15  # timed one-token target passes behind `target_ms`


@dataclass
class TimedProposer:
    """`inner` with each `propose` timed: (seconds, nodes drafted) per call, in `calls`."""

    inner: Proposer
    calls: list[tuple[float, int]] = field(default_factory=list)

    def __getattr__(self, name: str):  # everything but propose is the inner proposer's
        return getattr(self.inner, name)

    def propose(self, tokens: list[int], k: int, sampling: SamplingConfig,
                generator: torch.Generator) -> Draft:
        start = perf_counter()
        draft = self.inner.propose(tokens, k, sampling, generator)
        self.calls.append((perf_counter() - start, len(draft.tokens)))
        return draft


def propose_cost(target: Runtime, proposer: Proposer, prompt: list[int], k: int,
                 max_tokens: int) -> dict:
    """A greedy speculative decode of `max_tokens` after `prompt`, drafting k deep: the median
    ms of its `propose` calls that drafted something (all calls where none did: an automatic
    budget resting), the calls and drafted nodes, and the tokens accepted a step."""
    timed = TimedProposer(proposer)
    steps = list(speculative_decode(target, timed, FixedK(k), prompt, SamplingConfig(),
                                    max_tokens, (), make_generator(0)))
    drafting = [s for s, n in timed.calls if n] or [s for s, _ in timed.calls]
    decode_steps = [s for s in steps if not s.prefill]
    return {"propose_ms": statistics.median(drafting) * 1e3 if drafting else None,
            "calls": len(timed.calls), "drafting_calls": sum(1 for _, n in timed.calls if n),
            "nodes": sum(n for _, n in timed.calls),
            "accepted_per_step": sum(s.accepted for s in decode_steps) / max(1, len(decode_steps))}


def target_ms(target: Runtime, context: int) -> float:
    """Median ms of one one-token target pass after `context` cached tokens."""
    return measure_forward_curve(target, (1,), context, reps=FORWARD_REPS).seconds[0] * 1e3


def heads_cost(target: Runtime, heads, method: str, prompt: list[int], k: int, tree: int,
               max_tokens: int) -> dict:
    """Trained heads' drafting cost on `target`: the one-token pass after the prompt, then a
    chain of k and a tree of `tree` nodes, each `propose_cost` over a greedy decode."""
    out: dict = {"method": method, "k": k, "tree": tree,
                 "target_fwd1_ms": target_ms(target, len(prompt))}
    ctx = ProposerContext(target, heads=heads)  # one sequence: EAGLE's cache is reused
    for label, nodes in (("chain", 0), ("tree", tree)):
        proposer = PROPOSERS[method](SpecConfig(method, k, tree=nodes), ctx)
        cost = propose_cost(target, proposer, prompt, k, max_tokens)
        out[label] = cost | {"ratio": round(cost["propose_ms"] / out["target_fwd1_ms"], 3)
                             if cost["propose_ms"] is not None else None}
    return out
