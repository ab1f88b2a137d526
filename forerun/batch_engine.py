"""The batch step: every live sequence advances by one target pass shared with all the others.

Owns: `Sequence`, the one record of a sequence's state (tokens, cache handle, drafter,
length policy, generator, sampling, limits), and `step`, the phases of one pass over a batch
(phase 4 lives in `forerun.batch_verify`):

  1. propose   each decoding member drafts up to its k (its policy's choice, or the batch's;
               k = 0 is a plain decoding step); a new member's prompt is its prefill. A
               member whose drafter raises fails alone (`Sequence.error`), out of the pass;
               under a grammar a draft keeps only its valid nodes
  2. pack      every member's new tokens into one PackedBatch (pending token + draft; a tree
               with its mask and depths); under a token budget (`max_tokens`), decode rows
               first and prompts in chunks with what is left (at least `prefill_share` of
               it), so a long prompt never stalls the decodes around it
  3. forward   one target pass over all of them
  4. verify    each member on its own rows, penalties, logit bias and grammar masks applied
               with each row's history (its draft path included): greedy from one argmax
               over the batch; sampled
               members through one probability transform and one batched rejection sampler,
               each with its own generator (seeded requests reproduce whatever they are
               batched with)
  5. commit    each member's cache keeps its accepted path; its drafter forgets the rest (a
               shadow member keeps its first token alone: what was accepted is only counted);
               a drafter that learns from the target's rows is shown their argmaxes (or,
               learning online, their logits)
  6. adapt     each member's policy sees what was accepted
  7. emit      stop tokens, token budgets and context room, as the one-sequence loop (the
               grammar consumes what is emitted; logprobs from the raw rows where asked, and
               a prompt's own logprobs from its prefill's rows where `echo` asks them)

Cache invariant (as in `forerun.engine`): before a decoding member's verify, the target's
cache holds every token of the sequence but the last (the pending token). A member's drafter
is its own (a draft model fork, a lookup index), so drafting is per member; the target pass,
where the time goes, is shared. Knows nothing of text.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace

import torch

from forerun.batch_policy import BatchCostPolicy
from forerun.batch_verify import verify_all
from forerun.grammar import GrammarState
from forerun.logprobs import token_logprobs
from forerun.metrics import Step, TokenLogprob
from forerun.policy import LengthPolicy
from forerun.propose.base import BatchDrafter, Draft, DraftRequest, Proposer
from forerun.runtime.batch import BatchRuntime, PackedBatch, PoolFull
from forerun.sampling import SamplingConfig
from forerun.stopping import check_prompt, cut
from forerun.tree import TokenTree
from forerun.verify import TreeVerdict, Verdict

# Under a pass's token budget, prompt chunks get at least this share of it however many
# decode rows there are: a queue of prompts keeps moving under a full batch
PREFILL_SHARE = 0.25


@dataclass(eq=False)  # members are told apart by identity (two may hold the same prompt)
class Sequence:
    """Everything one sequence of a batch owns. `proposer` None = plain decoding."""

    prompt: list[int]
    sampling: SamplingConfig
    max_new_tokens: int
    generator: torch.Generator
    stop_ids: Collection[int]
    proposer: Proposer | None = None
    policy: LengthPolicy | None = None
    max_k: int = 0  # the most draft nodes a step may verify (reserves cache slack)
    k_limit: int = sys.maxsize  # the most draft tokens a step may propose now (a server's cap)
    handle: int = -1  # the cache pool's region; -1 = not admitted
    tokens: list[int] = field(default_factory=list)  # prompt + emitted (+ pending)
    emitted: int = 0
    fed: int = 0  # prompt tokens in the target's cache while the prefill is chunked
    finish: str | None = None  # "stop", "length", or "error" (then `error` says why)
    error: BaseException | None = None
    steps: list[Step] = field(default_factory=list)
    # preempted (its cache freed): the tokens it had, restored once its cache is recomputed
    resume: list[int] | None = None
    logprobs: int | None = None  # alternatives per emitted token's logprob (None: not asked)
    grammar: GrammarState | None = None  # structured output, in step with the emitted tokens
    # alternatives per prompt token's logprob (`echo`; None: not asked): its prefill's passes
    # want every row, and `echoed` gathers them by prompt position for the first Step
    prompt_logprobs: int | None = None
    echoed: list[TokenLogprob | None] = field(default_factory=list)
    shadow: bool = False  # its drafts are verified and scored, but one token a pass is kept

    @property
    def prefilled(self) -> bool:
        return bool(self.tokens)

    def source(self) -> list[int]:
        """What its prefill feeds: the prompt, or after a preemption every token it had but
        the pending one (recomputed, not sampled: its output stays as it was)."""
        return self.prompt if self.resume is None else self.resume[:-1]

    def fail(self, error: BaseException) -> None:
        self.error, self.finish = error, "error"

    def slots(self) -> int:
        """Cache slots it can ever need: prompt, new tokens, one verify pass beyond them."""
        return len(self.prompt) + self.max_new_tokens + self.max_k + 1


def admit(runtime: BatchRuntime, seq: Sequence, reserve: int | None = None) -> None:
    """Reserve the sequence's cache region, `reserve` slots (None: all it can ever need);
    PoolFull when it does not fit now. A preempted member keeps its drafter's state."""
    check_prompt(seq.prompt, runtime.capacity)
    if seq.proposer is not None and seq.proposer.needs.resume and \
            not runtime.capabilities.resume_rows:
        raise ValueError(f"{seq.proposer.name} drafts in the target's own cache, which this "
                         "runtime's passes cannot resume")
    seq.handle = runtime.add(min(reserve or seq.slots(), seq.slots(), runtime.capacity))
    if seq.proposer is not None and seq.proposer.needs.target_region:  # it drafts in it
        seq.proposer.bind(seq.handle)
    if seq.grammar is not None and seq.proposer is not None and seq.proposer.needs.grammar:
        seq.proposer.constrain(seq.grammar)  # it drafts under the sequence's grammar
    if seq.proposer is not None and seq.resume is None:
        try:
            seq.proposer.prefill(seq.prompt)  # a shared drafter reserves its region here
        except PoolFull:
            retire(runtime, seq)
            raise


