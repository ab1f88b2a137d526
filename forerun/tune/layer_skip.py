"""`forerun tune layer-skip`'s search: which layers the target's self-draft leaves out.

Owns: the calibration texts (the target's own greedy replies to the training package's chat
prompts), the measure of a skip set, and the greedy search over sets. Prints nothing; the
command module reports, `forerun.propose.layer_skip` keeps the result.

The measure of a set S (`Trial`):
- a, the agreement: the skipped model's top-1 against the target's, teacher-forced on the
  calibration texts (every reply row, and the prompt's last). All texts go through in one
  pass (`Calibration`: packed, positions from 0 in each, a block-diagonal causal mask), so a
  trial costs one forward of the skipped model over a few hundred tokens. With i.i.d.
  acceptance a, a chain of k drafts yields (1 - a^(k+1)) / (1 - a) tokens a step.
- c, the cost of a draft step as a fraction of a target pass: the weights it reads, (kept
  layers + LM head) / (all layers + LM head), as a decode step on a CPU is bound by them.
- the expected speedup over plain decoding at the best k <= max_k:
  (1 - a^(k+1)) / (1 - a) / (k c + v(k + 1)), v(n) the target's pass over n tokens relative to
  one token (its measured verify curve; 1 where none is given: the standard formula).

The search (greedy elimination, as SWIFT's and Draft & Verify's, made cheap): every layer is
first tried alone; then, from nothing skipped, each round adds the one of the `pool` layers
whose lone skip hurt least that keeps the most agreement, and the set with the most expected
speedup of all those measured is the answer. It stops after `patience` rounds without a
better speedup, after `max_evals` trials or `max_seconds`, or with one layer left. Layers
cost the same, so within a round agreement decides.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from forerun.reference import plain_decode
from forerun.runtime.torch_model import TorchRuntime
from forerun.sampling import SamplingConfig, make_generator

HEAD_ROWS = 256  # rows of logits computed at once (the LM head is [V, D]: bound the memory)


@dataclass(frozen=True)
class TuneConfig:
    prompts: int = 8  # calibration prompts (the training package's chat prompts, in order)
    reply_tokens: int = 48  # the target's greedy reply to each, teacher-forced
    max_k: int = 8  # the longest draft the speedup is priced at
    pool: int = 4  # layers tried a round: those whose lone skip hurt least
    max_evals: int = 80  # trials at most, the n lone layers' included (a trial: one forward
    # of the skipped model over all texts)
    patience: int = 2  # rounds without a better speedup before it stops
    max_seconds: float = 0.0  # no round starts after this long (0 = no limit)

    def __post_init__(self):
        if min(self.prompts, self.reply_tokens, self.max_k, self.pool, self.max_evals,
               self.patience) < 1 or self.max_seconds < 0:
            raise ValueError(f"every tune setting must be >= 1, got {self}")


@dataclass(frozen=True)
class Calibration:
    """The calibration texts packed into one pass."""

    tokens: torch.Tensor  # [T] every text, one after another
    positions: torch.Tensor  # [T] from 0 in each text
    mask: torch.Tensor  # [T, T] bool: causal within a text, nothing across texts
    rows: torch.Tensor  # [R] the rows scored: each prompt's last, then every reply row
    texts: int

    @staticmethod
    def of(texts: list[tuple[list[int], list[int]]]) -> Calibration:
        """(prompt, reply) pairs -> their packed pass."""
        tokens, positions, rows, blocks = [], [], [], []
        for prompt, reply in texts:
            start, n = len(tokens), len(prompt) + len(reply)
            tokens += [*prompt, *reply]
            positions += range(n)
            rows += range(start + len(prompt) - 1, start + n)
            blocks.append(torch.ones(n, n, dtype=torch.bool).tril())
        return Calibration(torch.tensor(tokens), torch.tensor(positions),
                           torch.block_diag(*blocks), torch.tensor(rows), len(texts))


@dataclass(frozen=True)
class Trial:
    skip: tuple[int, ...]
    agreement: float  # a: the skipped model's top-1 == the target's, over the scored rows
    cost: float  # c: a draft step's weights / a target pass's
    k: int  # the draft length with the most expected speed
    speedup: float  # expected tokens/s over plain decoding's at that k (< 1: it does not pay)


@dataclass
class SearchResult:
    best: Trial
    singles: list[Trial]  # every layer skipped alone
    rounds: list[Trial]  # each round's pick, in order
    evals: int
    stopped: str  # "patience", "budget", "time" or "layers"
    config: TuneConfig
    rows: int  # scored rows (calibration tokens)
    trials: list[Trial] = field(default_factory=list)  # every set measured

    def to_dict(self) -> dict:
        return asdict(self)


def calibration_texts(target: TorchRuntime, prompts: list[list[int]], reply_tokens: int,
                      stop_ids=()) -> list[tuple[list[int], list[int]]]:
    """Each prompt with the target's greedy reply (at most `reply_tokens`)."""
    out = []
    for ids in prompts:
        steps = plain_decode(target, ids, SamplingConfig(), reply_tokens, stop_ids,
                             make_generator(0))
        out.append((ids, [t for s in steps for t in s.tokens]))
    target.truncate(0)
    return out


