"""Draft trees that outlive a verify pass: drafted ahead, re-rooted on the verdict. Pure.

Owns: `AheadTree`, the draft tree of the asynchronous pipeline (`forerun.propose.disaggregate`),
kept the same way on both sides of it: the drafter worker grows it, the proposer mirrors it from
the worker's messages. Its nodes have global ids that never change (ids ascend in the order the
nodes were drafted, so a parent's id is below its children's), and the root is the pending
token, the sequence's last, whose id is a node's (a drafted token the verdict committed) or a
fresh negative one (a root nothing was drafted under).

    before the verdict             verdict: accepted [a], bonus b       after
         root                                                        root = node 2 (b)
        /    \\                      path root -> 1 (a) -> 2 (b)          |
      1 (a)   5 (c)                                                   3 (d)
       |                                                               |
      2 (b)                                                           4 (e)
       |
      3 (d)
       |
      4 (e)

`reroot(tokens)` follows the committed tokens (the accepted path, then the bonus or recovered
token) from the root: the node reached becomes the root and exactly its descendants are kept,
every other node is dropped; a walk that leaves the tree leaves an empty tree under a fresh
root. Nodes that arrive later (the worker drafted them before it heard the verdict) are added
only under a kept node or the new root: `add` drops a node whose parent is gone, so both sides
apply the same verdicts to the same nodes and agree on every id without renumbering.

Why the kept subtree is still a valid draft (losslessness): a node's token was drawn from the
draft's q conditioned on exactly its path from the sequence's start (the committed tokens, then
its ancestors), with the drafter's own randomness, which the target's verification never reads.
A kept node's path is the committed sequence followed by kept ancestors, so its token is a draw
from q given the sequence now committed and the draft above it, as a draft made now would be.
Whether a node survives depends on the verdict, and the verdict on the target's coins and on
the tokens of nodes above the new root (the verified draft, and the bonus position's own guess),
never on the kept nodes' own draws, which came after: conditioned on the committed sequence they
are fresh draws, and the verifier's rejection sampling with their q stays exact. Which nodes are
ready when the target takes a draft depends on timing alone, not on their tokens' values: a
draft length chosen that way keeps verification exact too (as any length fixed before the
target's coins are drawn does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AheadNode:
    parent: int  # the parent's id: a node's, or the root's
    token: int
    q: torch.Tensor | None = None  # [V] the distribution `token` was drawn from; None = chosen


class AheadTree:
    """A draft tree under `root`: node id -> AheadNode, every node a descendant of the root."""

    def __init__(self, root: int, nodes: dict[int, AheadNode] | None = None):
        self.root = root
        self.nodes: dict[int, AheadNode] = dict(nodes or {})

    def __len__(self) -> int:
        return len(self.nodes)

    def add(self, node_id: int, node: AheadNode) -> bool:
        """Add a node drafted under the root or a node of the tree; a node whose parent was
        dropped (the worker drafted it before a verdict reached it) is dropped. -> kept?"""
        if node.parent != self.root and node.parent not in self.nodes:
            return False
        self.nodes[node_id] = node
        return True

    def child(self, parent: int, token: int) -> int | None:
        """The id of `parent`'s child holding `token` (the first drafted), if there is one."""
        return next((i for i, n in self.nodes.items() if n.parent == parent and n.token == token),
                    None)

    def reroot(self, tokens: list[int], fresh: int) -> AheadTree:
        """The tree after `tokens` were committed behind the root (the accepted path, then the
        bonus or recovered token): rooted at the node they lead to, with exactly its
        descendants; where they leave the tree, an empty tree rooted at `fresh`."""
        node = self.root
        for token in tokens:
            found = self.child(node, token)
            if found is None:
                return AheadTree(fresh)
            node = found
        kept: dict[int, AheadNode] = {}
        for i in sorted(self.nodes):  # parents first: one pass finds every descendant
            n = self.nodes[i]
            if i != node and (n.parent == node or n.parent in kept):
                kept[i] = n
        return AheadTree(node, kept)

    def tip(self) -> tuple[int, list[int]]:
        """The end of the first-drafted line from the root (each node's first child) and the
        tokens along it: where a drafter extending its most likely continuation goes on."""
        node, tokens = self.root, []
        while (nxt := next((i for i in sorted(self.nodes) if self.nodes[i].parent == node),
                           None)) is not None:
            node = nxt
            tokens.append(self.nodes[nxt].token)
        return node, tokens

    def draft(self, k: int) -> tuple[list[int], list[int], list[int]]:
        """The first `k` nodes in drafting order (parents first, so a tree) -> their ids,
        tokens and parents as indices among them (-1 = the root), as `Draft` takes them."""
        ids = sorted(self.nodes)[:k]
        index = {i: n for n, i in enumerate(ids)}
        parents = [index.get(self.nodes[i].parent, -1) for i in ids]
        return ids, [self.nodes[i].token for i in ids], parents
