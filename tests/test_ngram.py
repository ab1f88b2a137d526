import numpy as np

from forerun.propose.ngram import NgramProposer, find_continuation
from forerun.sampling import SamplingConfig, make_generator


def cont(tokens, k=3, min_n=1, max_n=3):
    return find_continuation(np.array(tokens), k, min_n, max_n).tolist()


def test_longest_suffix_wins():
    # suffix [1, 2] occurred at 0 (followed by 3); suffix [2] alone last occurred at 5 (-> 9)
    assert cont([1, 2, 3, 4, 5, 2, 9, 1, 2]) == [3, 4, 5]


def test_latest_occurrence_wins():
    assert cont([7, 1, 7, 2, 7], k=1) == [2]


def test_continuation_is_cut_at_k_and_at_the_end():
    assert cont([5, 6, 7, 5, 6], k=10) == [7, 5, 6]
    assert cont([5, 6, 7, 5, 6], k=2) == [7, 5]


def test_no_match_proposes_nothing():
    assert cont([1, 2, 3, 4]) == []
    assert cont([1]) == []
    assert cont([1, 2, 3, 1], min_n=2) == []


def test_proposer_returns_deterministic_draft():
    d = NgramProposer(1, 3).propose([4, 5, 6, 4, 5], 2, SamplingConfig(), make_generator(0))
    assert d.tokens.tolist() == [6, 4] and d.q is None


def test_suffix_index_answers_find_match_step_after_step():
    """SuffixIndex, fed a sequence growing by 1-5 tokens a step (and once a different one),
    gives find_match's continuation and suffix length at every step."""
    from forerun.propose.ngram import SuffixIndex, find_match

    rng = np.random.default_rng(0)
    for min_n, max_n, vocab in ((1, 4, 6), (2, 3, 4), (1, 8, 3)):
        index = SuffixIndex(min_n, max_n)
        for _ in range(2):  # the second sequence is not an extension of the first
            tokens = rng.integers(0, vocab, 3).tolist()
            while len(tokens) < 120:
                k = int(rng.integers(0, 9))
                found, n = find_match(np.asarray(tokens), k, min_n, max_n)
                assert index.match(tokens, k) == (found.tolist(), n), tokens
                tokens = tokens + rng.integers(0, vocab, int(rng.integers(1, 6))).tolist()
