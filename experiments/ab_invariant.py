"""A/B in one process: plain batching of 8 and 16 Spec-Bench prompts and one prompt alone, the
torch bf16 target with row-invariant kernels off and on (toggled on the same loaded model),
alternating, 3 rounds; total tok/s per run."""
import statistics
import time

from forerun import Engine
from forerun.api import LoadConfig
from forerun.bench.workloads import sample_workloads
from forerun.propose import SpecConfig

e = Engine(draft=None, load=LoadConfig(dtype="bfloat16"), spec=SpecConfig("none"))
prompts = [list(p.messages) for p in sample_workloads(["spec_bench"], 6, 0)][:16]
res = {}
for rnd in range(3):
    for inv in (False, True):
        e.target.set_invariant(inv)
        for B in (1, 8, 16):
            t = time.perf_counter()
            outs = e.generate_batch(prompts[:B], max_tokens=64, spec=SpecConfig("none"))
            wall = time.perf_counter() - t
            n = sum(len(o.token_ids) for o in outs)
            res.setdefault((inv, B), []).append(n / wall)
            res.setdefault(("ids", inv, B), []).append([o.token_ids for o in outs])
            print(rnd, "invariant" if inv else "default", B, f"{n / wall:.2f} tok/s", flush=True)
for B in (1, 8, 16):
    off, on = statistics.median(res[(False, B)]), statistics.median(res[(True, B)])
    same = sum(a == b for a, b in zip(res[("ids", False, B)][0], res[("ids", True, B)][0],
                                      strict=True))
    print(f"batch {B}: default {off:.2f}, invariant {on:.2f} tok/s (median of 3), "
          f"ratio {on / off:.3f}; outputs equal between the two: {same}/{B}")
