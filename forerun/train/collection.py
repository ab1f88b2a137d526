"""Collecting the training data: the target answers the corpus's questions, then every window
is teacher-forced through it and written as a shard.

Owns: the target's own questions (`self_questions`, Magpie; `self_tasks`) and replies
(`chat_replies`: greedy, batched on llama.cpp), the order of the windows (`windows`: chat
replies, then code alternating with the user's text), one window's features and top-K
distribution (`teacher`), the resumable shards of a data folder (`collect`) and the folder's
`manifest.json`: what it holds (target, features, layers, window and reply lengths, question
and text sets). Other collections of the same target are found by reading their manifests
(`sibling_collections`), never by parsing folder names; `collection_key` names a new folder,
for people to read. Training is `loop`'s; the questions and texts themselves are `corpus`'s.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from forerun.runtime.base import Runtime
from forerun.train.config import TrainConfig
from forerun.train.corpus import (
    PASSAGE_OPENERS,
    SELF_OPENERS,
    TASK_TEMPLATES,
    chat_prompts,
    chunked,
    code_corpus,
    read_texts,
    text_files,
    user_questions,
)

TEACHER_TOP = 32  # the target's most likely tokens kept per position
MANIFEST = "manifest.json"  # a data folder's record of what it holds
DIGEST_CHARS = 8  # of a sha1: names a question or text set in a manifest and a folder name


# Magpie (Xu et al., 2024): an aligned model handed its chat template opened at the user's turn
# writes a user's message itself. Left free, Qwen2.5-Coder wrote exam questions ("Q: ... A. B.
# C.") and Chinese half the time (8 tried); each question here starts with an opener, in turn,
# that steers toward kinds of request the written templates cover thinly.
SELF_MARK = "\x00forerun-question\x00"
SELF_MIN_ASCII = 0.95  # the benchmarks' chat is English; Qwen drifts into Chinese


def self_questions(replier, n: int, seed: int = 0, max_tokens: int = 128, rows: int = 16,
                   progress: bool = True, openers: tuple[str, ...] = SELF_OPENERS) -> list[str]:
    """`n` user questions written by the target itself (Magpie): its chat template rendered up
    to the user's message (default system prompt included) and an opener, then sampled at
    temperature 1 until the turn ends, seeded (the same model gives the same questions),
    batched on llama.cpp. Candidates that run past `max_tokens`, are shorter than 16
    characters, are not English-like (under SELF_MIN_ASCII of ASCII) or repeat an earlier one
    are dropped; rounds continue until `n` are kept. `openers`: how the questions start, in
    turn."""
    from forerun.sampling import SamplingConfig

    tok = replier.tokenizer
    head = tok.apply_chat_template([{"role": "user", "content": SELF_MARK}])
    head = head[:head.index(SELF_MARK)]
    kept: list[str] = []
    seen: set[str] = set()
    start = 0
    bar = tqdm(desc="the target writes questions", unit="question", leave=False,
               disable=not progress)
    while len(kept) < n:
        count = (n - len(kept)) * 5 // 4 + 4
        bar.reset(total=count)  # each round's candidates; some are dropped after
        starts = [openers[i % len(openers)] for i in range(start, start + count)]
        prompts = [tok.encode(head + o, add_special=False) for o in starts]
        if replier.target.capabilities.greedy_many:
            replies = replier.target.greedy_many(prompts, max_tokens, tok.stop_ids, rows,
                                                 temperature=1.0, seed=seed)
        else:
            replies = ((j, replier.generate(ids, max_tokens=max_tokens, sampling=SamplingConfig(
                temperature=1.0, seed=seed * 1_000_003 + start + j)).token_ids)
                for j, ids in enumerate(prompts))
        got = {}
        for j, reply in replies:
            got[j] = reply
            bar.update()
        for j in range(count):
            text = (starts[j] + tok.decode(got[j])).strip()
            ascii_share = sum(c.isascii() for c in text) / max(1, len(text))
            if (len(got[j]) < max_tokens and len(text) >= 16 and ascii_share >= SELF_MIN_ASCII
                    and text not in seen):
                seen.add(text)
                kept.append(text)
        start += count
        seed += 1  # greedy_many seeds by prompt index: a new round, new generators
    bar.close()
    return kept[:n]


# --self-tasks: the benchmarks' kinds of work on a passage (summaries, questions on a text,
# rewrites), on passages the target writes itself, never on a benchmark's rows
def self_tasks(replier, n: int, seed: int = 0, request_tokens: int = 64,
               passage_tokens: int = 120, rows: int = 16, progress: bool = True) -> list[str]:
    """`n` questions on passages the target writes itself: a request for a text written by
    the target (`self_questions` from PASSAGE_OPENERS), its greedy answer of up to
    `passage_tokens` (the passage), and question i is TASK_TEMPLATES[i % 6] around it."""
    requests = self_questions(replier, n, seed, request_tokens, rows, progress,
                              openers=PASSAGE_OPENERS)
    passages = dict(chat_replies(replier, requests, passage_tokens, rows))
    return [TASK_TEMPLATES[i % len(TASK_TEMPLATES)].format(
        passage=replier.tokenizer.decode(passages[i]).strip()) for i in range(n)]


def windows(engine, cfg: TrainConfig, skip=lambda i: False, replier=None,
            known=lambda i: None, own: tuple[str, ...] = ()) -> Iterator[list[int] | None]:
    """Token windows of cfg.seq_len: the target's chat replies first (greedy, generated by
    `replier`, default `engine`) to cfg.chat written questions and then to `own` (the
    target's own, `self_questions` then `self_tasks`, then the user's `--questions`), then
    code (alternating with cfg.text's windows while they last); None for a chat window
    `skip(i)` says is already collected (its reply is not generated again); `known(i)`, where
    not None, is written question i's window from an earlier collection (the same reply, not
    generated again)."""
    tok, replier = engine.tokenizer, replier or engine
    questions = chat_prompts()[:cfg.chat] + tuple(own)
    skipped = [skip(i) for i in range(len(questions))]
    plan = [None if s or i >= cfg.chat else known(i) for i, s in enumerate(skipped)]
    todo = [i for i, ids in enumerate(plan) if ids is None and not skipped[i]]
    replies = chat_replies(replier, [questions[i] for i in todo], cfg.chat_tokens)
    done: dict[int, list[int]] = {}
    for i, question in enumerate(questions):
        if skipped[i]:
            yield None
            continue
        if plan[i] is not None:
            yield plan[i]
            continue
        while i not in done:  # a batched replier finishes them out of order
            j, reply = next(replies)
            done[todo[j]] = reply
        yield (tok.encode_prompt(question) + done.pop(i))[-cfg.seq_len:]
    streams = [chunked(tok, read_texts(text_files(cfg.text)), cfg.seq_len)] if cfg.text else []
    streams.append(chunked(tok, code_corpus(), cfg.seq_len))
    while streams:  # round robin: a text window, a code window, ...
        for stream in list(streams):
            if (ids := next(stream, None)) is None:
                streams.remove(stream)
            else:
                yield ids


def chat_replies(replier, questions: list[str], max_tokens: int, rows: int = 16
                 ) -> Iterator[tuple[int, list[int]]]:
    """(index, greedy reply) for each question: batched, `rows` at a time, where the replier's
    runtime can (llama.cpp: ~2.5x the tokens a second here), else one after another."""
    tok = replier.tokenizer
    if replier.target.capabilities.greedy_many:
        yield from replier.target.greedy_many([tok.encode_prompt(q) for q in questions],
                                              max_tokens, tok.stop_ids, rows)
        return
    for j, question in enumerate(questions):
        yield j, replier.generate(question, max_tokens=max_tokens).token_ids


def teacher(runtime: Runtime, ids: list[int], layers: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """One window through the target: its features and its top-K next-token log-probs."""
    runtime.truncate(0)
    out = runtime.forward(torch.tensor(ids), hidden_layers=layers)
    top_lp, top_ids = out.logits.float().log_softmax(-1).topk(TEACHER_TOP, dim=-1)  # [T, K]
    runtime.truncate(0)
    shard = {"tokens": torch.tensor(ids, dtype=torch.int32), "top_ids": top_ids.int(),
             "top_lp": top_lp.half()}
    for layer in layers:
        shard[f"h{layer}"] = out.hidden[layer].to(torch.bfloat16).contiguous()  # [T, D]
    return shard


def collect(engine, cfg: TrainConfig, layers: tuple[int, ...], data_dir: Path,
            replier=None, siblings: tuple[tuple[Path, int, bool], ...] = (),
            record: dict | None = None) -> list[Path]:
    """Shards data_dir/window-NNNNN.safetensors, one per window, up to cfg.max_tokens tokens;
    windows already there are kept (resumable): the corpus order is fixed. `siblings`: data
    folders of the same kind of corpus (`sibling_collections`), whose chat replies are reused
    (the slow part of a collection), and whose windows, where their features are the same
    (runtime and layers), are copied rather than teacher-forced again. `record`: the folder's
    `manifest` (written before the first shard; a folder whose manifest says otherwise is an
    error, its windows are not these), which makes it a sibling of later collections."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    def known(i: int) -> list[int] | None:
        for sibling, chats, _ in siblings:  # its first `chats` windows are chat replies
            if i < chats and (path := sibling / f"window-{i:05d}.safetensors").exists():
                with safe_open(str(path), "pt") as f:
                    return f.get_tensor("tokens").tolist()
        return None

    @functools.cache
    def done_before() -> dict[bytes, Path]:  # tokens -> a shard with these features
        found = {}
        for sibling, _, same in siblings:
            for path in sorted(sibling.glob("window-*.safetensors")) if same else ():
                with safe_open(str(path), "pt") as f:
                    found.setdefault(f.get_tensor("tokens").numpy().tobytes(), path)
        return found

    data_dir.mkdir(parents=True, exist_ok=True)
    if record is not None:
        write_manifest(data_dir, record)
    total = max(1, cfg.max_tokens // cfg.seq_len)
    paths = [data_dir / f"window-{i:05d}.safetensors" for i in range(total)]
    missing = [p for p in paths if not p.exists()]
    with tqdm(total=total, initial=total - len(missing), desc="collect", unit="window") as bar:
        if not missing:
            return paths
        def kept(name: str, write) -> tuple[str, ...]:
            """Questions written once and kept: a resumed collection answers the same ones."""
            saved = data_dir / name
            if not saved.exists():
                saved.write_text(json.dumps(write(), indent=1) + "\n")
            return tuple(json.loads(saved.read_text()))

        writer, context = replier or engine, engine.target.config.context_length
        own = ()
        if cfg.self_chat:
            own += kept("self-questions.json", lambda: self_questions(
                writer, cfg.self_chat, cfg.seed, min(128, context // 4)))
        if cfg.self_tasks:
            own += kept("self-tasks.json", lambda: self_tasks(
                writer, cfg.self_tasks, cfg.seed, min(64, context // 8), min(120, context // 4)))
        own += user_questions(cfg.questions)
        chunks = windows(engine, cfg, skip=lambda i: paths[i].exists(), replier=replier,
                         known=known, own=own)
        for i, ids in enumerate(chunks):
            if i >= total:
                break
            if ids is not None and not paths[i].exists():
                key = torch.tensor(ids, dtype=torch.int32).numpy().tobytes()
                if (twin := done_before().get(key)) is not None:
                    shutil.copyfile(twin, paths[i])
                else:
                    save_file(teacher(engine.target, ids, layers), str(paths[i]))
                bar.update()
    return [p for p in paths if p.exists()]


def manifest(target: str, features: str, layers: tuple[int, ...], cfg: TrainConfig) -> dict:
    """What a collection for `cfg` holds, as its folder's manifest.json records it: the target
    (by name) and the runtime or dtype its `features` came from, the layers, the window and
    reply lengths, the question counts, and digests of the user's question and text sets
    ("" = none). Reads those files: a wrong path fails here."""
    asked, files = user_questions(cfg.questions), text_files(cfg.text)
    return {"target": target, "features": features, "layers": list(layers),
            "seq_len": cfg.seq_len, "chat": cfg.chat, "chat_tokens": cfg.chat_tokens,
            "self_chat": cfg.self_chat, "self_tasks": cfg.self_tasks,
            "questions": _digest("\n\x00".join(asked)) if asked else "",
            "text": _digest("\n".join(map(str, files))) if files else ""}


def collection_key(record: dict) -> str:
    """A readable folder name for a manifest's collection (never parsed: manifests are read)."""
    r = record
    key = (f"{r['target']}-{r['features']}-L{'_'.join(map(str, r['layers']))}"
           f"-T{r['seq_len']}-C{r['chat']}x{r['chat_tokens']}")
    for mark, field in (("S", "self_chat"), ("P", "self_tasks"), ("Q", "questions"),
                        ("X", "text")):
        if r[field]:
            key += f"-{mark}{r[field]}"
    return key


def read_manifest(folder: Path) -> dict | None:
    """The folder's manifest, or None (none, or unreadable: not a collection we know)."""
    try:
        record = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def write_manifest(folder: Path, record: dict) -> None:
    """Record what the folder holds; a folder that already holds something else is an error."""
    found = read_manifest(folder)
    if found is not None and found != record:
        differ = sorted(k for k in found.keys() | record.keys() if found.get(k) != record.get(k))
        raise ValueError(f"{folder} holds a collection with other settings ({', '.join(differ)} "
                         f"differ, see its {MANIFEST}); give another data folder")
    if found is None:
        (folder / MANIFEST).write_text(json.dumps(record, indent=1) + "\n")


def sibling_collections(data: Path, record: dict) -> tuple[tuple[Path, int, bool], ...]:
    """The folders beside `data` whose manifests say they hold the same target's windows of the
    same length and reply length (collected for other layers, by another runtime, with --text
    or with more or fewer chat questions): (folder, its chat question count, whether its
    features are data's own: the same runtime and layers). See `collect` for what is reused."""
    def same(other: dict, fields: tuple[str, ...]) -> bool:
        return all(other.get(f) == record[f] for f in fields)

    found = []
    for folder in sorted(data.parent.iterdir()) if data.parent.is_dir() else ():
        other = read_manifest(folder) if folder != data and folder.is_dir() else None
        if other is not None and same(other, ("target", "seq_len", "chat_tokens")):
            found.append((folder, int(other["chat"]), same(other, ("features", "layers"))))
    return tuple(found)


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:DIGEST_CHARS]
