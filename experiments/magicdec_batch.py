"""MagicDec in a batch: N concurrent long-context requests through the batching session
(`forerun.batch_session.BatchSession`, what `forerun serve` drives), plain against the draft
model over its full cache (`draft`) and over a sparse one (`magicdec`: sinks + window).

Each method decodes the same N prompts (the long_context workload's rows of --context, cycled
to N; greedy, the chat template, no stop token: every member emits --max-tokens) in one
session of N live members, one method after another in this process. The target prefills each
distinct prompt once (the session's prefix cache; the members sharing it load its KV), the
drafter every member's. The figures are of the decode phase: from the pass where the last
member emitted its second token (every prompt is in the target's cache by then, and in the
drafter's: its first round feeds it the prompt) to the end: total tok/s over every member,
acceptance, mean accepted length (1 + accepted tokens a verify pass), and the shared drafter's
time per drafted token in that phase. "prefill s" is what comes before (the target's prompts,
the drafter's catch-up, the first verify pass). Members finish at different passes, so the
phase ends with fewer than N live.
Prints a table, writes JSON; where a member's output parts from plain's, where and plain's
logit margin there (a near-tie of bf16 rounding, or a bug).

    flock /tmp/forerun-bench.lock python experiments/magicdec_batch.py --context ctx_4k \
        --batch 8 --max-tokens 32 --threads 1 --out out/magicdec_batch.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from forerun import Engine, LoadConfig
from forerun.batch_session import BatchSession
from forerun.bench.long_context import prompt_text, rows
from forerun.models.load import open_model
from forerun.propose import SpecConfig
from forerun.propose.draft_batch import SharedDraftModel
from forerun.reference import divergence
from forerun.sampling import SamplingConfig

ROOM = 64  # cache slots past the longest prompt + output
KV_BUDGET = 4 << 30  # bytes of the target's KV pool: N members of 8k fit
PREFIX_BYTES = 1 << 30  # the target's prefix cache: members sharing a prompt prefill it once


class DraftClock:
    """Seconds the batch's shared drafters spend in propose, from when `start` is set."""

    def __init__(self):
        self.seconds, self.on = 0.0, False
        inner = SharedDraftModel.propose

        def timed(group, requests):
            t = time.perf_counter()
            out = inner(group, requests)
            if self.on:
                self.seconds += time.perf_counter() - t
            return out

        SharedDraftModel.propose = timed


def run(engine: Engine, prompts: list[list[int]], spec: SpecConfig, max_new: int,
        clock: DraftClock, kv_budget: int = KV_BUDGET) -> dict:
    session = BatchSession(engine, kv_budget, max_batch=len(prompts),
                           prefix_cache_bytes=PREFIX_BYTES)
    seqs = [session.sequence(ids, SamplingConfig(), max_new, spec) for ids in prompts]
    clock.seconds, clock.on = 0.0, False
    start, decode_from = time.perf_counter(), None
    first = {}  # one member a distinct prompt, prefilled first: the rest load it from the cache
    for seq in seqs:
        first.setdefault(tuple(seq.prompt), seq)
    for seq in first.values():
        session.add(seq)
    while not all(seq.steps for seq in first.values()):
        session.step()
    for seq in seqs:
        if seq not in first.values():
            session.add(seq)
    while not session.idle:
        session.step()
        if decode_from is None and all(len(seq.steps) >= 2 for seq in seqs):
            decode_from, clock.on = time.perf_counter(), True
    end = time.perf_counter()
    clock.on = False
    assert all(seq.error is None for seq in seqs), [seq.error for seq in seqs]
    later = [st for seq in seqs for st in seq.steps if st.time > decode_from]
    emitted = sum(len(st.tokens) for st in later)
    drafted, accepted = sum(st.drafted for st in later), sum(st.accepted for st in later)
    return {"tokens": [[t for st in seq.steps for t in st.tokens] for seq in seqs],
            "prefill_s": decode_from - start, "decode_s": end - decode_from,
            "decode_tok_s": emitted / (end - decode_from),
            "acceptance": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": 1 + accepted / max(sum(st.drafted > 0 for st in later), 1),
            "draft_s_per_token": clock.seconds / drafted if drafted else 0.0}


