"""Where an EAGLE draft's time goes on a GPU: one `propose` against its parts (the catch-up
step's replay, the tree growth's replay, both timed with CUDA events), and the growth's kernels
(its pass run eagerly under torch.profiler; a graph replays the same kernels). Random weights
of the default target's and the trained head's shapes (see scripts/gpu_check.py).

    python scripts/gpu_head_profile.py            # on a GPU
    python scripts/gpu_head_profile.py --device cpu --small   # a smoke test of the script
"""

from __future__ import annotations

import argparse
import statistics

import torch
from gpu_check import HEAD, SHAPES, SMALL, head_proposer, propose_ms, random_runtime

from forerun.sampling import make_generator


def event_ms(fn, reps: int = 50) -> float:
    """Median ms of fn() between CUDA events (device time, host waits excluded)."""
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--capacity", type=int, default=2048)
    args = ap.parse_args()
    import gpu_check
    if args.small:
        SHAPES.update(SMALL)
        HEAD.update(n_heads=4, ffn_dim=48)
        gpu_check.VOCAB = 512
    cuda = args.device == "cuda"
    target = random_runtime("target", torch.bfloat16, args.device, args.capacity, seed=0)
    prompt = [int(t) for t in torch.randint(gpu_check.VOCAB - 1, (200,),
                                            generator=make_generator(1))]
    for label, tree, k, topk in (("chain4", 0, 4, 1), ("tree8", 8, 4, 2), ("tree32", 32, 8, 4)):
        p = head_proposer("eagle", target, "bfloat16", tree, k, topk)
        if p.static is None:  # the CPU: static steps run eagerly
            p = head_proposer("eagle", target, "bfloat16", tree, k, topk)
        total = propose_ms(p, target, prompt, k)
        line = f"{label}: propose {total:.3f} ms"
        if cuda and p.static is not None:
            grow = next(g for key, g in p.static.tree._shaped.items()
                        if key[:3] == (k, topk, topk))
            step = next(s for key, s in p.static._sized.items() if key[0] == 1)
            print(line, flush=True)
            line = (f"  catch-up step replay {event_ms(step.graph.replay):.3f} ms, "
                     f"tree growth replay {event_ms(grow.graph.replay):.3f} ms")
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                with torch.inference_mode():
                    for _ in range(5):
                        grow.run()
                torch.cuda.synchronize()
            print(line)
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18,
                                            max_name_column_width=60))
        else:
            print(line)


if __name__ == "__main__":
    main()