def retire(runtime: BatchRuntime, seq: Sequence) -> None:
    """Free the sequence's cache region, and its drafter's (hand a drafter that learns from
    finished sequences the output)."""
    if seq.proposer is not None and seq.proposer.needs.archive:
        done = seq.resume or seq.tokens  # (a preempted member's are in `resume`)
        seq.proposer.archive(done[len(seq.prompt):len(seq.prompt) + seq.emitted])
    if seq.proposer is not None and seq.proposer.group is not None:
        seq.proposer.group.release(seq.proposer)
    if seq.handle >= 0:
        runtime.release(seq.handle)
        seq.handle = -1


def step(runtime: BatchRuntime, live: list[Sequence], lengths: BatchCostPolicy | None = None,
         max_tokens: int | None = None, prefill_share: float = PREFILL_SHARE
         ) -> list[Step | None]:
    """One target pass for the sequences in `live` (admitted, unfinished) -> each one's Step,
    None for a member that emitted nothing (it sat out, or fed a prompt chunk, or failed).
    `lengths` chooses every member's k together (else each member's own policy does);
    `max_tokens` caps the pass's rows (None: whole prompts)."""
    # 1. Propose: prompts for new members, pending token + draft for the others.
    drafts = [_grammar_cut(s, d) for s, d in zip(live, _propose_all(runtime, live, lengths),
                                                 strict=True)]
    # 2. Pack every member's new tokens (decodes first, then prompt chunks) into one pass.
    chunks = _chunks(live, drafts, max_tokens, prefill_share)
    members = [b for b, s in enumerate(live) if not s.error and
               (drafts[b] is not None or chunks[b])]
    if not members:  # every member failed its drafting (or sat out): no pass to run
        return [None] * len(live)
    batch, trees, spans, echoes = _pack([live[b] for b in members],
                                        [drafts[b] for b in members], [chunks[b] for b in members])
    bases = [runtime.length(live[b].handle) for b in members]
    # 3. One target pass over all of them (and the features their heads draft from).
    started = time.perf_counter()
    output = runtime.forward(batch, _layers_wanted([live[b] for b in members],
                                                   [drafts[b] for b in members]))
    if lengths is not None and output.logits.device.type == "cpu":  # (a GPU's may still run)
        lengths.observe_pass(len(batch.tokens), time.perf_counter() - started)
    # 4. Verify every member on its own rows.
    logits, spans = _verify_view(output.logits, spans)  # [R_v, V]: without echo-only rows
    verdicts, best = verify_all([live[b] for b in members], [drafts[b] for b in members],
                                trees, spans, logits)
    now = time.perf_counter()
    out: list[Step | None] = [None] * len(live)
    for j, (b, tree, verdict) in enumerate(zip(members, trees, verdicts, strict=True)):
        s, d, rows = live[b], drafts[b], batch.rows_of(j)
        if d is None:  # a prompt chunk: the last one's last row gave the first token
            _echo(s, output.logits, echoes[j], s.fed)
            s.fed += rows.stop - rows.start
            if s.resume is not None and s.fed == len(s.source()):  # recomputed: decode on
                s.tokens, s.resume = s.resume, None
            if verdict is None:
                continue
            if reads_prompt(s):
                needs = s.proposer.needs
                skip = rows.start + needs.hidden_from(len(s.prompt))  # the rows its head reads
                s.proposer.feed({i: output.hidden[i][skip:rows.stop] for i in needs.hidden_layers})
            out[b] = _emit(runtime, s, verdict.tokens, 0, 0, now, prefill=True,
                           logprobs=_logprobs(s, logits, spans[j], verdict))
            continue
        # 5. Commit the accepted path in the cache and the drafter (and its features).
        would = len(verdict.path)  # draft tokens accepted (a shadow's: had it speculated)
        if s.shadow:  # the first token alone: plain's (greedy), distributed as p (sampled)
            verdict = TreeVerdict(verdict.tokens[:1], [])
        kept = [0, *(i + 1 for i in verdict.path)]  # the member's rows now final
        runtime.commit(s.handle, bases[j], kept)
        s.tokens.extend(verdict.tokens)
        drafted = max(tree.depth, default=0)
        if s.proposer is not None:
            s.proposer.commit(len(s.tokens) - 1)
            if s.proposer.needs.observe:  # the target's choice at each of its rows
                s.proposer.observe(d, best[spans[j].start:spans[j].stop], verdict.path)
            if s.proposer.needs.teach:  # the target's rows, for a drafter learning online
                s.proposer.teach(d, logits[spans[j].start:spans[j].stop], verdict.path)
            if s.proposer.needs.hidden_layers:  # a chain's kept rows are a prefix: a view
                at = (slice(rows.start, rows.start + len(kept)) if tree.is_chain
                      else torch.tensor(kept) + rows.start)  # [n] rows of the packed pass
                s.proposer.feed({i: output.hidden[i][at] for i in s.proposer.needs.hidden_layers})
            # 6. Adapt the member's draft length.
            s.policy.update(drafted, would)
            if lengths is not None:
                lengths.update(id(s), drafted, would)
        # 7. Emit.
        out[b] = _emit(runtime, s, verdict.tokens, drafted, would, now,
                       logprobs=_logprobs(s, logits, spans[j], verdict))
    return out


