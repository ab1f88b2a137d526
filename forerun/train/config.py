"""`TrainConfig`: what `forerun train` collects and how it trains, in one frozen record (the
heads' settings, and the draft model's under kind "draft").

Owns: the settings and their defaults (the command's too), and `total_steps`. Every module of
`forerun.train` reads it; it imports nothing of theirs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class TrainConfig:
    kind: str
    max_tokens: int = 20000  # data budget: target tokens collected
    seq_len: int = 256  # teacher-forced window
    chat: int = 16  # chat_prompts() answered by the target (self-distillation)
    chat_tokens: int = 96  # reply length per chat prompt
    replies: str = "torch"  # the runtime generating the chat replies (the fastest: llama.cpp)
    steps: int = 600
    lr: float = 1e-3
    held_out: float = 0.1  # fraction of windows kept for agreement
    ttt: int = 3  # eagle, eagle3: rolled-out steps (training-time test)
    seed: int = 0
    bf16: bool = False  # training matmuls in bfloat16 (autocast; weights and Adam stay fp32)
    text: tuple[str, ...] = ()  # plain-text files/folders (TEXT_SUFFIXES), alternating with code
    self_chat: int = 0  # questions the target writes itself (Magpie), answered after chat's
    epochs: float = 0.0  # > 0: this many passes over the training windows, in place of steps
    self_tasks: int = 0  # questions on passages the target writes itself, after self_chat's
    questions: tuple[str, ...] = ()  # JSONL files of the user's own prompts, answered last
    # kind "draft" (forerun.train.draft): GKD toward the target
    student_mix: float = 0.5  # share of steps whose continuation the student samples itself
    divergence: str = "fkl"  # fkl, rkl or tvd between the target's p and the student's q
    temperature: float = 1.0  # the student's sampling temperature on its on-policy steps
    lora_rank: int = 16  # LoRA adapters through peft; 0 = every weight trained
    lora_alpha: float = 32.0

    def total_steps(self, windows: int) -> int:
        """Training steps (one window each): `steps`, or `epochs` passes over `windows`."""
        return max(1, math.ceil(self.epochs * windows)) if self.epochs > 0 else self.steps
