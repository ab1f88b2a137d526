"""`forerun train {medusa,hydra,eagle,eagle3}`: heads distilled from the target itself (and
`forerun train draft`: a draft model distilled toward it, in `draft`).

The features come from the runtime the heads will draft on: torch, or llama.cpp (final layer
only, so not for EAGLE-3), whose numerics differ from torch's by a few percent. Data:
- code: the Python standard library's own sources on this machine, teacher-forced in windows;
- chat: the target's own replies (greedy; on llama.cpp 16 decoding in one batch) to the
  questions of `chat_prompts()`, written or generated for forerun (none is a benchmark row),
  and optionally to questions the target wrote itself (`self_questions`, Magpie; `self_tasks`)
  and to the user's own (`--questions`: prompts of their traffic, in the bench's JSONL
  shapes), then teacher-forced like the code;
- text (`--text`, optional): the user's own plain-text files (prose, docs), teacher-forced,
  their windows alternating with the code's after the chat replies.
Loss: cross-entropy against the target's distribution (its top-K, renormalised over the head's
reduced vocabulary); reported: per-head (per-step for EAGLE) top-1/top-5 agreement with the
target's argmax on held-out windows.

Modules, each importing only those before it: `config` (TrainConfig), `corpus` (questions and
texts), `collection` (the target answers and is teacher-forced; shards and their manifest),
`losses` (predictions, loss, agreement), `loop` (vocabulary, initialisation, training, `run`),
then `draft` (`forerun train draft`: the draft model distilled toward the target, GKD, on `loop`'s
`fit`) and `export` (that model saved as a Hugging Face folder and a GGUF file). This file only
re-exports the heads' public names.
"""

from forerun.train.collection import (
    MANIFEST,
    TEACHER_TOP,
    chat_replies,
    collect,
    collection_key,
    manifest,
    read_manifest,
    self_questions,
    self_tasks,
    sibling_collections,
    teacher,
    windows,
    write_manifest,
)
from forerun.train.config import TrainConfig
from forerun.train.corpus import (
    CHAT_PROMPTS,
    PASSAGE_OPENERS,
    SELF_OPENERS,
    TASK_TEMPLATES,
    TEXT_SUFFIXES,
    chat_prompts,
    chunked,
    code_corpus,
    read_texts,
    text_files,
    user_questions,
)
from forerun.train.loop import corpus_vocab, head_layers, load_shards, new_heads, run, train
from forerun.train.losses import agreement, predictions, teacher_probs, vocab_lookup, window_loss

__all__ = [
    "CHAT_PROMPTS", "MANIFEST", "PASSAGE_OPENERS", "SELF_OPENERS",
    "TASK_TEMPLATES", "TEACHER_TOP", "TEXT_SUFFIXES", "TrainConfig", "agreement", "chat_prompts",
    "chat_replies", "chunked", "code_corpus", "collect", "collection_key", "corpus_vocab",
    "head_layers", "load_shards", "manifest", "new_heads", "predictions", "read_manifest",
    "read_texts", "run", "self_questions", "self_tasks", "sibling_collections", "teacher",
    "teacher_probs", "text_files", "train", "user_questions", "vocab_lookup", "window_loss",
    "windows", "write_manifest",
]
