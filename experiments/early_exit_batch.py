"""Early exit in a batch: N EditEval prompts decoded together through the batching session
(`forerun.batch_session.BatchSession`), plain against early exit drafting in each member's
region of the target's pool (`shared`: its verify resumes the draft rows at layer E) and
against its earlier batch path (`own`: each member drafts over a cache of its own, the prompt
fed through E layers too, and its verify runs every layer).

Each cell decodes the same N prompts (the bench's seeded EditEval sample, the chat template,
greedy, no stop token: every member emits --max-tokens) in one session of N live members, one
cell after another in this process, plain first and last (the machine drifts). Reported: total
tok/s over every member's tokens (prefill included) and of the decode phase (from the pass
where every member has emitted its second token), acceptance, and whether every member's
tokens equal plain's. Prints a table, writes JSON.

    flock /tmp/forerun-bench.lock python experiments/early_exit_batch.py --batch 4 \
        --max-tokens 64 -k 1 --out out/early_exit_batch.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import forerun.batch_session as batch_session
from forerun import Engine, LoadConfig
from forerun.batch_session import BatchSession
from forerun.bench.workloads import sample_workloads
from forerun.propose import SpecConfig
from forerun.sampling import SamplingConfig

KV_BUDGET = 1 << 30  # bytes of the target's KV pool
ROOM = 64  # context past the longest prompt + output
OFF = "no-batch-target"  # a ProposerContext.batch key nobody reads: the own-cache path


def run(engine: Engine, prompts: list[list[int]], spec: SpecConfig, max_new: int,
        own: bool) -> dict:
    batch_session.BATCH_TARGET = OFF if own else "batch-target"  # (the session's key)
    session = BatchSession(engine, KV_BUDGET, max_batch=len(prompts))
    seqs = [session.sequence(ids, SamplingConfig(), max_new, spec) for ids in prompts]
    start, decode_from = time.perf_counter(), None
    for seq in seqs:
        session.add(seq)
    while not session.idle:
        session.step()
        if decode_from is None and all(len(seq.steps) >= 2 for seq in seqs):
            decode_from = time.perf_counter()
    end = time.perf_counter()
    assert all(seq.error is None for seq in seqs), [seq.error for seq in seqs]
    later = [st for seq in seqs for st in seq.steps if st.time > decode_from]
    drafted, accepted = sum(st.drafted for st in later), sum(st.accepted for st in later)
    total = sum(len(st.tokens) for seq in seqs for st in seq.steps)
    return {"tokens": [[t for st in seq.steps for t in st.tokens] for seq in seqs],
            "tok_s": total / (end - start), "prefill_s": decode_from - start,
            "decode_tok_s": sum(len(st.tokens) for st in later) / (end - decode_from),
            "acceptance": accepted / drafted if drafted else 0.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("-k", type=int, default=1)
    p.add_argument("--exit-layer", type=int, default=None, help="default: the method's (8/28)")
    p.add_argument("--cells", default="none,shared,own,none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", default="out/early_exit_batch.json")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    chosen = sample_workloads([f"editeval:{args.batch}"], None, args.seed)
    engine = Engine(args.target, None, spec=SpecConfig("none"),
                    load=LoadConfig(args.dtype, runtime="torch", context=4096))
    prompts = [engine.tokenizer.encode_chat(list(c.messages)) for c in chosen]
    assert max(map(len, prompts)) + args.max_tokens + ROOM <= 4096
    spec = SpecConfig("early-exit", args.k, exit_layer=args.exit_layer)
    results, plain = [], None
    print(f"{args.batch} members, prompts {sorted(map(len, prompts))} tokens, k={args.k}")
    print(f"{'cell':7} {'tok/s':>6} {'decode':>7} {'x plain':>7} {'accept':>6} "
          f"{'prefill s':>9} {'same':>4}")
    for cell in args.cells.split(","):
        r = run(engine, prompts, SpecConfig("none") if cell == "none" else spec,
                args.max_tokens, own=cell == "own")
        plain = plain or r
        r.update(cell=cell, speedup=r["decode_tok_s"] / plain["decode_tok_s"],
                 identical=r["tokens"] == plain["tokens"])
        print(f"{cell:7} {r['tok_s']:6.2f} {r['decode_tok_s']:7.2f} {r['speedup']:7.2f} "
              f"{r['acceptance']:6.2f} {r['prefill_s']:9.1f} "
              f"{'yes' if r['identical'] else 'NO':>4}", flush=True)
        results.append({k: v for k, v in r.items() if k != "tokens"})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    print(f"-> {out}")


if __name__ == "__main__":
    main()
