"""Where a batch's time goes: the same prompts with 1 new token (prefill alone) and with 64,
plain batching on the bf16 default target, at batch 8, 16 and 32 (Spec-Bench sample)."""

import time

from forerun import Engine
from forerun.api import LoadConfig
from forerun.bench.workloads import sample_workloads
from forerun.propose import SpecConfig

PLAIN = SpecConfig("none")
e = Engine(draft=None, load=LoadConfig(dtype="bfloat16"), spec=PLAIN)
prompts = [list(p.messages) for p in sample_workloads(["spec_bench"], 6, 0)][:32]
for B in (8, 16, 32):
    lens = [len(e.tokenizer.encode_chat(p)) for p in prompts[:B]]
    t = time.perf_counter()
    e.generate_batch(prompts[:B], max_tokens=1, spec=PLAIN)
    pre = time.perf_counter() - t
    t = time.perf_counter()
    outs = e.generate_batch(prompts[:B], max_tokens=64, spec=PLAIN)
    full = time.perf_counter() - t
    n = sum(len(o.token_ids) for o in outs)
    print(f"batch {B}: prompt tokens {sum(lens)} (max {max(lens)}), prefill-only {pre:.1f} s, "
          f"full {full:.1f} s, {n} tokens, decode share {(full - pre) / full:.2f}, "
          f"decode tok/s {n / (full - pre):.1f}", flush=True)
