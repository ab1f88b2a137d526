"""The benchmark runner: every prompt runs plain decoding and each speculative cell side by side.

Owns: the run order and what one run records. For each prompt and temperature the baseline
(plain decoding on the same engine: same runtime, model and dtype) and every method x k cell run
in a seeded shuffled order, one right after the other, so slow drifts of the machine (thermal,
another process) hit all of them alike and every figure is a ratio measured side by side. Peers
run on the same prompt ids right after. With `repeats` > 1 that round runs that many times (each
in its own shuffled order) and each cell keeps its run of median wall time: on a noisy machine a
single run of a few seconds moves by ±10%. Aggregation and printing live in `report.py`.

The `suffix` method drafts from a global index of earlier requests' outputs, which the engine
keeps across requests, so what it holds is part of the measurement and the bench sets it for
every suffix run (`suffix_index`, a cell per state): `cold`, no global index (only the
request's own prompt and output); `warm`, the outputs of the prompts run before this one
(plain decoding's, in the run order; the first prompt's warm run is a cold one). Never the
prompt's own output: each run starts from a fresh copy, so neither another repeat nor another
cell of the same prompt (nor the warm-up) is drafted from. A conversation's later turns come
after its earlier ones (`workloads`), so warm holds them and the other conversations before.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

from forerun.api import Engine
from forerun.bench.peers import Peer, Trace
from forerun.bench.workloads import Prompt
from forerun.heads import KINDS as HEAD_KINDS
from forerun.metrics import GenerationStats
from forerun.models.tokenizer import TextTokenizer
from forerun.policy import POLICIES
from forerun.propose import AUTO_TREE, SpecConfig
from forerun.propose.suffix import STORE as SUFFIX_STORE
from forerun.propose.suffix_index import TokenIndex
from forerun.reference import divergence
from forerun.sampling import SamplingConfig

BASELINE = "forerun plain"
WARMUP_TOKENS = 4  # one short untimed run per cell first: one-off costs stay out of the figures
INDEX_STATES = ("cold", "warm")  # what the suffix method's global index holds as a run starts


@dataclass(frozen=True)
class BenchConfig:
    methods: tuple[str, ...] = ("draft", "ngram")
    ks: tuple[int, ...] = (4,)
    temperatures: tuple[float, ...] = (0.0,)
    policies: tuple[str, ...] = ("fixed",)
    max_tokens: int = 128
    seed: int = 0
    tree: int = 0  # head methods: draft-tree node budget (0 = chains)
    tree_topk: int = 4
    lookup: bool = False  # head methods: with the prompt-lookup branch
    repeats: int = 1  # rounds per prompt; each cell keeps its median-wall run
    suffix_index: tuple[str, ...] = ("warm",)  # suffix: a cell per state of the global index
    disaggregate: bool = False  # draft: the asynchronous pipeline (the engine's drafter worker)

    def __post_init__(self):
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        bad = [s for s in self.suffix_index if s not in INDEX_STATES]
        if bad or not self.suffix_index:
            raise ValueError(f"suffix index states must be among {INDEX_STATES}, got "
                             f"{list(self.suffix_index)}")

    def cells(self) -> list[tuple[str, SpecConfig]]:
        """(label, spec) for the baseline and every method x k x policy."""
        unknown = set(self.policies) - set(POLICIES)
        if unknown:
            raise ValueError(f"unknown policy {sorted(unknown)}; choose from {list(POLICIES)}")
        def spec(m: str, k: int, p: str, index: str = "") -> tuple[str, SpecConfig]:
            head = m in HEAD_KINDS
            tree = self.tree if head else 0
            shown = "auto" if tree == AUTO_TREE else tree
            apart = self.disaggregate and m == "draft"
            label = f"{m}{'+lookup' if head and self.lookup else ''} k={k}" + (
                " disaggregated" if apart else "") + (
                f" tree={shown}" if tree else "") + ("" if p == "fixed" else f" {p}") + (
                f" {index}" if index else "")
            cold = {"suffix_cache_tokens": 0} if index == "cold" else {}
            return label, SpecConfig(m, k, p, tree=tree, tree_topk=self.tree_topk,
                                     lookup=head and self.lookup, disaggregate=apart, **cold)

        return [(BASELINE, SpecConfig("none"))] + [
            spec(m, k, p, index) for m in self.methods for k in self.ks for p in self.policies
            for index in (self.suffix_index if m == "suffix" else ("",))]


@dataclass
class Run:
    prompt_id: str
    category: str
    label: str  # BASELINE, "draft k=4", or a peer's "hf assisted" ...
    baseline: str  # the label this run is compared with (same system's plain decoding)
    temperature: float
    prompt_tokens: int
    new_tokens: int
    wall_s: float
    ttft_s: float
    itl_s: list[float] = field(default_factory=list)  # per step: gap / tokens in the step
    verify_steps: int = 0  # target forward passes after the prefill (forerun runs only)
    drafted: int = 0
    accepted: int = 0
    identical: bool | None = None  # token ids == the baseline's (greedy only)
    # where a greedy forerun run parts from plain: {"at", "plain", "speculative", "logit_gap"},
    # the gap = plain's logit of its token minus that of the speculative one, at that position
    divergence: dict | None = None
    token_ids: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def trace_to_run(trace: Trace, prompt: Prompt, label: str, baseline: str, temperature: float,
                 prompt_tokens: int) -> Run:
    times = [t for t, _ in trace.steps]
    gaps = [(b - a) / n for a, (b, n) in zip(times, trace.steps[1:], strict=False) if n]
    return Run(prompt.id, prompt.category, label, baseline, temperature, prompt_tokens,
               len(trace.token_ids), times[-1] - trace.start if times else 0.0,
               times[0] - trace.start if times else 0.0, gaps, token_ids=trace.token_ids)


def run_forerun(engine: Engine, ids: list[int], spec: SpecConfig, sampling: SamplingConfig,
                max_tokens: int) -> tuple[Trace, GenerationStats]:
    start = time.perf_counter()
    steps = [c.step for c in engine.stream(ids, sampling=sampling, max_tokens=max_tokens,
                                           spec=spec)]
    trace = Trace([t for s in steps for t in s.tokens], start,
                  [(s.time, len(s.tokens)) for s in steps])
    return trace, GenerationStats.from_steps(spec.method, spec.k, start, steps)


def run_bench(engine: Engine, prompts: list[Prompt], cfg: BenchConfig,
              peers: Iterable[Peer] = (), on_run: Callable[[Run], None] | None = None
              ) -> list[Run]:
    """All runs, in the order they ran; `on_run` sees each one (progress bars)."""
    peers, cells, runs = list(peers), cfg.cells(), []
    earlier: list[list[int]] = []  # plain's output of each prompt run so far: a warm index
    _warmup(engine, prompts, cells, peers)
    for i, prompt in enumerate(prompts):
        ids, plain = encode(engine.tokenizer, prompt), {}
        for temperature in cfg.temperatures:
            sampling = SamplingConfig(temperature=temperature, seed=cfg.seed + i)
            tries: dict[str, list[Run]] = {}
            for r in range(cfg.repeats):
                order = cells[:]
                key = f"{cfg.seed}:{prompt.id}:{temperature}" + (f":{r}" if r else "")
                random.Random(key).shuffle(order)
                for label, spec in order:
                    start_index(engine, spec, earlier)
                    trace, stats = run_forerun(engine, ids, spec, sampling, cfg.max_tokens)
                    run = trace_to_run(trace, prompt, label, BASELINE, temperature, len(ids))
                    run.verify_steps = max(0, stats.target_forward_passes - 1)
                    run.drafted, run.accepted = stats.drafted, stats.accepted
                    tries.setdefault(label, []).append(run)
                for peer in peers:
                    for mode in peer.modes:
                        trace = peer.run(mode, ids, sampling, cfg.max_tokens)
                        tries.setdefault(peer.label(mode), []).append(trace_to_run(
                            trace, prompt, peer.label(mode), peer.label(peer.modes[0]),
                            temperature, len(ids)))
            done = {label: median_run(runs) for label, runs in tries.items()}
            for run in done.values():
                if temperature == 0.0 and run.label != run.baseline:
                    # every repeat, not only the median one: a divergence that shows in one
                    # repeat of three (a timing-driven draft shape) is still a divergence
                    base = done[run.baseline].token_ids
                    parted = next((r for r in tries[run.label] if r.token_ids != base), None)
                    run.identical = parted is None
                    if parted is not None and run.baseline == BASELINE:
                        run.divergence = divergence(engine.target, ids, base, parted.token_ids)
                runs.append(run)
                if on_run is not None:
                    on_run(run)
            plain[temperature] = done[BASELINE].token_ids
        earlier.append(plain[cfg.temperatures[0]])  # after all its runs: none drafts from it
    return runs


def encode(tokenizer: TextTokenizer, prompt: Prompt) -> list[int]:
    """A lone user turn as `encode_prompt` sends it (through the chat template when the model
    has one); a conversation, every message through the template (a model without one, the
    tiny test models', reads the turns as `role: content` lines)."""
    if len(prompt.messages) == 1:
        return tokenizer.encode_prompt(prompt.text)
    if tokenizer.chat_template is None:
        return tokenizer.encode("".join(f"{m['role']}: {m['content']}\n"
                                        for m in prompt.messages) + "assistant: ")
    return tokenizer.encode_chat(list(prompt.messages))


def start_index(engine: Engine, spec: SpecConfig, earlier: list[list[int]]) -> None:
    """A warm suffix run starts from a global index of `earlier` outputs only, made anew (a
    cold one has none: suffix_cache_tokens 0). Built outside the timed run; it replaces the
    engine's shared index, which the run then adds its own output to."""
    if spec.method != "suffix" or not spec.suffix_cache_tokens:
        return
    index = TokenIndex(spec.suffix_cache_tokens)
    for output in earlier:
        index.add_document(output)
    engine.proposers.shared[SUFFIX_STORE] = index


def median_run(runs: list[Run]) -> Run:
    """The run of median wall time (the lower middle one of an even count)."""
    return sorted(runs, key=lambda run: run.wall_s)[(len(runs) - 1) // 2]


def _warmup(engine: Engine, prompts: list[Prompt], cells, peers: list[Peer]) -> None:
    if not prompts:
        return
    engine.warm_up()  # every static size (CUDA graphs), not only those the warm-up run meets
    ids = encode(engine.tokenizer, prompts[0])
    for _, spec in cells:
        engine.generate(ids, max_tokens=WARMUP_TOKENS, spec=spec)
    for peer in peers:
        for mode in peer.modes:
            peer.run(mode, ids, SamplingConfig(), WARMUP_TOKENS)


def runs_per_prompt(cfg: BenchConfig, peers: Iterable[Peer]) -> int:
    return len(cfg.temperatures) * (len(cfg.cells()) + sum(len(p.modes) for p in peers))
