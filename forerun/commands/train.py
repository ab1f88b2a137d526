"""`forerun train {medusa,hydra,eagle,eagle3,draft}`: the command's flags, where data and heads
(or the distilled draft model) go.

Owns: parsing and checking the training options, naming the data and output folders, and the
report it prints; collecting and training are `forerun.train` (a draft model:
`forerun.train.draft`, saved by `forerun.train.export`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

from forerun.api import Engine
from forerun.bench.workloads import read_workload
from forerun.commands.options import add_model_args, load_config
from forerun.models.catalog import ModelError, forerun_home
from forerun.models.load import load_transformer, open_model, resolve_dtype, target_io
from forerun.propose import SpecConfig
from forerun.propose.early_exit import adapter_file, default_layer, save_adapter
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
from forerun.train.draft import DIVERGENCES, distil, examples
from forerun.train.early_exit import feature_layer
from forerun.train.early_exit import run as train_early_exit
from forerun.train.export import GGUF_DTYPES, save_gguf, save_hf


def add_parser(sub) -> None:
    t = sub.add_parser(
        "train", help="train Medusa/Hydra/EAGLE heads on the target's own outputs, or "
        "distil a draft model toward the target",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Distil drafting heads from the target: collect its features and "
        "next-token distributions on its own chat replies and on the Python standard library's "
        "sources (resumable shards), train against them, and write head.safetensors + "
        "head_config.json (use them with --heads DIR --method KIND). `forerun train draft` "
        "distils the --draft model toward the target instead (GKD: the target's distribution "
        "on the draft's own samples and on the target's replies or your text), LoRA or full, "
        "and writes a Hugging Face folder and a GGUF file that --draft loads.")
    t.add_argument("kind", choices=["medusa", "hydra", "eagle", "eagle3", "draft",
                                    "early-exit"])
    t.add_argument("--layer", type=int, default=None, metavar="E",
                   help="early-exit: the exit layer whose adapter is trained (default: the "
                        "method's, 8 of 28 layers); saved beside the model, where "
                        "--method early-exit --exit-layer E finds it")
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
                   help="the heads' (and the early-exit head's) reduced vocabulary (most "
                        "frequent ids; 0 = all)")
    t.add_argument("--out", default=None, help="output folder (default: next to the target "
                   "in the model cache: FORERUN_HOME/heads/TARGET/KIND, or KIND-llamacpp for "
                   "--runtime llama.cpp)")
    t.add_argument("--data", default=None, help="shard folder (default: FORERUN_HOME/"
                   "train-data/...); reused and extended when it exists")
    t.add_argument("--train-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="precision of the training matmuls (autocast; weights and optimizer stay "
                        "float32); auto = bfloat16 where the CPU has fast bf16 matmuls")
    t.add_argument("--json", action="store_true", help="print only the JSON report")
    d = t.add_argument_group("draft (forerun train draft)")
    d.add_argument("--student-mix", type=float, default=TrainConfig.student_mix, metavar="F",
                   help="share of steps trained on the draft's own samples (on-policy GKD); "
                        "the rest on the target's replies (--questions, --chat) or your "
                        "text's own continuation (--text)")
    d.add_argument("--divergence", choices=DIVERGENCES, default=TrainConfig.divergence,
                   help="fkl: KL(target || draft); rkl: KL(draft || target); tvd: total "
                        "variation, one minus the sampled draft token's acceptance")
    d.add_argument("--temperature", type=float, default=TrainConfig.temperature,
                   help="the draft's sampling temperature on its on-policy steps")
    d.add_argument("--lora-rank", type=int, default=TrainConfig.lora_rank,
                   help="LoRA adapters (through peft: pip install 'forerun[train]') on every "
                        "block's linears, merged into the saved weights; 0 = full fine-tune")
    d.add_argument("--lora-alpha", type=float, default=TrainConfig.lora_alpha)
    d.add_argument("--held-out", default=None, metavar="JSONL",
                   help="prompts for the before/after acceptance, answered by the target (any "
                        "`forerun bench --workload` shape; the bench's own sets are fine here: "
                        "nothing is trained on them); default: every tenth training example")
    d.add_argument("--held-out-count", type=int, default=32, metavar="N",
                   help="--held-out's rows used, evenly spaced")
    d.add_argument("--gguf-dtype", choices=GGUF_DTYPES, default="f16",
                   help="the GGUF file's matrices")
    add_model_args(t)
    t.set_defaults(func=run)


def run(args) -> int:
    if args.kind == "draft":
        return run_draft(args)
    load = load_config(args)
    if load.runtime != "torch" and args.kind in ("eagle3", "early-exit"):
        raise ModelError(f"{args.kind} reads middle layers, which only the torch runtime "
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
    n_layers = engine.target.config.n_layers
    exit_layer = args.layer if args.layer is not None else default_layer(n_layers)
    layers = ((feature_layer(exit_layer),) if args.kind == "early-exit" else
              head_layers(args.kind, n_layers))
    # features come from the runtime the heads will draft on (its numerics: llama.cpp's final
    # hidden state is ~5% off torch bf16's here); the manifest says which
    features = load.dtype if load.runtime == "torch" else load.runtime
    record = manifest(name, features, layers, cfg)
    data = Path(args.data) if args.data else forerun_home() / "train-data" / collection_key(record)
    siblings = sibling_collections(data, record)
    if args.kind == "early-exit":
        return run_early_exit(args, engine, exit_layer, cfg, data, replier, record)
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


def run_early_exit(args, engine, layer: int, cfg, data: Path, replier, record) -> int:
    """`forerun train early-exit`: the exit adapter at `layer`, saved beside the model (or in
    --out/adapter.safetensors)."""
    source = engine.target.source
    if args.out is None and source is None:
        raise ValueError("early-exit: the target has no weights file to keep the adapter "
                         "beside; give --out DIR")
    adapter, report = train_early_exit(engine, layer, cfg, data, replier, record,
                                       args.head_vocab)
    out = (Path(args.out) / "adapter.safetensors" if args.out else adapter_file(source, layer))
    report["out"] = str(save_adapter(out, adapter, layer, report))
    if not args.json:
        print(f"wrote {out}: held-out top-1 {report['before']} -> {report['after']} "
              f"({report['train_s']} s training)", file=sys.stderr)
    print(json.dumps(report))
    return 0


def run_draft(args) -> int:
    """`forerun train draft`: the --draft model distilled toward --target, saved as a Hugging
    Face folder and OUT/draft.gguf."""
    load = replace(load_config(args), heads=None)
    text = tuple(str(Path(t).expanduser().resolve()) for t in args.text)
    questions = tuple(str(Path(q).expanduser().resolve()) for q in args.questions)
    cfg = TrainConfig("draft", args.max_tokens, args.seq_len, args.chat, args.chat_tokens,
                      steps=args.steps, lr=args.lr, text=text, epochs=args.epochs,
                      questions=questions, student_mix=args.student_mix,
                      divergence=args.divergence, temperature=args.temperature,
                      lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                      bf16=resolve_dtype(args.train_dtype, "cpu") == "bfloat16")
    if not 0 < cfg.chat_tokens < cfg.seq_len or cfg.steps < 1 or cfg.epochs < 0:
        raise ValueError("need 0 < --chat-tokens < --seq-len, --steps >= 1 and --epochs >= 0")
    if not 0 <= cfg.chat <= len(chat_prompts()) or args.held_out_count < 1:
        raise ValueError(f"need --chat in 0..{len(chat_prompts())} and --held-out-count >= 1")
    text_files(text)  # wrong paths fail here, before any model is loaded
    user_questions(questions)
    held: tuple[str, ...] = ()
    if args.held_out:
        rows = [p.text for p in read_workload(args.held_out)]
        held = tuple(rows[::-(-len(rows) // args.held_out_count)][:args.held_out_count])
    target_src, draft_src = open_model(args.target), open_model(args.draft)
    if target_src.tokenizer.vocab != draft_src.tokenizer.vocab:
        raise ModelError(f"{args.draft} and {args.target} have different vocabularies; "
                         "distillation compares their distributions token by token")
    engine = Engine(args.target, None, spec=SpecConfig("none"), load=load)
    replies = args.replies
    if replies == "auto":
        gguf = target_src.kind == "gguf"
        replies = "llama.cpp" if gguf and importlib.util.find_spec("llama_cpp") else "torch"
    replier = engine if replies == load.runtime else Engine(
        args.target, None, spec=SpecConfig("none"), load=replace(load, runtime=replies))
    name = Path(str(args.draft)).name.removesuffix(".gguf")
    target_name = Path(str(args.target)).name.removesuffix(".gguf")
    out = (Path(args.out) if args.out
           else forerun_home() / "drafts" / f"{name}-distilled-{target_name}")
    out.mkdir(parents=True, exist_ok=True)
    train_set, held_set = examples(replier, cfg, out, held, progress=not args.json)
    student = load_transformer(draft_src, "float64" if args.draft_dtype == "float64"
                               else "float32")
    model, report = distil(student, engine.target, train_set, held_set, cfg, out,
                           engine.tokenizer.stop_ids, progress=not args.json)
    save_hf(model, draft_src, out)
    save_gguf(model, draft_src, out / "draft.gguf", args.gguf_dtype)
    report |= {"out": str(out), "gguf": str(out / "draft.gguf")}
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    if not args.json:
        before, after = report["before"], report["after"]
        print(f"wrote {out} (Hugging Face folder) and {out / 'draft.gguf'}; use either with "
              f"--draft", file=sys.stderr)
        print(f"held-out acceptance (sampled, sum min(p, q)): {before['accept']} -> "
              f"{after['accept']}; greedy agreement {before['greedy']} -> {after['greedy']}; "
              f"KL {before['kl']} -> {after['kl']}", file=sys.stderr)
    print(json.dumps(report))
    return 0
