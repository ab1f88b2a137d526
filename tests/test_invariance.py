"""Row-invariant kernels (the torch runtime on the CPU, prepacked float32 and bfloat16): a
token's logits are the same bits whether its pass decodes one token, verifies a draft of
several, or carries other sequences' rows in a batch; the kernels without the padding do
differ (so the test can fail). Random weights of a shape big enough for oneDNN's one-row and
many-row kernels to differ (the tiny test models' 32 dims do not)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from forerun.runtime.batch import BatchTorchRuntime, PackedBatch
from forerun.runtime.torch_model import TorchRuntime, can_prepack

SHAPE = dict(vocab=2048, dim=512, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=1536)
DTYPES = [d for d in (torch.float32, torch.bfloat16) if can_prepack(d, torch.device("cpu"))]


def _runtime(dtype, invariant, capacity=128):
    vocab = SHAPE["vocab"]
    model = tiny_model(0, **{k: v for k, v in SHAPE.items() if k != "vocab"}, vocab=vocab)
    return TorchRuntime(model.to(dtype), capacity=capacity, invariant=invariant)


def _decode_vs_verify(rt, prompt, draft):
    """Logits of each draft token's position: one token a pass, then all in one pass."""
    rt.truncate(0)
    rt.forward(prompt, last_only=True)
    one = torch.cat([rt.forward(draft[i:i + 1]).logits for i in range(len(draft))])
    rt.truncate(len(prompt))
    many = rt.forward(draft).logits
    return one, many


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_verify_and_batch_rows_are_the_same_bits(dtype):
    g = torch.Generator().manual_seed(0)
    prompt, draft = torch.randint(0, 2048, (40,), generator=g), torch.randint(0, 2048, (5,),
                                                                              generator=g)
    rt = _runtime(dtype, invariant=True)
    one, many = _decode_vs_verify(rt, prompt, draft)
    assert torch.equal(one, many)
    batched = BatchTorchRuntime(rt, 1 << 24)
    others = [(batched.add(80), torch.randint(0, 2048, (n,), generator=g)) for n in (7, 23, 1)]
    mine = batched.add(80)
    batched.forward(PackedBatch.of([*others, (mine, prompt)], last_only=True))
    feeds = [(s, torch.randint(0, 2048, (n,), generator=g)) for (s, _), n in zip(others, (3, 1, 6),
                                                                              strict=True)]
    out = batched.forward(PackedBatch.of([feeds[0], (mine, draft), *feeds[1:]])).logits
    assert torch.equal(out[3:8], many)


@pytest.mark.parametrize("dtype", DTYPES[:1])  # float32: at this shape bfloat16 logits round
def test_without_padding_the_one_row_kernel_differs(dtype):  # the two kernels' sums alike
    g = torch.Generator().manual_seed(0)
    prompt, draft = torch.randint(0, 2048, (40,), generator=g), torch.randint(0, 2048, (5,),
                                                                              generator=g)
    one, many = _decode_vs_verify(_runtime(dtype, invariant=False), prompt, draft)
    assert not torch.equal(one, many)
    assert torch.allclose(one, many, atol=0.1, rtol=0)  # the same model, rounded otherwise
