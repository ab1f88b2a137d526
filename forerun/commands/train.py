"""`forerun train {medusa,hydra,eagle,eagle3}`: the command's flags, where data and heads go.

Owns: parsing and checking the training options, naming the data and output folders, and the
report it prints; collecting and training are `forerun.train`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

from forerun.api import Engine
from forerun.commands.options import add_model_args, load_config
from forerun.models.catalog import ModelError, forerun_home
from forerun.models.load import open_model, resolve_dtype, target_io
from forerun.propose import SpecConfig
from forerun.train import (
    CHAT_PROMPTS,
    TrainConfig,
    chat_prompts,
    collection_key,
    head_layers,
    manifest,
    sibling_collections,
    text_files,
    user_questions,
)
from forerun.train import (
    run as train_run,
)


def add_parser(sub) -> None:
    t = sub.add_parser(
        "train", help="train Medusa/Hydra/EAGLE heads on the target's own outputs",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Distil drafting heads from the target: collect its features and "
        "next-token distributions on its own chat replies and on the Python standard library's "
        "sources (resumable shards), train against them, and write head.safetensors + "
        "head_config.json (use them with --heads DIR --method KIND).")
    t.add_argument("kind", choices=["medusa", "hydra", "eagle", "eagle3"])
    t.add_argument("--max-tokens", type=int, default=TrainConfig.max_tokens,
                   help="data budget: target tokens to collect")
    t.add_argument("--seq-len", type=int, default=TrainConfig.seq_len, help="window length")
    t.add_argument("--chat", type=int, default=TrainConfig.chat,
                   help=f"chat questions the target answers first: {len(CHAT_PROMPTS)} "
                        "written, then ones generated from templates and the standard library "
                        "(390 with Python 3.11's)")
    t.add_argument("--chat-tokens", type=int, default=TrainConfig.chat_tokens,
                   help="greedy reply length per chat question")
    t.add_argument("--self-chat", type=int, default=TrainConfig.self_chat, metavar="N",
                   help="then N questions the target writes itself (Magpie: its chat template "
                        "opened at the user's turn, sampled at temperature 1, seeded), answered "
                        "the same way; kept in the data folder as self-questions.json")
    t.add_argument("--self-tasks", type=int, default=TrainConfig.self_tasks, metavar="N",
                   help="then N questions on passages the target writes itself (a news report, "
                        "an encyclopedia entry, a story, ...): summarize it, its main point, "
                        "its key facts, a headline, questions on it, a simpler rewrite; "
                        "answered the same way; kept as self-tasks.json")
    t.add_argument("--questions", action="append", default=[], metavar="JSONL",
                   help="then your own prompts, answered the same way: a JSONL file in any shape "
                        "`forerun bench --workload` reads ({\"prompt\": ...} rows, Spec-Bench "
                        "or EditEval rows); repeatable. Prompts like your traffic teach a head "
                        "what it will draft; the bench's own sets are refused")
    t.add_argument("--replies", choices=["auto", "torch", "llama.cpp"], default="auto",
                   help="runtime that generates the chat replies (features and distributions "
                        "come from --runtime); auto = llama.cpp for a GGUF target when "
                        "installed (several times faster here)")
    t.add_argument("--text", action="append", default=[], metavar="PATH",
                   help="your own plain-text files or folders (their *.txt, *.md, *.rst files), "
                        "teacher-forced after the chat replies, their windows alternating with "
                        "the standard library's; repeatable. Prose brings a head closer to chat "
                        "replies than code does, e.g. Debian's python3-doc: "
                        "/usr/share/doc/python3/html/_sources")
    t.add_argument("--steps", type=int, default=TrainConfig.steps,
                   help="training steps, one window each (cosine schedule over them)")
    t.add_argument("--epochs", type=float, default=TrainConfig.epochs, metavar="E",
                   help="in place of --steps: E passes over the training windows (however many "
                        "the collection holds); a head on ~1,100 windows gained ~0.04 held-out "
                        "top-1 going from 2 to 4")
    t.add_argument("--lr", type=float, default=TrainConfig.lr)
    t.add_argument("--ttt", type=int, default=TrainConfig.ttt,
                   help="eagle/eagle3: rolled-out steps trained on the head's own predictions")
    t.add_argument("--num-heads", type=int, default=4, help="medusa/hydra: heads (tokens deep)")
    t.add_argument("--ffn-dim", type=int, default=2048, help="eagle: MLP width of its layer")
    t.add_argument("--head-vocab", type=int, default=32768,
                   help="the heads' reduced vocabulary (most frequent ids; 0 = all)")
    t.add_argument("--out", default=None, help="output folder (default: next to the target "
                   "in the model cache: FORERUN_HOME/heads/TARGET/KIND, or KIND-llamacpp for "
                   "--runtime llama.cpp)")
    t.add_argument("--data", default=None, help="shard folder (default: FORERUN_HOME/"
                   "train-data/...); reused and extended when it exists")
    t.add_argument("--train-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="precision of the training matmuls (autocast; weights and optimizer stay "
                        "float32); auto = bfloat16 where the CPU has fast bf16 matmuls")
    t.add_argument("--json", action="store_true", help="print only the JSON report")
    add_model_args(t)
    t.set_defaults(func=run)


def run(args) -> int:
    load = load_config(args)
    if load.runtime != "torch" and args.kind == "eagle3":
        raise ModelError(f"eagle3 heads read middle layers, which only the torch runtime "
                         f"exposes; drop --runtime {load.runtime}")
    if not 0 <= args.chat <= len(chat_prompts()):
        raise ValueError(f"--chat must be 0..{len(chat_prompts())}")
    text = tuple(str(Path(t).expanduser().resolve()) for t in args.text)
    text_files(text)  # a wrong path fails here, before any model is loaded
    user_questions(tuple(args.questions))  # as does a wrong or benchmark questions file
    questions = tuple(str(Path(q).expanduser().resolve()) for q in args.questions)
    source = open_model(args.target)
    engine = Engine(args.target, None, spec=SpecConfig("none"), load=replace(load, heads=None))
    replies = args.replies
    if replies == "auto":
        gguf = source.kind == "gguf"
        replies = "llama.cpp" if gguf and importlib.util.find_spec("llama_cpp") else "torch"
    replier = None if replies == load.runtime else Engine(
        args.target, None, spec=SpecConfig("none"),
        load=replace(load, heads=None, runtime=replies))
    bf16 = resolve_dtype(args.train_dtype, "cpu") == "bfloat16"
    cfg = TrainConfig(args.kind, args.max_tokens, args.seq_len, args.chat, args.chat_tokens,
                      replies, args.steps, args.lr, ttt=args.ttt, bf16=bf16, text=text,
                      self_chat=args.self_chat, epochs=args.epochs, self_tasks=args.self_tasks,
                      questions=questions)
    if (cfg.max_tokens < cfg.seq_len or cfg.steps < 1 or cfg.self_chat < 0 or cfg.epochs < 0
            or cfg.self_tasks < 0):
        raise ValueError("need --max-tokens >= --seq-len, --steps >= 1, --epochs >= 0, "
                         "--self-chat >= 0 and --self-tasks >= 0")
    name = Path(str(args.target)).name.removesuffix(".gguf")
    layers = head_layers(args.kind, engine.target.config.n_layers)
    # features come from the runtime the heads will draft on (its numerics: llama.cpp's final
    # hidden state is ~5% off torch bf16's here); the manifest says which
    features = load.dtype if load.runtime == "torch" else load.runtime
    record = manifest(name, features, layers, cfg)
    data = Path(args.data) if args.data else forerun_home() / "train-data" / collection_key(record)
    siblings = sibling_collections(data, record)
    # heads trained on another runtime's features land beside, not over, the torch ones
    suffix = "" if load.runtime == "torch" else "-" + load.runtime.replace(".", "")
    out = Path(args.out) if args.out else forerun_home() / "heads" / name / (args.kind + suffix)
    overrides = {"num_heads": args.num_heads, "ffn_dim": args.ffn_dim}
    if args.kind in ("eagle", "eagle3"):
        c = engine.target.config
        overrides |= {"n_heads": c.n_heads, "n_kv_heads": c.n_kv_heads,
                      "rope_theta": c.rope_theta, "norm_eps": c.norm_eps}
    report = train_run(engine, name, cfg, out, data, args.head_vocab, replier, siblings,
                       target_io(source, engine.target), record, **overrides)
    report["out"] = str(out)
    if not args.json:
        after = report["after"]
        print(f"wrote {out} ({report['data_tokens']} tokens, {report['train_s']} s training)",
              file=sys.stderr)
        print(f"held-out top-1 per head/step: {after['top1']}  top-5: {after['top5']}  "
              f"(before: {report['before']['top1']})", file=sys.stderr)
    print(json.dumps(report))
    return 0
