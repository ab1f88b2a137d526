import pytest
import torch
from scipy.stats import chisquare
from test_lossless_sampling import ALPHA

from forerun.sampling import SamplingConfig, SamplingError, logits_to_probs, make_generator, sample

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0], dtype=torch.float64)


def test_greedy_is_one_hot_on_first_argmax():
    probs = logits_to_probs(torch.tensor([1.0, 3.0, 3.0, 0.0]), SamplingConfig())
    assert probs.tolist() == [0.0, 1.0, 0.0, 0.0]


def test_temperature_matches_softmax():
    probs = logits_to_probs(LOGITS, SamplingConfig(temperature=0.5))
    assert torch.allclose(probs, (LOGITS / 0.5).softmax(-1))


def test_top_k_keeps_k_tokens():
    probs = logits_to_probs(LOGITS, SamplingConfig(temperature=1.0, top_k=2))
    assert (probs > 0).tolist() == [True, True, False, False, False]
    assert probs.sum().item() == pytest.approx(1.0)


def test_top_p_keeps_smallest_set_reaching_p():
    full = LOGITS.softmax(-1)  # ~[0.55, 0.20, 0.12, 0.07, 0.03]
    probs = logits_to_probs(LOGITS, SamplingConfig(temperature=1.0, top_p=0.7))
    assert (probs > 0).tolist() == [True, True, False, False, False]
    assert torch.allclose(probs[:2], full[:2] / full[:2].sum())
    tiny = logits_to_probs(LOGITS, SamplingConfig(temperature=1.0, top_p=0.01))
    assert (tiny > 0).sum() == 1  # the top token always survives


def test_min_p_drops_tokens_below_fraction_of_max():
    probs = logits_to_probs(LOGITS, SamplingConfig(temperature=1.0, min_p=0.3))
    assert (probs > 0).tolist() == [True, True, False, False, False]


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(temperature=float("nan")),
                                    dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
                                    dict(min_p=1.0)])
def test_invalid_parameters_fail_clearly(kwargs):
    with pytest.raises(SamplingError, match="must be"):
        SamplingConfig(**kwargs)


def test_one_hot_rows_take_their_token_and_mixed_rows_still_sample():
    """The one-hot shortcut (greedy) returns the only token with mass; a batch with any
    non-one-hot row samples every row: zero-mass tokens are never drawn, frequencies match."""
    one_hot = torch.zeros(3, 6).index_fill_(1, torch.tensor([4]), 1.0)
    one_hot[1] = torch.nn.functional.one_hot(torch.tensor(2), 6)
    assert sample(one_hot, make_generator(0)).tolist() == [4, 2, 4]
    mixed = torch.tensor([[0.0, 0.25, 0.0, 0.75], [0.0, 0.0, 1.0, 0.0]]).repeat(2000, 1)
    drawn = sample(mixed, make_generator(3)).reshape(2000, 2)
    assert set(drawn[:, 0].tolist()) == {1, 3} and set(drawn[:, 1].tolist()) == {2}
    # P(|freq - 0.75| > 0.05) with n = 2000, sd 0.0097: ~2.6e-7
    assert abs((drawn[:, 0] == 3).double().mean().item() - 0.75) < 0.05


def test_inverse_cdf_draws_the_distribution_and_never_a_zero_mass_token():
    """sample() draws by inverse CDF: zero-mass tokens (first, last, between) are never drawn,
    unnormalised rows are fine, and the frequencies pass chi-square at the suite's ALPHA."""
    p = torch.tensor([0.0, 0.1, 0.0, 0.2, 0.3, 0.0, 0.4, 0.0])
    drawn = sample((p * 3).repeat(20000, 1), make_generator(11))
    assert drawn.shape == (20000,) and drawn.dtype == torch.int64
    counts = torch.bincount(drawn, minlength=8).double()
    assert counts[p == 0].sum() == 0
    assert chisquare(counts[p > 0].numpy(), (p[p > 0] * 20000).double().numpy()).pvalue > ALPHA


def test_seed_reproduces_samples():
    probs = logits_to_probs(LOGITS.repeat(50, 1), SamplingConfig(temperature=1.0))
    a = sample(probs, make_generator(7))
    b = sample(probs, make_generator(7))
    assert torch.equal(a, b) and a.shape == (50,)


def test_incremental_decoder_never_splits_a_character():
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    from forerun.models.tokenizer import IncrementalDecoder, TextTokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(BPE(vocab={t: i for i, t in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text_tok = TextTokenizer(tok, None, None, None, False, frozenset())
    text = "héllo 🤖 wörld"
    ids = text_tok.encode(text)  # one id per byte: multi-byte characters span several ids
    decoder = IncrementalDecoder(text_tok)
    deltas = [decoder.push([i]) for i in ids]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_tiny_temperature_is_near_greedy_not_nan():
    logits = torch.tensor([1.0, 3.0, 2.0, 3.0 - 1e-3])
    probs = logits_to_probs(logits, SamplingConfig(temperature=1e-300))
    assert torch.isfinite(probs).all()
    assert probs.argmax() == 1 and abs(float(probs.sum()) - 1) < 1e-6


def test_next_token_is_sample_of_logits_to_probs():
    from forerun.sampling import next_token

    logits = torch.tensor([1.0, 3.0, 3.0, -2.0])
    assert next_token(logits, SamplingConfig(), make_generator(0)) == 1  # first on ties
    cfg = SamplingConfig(temperature=0.8, top_k=3)
    draws = [next_token(logits, cfg, make_generator(s)) for s in range(20)]
    assert draws == [int(sample(logits_to_probs(logits, cfg), make_generator(s)))
                     for s in range(20)]
