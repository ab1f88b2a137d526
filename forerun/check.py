"""`forerun check`'s logic: is speculative decoding lossless for this target, method and drafter?

Owns two tests and their verdicts; the CLI command only parses flags and prints.
(a) Greedy identity: over N prompts, speculative greedy output (the engine's own loop, end to
    end) against plain greedy output. Where one parts from the other, `reference.divergence`
    replays plain's path and gives plain's logit margin between the two tokens: below the
    runtime's rounding (NEAR_TIE_MARGINS) it is a numerical near-tie, above it a bug. Verdict:
    pass if every output is identical, near-tie if every divergence is one, fail otherwise.
(b) The sampling test: at M contexts c, the first token a verify step emits must be distributed
    exactly as the target's p(. | c). The sequence is put in the state the engine is in right
    after a prefill of c[:-1] that sampled c[-1] (target and proposer prefilled, features fed,
    c[-1] pending), so the counted token comes out of the rejection sampler, never out of the
    prefill. Each sample is one real draft + verify step: the real proposer drafts k tokens
    (a fixed k: a length policy decides how many tokens are drafted, never which token the
    verdict begins with), the target's verify pass gives p rows [N+1, V] (cached per distinct
    draft: the target is deterministic given its tokens; a deterministic drafter costs one
    pass a context), the engine's sampler returns a verdict, and its first token is counted.
    Then the proposer is put back in a state the engine reaches (final up to c[-2], c[-2]'s
    feature fed again) for the next sample. The expected p is plain decoding's: one target
    pass over c[-1] after the prefill. A chi-square goodness-of-fit test compares the counts
    with samples * p over the tokens whose expected count is >= MIN_EXPECTED, the rest pooled
    in one more bin; its p-value is the chi-square survival function (regularized upper
    incomplete gamma, torch.special.gammaincc). Each of the M tests runs at alpha / M
    (Bonferroni), so a correct verifier fails the whole test with probability <= alpha, the
    stated false-failure rate. A token with p = 0 sampled at all fails outright (no chance).
A verifier that accepts every draft token (ACCEPT_ALL, `forerun check --verifier accept-all`)
must fail: the self-test that this check has power on the user's own models and prompts (an
n-gram drafter on text without repeats drafts nothing, and then no verifier can be told apart).
Knows nothing of text: prompts are token ids with a label.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

import forerun.batch_verify as verify_phase
from forerun.api import Engine
from forerun.propose import PROPOSERS, SpecConfig
from forerun.propose.base import Draft
from forerun.reference import divergence, plain_logits_at, prefill
from forerun.runtime.base import Runtime
from forerun.sampling import SamplingConfig, logits_to_probs, make_generator, sample
from forerun.tree import TokenTree
from forerun.verify import (
    TreeVerdict,
    Verdict,
    greedy_accept,
    recursive_rejection_sample,
    rejection_sample,
)
from forerun.verify_batch import batch_rejection_sample, each_member
from forerun.verify_spectr import TREE_VERIFIERS

PASS, NEAR_TIE, FAIL = "pass", "near-tie", "fail"
GREEDY = SamplingConfig()
MIN_EXPECTED = 5.0  # chi-square bins need an expected count of at least this many samples
# Plain's logit margin under which a greedy divergence is put down to the runtime's numerics (a
# k+1-token pass rounds unlike a 1-token one): llama.cpp measured up to 0.59 logit between
# pass shapes on the default target; bfloat16 benches parted at margins up to 0.22; float32 and
# float64 round ~1e-6 and ~1e-15 of a logit.
NEAR_TIE_MARGINS = {"llama.cpp": 0.6, "bfloat16": 0.25, "float32": 1e-3, "float64": 1e-9}


def near_tie_margin(runtime: str, dtype: str) -> float:
    """The NEAR_TIE_MARGINS entry of a runtime (llama.cpp) or else of the torch dtype."""
    return NEAR_TIE_MARGINS.get(runtime) or NEAR_TIE_MARGINS[dtype]


# --- the verifier under test --------------------------------------------------------------

@dataclass(frozen=True)
class Verifier:
    """The three samplers a verify step may call, with verify.py's signatures."""

    chain: Callable[..., Verdict]  # rejection_sample
    tree: Callable[..., TreeVerdict]  # recursive_rejection_sample
    greedy: Callable[..., TreeVerdict]  # greedy_accept
    chains: Callable[..., list[Verdict]] | None = None  # the batch's chains; None: `chain` each


def _first_path(tree: TokenTree) -> list[int]:
    """The root's first child, its first child, ... down to a leaf (a chain: all of it)."""
    path, row = [], 0
    while tree.children[row]:
        path.append(tree.children[row][0])
        row = path[-1] + 1
    return path