def reads_prompt(s: Sequence) -> bool:
    """Its head drafts from the features of its prompt's rows (fed after the prefill)."""
    return s.proposer is not None and s.proposer.needs.prompt_features and bool(
        s.proposer.needs.hidden_layers)


def _chunks(live: list[Sequence], drafts: list[Draft | None], max_tokens: int | None,
            share: float) -> list[int]:
    """Prompt tokens each prefilling member feeds this pass (0 for the decoding ones, and for
    those the budget leaves out): decode rows first, then prompts in arrival order with what
    is left of `max_tokens`, at least `share` of it. A member whose head reads its prompt's
    features takes its whole prompt at once."""
    left = [len(s.source()) - s.fed if d is None and not s.error else 0
            for s, d in zip(live, drafts, strict=True)]
    if max_tokens is None:
        return left
    decode = sum(len(d.tokens) + 1 for d in drafts if d is not None)
    budget = max(max_tokens - decode, int(share * max_tokens), 1)
    chunks = [0] * len(live)
    for b, n in enumerate(left):
        if n and budget > 0:
            chunks[b] = n if reads_prompt(live[b]) else min(n, budget)
            budget -= chunks[b]
    return chunks


def _grammar_cut(s: Sequence, d: Draft | None) -> Draft | None:
    """A draft without its grammar-invalid nodes (a chain: its longest valid prefix)."""
    if s.grammar is None or d is None or not len(d.tokens):
        return d
    parents = None if d.parents is None else d.parents.tolist()
    kept = s.grammar.cut(d.tokens.tolist(), parents)
    if len(kept) == len(d.tokens):
        return d
    if parents is None or kept == list(range(len(kept))):  # a prefix: still a tree
        return d.fit(len(kept))
    index = {old: new for new, old in enumerate(kept)}
    at = torch.tensor(kept, dtype=torch.long)
    return Draft(d.tokens[at], None if d.q is None else d.q[at],
                 torch.tensor([-1 if parents[i] < 0 else index[parents[i]] for i in kept]))


