"""Tiny in-process random models (float64) for exact tests; real models live in test_real_models."""

from __future__ import annotations

import pytest
import torch

from forerun.runtime.base import ModelConfig
from forerun.runtime.torch_model import TorchRuntime, Transformer


def tiny_config(vocab: int = 64, arch: str = "qwen2", **overrides) -> ModelConfig:
    base = dict(arch=arch, vocab_size=vocab, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                ffn_dim=64, rope_theta=10000.0, norm_eps=1e-6, context_length=256,
                qkv_bias=arch == "qwen2", tied_embeddings=False)
    return ModelConfig(**{**base, **overrides})


def tiny_model(seed: int, vocab: int = 64, scale: float = 1.0, noise: float = 0.0,
               **overrides) -> Transformer:
    """A random model; `scale` sharpens (>1) or flattens (<1) its next-token distributions;
    `noise` > 0 perturbs it (a draft that agrees with the seed's model often, not always)."""
    torch.manual_seed(seed)
    model = Transformer(tiny_config(vocab, **overrides)).double().eval()
    with torch.no_grad():  # wide weights so that outputs depend on the context, not a copy
        for name, param in model.named_parameters():
            if name.endswith("weight") and param.dim() == 2:
                param.normal_(0, 2.0 / param.shape[1] ** 0.5)
        model.norm.mul_(scale)
        torch.manual_seed(seed + 1000)
        for param in model.parameters():
            param.add_(noise * torch.randn_like(param) * param.std())
    return model


def tiny_runtime(seed: int, vocab: int = 64, capacity: int = 256, **kw) -> TorchRuntime:
    """`kw` as for tiny_model (scale, noise) plus ModelConfig overrides."""
    return TorchRuntime(tiny_model(seed, vocab, **kw), capacity=capacity)


@pytest.fixture
def make_runtime():
    return tiny_runtime


def random_heads(kind: str, rt: TorchRuntime, seed: int = 0, scale: float = 0.3):
    """Randomly initialised heads of `kind` on a tiny target (equality tests need no training)."""
    from forerun.heads import HeadConfig, Heads, TargetIO

    vocab = rt.config.vocab_size
    cfg = HeadConfig(kind, dim=rt.config.dim, vocab_size=vocab, num_heads=3,
                     layers=(0, 1, -1) if kind == "eagle3" else (-1,), draft_vocab=0,
                     n_heads=4, n_kv_heads=2, ffn_dim=48)
    io = TargetIO(rt.model.embed.weight.detach(), rt.model.lm_weight().detach())
    heads = Heads(cfg, torch.arange(vocab), io, context=rt.capacity)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, scale)
    return heads.eval()


def heads_for(method: str, rt: TorchRuntime):
    """Random heads when `method` drafts with heads, else None."""
    from forerun.heads import KINDS

    return random_heads(method, rt) if method in KINDS else None


@pytest.fixture(autouse=True)
def _no_curve_cache_on_disk(monkeypatch):
    """Tests measure forward curves afresh and leave nothing in the user's model cache
    (test_llama_cpp's own test turns the disk cache on, in a temporary FORERUN_HOME)."""
    monkeypatch.setenv("FORERUN_CURVE_CACHE", "0")


# Synthetic forward-time curves (seconds per pass of n tokens): drafting pays on them wherever a
# test runs (the cost policy at its prior acceptance 0.5 drafts k = 2: 1.75 tokens / 1.3 s
# against plain's 1 / 1), where this machine's measured curve may price every draft out.
SYNTHETIC_VERIFY_FIRST, SYNTHETIC_VERIFY_PER_TOKEN = 1.0, 0.1
SYNTHETIC_DRAFT_TOKEN = 0.05


@pytest.fixture
def synthetic_curves(monkeypatch):
    """`price(target, drafter=None, per_token=...)`: the runtimes' calibration (the cost
    policy's, an automatic tree's) returns the synthetic curves above instead of timing passes
    (per_token = 0: a flat curve, as a GPU's, on which even random heads' trees pay); the
    decode loop's live correction still sees real passes. A runtime nobody priced fails."""
    import forerun.profile as profile
    from forerun.profile import ForwardCurve

    prices = {}

    def measure(runtime, sizes, **kwargs):
        first, per_token = prices[runtime]
        return ForwardCurve(tuple(sizes), tuple(first + per_token * (n - 1) for n in sizes))

    def price(target, drafter=None, per_token=SYNTHETIC_VERIFY_PER_TOKEN):
        prices[target] = (SYNTHETIC_VERIFY_FIRST, per_token)
        if drafter is not None:
            prices[drafter] = (SYNTHETIC_DRAFT_TOKEN, SYNTHETIC_DRAFT_TOKEN)

    monkeypatch.setattr(profile, "measure_forward_curve", measure)
    return price


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: tiny tensors gain nothing from a second one, and on a
    busy 2-core machine its spinning cost 20x the CPU time (the statistical tests here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
