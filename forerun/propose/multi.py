"""Multi-draft speculation: several drafters propose for the same step, and their drafts are
verified together as one token tree in one target pass.

Owns: `MultiProposer` (the method `multi`), which runs its sub-proposers (any Proposers, in the
order configured; a method listed twice is two independent drafts) and joins their drafts,
and the two joins:

- `merge` (verifier `rrs`, the default): one trie, shared prefixes merged. Recursive
  rejection sampling (forerun.verify) is exact when each child was drawn from the q given for
  it *conditioned on the siblings before it*. A merged node's children come from different
  drafters, each drawn independently of the others, and a child whose token an earlier sibling
  already holds is absorbed into it (its subtree continues there). So a node present in the
  trie was drawn from its drafter's q conditioned on not being one of its earlier siblings'
  tokens E: it keeps q renormalised over V minus E (a chosen token, q one-hot, is unchanged:
  it is not in E, or it was absorbed). Drafters that choose (n-gram, heads: q = None) and
  drafters that sample (a draft model at T > 0) mix freely; the merged q is None only when
  every sub-draft's is. Under greedy verification every merged tree is exact as it is.
  Sampled drafts join first (then the chosen ones, each group in the configured order): the
  root's sampled child is then tried with its own q exactly as alone, and a chosen child x
  after it is accepted with max(0, p(x) - q(x)) more, so the root accepts at least what
  either draft alone would (sum min(p, q) + max(0, p(x) - q(x)) >= p(x)); a chosen child
  first can fall below the sampled draft alone (tests/test_multi.py shows both).

        draft  [a d]            root
        ngram  [a b c]  ->      a
                              /   \\
                             d     b   (d keeps q(. | a); b is one-hot)
                                   |
                                   c

- `side_by_side` (verifier `spectr`): every draft its own branch under the root, nothing
  merged, so that the root's children stay i.i.d. draws from one q when the sub-methods are
  one sampling drafter listed k times (SpecTr's k draft sequences, forerun.verify_spectr);
  below the root each branch is a chain. Where every sub-draft chose its tokens (q = None:
  greedy) the trie is built instead: nothing is sampled, and merging only saves rows.

A method listed k times is one proposer drafting k times (the factory builds one per method):
between its drafts its model's cache is cut back to the sequence but the pending token, so each
drafts from the same state, and a draft model draws each draft's first token from the same row
(`forerun.propose.draft_model.RootRow`): the k root candidates are i.i.d. draws from one q, as
SpecTr needs, where a recomputed row would differ by rounding. One prefill. The method's needs
are its sub-proposers' (at most one of them may read the target's features).

In a batch (`MultiDrafter`, the `group` of every multi member one of whose sub-proposers drafts
in a group, such as the batch's shared draft model): round j runs every member's j-th
sub-proposer, those of a group in one call of it (one draft-model pass per position for all
the members' chains), the others alone; so each member's generator is drawn in its configured
order, as when it drafts alone, which is the same code with a batch of one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from forerun.propose.base import BatchDrafter, Draft, DraftRequest, Needs, Proposer
from forerun.sampling import SamplingConfig
from forerun.tree import TokenTree
from forerun.verify_spectr import TREE_VERIFIERS

DEFAULT_METHODS = ("draft", "ngram")


@dataclass(frozen=True)
class MultiConfig:
    methods: tuple[str, ...] = DEFAULT_METHODS  # sub-methods whose drafts join, in order
    verifier: str = "rrs"  # a key of forerun.verify_spectr.TREE_VERIFIERS

    def __post_init__(self):
        if not self.methods or "multi" in self.methods:
            raise ValueError(f"multi needs one or more other methods, got {self.methods}")
        if self.verifier not in TREE_VERIFIERS:
            raise ValueError(f"unknown verifier {self.verifier!r}; choose "
                             f"{', '.join(TREE_VERIFIERS)}")
        if self.verifier == "spectr" and len(set(self.methods)) != 1:
            raise ValueError("spectr verifies i.i.d. drafts: one sampling method listed k "
                             f"times (e.g. draft,draft,draft), not {','.join(self.methods)}")

    @property
    def merges(self) -> bool:
        """Whether sampled drafts are merged into a trie (rrs), or kept apart (spectr)."""
        return self.verifier != "spectr"


def parse_methods(text: str) -> tuple[str, ...]:
    """A --multi value: comma-separated sub-methods, e.g. ngram,draft or draft,draft,draft."""
    return tuple(m.strip() for m in text.split(",") if m.strip())


def _one_hot(tokens: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[K, V] one-hot rows on `tokens` [K], in `like`'s dtype and width."""
    rows = torch.zeros(len(tokens), like.shape[-1], dtype=like.dtype)
    return rows.index_put_((torch.arange(len(tokens)), tokens), torch.tensor(1, dtype=like.dtype))