def _pack(live: list[Sequence], drafts: list[Draft | None], chunks: list[int]
          ) -> tuple[PackedBatch, list[TokenTree | None], list[range], list[range]]:
    """The pass's PackedBatch (a prompt chunk, a verify's pending token + draft), each member's
    draft tree, its rows among the wanted logits that its verify reads (a prompt's last chunk
    its last row, an earlier chunk none, a verify every row), and the rows a prompt chunk
    echoes (every row where the member asks its prompt's logprobs, else none); logit_rows
    None where every row is wanted."""
    feeds, trees = [], []
    for s, d, n in zip(live, drafts, chunks, strict=True):
        if d is None:
            feeds.append(torch.tensor(s.source()[s.fed:s.fed + n]))
            trees.append(None)
        else:
            feeds.append(torch.cat([torch.tensor(s.tokens[-1:]), d.tokens]))  # [N_b+1]
            trees.append(TokenTree.of(d.parents, len(d.tokens)))
    resume = tuple(None if d is None else d.resume for d in drafts)  # early exit's rows
    batch = PackedBatch.of(
        [(s.handle, f) for s, f in zip(live, feeds, strict=True)],
        positions=[None if t is None or t.is_chain else t.positions(0) for t in trees],
        tree_masks=[None if t is None or t.is_chain else t.mask() for t in trees])
    batch = replace(batch, resume=resume if any(r is not None for r in resume) else None)
    wanted, spans, echoes = [], [], []
    for b, (s, d, n) in enumerate(zip(live, drafts, chunks, strict=True)):
        rows = batch.rows_of(b)
        last = s.resume is None and s.fed + n == len(s.prompt)  # a recompute samples nothing
        echo = d is None and s.resume is None and s.prompt_logprobs is not None
        mine = (range(rows.start, rows.stop) if d is not None or echo else
                range(rows.stop - 1, rows.stop) if last else range(0))
        at = len(wanted)
        spans.append(range(at + len(mine) - 1, at + len(mine)) if echo and last else
                     range(0) if echo else range(at, at + len(mine)))
        echoes.append(range(at, at + len(mine)) if echo else range(0))
        wanted.extend(mine)
    every = wanted == list(range(len(batch.tokens)))
    return replace(batch, logit_rows=None if every else torch.tensor(wanted, dtype=torch.long)
                   ), trees, spans, echoes


