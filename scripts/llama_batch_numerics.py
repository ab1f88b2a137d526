"""How much llama.cpp's logits depend on the shape of the passes that filled its cache.

After a random 120-token prompt, one 5-token path enters the cache four ways: a tree pass then
`keep`, a 9-token chain pass truncated to the path, five 1-token passes, and one 5-token pass
(the reference). Prints, for each, the largest logit difference against the reference over the
8 random tokens decoded next (and, for the tree, of the path's own rows), across 3 trials.

    python scripts/llama_batch_numerics.py [MODEL]   (default: the default target)
"""

from __future__ import annotations

import sys

import torch

from forerun.models.load import open_model
from forerun.tree import TokenTree

PROMPT, TRIALS, NEXT = 120, 3, 8
TREE = TokenTree((-1, -1, 0, 0, 2, 1, 5, 6))
ROWS = [0, 2, 6, 7, 8]  # the pending token, then nodes 1, 5, 6, 7: a root-to-leaf path


def next_diff(a, b, nxt: torch.Tensor) -> float:
    """Decode the same tokens one by one in both runtimes; the largest logit difference."""
    return max(float((a.forward(t[None]).logits - b.forward(t[None]).logits).abs().max())
               for t in nxt)


def reference(b, prompt: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """The path as one pass after the prompt: [len(path), V] logits."""
    b.truncate(0)
    b.forward(prompt)
    return b.forward(path).logits


def main() -> None:
    src = open_model(sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-1.5b-instruct")
    a, b = (src.load(runtime="llama.cpp", context=1024) for _ in range(2))
    g = torch.Generator().manual_seed(0)
    worst = dict.fromkeys(["tree rows", "tree + keep", "9-token pass", "1-token passes"], 0.0)
    for _ in range(TRIALS):
        prompt = torch.randint(0, 150000, (PROMPT,), generator=g)
        feed = torch.randint(0, 150000, (len(TREE) + 1,), generator=g)  # [N+1]
        nxt = torch.randint(0, 150000, (NEXT,), generator=g)
        path = feed[ROWS]

        a.truncate(0)
        a.forward(prompt)
        tree = a.forward(feed, positions=TREE.positions(PROMPT), tree_mask=TREE.mask()).logits
        ref = reference(b, prompt, path)
        worst["tree rows"] = max(worst["tree rows"], float((tree[ROWS] - ref).abs().max()))
        a.keep(PROMPT, ROWS)
        worst["tree + keep"] = max(worst["tree + keep"], next_diff(a, b, nxt))
        a.truncate(0)
        a.forward(prompt)
        a.forward(torch.cat([path, feed[:4]]))
        a.truncate(PROMPT + len(ROWS))
        reference(b, prompt, path)
        worst["9-token pass"] = max(worst["9-token pass"], next_diff(a, b, nxt))
        a.truncate(0)
        a.forward(prompt)
        for t in path:
            a.forward(t[None])
        reference(b, prompt, path)
        worst["1-token passes"] = max(worst["1-token passes"], next_diff(a, b, nxt))
    for name, value in worst.items():
        print(f"{name:>15}: max |logit difference| vs one 5-token pass = {value:.4f}")


if __name__ == "__main__":
    main()
