"""QSpec on real weights: each low-precision self-draft against plain decoding of the same target,
in one process, on the same prompts; plus what a draft step costs beside a target pass, and the
memory the draft adds.

For each prompt (the bench's seeded sample: Spec-Bench one per category, three EditEval), in
a round: plain
decoding, then every variant, greedy, `--max-tokens` new tokens; a run's tok/s is new tokens
over wall time (prefill included), `decode tok/s` excludes the first token. Acceptance, mean
accepted length (bonus included) and whether the output equals plain's come from the engine's
stats. Then the draft's and the target's one-token passes after CONTEXT cached tokens,
alternating, median of REPS (the cost a draft step adds, as a fraction of a target pass), and
the process's resident memory before and after the draft's weights were built. Each variant
first runs once untimed (a warm-up, as `forerun bench`'s: the cost policy calibrates there).
Where an output parts from plain's, plain's logit margin there is recorded (`divergence`:
a near-tie of the runtime's batch-shape rounding, or a bug).

    flock /tmp/forerun-bench.lock python experiments/qspec_bench.py --runtime torch \
        --dtype bfloat16 --variants llama.cpp,torch-int8 --out out/qspec_torch.json
    flock /tmp/forerun-bench.lock python experiments/qspec_bench.py --runtime llama.cpp \
        --variants Q4_0,Q3_K,Q2_K --out out/qspec_llama.json

Variants: `llama.cpp` (the target's GGUF on llama.cpp, as it is), `llama.cpp-Q2_K` (requantized
first), `torch-int8`, `torch-w8a8`, `torch-int4` (torch targets); `Q4_0`, `Q3_K`, `Q2_K`
(llama.cpp targets: the file requantized); `draft` (the draft model of `--draft`, the
draft-model method, for comparison in the same run); `NAME@K` drafts K tokens a step instead
of `--k`; `NAME:cost` runs it under the cost length policy (k = its K at most).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from forerun import Engine, LoadConfig
from forerun.bench.workloads import sample_workloads
from forerun.propose import PROPOSERS, SpecConfig
from forerun.reference import divergence

CONTEXT = 200  # cached tokens before the timed one-token passes (as `forerun bench curve`)
REPS = 20
TORCH_FORMS = {"torch-int8": (8, 16), "torch-w8a8": (8, 8), "torch-int4": (4, 16)}


def variant_spec(variant: str, k: int) -> SpecConfig:
    """`NAME[@K][:cost]` (K its draft length, default `k`; the cost length policy, K its cap)."""
    name, _, policy = variant.partition(":")
    name, _, own_k = name.partition("@")
    return replace(_spec(name, int(own_k) if own_k else k), policy=policy or "fixed")


def _spec(name: str, k: int) -> SpecConfig:
    if name == "draft":
        return SpecConfig("draft", k)
    if name in TORCH_FORMS:
        bits, act = TORCH_FORMS[name]
        return SpecConfig("qspec", k, qspec_runtime="torch", qspec_bits=bits,
                          qspec_activations=act)
    if name.startswith("llama.cpp"):
        qtype = name.partition("-")[2] or None
        return SpecConfig("qspec", k, qspec_runtime="llama.cpp", qspec_type=qtype)
    return SpecConfig("qspec", k, qspec_runtime="llama.cpp", qspec_type=name)


def target_copy(name: str, ftype: str, directory: Path) -> str:
    """The target's GGUF re-expressed in llama.cpp's `ftype` (e.g. Q8_0: a higher-precision
    file for a llama.cpp target whose requantized copies then draft), made once in
    `directory`."""
    import ctypes

    from llama_cpp import llama_cpp as C

    from forerun.models.load import open_model
    from forerun.runtime.llama_cpp import init_backend, physical_cores

    source = open_model(name).path
    path = directory / f"{source.stem}-{ftype}.gguf"
    if not path.is_file():
        init_backend()
        params = C.llama_model_quantize_default_params()
        params.ftype = getattr(C, f"LLAMA_FTYPE_MOSTLY_{ftype}")
        params.allow_requantize, params.nthread = True, physical_cores()
        directory.mkdir(parents=True, exist_ok=True)
        if C.llama_model_quantize(str(source).encode(), str(path).encode(),
                                  ctypes.byref(params)) != 0:
            raise SystemExit(f"could not requantize {source} to {ftype}")
    return str(path)


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def one_token_seconds(runtime, token: int) -> float:
    runtime.truncate(CONTEXT)
    start = time.perf_counter()
    runtime.forward(torch.tensor([token]), last_only=True)
    return time.perf_counter() - start


def step_costs(target, draft) -> dict:
    ids = torch.arange(1000, 1000 + CONTEXT)
    for rt in (target, draft):
        rt.truncate(0)
        rt.forward(ids, last_only=True)
    times = {"target": [], "draft": []}
    for i in range(REPS + 3):  # alternating, so drift hits both; the first 3 warm up
        for name, rt in (("target", target), ("draft", draft)):
            seconds = one_token_seconds(rt, 2000 + i)
            if i >= 3:
                times[name].append(seconds)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return {"target_ms": round(1e3 * med["target"], 2), "draft_ms": round(1e3 * med["draft"], 2),
            "cost": round(med["draft"] / med["target"], 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--runtime", default="torch")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--variants", default="llama.cpp,torch-int8")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--draft", default=None,
                   help="the draft model a `draft` variant drafts with (e.g. "
                        "qwen2.5-coder-0.5b-instruct)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--workload", action="append", default=None,
                   help="as forerun bench's (default: spec_bench:1 and editeval:3)")
    p.add_argument("--target-type", default=None, metavar="FTYPE",
                   help="run the target re-expressed in this llama.cpp type (Q8_0: a "
                        "higher-precision llama.cpp target), made once beside --out")
    p.add_argument("--out", default="out/qspec.json")
    args = p.parse_args()
    variants = args.variants.split(",")
    target = (target_copy(args.target, args.target_type, Path(args.out).parent / "targets")
              if args.target_type else args.target)
    engine = Engine(target, args.draft, spec=SpecConfig("draft" if args.draft else "none"),
                    load=LoadConfig(args.dtype, runtime=args.runtime))
    memory, costs = {}, {}
    for name in dict.fromkeys(v.partition(":")[0].partition("@")[0] for v in variants):
        before = rss_bytes()  # each draft once
        start = time.perf_counter()
        spec = variant_spec(name, args.k)
        proposer = PROPOSERS[spec.method](spec, engine.proposers)
        memory[name] = {"rss_added_mb": round((rss_bytes() - before) / 2**20),
                        "build_s": round(time.perf_counter() - start, 1)}
        costs[name] = step_costs(engine.target, proposer.runtime)
        print(name, memory[name], costs[name], flush=True)
    for name in variants:  # untimed warm-up, as forerun bench's: the cost policy calibrates here
        engine.generate("Say hi.", max_tokens=8, spec=variant_spec(name, args.k))
    runs = []
    for prompt in sample_workloads(args.workload or ["spec_bench:1", "editeval:3"], None, 0):
        ids = engine.tokenizer.encode_chat(list(prompt.messages))
        plain = engine.generate(ids, max_tokens=args.max_tokens, spec=SpecConfig("none"))
        row = {"id": prompt.id, "category": prompt.category, "prompt_tokens": len(ids),
               "plain": {"tok_s": plain.stats.tokens_per_s, "wall_s": plain.stats.wall_s,
                         "ttft_s": plain.stats.ttft_s, "tokens": plain.stats.new_tokens}}
        for name in variants:
            out = engine.generate(ids, max_tokens=args.max_tokens,
                                  spec=variant_spec(name, args.k))
            s = out.stats
            row[name] = {"tok_s": s.tokens_per_s, "wall_s": s.wall_s, "ttft_s": s.ttft_s,
                         "speedup": plain.stats.wall_s / s.wall_s * s.new_tokens
                         / plain.stats.new_tokens,
                         "decode_speedup": (plain.stats.wall_s - plain.stats.ttft_s)
                         / max(1, plain.stats.new_tokens - 1)
                         / ((s.wall_s - s.ttft_s) / max(1, s.new_tokens - 1)),
                         "acceptance": s.acceptance_rate, "accepted_len": s.mean_accepted_length,
                         "same_as_plain": out.token_ids == plain.token_ids,
                         "divergence": divergence(engine.target, ids, plain.token_ids,
                                                  out.token_ids)}
        print(json.dumps(row), flush=True)
        runs.append(row)
    record = {"args": vars(args), "threads": torch.get_num_threads(), "memory": memory,
              "step_costs": costs, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
