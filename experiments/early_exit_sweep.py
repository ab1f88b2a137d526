"""Which exit layer E? For each E: the early-exit draft's greedy acceptance (teacher-forced
top-1 agreement of its exit head with the target), its measured cost (one draft token over one
target pass), the cost of a verify pass that resumes its rows at E, and the expected speedup.

Loads the target (torch), answers CHAT prompts of the training package greedily (REPLY tokens,
the target's own text), then one target pass per text returns every E's layer-E states: the
exit head (`--adapter`: the adapters trained for each E where saved, else the identity) scores
them against the target's argmax. Costs: one-token passes of the draft and the target after
CONTEXT cached tokens, alternating, the median of REPS; the verify of k+1 rows with k resumed
against a full pass of k+1. Prints a table and writes JSON.

    flock /tmp/forerun-bench.lock python experiments/early_exit_sweep.py --layers 4,8,12,16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from forerun import Engine, LoadConfig
from forerun.propose import SpecConfig
from forerun.propose.early_exit import EarlyExitConfig
from forerun.reference import plain_decode
from forerun.runtime.early_exit import ExitAdapter, ExitDraft
from forerun.sampling import SamplingConfig, make_generator
from forerun.train import chat_prompts
from forerun.tune.layer_skip import best_k

CONTEXT = 200  # cached tokens before the timed passes (as `forerun bench curve`)
REPS = 20
VERIFY_K = 3  # the verify pass timed: pending + 3 drafted rows
MAX_K = 8


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layers", default="4,8,12,16")
    p.add_argument("--texts", type=int, default=8, help="chat prompts answered")
    p.add_argument("--first", type=int, default=0,
                   help="the first chat prompt used (`forerun train --chat 16` trains on the "
                        "first 16: --first 16 scores a trained adapter on others)")
    p.add_argument("--reply", type=int, default=48, help="greedy reply tokens each")
    p.add_argument("--adapter", choices=["saved", "none"], default="saved")
    p.add_argument("--vocab", type=int, default=0,
                   help="without a saved adapter: the exit head scores the N most frequent "
                        "tokens only (0 = all)")
    p.add_argument("--out", default="out/early_exit_sweep.json")
    args = p.parse_args()
    layers = [int(e) for e in args.layers.split(",")]
    engine = Engine(args.target, None, spec=SpecConfig("none"),
                    load=LoadConfig(args.dtype, runtime="torch"))
    target, tok = engine.target, engine.tokenizer
    adapters = {e: EarlyExitConfig(e, None if args.adapter == "saved" else "none"
                                   ).resolve_adapter(target, e) for e in layers}
    if args.vocab:  # untrained adapters scoring the tokenizer's most frequent tokens only
        vocab = torch.tensor(sorted(tok.frequent_ids(args.vocab)))
        adapters = {e: a or ExitAdapter(target.config.dim, vocab) for e, a in adapters.items()}
    drafts = {e: ExitDraft(target, e, adapters[e], shared=True) for e in layers}
    # 1. acceptance: the exit head's argmax against the target's on the target's own text
    agree = {e: [0, 0] for e in layers}
    for prompt in chat_prompts()[args.first:args.first + args.texts]:
        ids = tok.encode_prompt(prompt)
        reply = [t for s in plain_decode(target, ids, SamplingConfig(), args.reply,
                                         tok.stop_ids, make_generator(0)) for t in s.tokens]
        target.truncate(0)
        out = target.forward(torch.tensor([*ids, *reply]),
                             hidden_layers=tuple(e - 1 for e in layers))
        rows = slice(len(ids) - 1, len(ids) + len(reply) - 1)  # rows that predict the reply
        want = out.logits[rows].argmax(-1)
        for e in layers:
            got = drafts[e].exit_head(out.hidden[e - 1][rows]).argmax(-1).cpu()
            agree[e][0] += int((got == want).sum())
            agree[e][1] += len(want)
    # 2. cost: one draft token, one target token, a resumed and a full verify of k+1 rows
    context = torch.arange(1000, 1000 + CONTEXT)
    rows = torch.arange(3000, 3001 + VERIFY_K)  # [k+1]
    records = []
    for e in layers:
        draft = drafts[e]
        times: dict[str, list[float]] = {"draft": [], "target": [], "resumed": [], "full": []}
        target.truncate(0)
        target.forward(context, last_only=True)
        for i in range(REPS + 2):  # alternating, so drift hits all; the first 2 warm up
            draft.align(CONTEXT)
            t0 = time.perf_counter()
            for j in range(VERIFY_K):
                draft.forward(rows[j:j + 1], last_only=True)
            t1 = time.perf_counter()
            target.forward(rows, resume=draft.resume())  # rows 0..k-1 resumed, k in full
            t2 = time.perf_counter()
            target.truncate(CONTEXT)
            target.forward(rows)
            t3 = time.perf_counter()
            target.truncate(CONTEXT)
            target.forward(rows[:1], last_only=True)
            t4 = time.perf_counter()
            target.truncate(CONTEXT)
            t_draft, t_resumed, t_full, t_target = (t1 - t0) / VERIFY_K, t2 - t1, t3 - t2, t4 - t3
            if i >= 2:
                for name, t in (("draft", t_draft), ("target", t_target),
                                ("resumed", t_resumed), ("full", t_full)):
                    times[name].append(t)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        a = agree[e][0] / agree[e][1]
        cost = med["draft"] / med["target"]
        verify = med["resumed"] / med["target"]  # a resumed verify over one target pass
        k, speedup = best_k(a, cost, MAX_K, lambda n, r=verify: r)
        vocab_size = None if adapters[e] is None or adapters[e].vocab is None else len(
            adapters[e].vocab)
        records.append({"layer": e, "agreement": round(a, 3), "rows": agree[e][1],
                        "adapter": adapters[e] is not None and bool(adapters[e].weight.any()),
                        "vocab": vocab_size,
                        "draft_ms": round(1e3 * med["draft"], 2),
                        "target_ms": round(1e3 * med["target"], 2),
                        "draft_cost": round(cost, 3),
                        f"verify{VERIFY_K + 1}_resumed_ms": round(1e3 * med["resumed"], 2),
                        f"verify{VERIFY_K + 1}_full_ms": round(1e3 * med["full"], 2),
                        "best_k": k, "expected_speedup": round(speedup, 3)})
        print(json.dumps(records[-1]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"target": args.target, "dtype": args.dtype,
                                          "context": CONTEXT, "reps": REPS, "texts": args.texts,
                                          "first": args.first,
                                          "reply": args.reply, "threads": torch.get_num_threads(),
                                          "layers": records}, indent=1) + "\n")


if __name__ == "__main__":
    main()
