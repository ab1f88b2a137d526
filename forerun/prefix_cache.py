"""Prefix caching: the KV of prompt blocks kept after their requests, for later prompts that
begin the same way (a shared system prompt, a chat history sent again).

Owns: `PrefixCache`, blocks of `block` tokens, each keyed by (its parent block, its tokens),
so a block matches only after the very same prefix and the match is exact (no hash can
collide), as vLLM's and SGLang's prefix caches chain their block hashes; each block holds a
copy of its keys and values (whatever the runtime's `read_kv` returns: torch's K and V
tensors, llama.cpp's saved cells). A byte budget bounds them, least recently used
evicted first; a lookup touches a chain from its end to its root, so a parent is always used
more recently than its children and goes last. Blocks are copied into a new member's region
(`load`), not shared in place: reuse saves the prefill's compute, the time to first token, not
the region's memory. `store` keeps a member's prompt blocks once its prompt is cached. Every
block but the prompt's last token can come from here: that token's row gives the first logits.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from forerun.runtime.batch import BatchRuntime, KVCopy

BLOCK_TOKENS = 16  # as vLLM's default block size
ROOT = 0  # the parent id of a prompt's first block


@dataclass
class Block:
    id: int
    kv: KVCopy  # what the runtime's read_kv gave: torch's K and V, llama.cpp's saved cells

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes


class PrefixCache:
    """Prompt blocks' KV within `budget_bytes`, for one batched runtime's members."""

    def __init__(self, budget_bytes: int, block: int = BLOCK_TOKENS):
        if budget_bytes < 0 or block < 1:
            raise ValueError(f"need budget_bytes >= 0 and block >= 1, got {budget_bytes}, {block}")
        self.budget, self.block = budget_bytes, block
        self._blocks: OrderedDict[tuple[int, tuple[int, ...]], Block] = OrderedDict()
        self._next_id = ROOT + 1
        self.bytes = 0
        self.hits = 0  # prompt tokens served from here, since start
        self.lookups = 0  # prompt tokens looked up

    def _chain(self, prompt: list[int]) -> list[tuple[int, tuple[int, ...]]]:
        """The keys of the cached blocks that begin `prompt`, root first (its last token
        excluded: it is fed, for the first logits)."""
        keys, parent = [], ROOT
        for start in self._starts(prompt):
            key = (parent, tuple(prompt[start:start + self.block]))
            found = self._blocks.get(key)
            if found is None:
                break
            keys.append(key)
            parent = found.id
        return keys

    def _starts(self, prompt: list[int]) -> range:
        """Where the prompt's whole blocks begin, short of its last token (always fed)."""
        return range(0, len(prompt) - self.block, self.block)

    def _touch(self, keys: list[tuple[int, tuple[int, ...]]]) -> None:
        for key in reversed(keys):  # the root last: most recently used, evicted last
            self._blocks.move_to_end(key)

    def load(self, runtime: BatchRuntime, seq: int, prompt: list[int]) -> int:
        """Copy the longest cached prefix of `prompt` into member `seq`'s (empty) region ->
        the tokens it now caches (0: none)."""
        keys = self._chain(prompt)
        self.lookups += len(prompt)
        if not keys:
            return 0
        self._touch(keys)
        runtime.write_kv(seq, [self._blocks[key].kv for key in keys])
        n = len(keys) * self.block
        self.hits += n
        return n

    def store(self, runtime: BatchRuntime, seq: int, prompt: list[int]) -> None:
        """Keep the blocks of `prompt` (cached in member `seq`) that are not kept yet."""
        keys, parent, b = [], ROOT, self.block
        for start in self._starts(prompt):
            key = (parent, tuple(prompt[start:start + b]))
            block = self._blocks.get(key)
            if block is None:
                kv = runtime.read_kv(seq, start, start + b)
                if kv.nbytes > self.budget:
                    break
                block = Block(self._next_id, kv)
                self._next_id += 1
                self._blocks[key] = block
                self.bytes += block.nbytes
            keys.append(key)
            parent = block.id
        self._touch(keys)
        self._evict(keep=set(keys))

    def _evict(self, keep: set) -> None:
        """Least recently used blocks out until the budget holds (never one of `keep` while
        others remain)."""
        for key in list(self._blocks):
            if self.bytes <= self.budget:
                return
            if key not in keep:
                self.bytes -= self._blocks.pop(key).nbytes
        while self.bytes > self.budget and self._blocks:
            self.bytes -= self._blocks.popitem(last=False)[1].nbytes

    def __len__(self) -> int:
        return len(self._blocks)