def top1(runtime: TorchRuntime, calib: Calibration) -> torch.Tensor:
    """The runtime's argmax at every scored row [R], from one pass over every text."""
    runtime.truncate(0)
    last = runtime.config.n_layers - 1
    out = runtime.forward(calib.tokens, positions=calib.positions, tree_mask=calib.mask,
                          last_only=True, hidden_layers=(last,))
    x = out.hidden[last][calib.rows]  # [R, D]
    runtime.truncate(0)
    return torch.cat([runtime.head(part)[1].argmax(-1) for part in x.split(HEAD_ROWS)])


def draft_cost(target: TorchRuntime, skipped: int) -> float:
    """A draft step's weights over a target pass's: (kept layers + LM head) / (all + head)."""
    cfg = target.config
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    layer = cfg.dim * (q + 2 * kv) + q * cfg.dim + 3 * cfg.dim * cfg.ffn_dim
    head = cfg.vocab_size * cfg.dim
    full = cfg.n_layers * layer + head
    return (full - skipped * layer) / full


def best_k(agreement: float, cost: float, max_k: int,
           verify: Callable[[int], float] = lambda n: 1.0) -> tuple[int, float]:
    """(k, expected speedup over plain) at the k in 1..max_k with the most expected tokens/s,
    below 1 where no draft pays (sets are still ranked; the cost policy then drafts none).
    `verify(n)`: a target pass over n tokens / over 1."""
    best = (0, 0.0)
    for k in range(1, max_k + 1):
        tokens = k + 1 if agreement >= 1 else (1 - agreement ** (k + 1)) / (1 - agreement)
        speedup = tokens / (k * cost + verify(k + 1))
        if speedup > best[1]:
            best = (k, speedup)
    return best


def search(target: TorchRuntime, calib: Calibration, cfg: TuneConfig,
           verify: Callable[[int], float] = lambda n: 1.0,
           on_trial: Callable[[Trial], None] = lambda trial: None) -> SearchResult:
    """The greedy search of the module docstring over `target`'s layers."""
    n, started = target.config.n_layers, time.perf_counter()
    reference = top1(target.without_layers((), len(calib.tokens)), calib)  # [R]
    trials: dict[tuple[int, ...], Trial] = {}

    def measure(skip: tuple[int, ...]) -> Trial:
        if skip not in trials:
            drafted = top1(target.without_layers(skip, len(calib.tokens)), calib)  # [R]
            agreement = (drafted == reference).double().mean().item()
            cost = draft_cost(target, len(skip))
            trials[skip] = Trial(skip, agreement, cost, *best_k(agreement, cost, cfg.max_k, verify))
            on_trial(trials[skip])
        return trials[skip]

    singles = [measure((i,)) for i in range(n)] if n > 1 else []
    order = [t.skip[0] for t in sorted(singles, key=lambda t: -t.agreement)]
    nothing = Trial((), 1.0, 1.0, *best_k(1.0, 1.0, cfg.max_k, verify))  # the target itself
    best = max(singles, key=lambda t: t.speedup, default=nothing)
    current: tuple[int, ...] = ()
    rounds: list[Trial] = []
    stale, stopped = 0, "layers"
    while len(current) < n - 1:
        pool = [i for i in order if i not in current][:cfg.pool]
        if len(trials) + len(pool) > cfg.max_evals:
            stopped = "budget"
            break
        if cfg.max_seconds and time.perf_counter() - started > cfg.max_seconds:
            stopped = "time"
            break
        pick = max((measure(tuple(sorted((*current, i)))) for i in pool),
                   key=lambda t: t.agreement)
        rounds.append(pick)
        current = pick.skip
        if pick.speedup > best.speedup:
            best, stale = pick, 0
        elif len(current) > 1:  # (round 1 re-picks a single: no news)
            stale += 1
            if stale >= cfg.patience:
                stopped = "patience"
                break
    return SearchResult(best, singles, rounds, len(trials), stopped, cfg, len(calib.rows),
                        list(trials.values()))
