"""Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): accept draft tokens so that the
output is distributed exactly as the target's samples. Pure functions.

Vocabulary (as in the papers and vLLM):
- p: the target's distribution at each draft position plus one more, [K+1, V];
- q: the draft's distribution at each draft position, [K, V]; None means the drafter is
  deterministic (n-gram lookup), i.e. q is one-hot on the drafted token;
- accepted tokens: draft token x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)),
  stopping at the first rejection;
- recovered token: at the first rejection i, a token drawn from norm(max(0, p_i - q_i));
- bonus token: when all K are accepted, a token drawn from p_K.
Every verify step therefore yields accepted + 1 tokens. With temperature 0, p is one-hot, so a
draft token is accepted iff it is the target's argmax and the recovered token is that argmax:
greedy verification is the T = 0 case of the same function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from forerun.sampling import row_sums, sample
from forerun.tree import TokenTree


@dataclass(frozen=True)
class Verdict:
    tokens: list[int]  # the accepted draft tokens, then the recovered or bonus token
    num_accepted: int  # 0..K

    @property
    def path(self) -> list[int]:
        """The accepted nodes of the chain: 0 .. num_accepted - 1."""
        return list(range(self.num_accepted))


def rejection_sample(
    draft_tokens: torch.Tensor,  # [K] int64
    p: torch.Tensor,  # [K+1, V] target probabilities
    q: torch.Tensor | None,  # [K, V] draft probabilities; None = one-hot on draft_tokens
    generator: torch.Generator,
) -> Verdict:
    K = draft_tokens.shape[0]
    rows = torch.arange(K, device=p.device)
    p_x = p[rows, draft_tokens]  # [K]
    q_x = q[rows, draft_tokens] if q is not None else torch.ones_like(p_x)  # [K]
    u = torch.rand(K, generator=generator, dtype=p.dtype, device=p.device)  # [K]
    accepted = u * q_x < p_x  # [K]; u < p/q without dividing by q
    rejected_at = (~accepted).nonzero()
    n = int(rejected_at[0]) if rejected_at.numel() else K
    if n == K:
        last = sample(p[K], generator)  # bonus
    else:
        q_n = q[n] if q is not None else torch.zeros_like(p[n]).index_fill_(0, draft_tokens[n], 1)
        residual = (p[n] - q_n).clamp_min(0)  # [V]
        total = row_sums(residual)
        # total == 0 only when p_n == q_n, where rejection has probability 0; guard anyway.
        last = sample(residual / total if total > 0 else p[n], generator)  # recovered
    return Verdict(tokens=[*draft_tokens[:n].tolist(), int(last)], num_accepted=n)


@dataclass(frozen=True)
class TreeVerdict:
    tokens: list[int]  # the accepted path's draft tokens, then the recovered or bonus token
    path: list[int]  # the accepted nodes, root's child first (len = number accepted)


def recursive_rejection_sample(
    tree: TokenTree,
    draft_tokens: torch.Tensor,  # [N] int64, node i's token
    p: torch.Tensor,  # [N+1, V] target probabilities; row 0 = after the root, row i+1 = node i
    q: torch.Tensor | None,  # [N, V] the distribution node i was drawn from; None = chosen
    generator: torch.Generator,
) -> TreeVerdict:
    """Walk the tree from the root; at each node try its children in order (SpecInfer;
    Jeon et al. 2024, recursive rejection sampling). Child x with proposal q is accepted with
    probability min(1, p(x) / q(x)); on rejection the target's distribution becomes the
    residual norm(max(0, p - q)) and the next sibling is tried against it; when every child is
    rejected the token is drawn from the last residual, and past an accepted leaf from p.

    Lossless whenever each child's token was drawn from the q given for it, conditioned on the
    siblings before it (so i.i.d. samples, samples without replacement with q renormalised
    over what is left, or, with q = None, tokens picked deterministically, as one-hot q, as the
    top-k of a head's distribution are). By induction from the last sibling: the residual after
    a rejection does not depend on which token was rejected, and one rejection step turns
    target p into min(p, q) + (1 - sum min(p, q)) * residual = p. A chain (one child per node)
    is exactly `rejection_sample`. Greedy is T = 0: p is one-hot, a child is accepted iff it
    is the target's argmax."""
    path: list[int] = []
    row = 0
    while True:
        target = p[row]  # [V]
        accepted = None
        for child in tree.children[row]:
            x = int(draft_tokens[child])
            proposal = q[child] if q is not None else None  # [V] or one-hot on x
            q_x = float(proposal[x]) if proposal is not None else 1.0
            u = float(torch.rand((), generator=generator, dtype=p.dtype))
            if u * q_x < float(target[x]):
                accepted = child
                break
            if proposal is None:
                proposal = torch.zeros_like(target).index_fill_(0, draft_tokens[child], 1)
            residual = (target - proposal).clamp_min(0)  # [V]
            total = row_sums(residual)
            # total == 0 only where rejection has probability 0; guard anyway.
            target = residual / total if total > 0 else target
        if accepted is None:
            last = int(sample(target, generator))  # recovered (or bonus past a leaf)
            return TreeVerdict([int(draft_tokens[i]) for i in path] + [last], path)
        path.append(accepted)
        row = accepted + 1


def greedy_accept(tree: TokenTree, draft_tokens: torch.Tensor, best: torch.Tensor
                  ) -> TreeVerdict:
    """Temperature 0 without probabilities: `best` [N+1] is the target's argmax at each row
    (first index on ties, as `logits_to_probs` picks). Walk from the root taking the child whose
    token is its row's argmax. Exactly what the two samplers above return at T = 0, where p is
    one-hot (a child is accepted iff it is the argmax; the recovered and bonus tokens are the
    argmax), without building [N+1, V] one-hot rows and scanning them (tests check equality):
    on Qwen's 151,936 ids that was ~1 ms a row here."""
    best_ids, ids = best.tolist(), draft_tokens.tolist()
    path: list[int] = []
    row = 0
    while True:
        child = next((c for c in tree.children[row] if ids[c] == best_ids[row]), None)
        if child is None:
            return TreeVerdict([ids[i] for i in path] + [best_ids[row]], path)
        path.append(child)
        row = child + 1
