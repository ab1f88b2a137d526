"""Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) over a packed batch of chains.

Owns `batch_rejection_sample`: `forerun.verify.rejection_sample` for every member of a batch at
once, in the vocabulary of that module (p the target's, q the draft's; accepted, recovered and
bonus tokens). The arithmetic runs on the packed tensors, as vLLM's rejection sampler lays them
out: member b owns K_b draft tokens, K_b + 1 consecutive rows of p and K_b rows of q (or none:
a deterministic drafter, q one-hot on its tokens). q is taken in p's dtype (both come from
runtimes of one dtype; another is cast).

Randomness stays per member: member b draws from its own generator exactly what
`rejection_sample` draws, in the same order (K_b uniforms, then one more unless its last
distribution is one-hot), and every row's arithmetic is the same operations on the same numbers,
so a seeded member gets the tokens it gets alone, whatever it is batched with (tests check this
against `rejection_sample`). A plain decoding step is the chain of no draft tokens: its token is
the bonus token, drawn as `forerun.sampling.next_token` draws it. Trees stay per member
(`forerun.verify.recursive_rejection_sample`): a node's siblings are tried one after another,
each against the residual the one before it left.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from forerun.sampling import row_sums, sample
from forerun.verify import Verdict, rejection_sample


def batch_rejection_sample(
    draft_tokens: list[torch.Tensor],  # B x [K_b] int64
    p: torch.Tensor,  # [sum_b (K_b + 1), V] target probabilities, member b's rows together
    q: list[torch.Tensor | None],  # B x [K_b, V] draft probabilities; None = one-hot
    generators: list[torch.Generator],  # B, one per member, each drawn from in its order
) -> list[Verdict]:
    """One Verdict per member: `rejection_sample(draft_tokens[b], p_b, q[b], generators[b])`."""
    B = len(draft_tokens)
    if not len(q) == len(generators) == B:
        raise ValueError(f"{B} drafts, {len(q)} q's and {len(generators)} generators")
    if len({id(g) for g in generators}) < B:
        raise ValueError("each member draws from its own generator (the draws' order is its own)")
    if B <= 1:  # a batch of one is rejection_sample itself (the same draws, fewer small ops)
        return [rejection_sample(t, p, b_q, g) for t, b_q, g in zip(draft_tokens, q, generators,
                                                                   strict=True)]
    device = p.device
    K = torch.tensor([len(t) for t in draft_tokens], device=device)  # [B]
    first_p = torch.cumsum(K + 1, 0) - (K + 1)  # [B] member b's first row of p
    first_x = torch.cumsum(K, 0) - K  # [B] member b's first draft token in the packed list
    tokens = torch.cat([t.to(device) for t in draft_tokens])  # [T], T = sum_b K_b
    member = torch.repeat_interleave(torch.arange(B, device=device), K)  # [T]
    position = torch.arange(tokens.shape[0], device=device) - first_x[member]  # [T] 0..K_b-1
    p_x = p[first_p[member] + position, tokens]  # [T]
    has_q = torch.tensor([t is not None for t in q], device=device)  # [B]
    q_at = torch.cat([t.to(device, p.dtype) for t in q if t is not None] or
                     [p.new_zeros(0, p.shape[1])])  # [T_q, V] the q rows, packed
    first_q = torch.cumsum(K * has_q, 0) - K * has_q  # [B] member b's first row of q_at
    q_x = torch.ones_like(p_x)  # [T]; 1 where q is one-hot
    with_q = has_q[member]  # [T]
    q_x[with_q] = q_at[torch.arange(q_at.shape[0], device=device), tokens[with_q]]
    # 1. Accept: x_i with probability min(1, p_i(x_i) / q_i(x_i)), i.e. u * q < p.
    u = torch.cat([_uniform(int(k), g, p.dtype) for k, g in zip(K.tolist(), generators,
                                                                 strict=True)]).to(device)  # [T]
    rejected = ~(u * q_x < p_x)  # [T]
    n = K.clone().scatter_reduce_(0, member[rejected], position[rejected], "amin")  # [B]
    # 2. The last token's distribution: p at K_b (bonus), else norm(max(0, p_n - q_n)).
    target = p[first_p + n]  # [B, V]
    bonus = n == K  # [B]
    q_n = torch.zeros_like(target)  # [B, V]; a bonus row keeps zeros (unused)
    one_hot = (~bonus & ~has_q).nonzero().flatten()  # [.] rejected, q one-hot on the token
    q_n[one_hot, tokens[first_x[one_hot] + n[one_hot]]] = 1.0
    given = (~bonus & has_q).nonzero().flatten()  # [.] rejected, q given
    q_n[given] = q_at[first_q[given] + n[given]]
    residual = (target - q_n).clamp_min(0)  # [B, V]
    total = row_sums(residual)  # [B, 1]
    # total == 0 only when p_n == q_n, where rejection has probability 0; guard anyway.
    recovered = torch.where(total > 0, residual / total, target)  # [B, V]
    final = torch.where(bonus[:, None], target, recovered)  # [B, V]
    last = [int(sample(row, g)) for row, g in zip(final, generators, strict=True)]  # [B]
    return [Verdict(tokens=[*t[:m].tolist(), token], num_accepted=m)
            for t, m, token in zip(draft_tokens, n.tolist(), last, strict=True)]


def _uniform(k: int, generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """[k] uniforms from one member's generator, as `rejection_sample` draws them."""
    return torch.rand(k, generator=generator, dtype=dtype, device=generator.device)


def each_member(chain: Callable[..., Verdict]) -> Callable[..., list[Verdict]]:
    """`batch_rejection_sample`'s signature over a one-member sampler called member by member
    (member b's rows of the packed p: its K_b + 1 after the members before it). The
    self-test and the tests run altered samplers in the batch step through it."""
    def chains(draft_tokens, p, q, generators) -> list[Verdict]:
        out, row = [], 0
        for tokens, q_b, generator in zip(draft_tokens, q, generators, strict=True):
            out.append(chain(tokens, p[row:row + len(tokens) + 1], q_b, generator))
            row += len(tokens) + 1
        return out
    return chains
