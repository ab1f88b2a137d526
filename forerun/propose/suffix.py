"""SuffixDecoding (Oliaro et al., 2024, arXiv 2411.04975): draft a token tree from what followed
the text's longest earlier match, in this request and in earlier requests' outputs.

Owns: `SuffixProposer` and the tree it grows. Two indexes (`forerun.propose.suffix_index`): one
per request over its prompt and output, and one global over the outputs of earlier requests,
bounded (`--suffix-cache-tokens`, oldest evicted first) and shared by every request of an
engine or a server (`ProposerContext.shared`; a sequence's output joins it when the sequence
leaves the engine: `Needs.archive`). Each step, in each index:

  1. match    the longest suffix of the text (up to MAX_MATCH tokens) that occurred before, of
              length m, and the occurrences that match that far back;
  2. count    the continuations that followed them form a trie; a node's estimated
              probability is the product of count(child) / count(parent) along its path;
  3. grow     greedily, likeliest node first (so parents come first), at most
              min(k, factor * m) nodes, none below `min_prob` (the paper's MAX_SPEC = alpha * p
              and its probability floor);

and the tree with the higher score (the sum of its nodes' probabilities: the expected accepted
length) is the draft. Free to draft and deterministic (q = None): verified as a tree by
recursive rejection sampling with one-hot proposals, which is lossless.

Library choice: arctic-inference's C++ suffix tree (the paper's authors') ships as a source
build pulled in as a vLLM plugin; a numpy ring with hash chains keeps lookup flat and memory
fixed with no new dependency (see suffix_index's docstring for what that approximates).
"""

from __future__ import annotations

import atexit
import heapq
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from forerun.propose.base import Draft, Needs
from forerun.propose.suffix_index import MAX_MATCH, MIN_CAPACITY, TokenIndex

DEFAULT_CACHE_TOKENS = 1 << 20  # the global index: 28 MB (suffix_index's bytes a token)
DEFAULT_FACTOR = 1.0  # tree nodes per matched token (arctic-inference's max_spec_factor)
DEFAULT_MIN_PROB = 0.1  # arctic-inference's min_token_prob
STORE = "suffix"  # the global index's name in ProposerContext.shared
INDEX_FILE = "suffix-index.npz"  # its file in a cache_dir


@dataclass(frozen=True)
class SuffixConfig:
    cache_tokens: int = DEFAULT_CACHE_TOKENS  # the global index's size (0: none)
    factor: float = DEFAULT_FACTOR  # at most factor * match length nodes a draft
    min_prob: float = DEFAULT_MIN_PROB  # no node whose estimated probability is lower
    cache_dir: str | None = None  # the global index is kept here between runs (None: not kept)

    def __post_init__(self):
        if self.cache_tokens < 0 or 0 < self.cache_tokens < MIN_CAPACITY:
            raise ValueError(f"suffix cache tokens must be 0 (no global index) or at least "
                             f"{MIN_CAPACITY}, got {self.cache_tokens}")
        if not self.factor > 0 or not math.isfinite(self.factor):
            raise ValueError(f"suffix factor must be a positive number, got {self.factor}")
        if not 0 <= self.min_prob <= 1:
            raise ValueError(f"suffix min prob must be in [0, 1], got {self.min_prob}")


@dataclass(frozen=True)
class SuffixTree:
    tokens: list[int]  # [N] in topological order
    parents: list[int]  # [N] -1 = a child of the root
    probs: list[float]  # [N] each node's estimated probability (non-increasing)
    match: int = 0  # the match length it was grown from

    @property
    def score(self) -> float:
        """The expected number of accepted tokens, by the estimates."""
        return sum(self.probs)


EMPTY = SuffixTree([], [], [])


def grow_tree(continuations: list[list[int]], budget: int, min_prob: float) -> SuffixTree:
    """The paper's greedy expansion over the trie of `continuations`: repeatedly take the
    likeliest node whose parent is taken (ties: the shallower), until `budget` nodes or the
    next is below `min_prob`. A child is never likelier than its parent, so the order is
    topological."""
    counts: list[int] = []  # trie node -> occurrences through it
    tokens: list[int] = []
    children: list[dict[int, int]] = [{}]  # trie node + 1 -> token -> trie node (0: the root)
    for path in continuations:
        at = 0
        for token in path:
            node = children[at].get(token)
            if node is None:
                node = children[at][token] = len(counts)
                counts.append(0)
                tokens.append(token)
                children.append({})
            counts[node] += 1
            at = node + 1
    total = sum(1 for path in continuations if path)
    # (-prob, depth, trie node, parent in the output): ties go to the shallower node
    heap = [(-counts[c] / total, 1, c, -1) for c in children[0].values()]
    heapq.heapify(heap)
    out = SuffixTree([], [], [])
    while heap and len(out.tokens) < budget:
        neg, depth, node, parent = heapq.heappop(heap)
        if -neg < min_prob:
            break
        out.tokens.append(tokens[node])
        out.parents.append(parent)
        out.probs.append(-neg)
        me = len(out.tokens) - 1
        for child in children[node + 1].values():
            heapq.heappush(heap, (neg * counts[child] / counts[node], depth + 1, child, me))
    return out


