"""Time one drafting step of B EAGLE members: SharedEagle (one layer call a level for all) vs
each member's own propose, random heads at the default target's shapes (Qwen2.5-1.5B: D=1536,
12 query / 2 KV heads, FFN 8960, draft vocab 32k), chains of k=4, int8 drafting precision."""
import statistics
import time

import torch

from forerun.heads import HeadConfig, Heads, TargetIO
from forerun.propose.base import DraftRequest
from forerun.propose.eagle import EagleProposer, SharedEagle
from forerun.sampling import SamplingConfig

torch.manual_seed(0)
D, V, N = 1536, 151936, 32768
cfg = HeadConfig("eagle", dim=D, vocab_size=V, num_heads=1, layers=(-1,), draft_vocab=N,
                 n_heads=12, n_kv_heads=2, ffn_dim=8960)
io = TargetIO(torch.randn(V, D) * 0.02, torch.randn(V, D) * 0.02)
heads = Heads(cfg, torch.arange(N), io, context=1024)
with torch.no_grad():
    for p in heads.parameters():
        p.normal_(0, 0.02)
heads = heads.eval().for_drafting("int8")
greedy, gen = SamplingConfig(temperature=0), torch.Generator()
def members(B, shared):
    ps = []
    for b in range(B):
        p = EagleProposer(heads, 600, group=shared)
        prompt = list(range(100 + b, 140 + b))
        p.prefill(prompt)
        p.feed({-1: torch.randn(len(prompt), D)})
        ps.append((p, [*prompt, 7]))
    return ps
def step(ps, shared):
    # a decode step: the pending token's feature comes in, then a draft of 4
    for p, toks in ps:
        p.commit(len(toks) - 1)
    reqs = [DraftRequest(p, toks, 4, greedy, gen) for p, toks in ps]
    t = time.perf_counter()
    if shared is not None:
        shared.propose(reqs)
    else:
        for r in reqs:
            r.proposer.propose(r.tokens, r.k, r.sampling, r.generator)
    return time.perf_counter() - t
torch.set_num_threads(2)
for B in (1, 4, 8, 16):
    out = {}
    for mode in ("alone", "shared"):
        shared = SharedEagle(heads) if mode == "shared" else None
        ps = members(B, shared)
        times = []
        for _ in range(8):
            for p, toks in ps:
                p.feed({-1: torch.randn(1, D)})
                toks.append(9)
            times.append(step(ps, shared))
        out[mode] = statistics.median(times[2:])
    print(f"B={B:2d}  alone {out['alone']*1e3:7.1f} ms  shared {out['shared']*1e3:7.1f} ms  "
          f"ratio {out['alone']/out['shared']:.2f}x", flush=True)