def _verify_view(logits: torch.Tensor, spans: list[range]) -> tuple[torch.Tensor, list[range]]:
    """The rows [R_v, V] of the pass's wanted `logits` [R, V] that verifies read, and each
    member's span among them (rows wanted only for a prompt's logprobs left out)."""
    if sum(map(len, spans)) == logits.shape[0]:  # no echo-only rows: the usual pass
        return logits, spans
    rows = [r for span in spans for r in span]
    out, start = [], 0
    for span in spans:
        out.append(range(start, start + len(span)))
        start += len(span)
    return logits[rows], out


def _echo(s: Sequence, logits: torch.Tensor, rows: range, fed: int) -> None:
    """Gather a prompt chunk's logprobs (`rows` of the pass's raw `logits` [R, V]; the chunk
    starts at prompt position `fed`): row i gives prompt token fed + i + 1 its logprob."""
    if not rows:
        return
    s.echoed = s.echoed or [None] * len(s.prompt)  # the first token has nothing before it
    tokens = s.prompt[fed + 1:fed + 1 + len(rows)]  # the prompt's last row gives no prompt token
    s.echoed[fed + 1:fed + 1 + len(tokens)] = token_logprobs(
        logits[rows.start:rows.stop], tokens, s.prompt_logprobs)


def _layers_wanted(live: list[Sequence], drafts: list[Draft | None]) -> tuple[int, ...]:
    """The target layers this pass returns: those its members' heads read from its rows (a
    prefill's only where the head reads the prompt's features)."""
    layers: set[int] = set()
    for s, d in zip(live, drafts, strict=True):
        if s.proposer is not None and (d is not None or s.proposer.needs.prompt_features):
            layers.update(s.proposer.needs.hidden_layers)
    return tuple(sorted(layers))


def _propose_all(runtime: BatchRuntime, live: list[Sequence],
                 lengths: BatchCostPolicy | None) -> list[Draft | None]:
    """Each member's draft (None for a member still to prefill, or one that failed). Members
    whose proposers share a drafter (`group`) draft together, one pass per draft position for
    all of them. A drafter that raises fails its member (a shared one, the members it drafted
    for), not the batch."""
    drafts: list[Draft | None] = [None] * len(live)
    decoding = [i for i, s in enumerate(live) if s.prefilled and not s.error]
    caps = [0 if live[i].proposer is None else max(0, min(
        live[i].max_new_tokens - live[i].emitted - 1, _room(runtime, live[i]), live[i].k_limit))
        for i in decoding]
    # catch-up rows each member's shared drafter must feed first (priced by the joint policy)
    behind = {i: _backlog(live[i]) for i in decoding} if lengths is not None else {}
    ks = (lengths.choose([id(live[i]) for i in decoding], caps,
                         [live[i].proposer is not None and live[i].proposer.runtime is not None
                          for i in decoding],
                         [behind[i] for i in decoding],
                         [live[i].max_new_tokens - live[i].emitted for i in decoding])
          if lengths is not None else
          [min(c, live[i].policy.next_k()) if c else 0 for i, c in zip(decoding, caps,
                                                                        strict=True)])
    grouped: dict[int, tuple[BatchDrafter, list[tuple[int, DraftRequest]]]] = {}
    for i, k in zip(decoding, ks, strict=True):
        s = live[i]
        if s.proposer is None:
            drafts[i] = Draft.empty()
        elif s.proposer.group is None:
            try:
                drafts[i] = s.proposer.propose(s.tokens, k, s.sampling, s.generator)
            except Exception as e:  # its own failure: the batch goes on
                s.fail(e)
        else:
            grouped.setdefault(id(s.proposer.group), (s.proposer.group, []))[1].append(
                (i, DraftRequest(s.proposer, s.tokens, k, s.sampling, s.generator)))
    for group, requests in grouped.values():
        started = time.perf_counter()
        try:
            made = group.propose([r for _, r in requests])
        except Exception as e:  # fails the members it drafted for
            for i, _ in requests:
                live[i].fail(e)
            continue
        if lengths is not None:
            lengths.observe_drafting([r.k for _, r in requests], time.perf_counter() - started,
                                     sum(behind[i] for i, r in requests if r.k))
        for (i, _), draft in zip(requests, made, strict=True):
            drafts[i] = draft
    return [d if d is None else d.fit(_room(runtime, s)) for d, s in zip(drafts, live,
                                                                           strict=True)]