def speculate(index: TokenIndex, context: list[int], k: int, cfg: SuffixConfig) -> SuffixTree:
    """The tree one index drafts after `context`: grown from its longest match."""
    match = index.lookup(context)
    budget = min(k, int(cfg.factor * match.length + 1e-9))
    if budget < 1:
        return EMPTY
    tree = grow_tree(index.continuations(match.ends, budget), budget, cfg.min_prob)
    return SuffixTree(tree.tokens, tree.parents, tree.probs, match.length)


def shared_index(shared: dict[str, Any] | None, cfg: SuffixConfig) -> TokenIndex | None:
    """The engine's global index of earlier outputs, made at its first use (None where nothing
    is shared, or it is turned off); a config asking another size replaces it. With a
    `cache_dir`, it starts as the index saved there (if of this size) and is saved there when
    the process exits (`save_indexes`)."""
    if shared is None or not cfg.cache_tokens:
        return None
    index = shared.get(STORE)
    if index is None or index.capacity != cfg.cache_tokens:
        path = Path(cfg.cache_dir) / INDEX_FILE if cfg.cache_dir else None
        loaded = TokenIndex.load(path, cfg.cache_tokens) if path is not None else None
        index = shared[STORE] = loaded or TokenIndex(cfg.cache_tokens)
        if path is not None:
            if not _TO_SAVE:
                atexit.register(save_indexes)
            _TO_SAVE[path] = index  # the latest index for a file wins
    return index


_TO_SAVE: dict[Path, TokenIndex] = {}  # indexes with a cache_dir, by their file


def save_indexes() -> None:
    """Write every index that has a cache_dir to it (at exit; a test calls it directly)."""
    for path, index in _TO_SAVE.items():
        try:
            index.save(path)
        except OSError as e:  # the process is ending: say so, but let it end
            print(f"forerun: could not save the suffix index to {path}: {e}", file=sys.stderr)


@dataclass
class SuffixProposer:
    cfg: SuffixConfig
    capacity: int  # the most tokens its sequence holds: sizes the per-request index
    cache: TokenIndex | None = None  # earlier requests' outputs (None: none)
    name: str = "suffix"
    runtime: ClassVar[None] = None  # no model: drafting costs no forward passes
    group: ClassVar[None] = None  # drafts alone
    needs: ClassVar[Needs] = Needs(archive=True)  # its output joins the global index

    local: TokenIndex | None = None  # this request's prompt and output
    prompt_len: int = 0
    archived: bool = False  # its output is in the global index already

    def prefill(self, prompt: list[int]) -> None:
        self.local = TokenIndex(max(self.capacity, 2 * MAX_MATCH))
        self.local.extend(prompt)
        self.prompt_len, self.archived = len(prompt), False

    def propose(self, tokens, k, sampling, generator) -> Draft:
        if self.local is None or len(tokens) < self.local.total:  # not this sequence's
            self.prefill(tokens[:self.prompt_len])  # continuation: index it anew
        self.local.extend(tokens[self.local.total:])
        context = tokens[-MAX_MATCH:]
        best = speculate(self.local, context, k, self.cfg)
        if self.cache is not None:
            other = speculate(self.cache, context, k, self.cfg)
            if (other.score, other.match) > (best.score, best.match):
                best = other
        chain = best.parents == list(range(-1, len(best.parents) - 1))
        return Draft(torch.tensor(best.tokens, dtype=torch.long), None,
                     None if chain else torch.tensor(best.parents, dtype=torch.long))

    def commit(self, num_final: int) -> None:
        pass  # it indexes only final tokens (the sequence it is shown), so nothing to undo

    def archive(self, output: list[int]) -> None:
        if self.cache is not None and not self.archived:
            self.cache.add_document(output)
            self.archived = True
