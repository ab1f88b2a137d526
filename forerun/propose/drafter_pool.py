"""The drafter worker's pool mode: one draft model in its own process drafting ahead for every
sequence of a batch, one draft pass for all of them.

Owns: `serve_pool`, the worker's loop after a `Pool` message, and `_Member`, one sequence's
state in it (its `AheadTree`, the committed tokens, its own generator, and its region of the
draft's cache pool). The messages are `forerun.propose.drafter_messages`'s, each naming its
session; the tree is kept and re-rooted exactly as the one-sequence worker keeps its own
(`forerun.propose.drafter_worker`: the same `Rooted` answers, the same node ids per session),
so each sequence's proposer mirrors it as it would a worker of its own.

The loop: while some member has room ahead (fewer than `ahead` nodes past its root, within its
region) and no message waits, one pass over the batched draft view (`forerun.runtime.views`)
feeds every such member what its region lacks of its line (its committed sequence, then its
tree's first-drafted line) and draws one token after it: one pass drafts one token for every
sequence. A member prefilled but not begun has its prompt (but the last token) fed in the next
pass, beside the others' drafts. Between passes it reads what came in: `Prefill` reserves a
member's region (`Dropped` when the pool has no room: that sequence decodes plainly), `Verdict`
re-roots its tree, `Rest` frees its region. Prompt lookup (`Begin.lookup`) is the
one-sequence worker's alone; here every pass drafts one token a member.

Cache invariant, per member: its region holds `cached`, a prefix of its line; a pass truncates
the region to what the line still shares with it and feeds the rest. Knows nothing of text,
nor of the target.
"""

from __future__ import annotations

import torch

from forerun.processors import process_row
from forerun.propose.drafter_messages import (
    FIRST_ROOT,
    Begin,
    Channel,
    Drafted,
    Dropped,
    Pool,
    Prefill,
    Rest,
    Rooted,
    Shutdown,
    Verdict,
    common_prefix,
    to_host,
    to_vocab,
)
from forerun.propose.reroot import AheadNode, AheadTree
from forerun.runtime.base import Runtime
from forerun.runtime.batch import BatchRuntime, PackedBatch, PoolFull
from forerun.runtime.views import batched_view, kv_token_bytes
from forerun.sampling import logits_to_probs, make_generator, sample


class _Member:
    """One sequence the pool drafts for: its region, and after Begin its tree."""

    def __init__(self, pool: BatchRuntime, handle: int, prompt: list[int]):
        self.pool, self.handle, self.prompt = pool, handle, prompt
        self.cached: list[int] = []  # what its region holds
        self.begun: Begin | None = None
        self.committed: list[int] = []  # the sequence, its last token the root
        self.tree = AheadTree(FIRST_ROOT)
        self.verdicts, self.next_id = 0, 0
        self.generator = make_generator(0)

    def begin(self, msg: Begin) -> None:
        self.begun, self.committed = msg, list(msg.tokens)
        self.tree, self.verdicts, self.next_id = AheadTree(FIRST_ROOT), 0, 0
        self.generator = make_generator(msg.seed)

    def verdict(self, tokens: list[int]) -> None:
        self.verdicts += 1
        self.tree = self.tree.reroot(tokens, FIRST_ROOT - self.verdicts)
        self.committed.extend(tokens)

    def room(self) -> int:
        """Nodes it may still draft: up to `ahead` past the root, within its region."""
        if self.begun is None:
            return 0
        depth = len(self.tree.tip()[1])
        return min(self.begun.ahead - depth,
                   self.pool.reserved(self.handle) - len(self.committed) - depth)

    def wants_pass(self) -> bool:
        """It drafts in the next pass, or has a prompt still to feed before its Begin."""
        return self.room() > 0 or (self.begun is None and len(self.prompt) > 1
                                   and not self.cached)

    def feed(self) -> torch.Tensor:
        """Its region cut back to what its line shares with it -> the rest of the line [M],
        M >= 1 (the last token fed again where the region holds all of it)."""
        line = self.line()
        same = min(common_prefix(self.cached, line), len(line) - 1)
        if same < len(self.cached):  # a verdict dropped what the region was built on
            self.pool.truncate(self.handle, same)
        self.cached = line
        return torch.tensor(line[same:], dtype=torch.long)

    def line(self) -> list[int]:
        if self.begun is None:  # the prompt but its last token, as the sync drafter
            return self.prompt[:-1]
        return [*self.committed, *self.tree.tip()[1]]

    def draw(self, logits: torch.Tensor, vocab_size: int) -> Drafted:
        """The token after its line from the pass's row [V_draft] -> its node's message."""
        msg, line = self.begun, self.cached
        row = to_vocab(logits, vocab_size)  # [V]
        if msg.sampling.processing.active:  # q shaped as the target's p is
            row = process_row(row, msg.sampling.processing, line, len(self.prompt))
        if msg.sampling.greedy:
            token, q = int(row.argmax(-1)), None
        else:
            q = logits_to_probs(row, msg.sampling)  # [V]
            token = int(sample(q, self.generator))
        tip = self.tree.tip()[0]
        node, self.next_id = self.next_id, self.next_id + 1
        self.tree.add(node, AheadNode(tip, token, q))
        return Drafted(msg.session, node, tip, token, None if q is None else to_host(q))


def serve_pool(channel: Channel, runtime: Runtime, vocab_size: int, msg: Pool) -> None:
    """The pool's loop (after `msg`): a pass while some member has room and no message waits;
    block on the channel otherwise. Ends on Shutdown; EOF and failures are the caller's."""
    pool = batched_view(runtime, msg.tokens * kv_token_bytes(runtime))
    members: dict[int, _Member] = {}
    while True:
        ready = [m for m in members.values() if m.wants_pass()]
        if ready and not channel.poll(0):
            for sent in _pass(pool, ready, vocab_size):
                channel.send(sent)
            continue
        msg = channel.recv()
        if isinstance(msg, Shutdown):
            return
        session = msg.session if isinstance(msg, Prefill | Begin | Verdict | Rest) else None
        member = members.get(session)
        if isinstance(msg, Prefill | Rest) and member is not None:  # a sequence ends here
            pool.release(members.pop(session).handle)
        if isinstance(msg, Prefill):
            slots = min(msg.slots or pool.capacity, pool.capacity)
            try:
                members[session] = _Member(pool, pool.add(slots), list(msg.prompt))
            except (PoolFull, ValueError) as e:
                channel.send(Dropped(session, f"the drafter's pool has no room: {e}"))
        elif isinstance(msg, Begin) and member is not None:
            member.begin(msg)
        elif isinstance(msg, Verdict) and member is not None and member.begun is not None:
            member.verdict(msg.tokens)
            channel.send(Rooted(session, member.verdicts, member.tree.root))


def _pass(pool: BatchRuntime, ready: list[_Member], vocab_size: int) -> list[Drafted]:
    """One draft pass over `ready` -> the node each begun member drafted."""
    batch = PackedBatch.of([(m.handle, m.feed()) for m in ready], last_only=True)
    logits = pool.forward(batch).logits  # [B, V_draft]
    return [m.draw(logits[b], vocab_size) for b, m in enumerate(ready) if m.begun is not None]