def _backlog(s: Sequence) -> int:
    """Tokens the member's shared drafter must feed before its next draft (`backlog`)."""
    if s.proposer is None or s.proposer.group is None:
        return 0
    return s.proposer.group.backlog(s.proposer, s.tokens)


def _room(runtime: BatchRuntime, s: Sequence) -> int:
    """Draft nodes a verify pass of `s` may hold: its region's slots after the pending token
    (and the rows its drafter adds to a pass), and its max_k."""
    extra = 0 if s.proposer is None else s.proposer.needs.extra_rows
    return min(runtime.reserved(s.handle) - len(s.tokens) - extra, s.max_k)


def _logprobs(s: Sequence, logits: torch.Tensor, span: range, verdict: Verdict | TreeVerdict
              ) -> list[TokenLogprob] | None:
    """The emitted tokens' logprobs from the pass's raw logits [R, V] (None unless asked):
    token 0 from the member's first row, token i + 1 from the row of path node i."""
    if s.logprobs is None:
        return None
    rows = [span.start, *(span.start + n + 1 for n in verdict.path)]  # [len(tokens)]
    return token_logprobs(logits[rows], verdict.tokens, s.logprobs)


def _emit(runtime: BatchRuntime, s: Sequence, tokens: list[int], drafted: int,
          accepted: int, now: float, prefill: bool = False,
          logprobs: list[TokenLogprob] | None = None) -> Step:
    if prefill:
        s.tokens = [*s.prompt, *tokens]
    room = runtime.capacity - len(s.prompt) - s.emitted
    emitted, s.finish = cut(tokens, s.stop_ids, s.max_new_tokens - s.emitted, room)
    s.emitted += len(emitted)
    if s.grammar is not None:
        s.grammar.commit([t for t in emitted if t not in s.stop_ids])
        if s.finish is None and s.grammar.done:  # the grammar allows nothing more
            s.finish = "stop"
    echoed = tuple(s.echoed) if prefill and s.prompt_logprobs is not None else None
    result = Step(emitted, drafted, accepted, now, s.finish, prefill=prefill,
                  logprobs=None if logprobs is None else tuple(logprobs[:len(emitted)]),
                  prompt_logprobs=echoed)
    s.steps.append(result)
    return result


def run_to_completion(runtime: BatchRuntime, seqs: list[Sequence],
                      max_batch: int | None = None,
                      on_step: Callable[[Sequence, Step], bool] | None = None,
                      lengths: BatchCostPolicy | None = None) -> None:
    """Decode every sequence: admit while the pool and `max_batch` allow, step the live ones
    together, retire the finished (their regions go to the waiting). `on_step(seq, step)`
    sees every step; True ends that sequence there (a stop string: finish "stop"). A member
    that fails raises its error once the others are done."""
    waiting, live = list(seqs), []
    while waiting or live:
        while waiting and (max_batch is None or len(live) < max_batch):
            try:
                admit(runtime, waiting[0])
            except PoolFull:  # wait for a member to finish
                if not live:
                    raise
                break
            live.append(waiting.pop(0))
        for s, result in zip(live, step(runtime, live, lengths), strict=True):
            if result is not None and on_step is not None and on_step(s, result) and \
                    not s.finish:
                s.finish = "stop"
        for s in [s for s in live if s.finish]:
            retire(runtime, s)
            live.remove(s)
            if lengths is not None:
                lengths.forget(id(s))
    failed = next((s.error for s in seqs if s.error is not None), None)
    if failed is not None:
        raise failed
