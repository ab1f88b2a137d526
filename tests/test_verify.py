"""The rejection sampler alone: table cases, then its output distribution on random p and q."""

import torch
from scipy.stats import chisquare

from forerun.sampling import make_generator
from forerun.verify import rejection_sample

G = make_generator(0)


def one_hot(rows: list[int], V: int = 5) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(rows), V).double()


def test_all_accepted_gives_bonus_token():
    v = rejection_sample(torch.tensor([1, 2]), one_hot([1, 2, 4]), None, G)
    assert v.tokens == [1, 2, 4] and v.num_accepted == 2


def test_first_rejected_gives_recovered_token():
    v = rejection_sample(torch.tensor([3, 2]), one_hot([1, 2, 4]), None, G)
    assert v.tokens == [1] and v.num_accepted == 0


def test_middle_rejection_with_draft_probabilities():
    q = one_hot([1, 3])
    v = rejection_sample(torch.tensor([1, 3]), one_hot([1, 2, 4]), q, G)
    assert v.tokens == [1, 2] and v.num_accepted == 1


def test_empty_draft_samples_from_target():
    v = rejection_sample(torch.empty(0, dtype=torch.long), one_hot([3]), None, G)
    assert v.tokens == [3] and v.num_accepted == 0


def test_identical_p_and_q_accept_everything():
    g = make_generator(1)
    p = torch.rand(4, 7, dtype=torch.float64, generator=g).softmax(-1)
    for _ in range(200):
        x = torch.multinomial(p[:3], 1, generator=g).squeeze(-1)
        assert rejection_sample(x, p, p[:3], g).num_accepted == 3


def test_output_distribution_is_target_distribution():
    """Draft x ~ q, run the sampler; the first emitted token must be distributed as p_0 and,
    given it, the second as p_1 when the first was accepted. Chi-square at alpha = 1e-6 per
    check (false-failure probability < 3e-6 for the three checks together)."""
    V, trials, alpha = 5, 20_000, 1e-6
    g = make_generator(123)
    p = (torch.randn(3, V, dtype=torch.float64, generator=g) * 1.5).softmax(-1)  # [K+1, V]
    q = (torch.randn(2, V, dtype=torch.float64, generator=g) * 1.5).softmax(-1)  # [K, V]
    first, pairs = torch.zeros(V), torch.zeros(V)
    for _ in range(trials):
        x = torch.multinomial(q, 1, generator=g).squeeze(-1)
        v = rejection_sample(x, p, q, g)
        first[v.tokens[0]] += 1
        if v.num_accepted >= 1:
            pairs[v.tokens[1]] += 1
    assert chisquare(first, p[0] * trials).pvalue > alpha
    assert chisquare(pairs, p[1] * pairs.sum()).pvalue > alpha
    # a deterministic drafter (q = None) keeps the same guarantee
    counts = torch.zeros(V)
    for _ in range(trials):
        counts[rejection_sample(torch.tensor([2]), p[:2], None, g).tokens[0]] += 1
    assert chisquare(counts, p[0] * trials).pvalue > alpha


def test_greedy_accept_is_the_samplers_at_temperature_zero():
    """greedy_accept (argmax only) returns what rejection_sample and recursive_rejection_sample
    return on one-hot p, on random trees and chains with ties in the logits and drafts that
    follow the argmax for a while."""
    from forerun.sampling import SamplingConfig, logits_to_probs
    from forerun.tree import TokenTree
    from forerun.verify import greedy_accept, recursive_rejection_sample

    rng = torch.Generator().manual_seed(3)
    greedy = SamplingConfig()
    for trial in range(300):
        n = int(torch.randint(0, 9, (), generator=rng))
        chain = trial % 2 == 0
        parents = list(range(-1, n - 1)) if chain else [
            int(torch.randint(-1, i, (), generator=rng)) for i in range(n)]
        tree = TokenTree.of(None if chain else parents, n)
        logits = torch.randint(0, 4, (n + 1, 6), generator=rng).float()  # ties are common
        best = logits.argmax(-1)
        # each node's token: its parent's row's argmax half the time, else any token
        tokens = torch.tensor([int(best[p + 1]) if torch.rand((), generator=rng) < 0.5
                               else int(torch.randint(0, 6, (), generator=rng))
                               for p in parents], dtype=torch.long)
        p = logits_to_probs(logits, greedy)
        fast = greedy_accept(tree, tokens, best)
        if chain:
            slow = rejection_sample(tokens, p, None, G)
        else:
            slow = recursive_rejection_sample(tree, tokens, p, None, G)
        assert (fast.tokens, fast.path) == (slow.tokens, slow.path), (parents, tokens, logits)
