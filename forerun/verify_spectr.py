"""SpecTr's k-sequential draft selection (Sun et al. 2023, "SpecTr: Fast Speculative Decoding
via Optimal Transport", Algorithm K-SEQ) as a tree verifier; and TREE_VERIFIERS, the tree
verifiers by name, through which the engine verifies a sampled member's tree. Pure functions.

Vocabulary as in forerun.verify (p the target's distribution, q the draft's; accepted,
recovered and bonus tokens). K-SEQ's setting: at one position the drafter drew k candidates
X_1 .. X_k i.i.d. from q. With a division factor rho in [1, k]:

    beta(rho)  = sum_x min(q(x), p(x) / rho)
    p_acc      = 1 - (1 - beta)^k                        (P(some candidate is accepted))
    X_i is tried in turn, accepted with probability min(1, p(X_i) / (rho q(X_i)))
    else Y ~ p_res(x) = (p(x) - min(q(x), p(x) / rho) p_acc / beta) / (1 - p_acc)

P(Y = x by acceptance) = sum_i (1 - beta)^(i-1) min(q(x), p(x)/rho) = min(q, p/rho) p_acc /
beta, so Y ~ p whenever p_res >= 0, which holds iff p_acc <= rho beta(rho). rho beta(rho) =
sum min(rho q, p) grows with rho and p_acc falls with it, so the valid rho form [rho*, k];
p_acc is largest at rho*, the root of p_acc = rho beta(rho) (found by bisection,
`optimal_rho`, one sort of the tokens by p / q per tree node visited). k = 1 gives rho* = 1:
Leviathan's rejection sampling. At rho*, p_acc = sum min(rho* q, p) >= sum min(q, p): never
below one draft's acceptance.

On a tree (`spectr_sample`): walk from the root; a node's children are its k candidates (the
order they were drawn in), all drawn i.i.d. from the one q their rows of the draft's q hold
(checked); K-SEQ picks one or draws the recovered token from p_res; past an accepted leaf the
bonus token comes from p. Lossless by induction on depth: the children of an accepted node
were drawn from q(. | path) independently of the selection's uniforms. Duplicate tokens among
siblings are separate nodes (i.i.d. draws repeat). A tree without q (chosen siblings, or
T = 0) is recursive rejection sampling's case, and goes there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from forerun.sampling import row_sums, sample
from forerun.tree import TokenTree
from forerun.verify import TreeVerdict, recursive_rejection_sample

RHO_TOLERANCE = 1e-12  # rho* to within this (a scalar bisection: ~40 steps)
SIBLING_Q_TOLERANCE = 1e-6  # siblings' q rows must agree this closely (one distribution)


def beta(p: torch.Tensor, q: torch.Tensor, rho: float) -> float:
    """beta_{p,q}(rho) = sum_x min(q(x), p(x) / rho); p, q [V]."""
    return float(torch.minimum(q, p / rho).sum())


def acceptance(b: float, k: int) -> float:
    """p_acc = 1 - (1 - beta)^k: the chance that one of k candidates is accepted."""
    return 1.0 - (1.0 - b) ** k


def optimal_rho(p: torch.Tensor, q: torch.Tensor, k: int) -> float:
    """rho*: the least rho in [1, k] with p_acc(rho) <= rho beta(rho) (the residual is then a
    distribution), to within RHO_TOLERANCE; the returned rho is always valid, so the verifier is
    exact whatever the tolerance (a larger rho accepts less). With the tokens sorted by p / q,
    beta(rho) = (q of the tokens with p / q >= rho) + (p of the others) / rho: between two
    consecutive ratios a line in 1 / rho. One sort finds the segment where the condition turns
    true (it is monotone), a scalar bisection the point in it."""
    if k == 1:
        return 1.0
    # p / q: 0 where only q has mass, inf where only p has (both add 0 to beta at any rho)
    ratio, order = (p / q).nan_to_num(nan=float("inf")).sort()  # [V] ascending
    zero = p.new_zeros(1)
    below_q = torch.cat([zero, q[order].cumsum(0)])  # [V+1] q of the j lowest ratios
    below_p = torch.cat([zero, p[order].cumsum(0)])  # [V+1] p of the j lowest ratios
    total_q = float(below_q[-1])
    # segment j: rho in (ratio[j-1], ratio[j]] within [1, k], where j tokens have p / q < rho
    ends = torch.cat([ratio, ratio.new_tensor([float("inf")])])  # [V+1]
    right = ends.clamp(1, k)  # [V+1] its right end (segments below rho = 1 are empty)
    b = total_q - below_q + below_p / right  # [V+1] beta there
    ok = (1 - (1 - b) ** k <= right * b) & (ends >= 1)  # [V+1]
    j = int(ok.nonzero()[0])  # the first segment valid at its right end (rho = k is valid)
    a, c = total_q - float(below_q[j]), float(below_p[j])  # beta = a + c / rho in segment j

    def valid(rho: float) -> bool:
        return acceptance(a + c / rho, k) <= rho * (a + c / rho)

    lo, hi = (max(1.0, float(ratio[j - 1])) if j else 1.0), float(right[j])
    if valid(lo):
        return lo
    while hi - lo > RHO_TOLERANCE:
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if valid(mid) else (mid, hi)
    return hi


def residual(p: torch.Tensor, q: torch.Tensor, rho: float, k: int) -> torch.Tensor:
    """p_res [V], normalised: what K-SEQ draws from when every candidate is rejected."""
    accepted = torch.minimum(q, p / rho)  # [V]
    b = float(accepted.sum())
    p_acc = acceptance(b, k)
    # clamp: at rho* the residual vanishes wherever q >= p / rho, up to rounding
    left = (p - accepted * (p_acc / b if b > 0 else 0.0)).clamp_min(0)  # [V]
    total = row_sums(left)
    # total == 0 only where p_acc == 1, where rejection has probability 0; guard anyway.
    return left / total if total > 0 else p


def k_sequential(candidates: list[int], p: torch.Tensor, q: torch.Tensor,
                 generator: torch.Generator) -> tuple[int | None, int]:
    """K-SEQ at one position: candidates X_1..X_k i.i.d. from q [V], target p [V] ->
    (index of the accepted candidate, its token), or (None, the recovered token from p_res).
    Draws one uniform per candidate tried, then one more for a recovered token."""
    k = len(candidates)
    rho = optimal_rho(p, q, k)
    for i, x in enumerate(candidates):
        u = float(torch.rand((), generator=generator, dtype=p.dtype))
        if u * rho * float(q[x]) < float(p[x]):  # u < p / (rho q) without dividing by q
            return i, x
    return None, int(sample(residual(p, q, rho, k), generator))


def spectr_sample(
    tree: TokenTree,
    draft_tokens: torch.Tensor,  # [N] int64, node i's token
    p: torch.Tensor,  # [N+1, V] target probabilities; row 0 = after the root, row i+1 = node i
    q: torch.Tensor | None,  # [N, V] the distribution node i was drawn from; siblings share it
    generator: torch.Generator,
) -> TreeVerdict:
    """SpecTr on a tree whose every node's children are i.i.d. draws from one q (see the
    module docstring); `recursive_rejection_sample`'s signature."""
    if q is None:  # chosen siblings (one-hot q each): recursive rejection's case
        return recursive_rejection_sample(tree, draft_tokens, p, None, generator)
    path: list[int] = []
    row = 0
    while True:
        children = tree.children[row]
        if not children:  # past an accepted leaf (or an empty draft): the bonus token
            last = int(sample(p[row], generator))
            return TreeVerdict([int(draft_tokens[i]) for i in path] + [last], path)
        q_row = q[children[0]]  # [V]
        if any(not torch.allclose(q[c], q_row, atol=SIBLING_Q_TOLERANCE) for c in children[1:]):
            raise ValueError("spectr verifies siblings drawn i.i.d. from one q; these were "
                             "drawn from different distributions (use rrs)")
        picked, token = k_sequential([int(draft_tokens[c]) for c in children], p[row], q_row,
                                     generator)
        if picked is None:  # recovered
            return TreeVerdict([int(draft_tokens[i]) for i in path] + [token], path)
        path.append(children[picked])
        row = children[picked] + 1


TreeVerifier = Callable[[TokenTree, torch.Tensor, torch.Tensor, torch.Tensor | None,
                         torch.Generator], TreeVerdict]
# name -> tree verifier: what a proposer's `needs.tree_verifier` names; "rrs" holds for any
# tree whose nodes were drawn from the q given for them (forerun.verify), "spectr" for trees
# whose siblings are i.i.d. draws from one q
TREE_VERIFIERS: dict[str, TreeVerifier] = {
    "rrs": recursive_rejection_sample,
    "spectr": spectr_sample,
}