def diverged(engine: Engine, prompts: list[list[int]], plain: list[list[int]],
             other: list[list[int]], most: int = 4) -> list[dict]:
    """The first `most` members whose output parts from plain batching's: where, and plain's
    logit margin there, replayed on the target alone (`forerun.reference.divergence`)."""
    out = []
    for member, (ids, want, got) in enumerate(zip(prompts, plain, other, strict=True)):
        if want != got and len(out) < most:
            out.append({"member": member, **divergence(engine.target, ids, want, got)})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--context", default="ctx_4k", help="the long_context category")
    p.add_argument("--batch", type=int, default=8, help="concurrent members")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--methods", default="none,draft,magicdec",
                   help="of none, draft, magicdec (the draft model drafting) and magicdec-self "
                        "(the target drafting over its own cache)")
    p.add_argument("--kv-gb", type=float, default=KV_BUDGET / 2**30,
                   help="the target's KV pool, GiB (32 members of 8k need ~8)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (0: torch's default; 1 survives other jobs' bursts)")
    p.add_argument("--out", default="out/magicdec_batch.json")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    chosen = rows([args.context])
    tokenizer = open_model(args.target).tokenizer
    distinct = [tokenizer.encode_chat([{"role": "user", "content": prompt_text(r)}])
                for r in chosen]
    prompts = [distinct[i % len(distinct)] for i in range(args.batch)]
    context = max(len(ids) for ids in prompts) + args.max_tokens + ROOM
    engine = Engine(args.target, args.draft, spec=SpecConfig("draft"),
                    load=LoadConfig(args.dtype, context=context))
    specs = {"none": SpecConfig("none"), "draft": SpecConfig("draft", args.k),
             "magicdec": SpecConfig("magicdec", args.k, magicdec_sinks=args.sinks,
                                    magicdec_window=args.window),
             "magicdec-self": SpecConfig("magicdec", args.k, magicdec_sinks=args.sinks,
                                         magicdec_window=args.window, magicdec_drafter="self")}
    clock, results, by = DraftClock(), [], {}
    print(f"{args.batch} members, contexts {sorted({len(i) for i in prompts})} tokens")
    print(f"{'method':13} {'tok/s':>6} {'x plain':>7} {'x draft':>7} {'accept':>6} {'MAL':>5} "
          f"{'draft ms/tok':>12} {'prefill s':>9} {'same':>4}")
    for name in args.methods.split(","):
        by[name] = r = run(engine, prompts, specs[name], args.max_tokens, clock,
                           int(args.kv_gb * 2**30))
        plain, draft = by.get("none"), by.get("draft")
        r.update(method=name, batch=args.batch, context=args.context,
                 speedup=r["decode_tok_s"] / plain["decode_tok_s"] if plain else None,
                 vs_draft=r["decode_tok_s"] / draft["decode_tok_s"] if draft else None,
                 identical=plain is None or r["tokens"] == plain["tokens"])
        if not r["identical"]:  # where each differing member parted, plain's margin there
            r["diverged"] = diverged(engine, prompts, plain["tokens"], r["tokens"])
        print(f"{name:13} {r['decode_tok_s']:6.2f} {r['speedup'] or 0:7.2f} "
              f"{r['vs_draft'] or 0:7.2f} {r['acceptance']:6.2f} "
              f"{r['mean_accepted_length']:5.2f} {1000 * r['draft_s_per_token']:12.1f} "
              f"{r['prefill_s']:9.1f} {'yes' if r['identical'] else 'NO':>4}", flush=True)
        for d in r.get("diverged", []):
            print(f"  member {d['member']}: token {d['at']}, plain {d['plain']} vs "
                  f"{d['speculative']}, plain's logit margin {d['logit_gap']}", flush=True)
        results.append({k: v for k, v in r.items() if k != "tokens"})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    print(f"-> {out}")


if __name__ == "__main__":
    main()