def _accept_chain(draft_tokens, p, q, generator) -> Verdict:
    n = draft_tokens.shape[0]
    return Verdict([*draft_tokens.tolist(), int(sample(p[n], generator))], n)


def _accept_tree(tree, draft_tokens, p, q, generator) -> TreeVerdict:
    path = _first_path(tree)
    last = int(sample(p[path[-1] + 1 if path else 0], generator))
    return TreeVerdict([int(draft_tokens[i]) for i in path] + [last], path)


def _accept_greedy(tree, draft_tokens, best) -> TreeVerdict:
    path = _first_path(tree)
    return TreeVerdict([int(draft_tokens[i]) for i in path] + [int(best[path[-1] + 1 if path
                                                                         else 0])], path)


EXACT = Verifier(rejection_sample, recursive_rejection_sample, greedy_accept,
                 batch_rejection_sample)
ACCEPT_ALL = Verifier(_accept_chain, _accept_tree, _accept_greedy)  # broken on purpose
VERIFIERS = {"rejection": EXACT, "accept-all": ACCEPT_ALL}


@contextmanager
def _in_engine(verifier: Verifier) -> Iterator[None]:
    """The engine's loop with `verifier`'s samplers (the self-test); its verify phase
    (forerun.batch_verify) looks them up as module globals, swapped here for the duration and
    always restored."""
    if verifier is EXACT:  # the engine as it ships
        yield
        return
    names = {"batch_rejection_sample": verifier.chains or each_member(verifier.chain),
             "TREE_VERIFIERS": {**TREE_VERIFIERS, "rrs": verifier.tree},
             "greedy_accept": verifier.greedy}
    saved = {name: getattr(verify_phase, name) for name in names}
    try:
        for name, fn in names.items():
            setattr(verify_phase, name, fn)
        yield
    finally:
        for name, fn in saved.items():
            setattr(verify_phase, name, fn)


# --- (a) greedy identity --------------------------------------------------------------------

@dataclass(frozen=True)
class GreedyResult:
    prompt: str
    new_tokens: int  # plain's
    identical: bool
    divergence: dict | None  # reference.divergence, its logit_gap filled in where one stopped
    near_tie: bool  # parted at a margin below the threshold


@dataclass(frozen=True)
class GreedyReport:
    max_tokens: int
    near_tie_margin: float
    prompts: list[GreedyResult]
    verdict: str


def greedy_identity(engine: Engine, prompts: Sequence[tuple[str, list[int]]], max_tokens: int,
                    near_tie: float, verifier: Verifier = EXACT
                    ) -> tuple[GreedyReport, list[list[int]]]:
    """Speculative (engine.spec) vs plain greedy output on each (label, ids); also plain's
    outputs, which the sampling test's contexts grow from."""
    results, plains = [], []
    for label, ids in prompts:
        plain = engine.generate(ids, sampling=GREEDY, max_tokens=max_tokens,
                                spec=SpecConfig("none")).token_ids
        with _in_engine(verifier):
            spec = engine.generate(ids, sampling=GREEDY, max_tokens=max_tokens).token_ids
        parted = divergence(engine.target, ids, plain, spec)
        if parted is not None and parted["logit_gap"] is None:
            parted["logit_gap"] = _stop_margin(engine, ids, plain, parted)
        results.append(GreedyResult(label, len(plain), parted is None, parted,
                                    parted is not None and parted["logit_gap"] < near_tie))
        plains.append(plain)
    parted = [r for r in results if not r.identical]
    verdict = PASS if not parted else NEAR_TIE if all(r.near_tie for r in parted) else FAIL
    return GreedyReport(max_tokens, near_tie, results, verdict), plains


def _stop_margin(engine: Engine, ids: list[int], plain: list[int], parted: dict) -> float:
    """Where one output stopped and the other went on: plain's margin between its choice there
    (its argmax; a stop token if plain stopped) and the other's (the best stop token if the
    speculative output stopped)."""
    logits = plain_logits_at(engine.target, ids, plain, parted["at"])  # [V]
    if parted["speculative"] is not None:  # plain stopped
        return round(float(logits.max() - logits[parted["speculative"]]), 4)
    stops = torch.tensor(sorted(engine.tokenizer.stop_ids), dtype=torch.long)
    return round(float(logits[parted["plain"]] - logits[stops].max()), 4)


# --- (b) the sampling test ------------------------------------------------------------------

