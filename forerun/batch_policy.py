"""Draft lengths for a whole batch: every member's k chosen together, so that the batch's
expected tokens per second is highest under the measured cost of a pass of that many rows.

Owns: `BatchCost` (the choice), `measure_batch_curve` (seconds of one target pass over n rows
spread over several sequences, the cost surface the choice reads) and `BatchCostPolicy`, the
choice fed with each member's running acceptance.

Why a batch needs its own policy: one sequence's verify pass of k+1 rows costs little more
than one row on a CPU (the weights are read once either way), so drafting pays. A batch of B
sequences already reads the weights for B rows; k more rows each make the pass B(k+1) rows,
which is compute, not memory, once B is large. So speculation must shrink by itself as the
batch fills, down to k = 0 (plain batched decoding), and come back as it empties. The choice
is greedy by marginal gain: start every member at k = 0 (one row each, B expected tokens),
and keep adding the draft token with the largest expected gain, member b's next token being
accepted with probability a_b^(k_b+1) (each accepted independently with the member's rate
until the first rejection: `forerun.policy.expected_tokens`), while tokens per second rises:

    rate(k) = sum_b E[tokens_b | k_b] / (verify(B + sum_b k_b) + draft(k))

where draft(k) is the shared draft model's rounds: round r runs the members with k_b >= r.
Output never depends on the choice (every k is lossless); only speed does.

The costs are calibrated once (`measure_batch_curve`) and corrected while serving: every target
pass is shown to the verify curve (a `LiveCurve`, per size), and every shared draft call's
seconds against what the policy priced it at (`draft_round` summed over its rounds) keep a
running ratio that scales `draft_round`. Calibration passes are clean (random tokens, one
pass each); a served draft call also catches up the tokens the last verify accepted, reads
q and masks, and shares the cores: what it really costs is what it must be priced at.

A member whose shared draft model has not read its sequence (a newcomer's prompt, the tokens
it decoded while at rest) pays that catch-up, one draft pass of that many rows, on its first
draft token: priced (`BatchCostPolicy.catch_up`) spread over the steps it may still draft in,
so a long prompt with a short reply left does not stall the batch for a draft that cannot pay.

A member at k = 0 shows nothing of its acceptance, so a low estimate could keep it at 0 for
good. The policy therefore reads each member's acceptance optimistically, its running rate
plus EXPLORE / sqrt(evidence) (little evidence: a generous rate, so it drafts where drafting
may pay and learns), and a member left at k = 0 ages its evidence by one position a step: after
a while at rest it probes again, if spare compute allows (at large batches even a generous rate
chooses no draft, so nothing is spent there). Measured on this pair (bf16, 2-core EPYC), the
prior alone (0.5) chose k = 0 at batch 1 where fixed k = 4 ran 1.22x faster than plain.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate
from time import perf_counter

import torch

from forerun.policy import expected_tokens
from forerun.profile import FILLER_SEED, LIVE_CLIP, LIVE_WEIGHT, ForwardCurve, LiveCurve
from forerun.propose.base import AcceptanceEstimate
from forerun.runtime.batch import BatchRuntime, PackedBatch

# Per-member acceptance before any evidence (as the one-sequence cost policy's prior), worth a
# few positions, forgetting over ~64 positions: it follows the text
ACCEPTANCE_PRIOR, PRIOR_TRIALS, ACCEPTANCE_MEMORY = 0.5, 4.0, 64.0
EXPLORE = 0.5  # optimism: the rate read is rate + EXPLORE / sqrt(trials + PRIOR_TRIALS), <= 1
BATCH_CURVE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)  # rows of the calibration passes
CURVE_MEMBERS = 8  # sequences a calibration pass spreads its rows over (attention per member)
CURVE_CONTEXT = 200  # tokens each of them holds, as in a short chat
CURVE_REPS, CURVE_WARMUP = 3, 1


@dataclass(frozen=True)
class BatchCost:
    """`verify(n)`: target seconds for a pass of n rows; `draft_round(m)`: seconds of one
    shared draft round over m members (None: drafting is free, e.g. n-gram lookup)."""

    verify: Callable[[float], float]
    draft_round: Callable[[float], float] | None = None

    def drafting(self, ks: list[int]) -> float:
        """Priced seconds of a shared draft call for members drafting `ks` tokens: round r
        runs the members with k >= r."""
        if self.draft_round is None:
            return 0.0
        return sum(self.draft_round(sum(k >= r for k in ks)) for r in range(1, max(ks) + 1)
                   ) if ks else 0.0

    def choose(self, acceptance: list[float], caps: list[int],
               paid: list[bool] | None = None, draft_scale: float = 1.0,
               catch_up: list[float] | None = None) -> list[int]:
        """Every member's k (0..caps[b]) with the most expected tokens per second; `paid[b]`:
        member b's drafting runs the shared draft model (None: every member's does), whose
        rounds cost `draft_scale` times `draft_round`; `catch_up[b]`: seconds member b's
        first draft token costs on top of its round (its backlog fed to the draft model, its
        share for this step)."""
        B = len(acceptance)
        k = [0] * B
        in_round = [0] * (max(caps, default=0) + 2)  # members drafting at each depth
        tokens, rows, drafting = float(B), B, 0.0
        rate = tokens / self.verify(rows)
        while True:
            best, best_rate, best_cost = -1, rate, 0.0
            for b in range(B):
                if k[b] >= caps[b]:
                    continue
                depth = k[b] + 1
                extra = 0.0
                if self.draft_round is not None and (paid is None or paid[b]):
                    # round `depth` gains one member
                    m = in_round[depth]
                    extra = draft_scale * (self.draft_round(m + 1) - (
                        self.draft_round(m) if m else 0.0))
                    if depth == 1 and catch_up is not None:
                        extra += catch_up[b]
                gain = acceptance[b] ** depth
                r = (tokens + gain) / (self.verify(rows + 1) + drafting + extra)
                if r > best_rate:
                    best, best_rate, best_cost = b, r, extra
            if best < 0:
                return k
            k[best] += 1
            in_round[k[best]] += paid is None or paid[best]
            tokens += acceptance[best] ** k[best]
            rows, drafting, rate = rows + 1, drafting + best_cost, best_rate


@dataclass
class BatchCostPolicy:
    """BatchCost fed with each member's running acceptance (keyed by the member's id)."""

    cost: BatchCost
    estimates: dict[int, AcceptanceEstimate] = field(default_factory=dict)
    draft_scale: float = 1.0  # running seen / priced seconds of the shared draft's calls
    draft_calls: int = 0

    def choose(self, members: list[int], caps: list[int], paid: list[bool] | None = None,
               backlog: list[int] | None = None, remaining: list[int] | None = None
               ) -> list[int]:
        """Every member's k; `backlog[b]`: tokens member b's drafter must feed its model before
        drafting (`BatchDrafter.backlog`), `remaining[b]`: the tokens it may still decode."""
        estimates = [self._estimate(m) for m in members]
        rates = [optimistic(e) for e in estimates]
        catch_up = None if backlog is None or remaining is None else [
            self.catch_up(n, left, a, cap)
            for n, left, a, cap in zip(backlog, remaining, rates, caps, strict=True)]
        ks = self.cost.choose(rates, caps, paid, self.draft_scale, catch_up)
        for e, k in zip(estimates, ks, strict=True):
            if not k:  # at rest: its evidence ages, so it probes again in a while
                e.age()
        return ks

    def catch_up(self, backlog: int, remaining: int, acceptance: float, cap: int) -> float:
        """The seconds of feeding `backlog` tokens to the draft model (one pass of that many
        rows), spread over the steps the member may still draft in: it is paid once, and
        every later step drafts on it. A newcomer's prompt (a few hundred rows of the draft
        model) then keeps a short reply from drafting where it cannot pay that back."""
        if not backlog or self.cost.draft_round is None:
            return 0.0
        steps = max(1.0, remaining / expected_tokens(acceptance, max(cap, 1)))
        return self.draft_scale * self.cost.draft_round(backlog) / steps

    def observe_pass(self, rows: int, seconds: float) -> None:
        """A timed target pass over `rows` rows (its verify curve learns it, if live)."""
        if isinstance(self.cost.verify, LiveCurve):
            self.cost.verify.observe(rows, seconds)

    def observe_drafting(self, ks: list[int], seconds: float, catch_up: int = 0) -> None:
        """A timed shared draft call for members drafting `ks`, after feeding `catch_up` rows
        of their backlogs (priced as one pass of that many rows): the draft's rounds are priced
        by the running ratio of seen to priced seconds (a call stalled by the machine moves it
        by LIVE_CLIP-fold at most)."""
        priced = self.cost.drafting(ks)
        if catch_up and self.cost.draft_round is not None:
            priced += self.cost.draft_round(catch_up)
        if priced <= 0 or seconds <= 0:
            return
        self.draft_calls += 1
        old = self.draft_scale
        ratio = min(max(seconds / priced, old / LIVE_CLIP), old * LIVE_CLIP)
        self.draft_scale = old + max(LIVE_WEIGHT, 1 / self.draft_calls) * (ratio - old)

    def update(self, member: int, drafted: int, accepted: int) -> None:
        if drafted:
            self._estimate(member).observe(accepted, drafted)

    def forget(self, member: int) -> None:
        self.estimates.pop(member, None)

    def _estimate(self, member: int) -> AcceptanceEstimate:
        if member not in self.estimates:
            self.estimates[member] = AcceptanceEstimate(ACCEPTANCE_PRIOR, PRIOR_TRIALS,
                                                        ACCEPTANCE_MEMORY)
        return self.estimates[member]


def optimistic(e: AcceptanceEstimate) -> float:
    """The acceptance a member is priced at: its rate plus a bonus that shrinks with evidence."""
    return min(1.0, e.rate + EXPLORE / (e.trials + e.prior_trials) ** 0.5)


def measure_batch_curve(runtime: BatchRuntime, vocab_size: int,
                        sizes: tuple[int, ...] = BATCH_CURVE_SIZES,
                        members: int = CURVE_MEMBERS, context: int = CURVE_CONTEXT,
                        reps: int = CURVE_REPS, warmup: int = CURVE_WARMUP) -> ForwardCurve:
    """Seconds of one pass over n rows, its rows spread over min(n, members) sequences that
    each hold `context` tokens, for each n in `sizes` (the fastest of `reps` passes, in
    rounds over all sizes, `warmup` untimed rounds first). Its sequences are released after."""
    sizes = tuple(sorted({min(n, runtime.capacity - 1) for n in sizes}))
    context = max(1, min(context, runtime.capacity - sizes[-1]))
    filler = torch.Generator().manual_seed(FILLER_SEED)
    ids = torch.randint(vocab_size, (context + sizes[-1],), generator=filler)
    seqs = [runtime.add(context + sizes[-1]) for _ in range(members)]
    try:
        runtime.forward(PackedBatch.of([(s, ids[:context]) for s in seqs], last_only=True))
        times: list[list[float]] = [[] for _ in sizes]
        for rep in range(warmup + reps):
            for i, n in enumerate(sizes):
                used = seqs[:min(n, members)]
                split = [n // len(used) + (j < n % len(used)) for j in range(len(used))]
                batch = PackedBatch.of([(s, ids[context:context + t])
                                        for s, t in zip(used, split, strict=True)])
                start = perf_counter()
                runtime.forward(batch).logits.argmax(-1).tolist()  # synced, as a step is
                elapsed = perf_counter() - start
                for s in used:
                    runtime.truncate(s, context)
                if rep >= warmup:
                    times[i].append(elapsed)
    finally:
        for s in seqs:
            runtime.release(s)
    # timing noise must not make a larger pass look cheaper than a smaller one
    return ForwardCurve(sizes, tuple(accumulate((min(t) for t in times), max)))
