"""Any one-sequence runtime as a batch: one fork per member, one pass per member.

Owns: `ForkedBatch`, the `BatchRuntime` of a `Runtime` that has no pooled view of its own (a
test's scripted model, a wrapper around a real runtime, a future backend before it gets one).
Each member gets a fork of the runtime (same weights, a cache of its own) behind a `SoloBatch`;
a packed pass runs every member's rows as its own `Runtime.forward`, so the batch step, the
scheduler and the server work unchanged over it, only without the shared matmuls that make a
real batch fast. Forks are kept for reuse when members leave. Never samples, never tokenizes.
"""

from __future__ import annotations

import torch

from forerun.runtime.base import ForwardOutput, Runtime
from forerun.runtime.batch import PackedBatch, PoolFull
from forerun.runtime.solo import SoloBatch


class ForkedBatch:
    """Members over forks of `runtime`; at most `max_seqs` at once (PoolFull beyond)."""

    def __init__(self, runtime: Runtime, max_seqs: int = 64):
        self.single, self.max_seqs = runtime, max_seqs
        self.capacity = runtime.capacity
        self.capabilities = runtime.capabilities
        self._members: dict[int, SoloBatch] = {}
        self._spare: list[SoloBatch] = []
        self._next = 0
        self._peak = 0

    def add(self, tokens: int) -> int:
        if tokens > self.capacity:
            raise ValueError(f"a sequence of {tokens} tokens exceeds the context {self.capacity}")
        if len(self._members) >= self.max_seqs:
            raise PoolFull(f"{self.max_seqs} sequences are live (one fork each)")
        solo = self._spare.pop() if self._spare else SoloBatch(self.single.fork())
        solo.add(tokens)
        handle, self._next = self._next, self._next + 1
        self._members[handle] = solo
        self._peak = max(self._peak, len(self._members))
        return handle

    def release(self, seq: int) -> None:
        solo = self._members.pop(seq)
        solo.release(0)
        self._spare.append(solo)

    def length(self, seq: int) -> int:
        return self._members[seq].length(0)

    def reserved(self, seq: int) -> int:
        return self._members[seq].reserved(0)

    def commit(self, seq: int, base: int, rows: list[int]) -> None:
        self._members[seq].commit(0, base, rows)

    def truncate(self, seq: int, length: int) -> None:
        self._members[seq].truncate(0, length)

    def kv_peak_bytes(self, reset: bool = False) -> int:
        return 0  # each fork's own cache, sized by its context

    def kv_bytes(self) -> int:
        return 0

    def forward(self, batch: PackedBatch, hidden_layers: tuple[int, ...] = ()) -> ForwardOutput:
        """Each member's rows through its own fork -> the wanted rows' logits [R, V] in the
        batch's order, and hidden states layer -> [N, D]."""
        wanted = (list(range(len(batch.tokens))) if batch.logit_rows is None
                  else batch.logit_rows.tolist())
        logits, hidden = [], {i: [] for i in hidden_layers}
        for b, seq in enumerate(batch.seqs):
            rows = batch.rows_of(b)
            mine = [r - rows.start for r in wanted if rows.start <= r < rows.stop]
            n = rows.stop - rows.start
            every = mine != [n - 1]  # a verify wants every row; a prefill (chunk) its last
            member = PackedBatch(
                (0,), batch.tokens[rows], (0, n),
                None if batch.positions is None else batch.positions[rows],
                None if batch.tree_masks is None else (batch.tree_masks[b],),
                None if every else torch.tensor([n - 1]))
            out = self._members[seq].forward(member, hidden_layers)
            logits.append(out.logits[mine] if every else out.logits)
            for i in hidden_layers:
                hidden[i].append(out.hidden[i])
        return ForwardOutput(torch.cat(logits) if logits else torch.empty(0),
                             {i: torch.cat(h) for i, h in hidden.items()})
