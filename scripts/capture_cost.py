"""What a CUDA graph's first use costs in the torch runtime (`forerun/runtime/static.py`), and
what crossing an attention span's boundary costs with `spans=True`. Random weights of the
default target's shape (as `scripts/gpu_check.py`); a GPU is needed for
graphs (on the CPU the passes run eagerly and the script only runs through).

`--rounds` times: a fresh runtime (the same weights, a cache and graphs of its own), a
200-token prompt, then the first pass of each padded size (capture and replay) and a second
one (replay only); the capture's cost is first - second (the first round pays the process's
one-time costs too: CUDA's lazy kernel loading, cuBLAS). Then plain decoding with attention
spans across a span boundary (slot 256): ms a step around it.

With `--first-reply {cold,warm}` it times instead, in a fresh process, a first reply's
decoding (plain, then the target drafting for itself with k=4; 64 tokens each after a
200-token prompt): cold, every size recorded at its first use inside the reply; warm, after
`TorchRuntime.warm_up()` (timed on its own), as `forerun serve` and `forerun bench` do.

    python scripts/capture_cost.py [--json out.json]
    python scripts/capture_cost.py --first-reply cold   # then --first-reply warm
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import gpu_check
import torch
from gpu_check import VOCAB, random_runtime

from forerun.reference import plain_decode
from forerun.runtime.torch_model import TorchRuntime
from forerun.sampling import SamplingConfig, make_generator

SIZES = (1, 2, 4, 8, 16)


def sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def first_uses(model, capacity: int, prompt: torch.Tensor, dev: str) -> dict:
    """A fresh runtime's first and second pass of each size, ms."""
    rt = TorchRuntime(model, capacity)
    rt.forward(prompt, last_only=True)
    ms = {}
    for B in SIZES:
        times = []
        for _ in range(2):
            rt.truncate(prompt.shape[0])
            sync(dev)
            start = time.perf_counter()
            rt.forward(torch.arange(3, 3 + B, device=dev))
            sync(dev)
            times.append((time.perf_counter() - start) * 1e3)
        ms[B] = times
    return ms


def span_steps(model, capacity: int, prompt: torch.Tensor, n: int) -> list[float]:
    """Plain greedy decoding with spans from a 200-token prompt over n tokens: ms each step."""
    rt = TorchRuntime(model, capacity, spans=True)
    times, last = [], time.perf_counter()
    for _ in plain_decode(rt, prompt.tolist(), SamplingConfig(), n, (), make_generator(0)):
        now = time.perf_counter()
        times.append((now - last) * 1e3)
        last = now
    return times


def first_reply(model, capacity: int, prompt: torch.Tensor, warm: bool, dev: str) -> dict:
    """ms of warm_up (if `warm`) and of a first plain and self-drafting reply, 64 tokens."""
    from forerun.engine import speculative_decode
    from forerun.policy import FixedK
    from forerun.propose.draft_model import DraftModelProposer

    rt, out = TorchRuntime(model, capacity), {}
    if warm:
        sync(dev)
        start = time.perf_counter()
        out["warm_up_sizes"] = rt.warm_up()
        sync(dev)
        out["warm_up_ms"] = (time.perf_counter() - start) * 1e3
    ids, gen = prompt.tolist(), make_generator(0)
    for name in ("plain", "self k=4"):
        rt.truncate(0)
        loop = (plain_decode(rt, ids, SamplingConfig(), 64, (), gen) if name == "plain" else
                speculative_decode(rt, DraftModelProposer(rt.fork(), VOCAB), FixedK(4), ids,
                                   SamplingConfig(), 64, (), gen))
        start = time.perf_counter()
        for _ in loop:
            pass
        out[f"{name} ms"] = (time.perf_counter() - start) * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="tiny shapes (to try the script)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--first-reply", choices=("cold", "warm"),
                    help="time a fresh process's first reply instead (see above)")
    args = ap.parse_args()
    dev, dtype = args.device, getattr(torch, args.dtype)
    if args.small:
        gpu_check.SHAPES.update(gpu_check.SMALL)
    target = random_runtime("target", dtype, dev, 2048, seed=0)
    prompt = torch.randint(VOCAB - 1, (200,), generator=make_generator(1)).to(dev)
    results: dict = {"device": torch.cuda.get_device_name() if dev == "cuda" else dev,
                     "capture_ms": {}}
    if args.first_reply:
        res = first_reply(target.model, 2048, prompt, args.first_reply == "warm", dev)
        print(f"first reply, {args.first_reply}:",
              ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                        for k, v in res.items()))
        return
    for _ in range(args.rounds):
        ms = first_uses(target.model, 2048, prompt, dev)
        for B, (first, second) in ms.items():
            results["capture_ms"].setdefault(B, []).append(first - second)
    print(f"{'round':>5} " + " ".join(f"{f'B={B}':>9}" for B in SIZES) + "   (capture, ms)")
    for r in range(args.rounds):
        print(f"{r + 1:5d} " + " ".join(f"{results['capture_ms'][B][r]:9.1f}" for B in SIZES))
    steps = span_steps(target.model, 2048, prompt, 96)
    results["span_steps_ms"] = steps
    around = steps[50:60]  # the prompt is 200 tokens: slot 256 is crossed at the 57th token
    print("spans, plain decoding: ms a step, tokens 51-60:", " ".join(f"{t:.1f}" for t in around),
          f"; median of all {statistics.median(steps[1:]):.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