def _dense_q(drafts: list[Draft]) -> list[torch.Tensor] | None:
    """Each draft's q [K_d, V], one-hot rows for a drafter that chose its tokens; None when
    every draft chose (all one-hot: q = None says it)."""
    given = next((d.q for d in drafts if d.q is not None), None)
    if given is None:
        return None
    return [d.q.to(given.dtype) if d.q is not None else _one_hot(d.tokens, given)
            for d in drafts]


def merge(drafts: list[Draft]) -> Draft:
    """The drafts' trie (see the module docstring): node order is first appearance, drafts in
    order, so parents come first and a node's earlier siblings are those made before it; a
    node keeps the q it was drawn from, renormalised over the tokens its earlier siblings hold."""
    rows = _dense_q(drafts)
    tokens: list[int] = []
    parents: list[int] = []
    q: list[torch.Tensor] = []
    index: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for d, draft in enumerate(drafts):
        tree = TokenTree.of(draft.parents, len(draft.tokens))
        at: list[int] = []  # this draft's node i -> merged node
        for i, token in enumerate(draft.tokens.tolist()):
            parent = -1 if tree.parents[i] < 0 else at[tree.parents[i]]
            node = index.get((parent, token))
            if node is None:
                node = index[(parent, token)] = len(tokens)
                if rows is not None:
                    taken = [tokens[s] for s in range(len(tokens)) if parents[s] == parent]
                    row = rows[d][i].clone()  # [V]
                    row[taken] = 0  # drawn conditioned on missing its earlier siblings
                    q.append(row / row.sum())
                tokens.append(token)
                parents.append(parent)
            at.append(node)
    return Draft(torch.tensor(tokens, dtype=torch.long), torch.stack(q) if q else None,
                 torch.tensor(parents, dtype=torch.long))


def side_by_side(drafts: list[Draft]) -> Draft:
    """The drafts as separate branches of one tree (nothing merged), in order."""
    rows = _dense_q(drafts)
    tokens, parents, q, base = [], [], [], 0
    for d, draft in enumerate(drafts):
        tree = TokenTree.of(draft.parents, len(draft.tokens))
        tokens.append(draft.tokens)
        parents.append(torch.tensor([-1 if p < 0 else p + base for p in tree.parents],
                                    dtype=torch.long))
        if rows is not None:
            q.append(rows[d])
        base += len(draft.tokens)
    if not tokens:
        return Draft.empty()
    return Draft(torch.cat(tokens), torch.cat(q) if q else None, torch.cat(parents))


def join(drafts: list[Draft], merges: bool) -> Draft:
    """The sub-drafts of one step as one draft: `merge`d (sampled drafts first), or
    `side_by_side` where `merges` is False and some draft sampled; a lone chain as it is."""
    drafts = [d for d in drafts if len(d.tokens)]
    if not drafts:
        return Draft.empty()
    if len(drafts) == 1 and drafts[0].parents is None:
        return drafts[0]  # one chain: nothing to join
    if not any(d.q is not None for d in drafts):
        return merge(drafts)  # all chosen (greedy, or chosen drafters): the trie, one-hot
    if not merges:
        return side_by_side(drafts)
    return merge(sorted(drafts, key=lambda d: d.q is None))  # sampled first (see above)


