"""How much of the full-cache drafter's agreement a sparse (sinks + window) drafter keeps, on
long-context prompts: teacher-forced top-1 agreement with the target's greedy continuation.

For each prompt: the target's greedy continuation (--max-tokens); then, over prompt +
continuation in one teacher-forced pass each, the fraction of continuation tokens the drafter's
argmax predicts, for
- `dense`: the draft model over its full cache (the `draft` method's drafter);
- `sparse W`: the draft model through the streaming view for the whole sequence, prompt
  included (what `magicdec` runs: the prompt's keys above layer 0 come from windowed
  attention too);
- `dense-kv W`: the draft model's prompt keys from a full pass, the continuation's rows
  attending to sinks + window over them (MagicDec's paper: a full prefill, then a sparse
  decode);
- `self W`: the same for the target's own weights over its full prompt cache (magicdec's
  `self` drafter over the target's cache).
Chain acceptance at k follows from these only roughly (rejections end a chain).

    flock /tmp/forerun-bench.lock python experiments/magicdec_window_agreement.py \
        --contexts ctx_4k --windows 64,256,1024,2048 --out out/magicdec_window_agreement.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from forerun import Engine, LoadConfig
from forerun.bench.long_context import prompt_text, rows
from forerun.models.load import open_model
from forerun.propose import SpecConfig
from forerun.runtime.batch import BatchTorchRuntime, PackedBatch
from forerun.runtime.streaming import StreamingRuntime
from forerun.runtime.streaming_batch import StreamingBatchRuntime

SINKS = 4
ROOM = 64


def agreement(logits: torch.Tensor, want: list[int]) -> float:
    """logits [N, V] predicting want [N] -> the fraction of argmax hits."""
    got = logits.float().argmax(-1).tolist()
    return sum(a == b for a, b in zip(got, want, strict=True)) / len(want)


def dense_kv(runtime, full: torch.Tensor, prompt: int, windows: list[int]) -> dict[int, float]:
    """The prompt's keys from a full pass, the continuation's rows over sinks + window."""
    dense = BatchTorchRuntime(runtime, 4 << 30)
    seq = dense.add(full.shape[0] + 8)
    dense.forward(PackedBatch.of([(seq, full[:prompt - 1])], last_only=True))
    want = full[prompt:].tolist()
    out = {}
    for w in windows:
        view = StreamingBatchRuntime(dense, SINKS, w)
        logits = view.forward(PackedBatch.of([(seq, full[prompt - 1:-1])])).logits
        out[w] = agreement(logits, want)
        dense.truncate(seq, prompt - 1)
    dense.release(seq)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--contexts", default="ctx_4k")
    p.add_argument("--limit", type=int, default=3, help="prompts a context")
    p.add_argument("--windows", default="64,256,1024,2048")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", default="out/magicdec_window_agreement.json")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    windows = [int(w) for w in args.windows.split(",")]
    tokenizer = open_model(args.target).tokenizer
    chosen = [r for c in args.contexts.split(",") for r in rows([c])[:args.limit]]
    prompts = [tokenizer.encode_chat([{"role": "user", "content": prompt_text(r)}])
               for r in chosen]
    engine = Engine(args.target, args.draft, spec=SpecConfig("draft"),
                    load=LoadConfig(args.dtype, context=max(map(len, prompts)) + args.max_tokens
                                    + ROOM))
    results = []
    print(f"{'prompt':24} {'tokens':>6} {'drafter':12} " + " ".join(f"{w:>6}" for w in windows))
    for row, ids in zip(chosen, prompts, strict=True):
        cont = engine.generate(ids, max_tokens=args.max_tokens, spec=SpecConfig("none")).token_ids
        full, n = torch.tensor(ids + cont), len(ids)
        want = list(cont)
        draft = engine.draft
        draft.truncate(0)
        full_agree = agreement(draft.forward(full[:-1]).logits[n - 1:], want)
        draft.truncate(0)
        sparse = {w: agreement(StreamingRuntime(draft, SINKS, w).forward(full[:-1]).logits[n - 1:],
                               want) for w in windows}
        r = {"id": row["id"], "tokens": n, "dense": full_agree, "sparse": sparse,
             "dense_kv": dense_kv(draft, full, n, windows),
             "self": dense_kv(engine.target, full, n, windows)}
        results.append(r)
        print(f"{row['id']:24} {n:6} {'dense':12} {full_agree:6.3f} (any window)")
        for name in ("sparse", "dense_kv", "self"):
            print(f"{'':24} {'':6} {name:12} " + " ".join(f"{r[name][w]:6.3f}" for w in windows),
                  flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    print(f"-> {out}")


if __name__ == "__main__":
    main()
