"""Peers measured in the same benchmark run: Hugging Face transformers and llama-cpp-python.

Owns: loading each peer on the same GGUF files and running it on the same prompt token ids with
the same sampling settings, recording when each token arrived (a `Trace`). Each peer runs in
the modes its users would reach for, with the peer's own default draft lengths:
- hf: `generate()` plain, with `assistant_model=` (the draft GGUF) and with
  `prompt_lookup_num_tokens=`; weights dequantized to the benchmark's dtype;
- llama.cpp: plain, and with its prompt-lookup drafter (`LlamaPromptLookupDecoding`), on its own
  quantized kernels.
Peers never import the engine: they are what we compare with.
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from forerun.models.catalog import ModelError
from forerun.sampling import SamplingConfig

PROMPT_LOOKUP_TOKENS = 10  # both peers' documented default for prompt lookup
LOOKUP_NGRAM_MAX = 2  # llama-cpp-python's LlamaPromptLookupDecoding default
PEER_NAMES = ("hf", "llama.cpp")


@dataclass
class Trace:
    token_ids: list[int]
    start: float  # perf_counter() when the request started
    steps: list[tuple[float, int]] = field(default_factory=list)  # (arrival time, tokens)


class Peer(Protocol):
    modes: tuple[str, ...]  # the first mode is the peer's own plain decoding

    def label(self, mode: str) -> str: ...

    def run(self, mode: str, ids: list[int], sampling: SamplingConfig,
            max_tokens: int) -> Trace: ...


class _Clock:
    """A transformers streamer that timestamps every put (the first put is the prompt)."""

    def __init__(self, start: float):
        self.trace, self._prompt_seen = Trace([], start), False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        new = value.flatten().tolist()
        self.trace.token_ids.extend(new)
        self.trace.steps.append((time.perf_counter(), len(new)))

    def end(self) -> None:
        pass


class HFPeer:
    modes = ("plain", "assisted", "prompt_lookup")

    def __init__(self, target: Path, draft: Path | None, dtype: str, stop_ids: Collection[int]):
        self.stop_ids = sorted(stop_ids)
        self.model = _load_hf(target, dtype)
        extra = {"plain": {}, "prompt_lookup": {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}}
        if draft is not None:
            extra["assisted"] = {"assistant_model": _load_hf(draft, dtype)}
        self.modes = tuple(m for m in HFPeer.modes if m in extra)
        self._extra = extra

    def label(self, mode: str) -> str:
        return f"hf {mode}"

    def run(self, mode, ids, sampling, max_tokens) -> Trace:
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        clock = _Clock(time.perf_counter())
        greedy = sampling.temperature == 0.0
        sample_kw = {} if greedy else {"temperature": sampling.temperature,
                                       "top_p": sampling.top_p, "top_k": sampling.top_k}
        with torch.inference_mode():
            self.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                dtype=torch.long), max_new_tokens=max_tokens,
                                do_sample=not greedy, eos_token_id=self.stop_ids,
                                pad_token_id=self.stop_ids[0], streamer=clock,
                                **sample_kw, **self._extra[mode])
        trace = clock.trace
        stop = next((i for i, t in enumerate(trace.token_ids) if t in self.stop_ids), None)
        if stop is not None:  # hf keeps the stop token; forerun emits it too: keep it
            del trace.token_ids[stop + 1:]
        return trace


def _load_hf(path: Path, dtype: str):
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        raise ModelError("peer 'hf' needs transformers: pip install 'forerun[dev]'") from e
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(dtype, torch.float32)
    kw = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    root = path.parent if path.suffix == ".gguf" else path
    model = AutoModelForCausalLM.from_pretrained(str(root), dtype=torch_dtype, **kw)
    return model.eval()


class LlamaCppPeer:
    modes = ("plain", "prompt_lookup")

    def __init__(self, target: Path, context: int, stop_ids: Collection[int]):
        try:
            from llama_cpp import Llama
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        except ImportError as e:
            raise ModelError("peer 'llama.cpp' needs llama-cpp-python: "
                             "pip install 'forerun[llama]'") from e
        if target.suffix != ".gguf":
            raise ModelError(f"peer 'llama.cpp' runs GGUF files; {target} is not one")
        self.stop_ids = set(stop_ids)
        threads = len(os.sched_getaffinity(0))
        common = dict(model_path=str(target), n_ctx=context, n_threads=threads,
                      n_threads_batch=threads, verbose=False)
        # its draft_model path needs logits_all=True (it crashes without once the context
        # exceeds n_batch); plain decoding runs without, as a plain user would
        self.llms = {
            "plain": Llama(**common),
            "prompt_lookup": Llama(**common, logits_all=True, draft_model=(
                LlamaPromptLookupDecoding(LOOKUP_NGRAM_MAX, PROMPT_LOOKUP_TOKENS))),
        }

    def label(self, mode: str) -> str:
        return f"llama.cpp {mode}"

    def run(self, mode, ids, sampling, max_tokens) -> Trace:
        llm = self.llms[mode]
        llm.reset()  # no prefix reuse between runs: every system prefills the whole prompt
        if sampling.seed is not None:
            llm.set_seed(sampling.seed)
        trace = Trace([], time.perf_counter())
        for token in llm.generate(ids, temp=sampling.temperature, top_k=sampling.top_k,
                                  top_p=sampling.top_p, min_p=sampling.min_p,
                                  repeat_penalty=1.0, reset=True):
            trace.token_ids.append(token)
            trace.steps.append((time.perf_counter(), 1))
            if token in self.stop_ids or len(trace.token_ids) >= max_tokens:
                break
        return trace