@dataclass(frozen=True)
class ContextResult:
    prompt: str
    context_tokens: int  # len(c): the prompt and the plain tokens after it
    statistic: float  # chi-square
    df: int  # bins - 1; 0: p is too peaked to test with this many samples
    p_value: float
    impossible: int  # samples of a token with p = 0
    drafted: float  # share of samples with a non-empty draft
    first_accepted: float  # share whose first token was an accepted draft token
    verify_passes: int  # distinct drafts, each verified once
    passed: bool


@dataclass(frozen=True)
class SamplingReport:
    samples: int  # per context
    alpha: float  # the stated false-failure rate of the whole test
    per_test_alpha: float  # alpha / contexts (Bonferroni)
    sampling: dict
    contexts: list[ContextResult]
    verdict: str
    note: str = ""


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square with df degrees of freedom: Q(df / 2, x / 2)."""
    half = torch.tensor([df / 2, x / 2], dtype=torch.float64)
    return float(torch.special.gammaincc(half[0], half[1]))


def chi_square(counts: torch.Tensor, p: torch.Tensor) -> tuple[float, int, float]:
    """Counts [V] of n samples against p [V]: (statistic, df, p-value) over the bins whose
    expected count is >= MIN_EXPECTED plus one bin pooling the rest (into the smallest kept
    bin when that pool's expectation is below MIN_EXPECTED). df 0: nothing to test."""
    n = float(counts.sum())
    expected = p.to(torch.float64) * n  # [V]
    keep = expected >= MIN_EXPECTED
    observed, expected_kept = counts[keep].to(torch.float64), expected[keep]  # [B]
    rest_o, rest_e = n - float(observed.sum()), max(0.0, n - float(expected_kept.sum()))
    if observed.numel() == 0:
        return 0.0, 0, 1.0
    if rest_e >= MIN_EXPECTED:
        observed = torch.cat([observed, observed.new_tensor([rest_o])])
        expected_kept = torch.cat([expected_kept, expected_kept.new_tensor([rest_e])])
    else:
        smallest = int(expected_kept.argmin())
        observed[smallest] += rest_o
        expected_kept[smallest] += rest_e
    df = observed.numel() - 1
    if df < 1:
        return 0.0, 0, 1.0
    statistic = float(((observed - expected_kept) ** 2 / expected_kept).sum())
    return statistic, df, chi2_sf(statistic, df)


def sample_contexts(prompts: Sequence[tuple[str, list[int]]], plains: Sequence[list[int]],
                    m: int) -> list[tuple[str, list[int]]]:
    """Up to m contexts: each prompt with plain's first token (the state right after a
    prefill), or with the first half of plain's output (mid-reply, where an n-gram drafter
    finds repeats), alternating from prompt to prompt, then the other of the two."""
    out: list[tuple[str, list[int]]] = []
    for turn in range(2):
        for i, ((label, ids), plain) in enumerate(zip(prompts, plains, strict=True)):
            n = max(1, len(plain) // 2) if (i + turn) % 2 else 1
            context = ids + plain[:n]
            if len(context) >= 2 and all(context != c for _, c in out):
                out.append((f"{label} +{min(n, len(plain))}", context))
    return out[:m]


def sampling_test(engine: Engine, contexts: Sequence[tuple[str, list[int]]],
                  sampling: SamplingConfig, samples: int, alpha: float,
                  generator: torch.Generator, verifier: Verifier = EXACT) -> SamplingReport:
    """The first token of `samples` draft + verify steps at each (label, context) against
    the target's p there, under `sampling` (temperature > 0)."""
    if sampling.greedy:
        raise ValueError("the sampling test needs a temperature > 0 (greedy is test (a))")
    if not 0 < alpha < 1 or samples < 1 or not contexts:
        raise ValueError(f"need 0 < alpha < 1, samples >= 1 and a context; got {alpha}, "
                         f"{samples}, {len(contexts)}")
    per_test = alpha / len(contexts)
    config = {"temperature": sampling.temperature, "top_k": sampling.top_k,
              "top_p": sampling.top_p, "min_p": sampling.min_p}
    spec = engine.spec
    if spec.method == "none":
        return SamplingReport(samples, alpha, per_test, config, [], PASS,
                              "method none samples the target directly: no verifier to test")
    results = []
    for label, context in contexts:
        # a proposer per context, built before the target is filled (a tree budget of auto
        # measures the target's verify curve, emptying its cache)
        proposer = PROPOSERS[spec.method](spec, engine.proposers)
        counts, p, stats = _first_tokens(engine.target, proposer, context, spec.k, sampling,
                                         samples, generator, verifier)
        statistic, df, p_value = chi_square(counts, p)
        impossible = int(counts[p == 0].sum())
        results.append(ContextResult(label, len(context), round(statistic, 4), df, p_value,
                                     impossible, *stats,
                                     impossible == 0 and p_value >= per_test))
    note = ("" if any(r.drafted for r in results) else
            "the proposer drafted nothing at any context: no verifier could fail this test here")
    verdict = PASS if all(r.passed for r in results) else FAIL
    return SamplingReport(samples, alpha, per_test, config, results, verdict, note)


def _first_tokens(target: Runtime, proposer, context: list[int], k: int,
                  sampling: SamplingConfig, samples: int, generator: torch.Generator,
                  verifier: Verifier) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """Counts [V] of the verdicts' first tokens, the target's p [V] at `context`, and
    (drafted share, first-accepted share, verify passes)."""
    head, pending = context[:-1], context[-1]
    # 1. The engine's prefill of head, as if it had sampled `pending` (speculative_decode 1.)
    needs = proposer.needs
    proposer.prefill(head)
    wanted = needs.hidden_layers if needs.prompt_features else ()
    _, hidden = prefill(target, head, GREEDY, generator, wanted,
                        needs.hidden_from(len(head)) if wanted else 0)
    if wanted:
        proposer.feed(hidden)
    again = {i: h[-1:] for i, h in hidden.items()}  # head[-1]'s features, fed after each reset
    base = target.length
    p = logits_to_probs(target.forward(torch.tensor([pending])).logits[-1], sampling)  # [V]
    target.truncate(base)
    rows: dict[tuple, torch.Tensor] = {}  # draft -> its verify pass's p [N+1, V]
    counts = torch.zeros(p.shape[-1], dtype=torch.long)  # [V]
    drafted = first_accepted = 0
    room = target.capacity - len(context)
    for _ in range(samples):
        # 2. Propose, 3. verify (speculative_decode's phases), with the verifier under test.
        draft = proposer.propose(context, k, sampling, generator).fit(room)
        tree = TokenTree.of(draft.parents, len(draft.tokens))
        key = (tuple(draft.tokens.tolist()),
               None if draft.parents is None else tuple(draft.parents.tolist()))
        if key not in rows:
            rows[key] = _verify_pass(target, pending, draft, tree, sampling)
        verdict = (verifier.chain(draft.tokens, rows[key], draft.q, generator) if tree.is_chain
                   else verifier.tree(tree, draft.tokens, rows[key], draft.q, generator))
        counts[verdict.tokens[0]] += 1
        drafted += len(draft.tokens) > 0
        first_accepted += len(verdict.path) > 0
        # back to a state the engine reaches (after a step that accepted nothing): the first
        # len(head) - 1 tokens final, head[-1]'s features fed again
        proposer.commit(len(head) - 1)
        if again:
            proposer.feed(again)
    return counts, p, (drafted / samples, first_accepted / samples, len(rows))


def _verify_pass(target: Runtime, pending: int, draft: Draft, tree: TokenTree,
                 sampling: SamplingConfig) -> torch.Tensor:
    """The target's pass over [pending, draft...] (a chain, or the tree's mask and positions)
    -> p [N+1, V]; the cache is truncated back after it."""
    base = target.length
    feed = torch.cat([torch.tensor([pending]), draft.tokens])  # [N+1]
    shape = {} if tree.is_chain else {"positions": tree.positions(base),
                                      "tree_mask": tree.mask()}
    logits = target.forward(feed, **shape).logits  # [N+1, V]
    target.truncate(base)
    return logits_to_probs(logits, sampling)


# --- both -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class CheckReport:
    method: str
    k: int
    verifier: str
    greedy: GreedyReport
    sampling: SamplingReport
    verdict: str  # pass, near-tie (greedy parted only at near-ties, sampling passed), fail

    def to_dict(self) -> dict:
        return asdict(self)


def check(engine: Engine, prompts: Sequence[tuple[str, list[int]]], *, max_tokens: int,
          near_tie: float, contexts: int, samples: int, sampling: SamplingConfig,
          alpha: float, seed: int = 0, verifier: str = "rejection") -> CheckReport:
    """(a) then (b) on contexts grown from (a)'s plain outputs; `verifier` a key of VERIFIERS
    (accept-all: the self-test, which must fail)."""
    chosen = VERIFIERS[verifier]
    greedy, plains = greedy_identity(engine, prompts, max_tokens, near_tie, chosen)
    generator = make_generator(seed)
    sampled = sampling_test(engine, sample_contexts(prompts, plains, contexts), sampling,
                            samples, alpha, generator, chosen)
    verdicts = {greedy.verdict, sampled.verdict}
    verdict = FAIL if FAIL in verdicts else NEAR_TIE if NEAR_TIE in verdicts else PASS
    return CheckReport(engine.spec.method, engine.spec.k, verifier, greedy, sampled, verdict)
