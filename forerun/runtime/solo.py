"""A one-sequence runtime seen as a batch of one: how `speculative_decode` runs the batch step.

Owns: `SoloBatch`, the `BatchRuntime` over a `Runtime` (torch, llama.cpp, a fork, a test's
tiny model) whose one cache is the one member. A packed batch of that member becomes one
`Runtime.forward` (tree positions made absolute), `commit` becomes `truncate` for a chain's
prefix or `keep` after a tree pass, and each verify pass (every row's logits wanted) is timed
and shown to the runtime's calibrated cost curve (`forerun.profile.observe_pass`), which prices
drafts. A second `add` while the member is live is refused (PoolFull): one cache, one sequence.
"""

from __future__ import annotations

import time

from forerun.profile import observe_pass
from forerun.runtime.base import ForwardOutput, Runtime
from forerun.runtime.batch import PackedBatch, PoolFull


class SoloBatch:
    """The BatchRuntime of one member over `runtime`'s own cache (handle 0)."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.capacity = runtime.capacity
        self.capabilities = runtime.capabilities
        self.live = False
        self.tree = False  # the last pass verified a tree (its commit is a `keep`)

    def add(self, tokens: int) -> int:
        if self.live:
            raise PoolFull("a one-sequence runtime holds one sequence at a time")
        if tokens > self.capacity:
            raise ValueError(f"a sequence of {tokens} tokens exceeds the context {self.capacity}")
        self.runtime.truncate(0)
        self.live = True
        return 0

    def release(self, seq: int) -> None:
        self.live = False

    def length(self, seq: int) -> int:
        return self.runtime.length

    def reserved(self, seq: int) -> int:
        return self.capacity

    def commit(self, seq: int, base: int, rows: list[int]) -> None:
        if self.tree:  # a tree pass: `keep` (llama.cpp also drops its leaves' sequences)
            self.runtime.keep(base, rows)
        elif rows == list(range(len(rows))):  # a chain's accepted rows: a prefix
            self.runtime.truncate(base + len(rows))
        else:
            raise ValueError(f"a chain pass keeps a prefix of its rows, not {rows}")

    def truncate(self, seq: int, length: int) -> None:
        self.runtime.truncate(length)

    def kv_peak_bytes(self, reset: bool = False) -> int:
        return 0  # the runtime's own cache, sized by its context, not a pool's budget

    def kv_bytes(self) -> int:
        return 0

    def forward(self, batch: PackedBatch, hidden_layers: tuple[int, ...] = ()) -> ForwardOutput:
        """-> logits [R, V] of batch.logit_rows (a prefill's last row, or every row), hidden
        states layer -> [N, D] of every row."""
        if batch.size != 1:
            raise ValueError(f"a one-sequence runtime runs one member a pass, not {batch.size}")
        n, base = len(batch.tokens), self.runtime.length
        rows = batch.logit_rows
        last_only = rows is not None and rows.tolist() == [n - 1]
        if rows is not None and not last_only and rows.tolist() != list(range(n)):
            raise ValueError("a one-sequence pass returns its last row's logits or every row's")
        mask = batch.tree_masks[0] if batch.tree_masks else None
        self.tree = mask is not None
        positions = None if batch.positions is None else batch.positions + base  # [N]
        # early exit's draft rows start at its layer (only a runtime with resume_rows gets one)
        resume = {"resume": batch.resume[0]} if batch.resume and batch.resume[0] else {}
        started = time.perf_counter()
        out = self.runtime.forward(batch.tokens, positions=positions, tree_mask=mask,
                                   last_only=last_only, hidden_layers=hidden_layers, **resume)
        # a verify pass (a chain, a tree, a plain step) is timed; a GPU's may still be running
        if (not last_only or n == 1) and out.logits.device.type == "cpu":
            observe_pass(self.runtime, n, time.perf_counter() - started)
        return out