def joint_needs(subs: list[Proposer], verifier: str) -> Needs:
    """What the sub-proposers need of the engine, together: the feature reader's needs (at most
    one), any sub's grammar, store and archive, and the verifier its trees take."""
    readers = [s for s in subs if s.needs.hidden_layers]
    if len(readers) > 1:
        raise ValueError("multi: at most one sub-method may draft from the target's features")
    base = readers[0].needs if readers else Needs()
    return replace(base, grammar=any(s.needs.grammar for s in subs),
                   shared_store=any(s.needs.shared_store for s in subs),
                   archive=any(s.needs.archive for s in subs),
                   extra_rows=sum(s.needs.extra_rows for s in subs),
                   tree_verifier=verifier)


class MultiProposer:
    """Several proposers' drafts for one step, joined into one tree (`merge` or
    `side_by_side`); `propose`'s k is each sub-proposer's."""

    name = "multi"

    def __init__(self, subs: list[Proposer], cfg: MultiConfig):
        self.subs, self.cfg = subs, cfg
        self.unique = list({id(s): s for s in subs}.values())  # each proposer once
        self.needs = joint_needs(subs, cfg.verifier)
        # the cost policy prices drafting by this runtime's step (the draft model's, if any)
        self.runtime = next((s.runtime for s in subs if s.runtime is not None), None)
        # sub j drafts again later from its model's cache: cut it back after drafting
        self.again = [s.runtime is not None and any(t.runtime is s.runtime for t in subs[j + 1:])
                      for j, s in enumerate(subs)]
        # drafts with the batch's other multi members where a sub-proposer drafts in a group
        self.group = MULTI_DRAFTER if any(s.group is not None for s in subs) else None

    def prefill(self, prompt: list[int]) -> None:
        for s in self.unique:
            s.prefill(prompt)

    def propose(self, tokens: list[int], k: int, sampling: SamplingConfig,
                generator: torch.Generator) -> Draft:
        return MULTI_DRAFTER.propose([DraftRequest(self, tokens, k, sampling, generator)])[0]

    def commit(self, num_final: int) -> None:
        for s in self.unique:
            s.commit(num_final)

    def feed(self, hidden: dict[int, torch.Tensor]) -> None:
        for s in self.unique:
            if s.needs.hidden_layers:
                s.feed(hidden)

    def constrain(self, grammar) -> None:
        for s in self.unique:
            if s.needs.grammar:
                s.constrain(grammar)

    def archive(self, output: list[int]) -> None:
        for s in self.unique:
            if s.needs.archive:
                s.archive(output)


class MultiDrafter:
    """The BatchDrafter of multi members (stateless: it reads each request's MultiProposer).
    Round j drafts every member's j-th sub-proposer: those that draft in a group together,
    through it, the others alone; then cuts back the caches of those that draft again."""

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        multis: list[MultiProposer] = [r.proposer for r in requests]
        subs = [m.subs if r.k else [] for m, r in zip(multis, requests, strict=True)]
        drafts: list[list[Draft | None]] = [[] for _ in requests]
        for j in range(max(map(len, subs), default=0)):
            grouped: dict[int, tuple[BatchDrafter, list[tuple[int, DraftRequest]]]] = {}
            for i, r in enumerate(requests):
                if j >= len(subs[i]):
                    continue
                s = subs[i][j]
                if s.group is None:
                    drafts[i].append(s.propose(r.tokens, r.k, r.sampling, r.generator))
                else:
                    drafts[i].append(None)
                    grouped.setdefault(id(s.group), (s.group, []))[1].append(
                        (i, DraftRequest(s, r.tokens, r.k, r.sampling, r.generator)))
            for group, asked in grouped.values():
                made = group.propose([a for _, a in asked])
                for (i, _), draft in zip(asked, made, strict=True):
                    drafts[i][j] = draft
            for i, r in enumerate(requests):
                if j < len(subs[i]) and multis[i].again[j]:  # the same state for the next
                    subs[i][j].commit(len(r.tokens) - 1)
        return [join(d, m.cfg.merges) for d, m in zip(drafts, multis, strict=True)]

    def backlog(self, proposer: MultiProposer, tokens: list[int]) -> int:
        return max((s.group.backlog(s, tokens) for s in proposer.unique if s.group is not None),
                   default=0)

    def release(self, proposer: MultiProposer) -> None:
        for s in proposer.unique:
            if s.group is not None:
                s.group.release(s)


MULTI_DRAFTER = MultiDrafter()
