"""`forerun.Engine`: the library entry point. Loads a target (and a draft), turns text into
tokens, runs plain or speculative decoding, and turns tokens back into streamed text.

Owns: model loading and the vocabulary bridge between draft and target, chat templating, stop
strings, incremental detokenization and the per-generation stats. The decode loops themselves
live in `forerun.engine` and `forerun.reference` and know nothing of text.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Generator
from dataclasses import asdict, dataclass, replace

import torch

from forerun.batch_policy import measure_batch_curve
from forerun.batch_session import BatchSession
from forerun.engine import speculative_decode
from forerun.grammar import state_for
from forerun.heads import PRECISIONS, Heads, load_heads, w8a8_available
from forerun.metrics import GenerationStats, Step, TokenLogprob
from forerun.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET, ModelError
from forerun.models.load import DEFAULT_CONTEXT, ModelSource, open_model, resolve_dtype, target_io
from forerun.models.tokenizer import TextTokenizer
from forerun.policy import POLICIES
from forerun.profile import ForwardCurve
from forerun.propose import PROPOSERS, ProposerContext, SpecConfig
from forerun.propose.cross_vocab import VocabBridge, vocab_bridge
from forerun.propose.disaggregate import DRAFTER, DraftRecipe, start_drafter
from forerun.propose.drafter_hub import DrafterHub
from forerun.propose.drafter_worker import DrafterProcess, pin
from forerun.reference import plain_decode
from forerun.runtime.base import Runtime
from forerun.runtime.batch import BatchRuntime
from forerun.runtime.memory import return_free_memory
from forerun.runtime.torch_model import TorchRuntime
from forerun.runtime.views import batched_view
from forerun.sampling import SamplingConfig, make_generator
from forerun.stopping import StopStrings, TextOut

DEFAULT_MAX_TOKENS = 256
MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI allows
# KV memory of a batch (per model), reserved per sequence for its prompt + max_tokens
DEFAULT_KV_BUDGET_BYTES = 2 << 30


@dataclass(frozen=True)
class LoadConfig:
    dtype: str = "auto"  # bfloat16 where the hardware has fast bf16 matmuls, else float32
    device: str = "cpu"
    context: int = DEFAULT_CONTEXT
    runtime: str = "torch"  # a key of forerun.models.load.RUNTIMES; dtype is torch's only
    # The draft's precision never changes the output (the target verifies every token), only
    # its speed: "auto" runs it in bfloat16 where that is fast, even under a float32 target.
    draft_dtype: str = "auto"
    # > 0: the draft computes logits for this many frequent tokens only (torch runtime); the
    # output is unchanged, only the draft step gets cheaper (see TorchRuntime.limit_vocab)
    draft_vocab: int = 0
    heads: str | None = None  # trained Medusa/Hydra/EAGLE heads for the target (forerun train)
    # the heads' weights when drafting (forerun.heads.PRECISIONS); like the draft's dtype it
    # changes speed and drafts, never the output. auto: int8 where bfloat16 is fast, else float32
    head_precision: str = "auto"
    # torch runtime: row-invariant kernels (TorchRuntime.set_invariant), so a row's logits do
    # not depend on how many rows share its pass; slower, off by default
    invariant: bool = False

    def __post_init__(self):
        if self.head_precision not in ("auto", *PRECISIONS):
            raise ValueError(f"head_precision must be auto or one of {', '.join(PRECISIONS)}, "
                             f"got {self.head_precision!r}")
        if self.draft_vocab < 0:
            raise ValueError(f"draft_vocab must be >= 0 (0 = full vocabulary), got "
                             f"{self.draft_vocab}")


@dataclass(frozen=True)
class Chunk:
    text: str  # new text since the previous chunk
    token_ids: list[int]
    step: Step


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: GenerationStats
    prompt_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per token id, where asked
    # one per prompt token (the first None), where asked (`prompt_logprobs`, echo)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids,
                "finish_reason": self.finish_reason, "prompt_tokens": self.prompt_tokens,
                "stats": self.stats.to_dict()} | ({} if self.logprobs is None else {
                    "logprobs": [asdict(lp) for lp in self.logprobs]}) | (
                    {} if self.prompt_logprobs is None else {"prompt_logprobs": [
                        lp and asdict(lp) for lp in self.prompt_logprobs]})


def heads_device(load: LoadConfig) -> str:
    """Where heads draft: on a torch target's device (they read its tensors), else the CPU
    (llama.cpp's features come back to the host)."""
    return load.device if load.runtime == "torch" else "cpu"


def head_precision(name: str, device: str = "cpu") -> str:
    """LoadConfig.head_precision resolved for heads drafting on `device` (a torch target's,
    else the CPU): auto = bfloat16 on a GPU; on the CPU int8 where it
    multiplies bfloat16 fast and torch has the int8 weight-only kernel, else w8a8 where torch
    has fbgemm (x86), else float32. Measured: an EAGLE draft step 7.9 ms in float32 (LM slice
    bfloat16), ~2.5 ms in int8 on an AVX512-BF16 EPYC; on an AVX2-only Zen 3 a chain of 4 steps
    53 ms in float32, 22 ms in int8, w8a8 in the README (`forerun profile heads`)."""
    if name != "auto":
        return name
    if device != "cpu":
        return "bfloat16"
    if resolve_dtype("auto", "cpu") == "bfloat16" and hasattr(torch.ops.aten,
                                                              "_weight_int8pack_mm"):
        return "int8"
    return "w8a8" if w8a8_available() else "float32"


def draft_bridge(target: ModelSource, draft: ModelSource,
                 runtime: str = "torch") -> VocabBridge | None:
    """The bridge the draft method drafts through where the draft's tokenizer is not the
    target's (None where they agree on every token/id pair); from the tokenizers alone, before
    any weights load. Raises ModelError for a draft it cannot bridge, or one `runtime` cannot
    run (an architecture our torch model lacks, as Gemma 3's, runs on llama.cpp only)."""
    if draft.config is None and runtime != "llama.cpp":
        raise ModelError(f"draft {draft.name!r}: its architecture is not supported by the "
                         f"{runtime} runtime (supported: llama, qwen2); --runtime llama.cpp "
                         "runs it")
    size = target.config.vocab_size if target.config else len(target.tokenizer.vocab)
    draft_size = (draft.config.vocab_size if draft.config else
                  draft.tokenizer.tokenizer.get_vocab_size(with_added_tokens=True))
    return vocab_bridge(target.tokenizer, draft.tokenizer, size, draft_size)


def load_draft(target: ModelSource, draft: ModelSource, load: LoadConfig) -> Runtime:
    """The draft model's runtime for `target`: the pair checked before any weights load (a
    draft of another vocabulary must be bridgeable: `draft_bridge`), then the draft in
    load.draft_dtype, cut to load.draft_vocab tokens if asked (one vocabulary only)."""
    bridge = draft_bridge(target, draft, load.runtime)
    if bridge is not None and load.draft_vocab > 0:
        raise ModelError("a reduced draft vocabulary (--draft-vocab) needs a draft with the "
                         "target's tokenizer")
    runtime = draft.load(dtype=load.draft_dtype, device=load.device, context=load.context,
                         runtime=load.runtime)
    if load.draft_vocab > 0:
        if not runtime.capabilities.reduced_vocab:
            raise ModelError(f"a reduced draft vocabulary needs the torch runtime, not "
                             f"{load.runtime}")
        runtime.limit_vocab(target.tokenizer.frequent_ids(load.draft_vocab))
    return runtime


def start_disaggregated(target: ModelSource, draft: ModelSource, source: str, spec: SpecConfig,
                        load: LoadConfig) -> DrafterProcess:
    """--disaggregate: the draft model (`source`) in a worker process on its cores (or, with
    spec.drafter_placement, a Ray actor: the same interface), and this process, the target's,
    pinned to the others before the target loads (llama.cpp counts its threads then)."""
    if draft_bridge(target, draft, load.runtime) is not None or load.draft_vocab:
        raise ModelError("--disaggregate needs a draft with the target's tokenizer and its "
                         "full vocabulary")
    recipe = DraftRecipe(source, load.draft_dtype, load.device, load.context, load.runtime)
    if spec.drafter_placement is not None:  # a Ray actor, placed by a placement group
        from forerun.cluster.drafter_actor import start_ray_drafter

        worker, cores = start_ray_drafter(recipe, target.config.vocab_size,
                                          spec.disaggregated(), spec.drafter_placement,
                                          os.sched_getaffinity(0))
    else:
        worker, cores = start_drafter(recipe, target.config.vocab_size, spec.disaggregated(),
                                      os.sched_getaffinity(0))
    pin(cores)
    return worker


class Engine:
    def __init__(self, target: str = DEFAULT_TARGET, draft: str | None = DEFAULT_DRAFT, *,
                 spec: SpecConfig | None = None, load: LoadConfig | None = None):
        spec, load = spec or SpecConfig(), load or LoadConfig()
        target_src = open_model(target)
        if target_src.config is None:
            raise ModelError(f"{target}: architecture not supported by the torch runtime "
                             "(supported: llama, qwen2)")
        draft_src = open_model(draft) if draft and spec.uses_draft else None
        drafter = None
        if spec.disaggregate and draft_src is not None:  # the draft loads in its own process
            drafter = start_disaggregated(target_src, draft_src, draft, spec, load)
            draft_src = None
        draft_rt = load_draft(target_src, draft_src, load) if draft_src else None
        bridge = draft_bridge(target_src, draft_src, load.runtime) if draft_src else None
        target_rt = target_src.load(dtype=load.dtype, device=load.device, context=load.context,
                                    runtime=load.runtime)
        if load.invariant:
            if not isinstance(target_rt, TorchRuntime):
                raise ModelError(f"--invariant applies to the torch runtime; {load.runtime}'s "
                                 "patched kernels are row-invariant already")
            target_rt.set_invariant(True)
        heads = None
        if load.heads:
            heads = load_heads(load.heads, target_io(target_src, target_rt), target_src.name,
                               load.context, head_precision(load.head_precision,
                                                            heads_device(load)))
            if not target_rt.capabilities.exposes(heads.cfg.layers):
                raise ModelError(f"{heads.cfg.kind} heads read target layers "
                                 f"{list(heads.cfg.layers)}; the {load.runtime} runtime exposes "
                                 "only the final one (-1): use --runtime torch")
        self._attach(target_rt, target_src.tokenizer, draft_rt, spec, heads, bridge)
        if drafter is not None:
            self.drafter = drafter
            self.proposers.shared[DRAFTER] = DrafterHub(drafter)  # every sequence's channel
        return_free_memory()  # loading's temporaries, freed but still mapped

    @classmethod
    def from_runtimes(cls, target: Runtime, tokenizer: TextTokenizer,
                      draft: Runtime | None = None, spec: SpecConfig | None = None,
                      heads: Heads | None = None, *,
                      draft_tokenizer: TextTokenizer | None = None) -> Engine:
        """`draft_tokenizer`: the draft's, where it is not `tokenizer` (a draft of another
        vocabulary: the draft method bridges the two)."""
        engine = cls.__new__(cls)
        bridge = None if draft_tokenizer is None else vocab_bridge(
            tokenizer, draft_tokenizer, target.config.vocab_size, draft.config.vocab_size)
        engine._attach(target, tokenizer, draft, spec or SpecConfig(), heads, bridge)
        return engine

    def _attach(self, target, tokenizer, draft, spec, heads=None, bridge=None) -> None:
        self.target, self.tokenizer, self.draft, self.spec = target, tokenizer, draft, spec
        self.heads = heads
        self.drafter: DrafterProcess | None = None  # --disaggregate's worker (forks share it)
        self.bridge: VocabBridge | None = bridge  # the draft's vocabulary to the target's
        # what proposers are built from; its stores are this sequence's (forks get their own)
        # (its `shared`, the suffix method's index of earlier outputs, outlives every request)
        self.proposers = ProposerContext(target, draft, heads, tokenizer, shared={},
                                         bridge=bridge)
        self._batches: dict[str, tuple[int, BatchRuntime]] = {}  # role -> (budget, its view)
        self._batch_curves: dict[str, ForwardCurve] = {}  # role -> its view's pass costs

    def use_heads(self, heads: Heads) -> None:
        """Draft with these heads from the next sequence on (a server's online-distilled
        Medusa head, made after loading)."""
        self.heads = heads
        self.proposers = replace(self.proposers, heads=heads)

    def warm_up(self) -> int:
        """Record the target's and the draft model's static passes (CUDA graphs on a GPU) of
        every size now, not in a request's first steps; runtimes without them skip it (the
        CPU, llama.cpp). -> sizes recorded."""
        return sum(rt.warm_up() for rt in (self.target, self.draft)
                   if rt is not None and rt.capabilities.static_passes)

    def close(self) -> None:
        """Let go of the models, heads and caches (their memory returns once nothing else holds
        them); the engine is unusable after. A benchmark frees them so a peer can load its own
        (vLLM's draft-model speculation beside forerun's bf16 pair overran 23 GiB)."""
        self._batches.clear()
        self._batch_curves.clear()
        if self.drafter is not None:
            self.drafter.close()
        self.target = self.draft = self.heads = self.proposers = None
        gc.collect()

    def fork(self) -> Engine:
        """An engine over the same weights with KV caches of its own: one more sequence that can
        be decoded between the steps of this engine's (the server holds one per request)."""
        forked = Engine.from_runtimes(self.target.fork(), self.tokenizer,
                                      self.draft.fork() if self.draft is not None else None,
                                      self.spec, self.heads)
        forked.bridge = self.bridge
        forked.proposers = replace(forked.proposers, shared=self.proposers.shared,  # one index
                                   bridge=self.bridge)
        return forked

    def encode(self, prompt: str | list[int], raw: bool = False) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        return self.tokenizer.encode_prompt(prompt, raw=raw)

    def stream(self, prompt: str | list[int], *, sampling: SamplingConfig | None = None,
               max_tokens: int = DEFAULT_MAX_TOKENS, stop: tuple[str, ...] = (),
               raw: bool = False, spec: SpecConfig | None = None,
               logprobs: int | None = None, prompt_logprobs: int | None = None
               ) -> Generator[Chunk, None, None]:
        """Yield text as it is generated; `spec` overrides the engine's speculation config.
        One chunk per target forward pass; `logprobs` (alternatives per token, 0..20): each
        chunk's step carries its tokens' logprobs from the verify pass; `prompt_logprobs`
        (0..20): the first chunk's step carries the prompt tokens' (the prefill then computes
        the logits of every prompt row)."""
        sampling, spec = sampling or SamplingConfig(), spec or self.spec
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        ids = self.encode(prompt, raw)
        sampling.processing.check_vocab(self.target.config.vocab_size)
        generator = make_generator(sampling.seed)
        stop_ids = self.tokenizer.stop_ids
        for name, n in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if n is not None and not 0 <= n <= MAX_TOP_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {n}")
        grammar = state_for(sampling.grammar, self.tokenizer, self.target.config.vocab_size)
        asked = {"logprobs": logprobs, "grammar": grammar, "prompt_logprobs": prompt_logprobs}
        if spec.method == "none" and not any(v is not None for v in asked.values()):
            steps = plain_decode(self.target, ids, sampling, max_tokens, stop_ids, generator)
        elif spec.method == "none":  # the batch step itself, which reads and masks the logits
            steps = speculative_decode(self.target, None, None, ids, sampling, max_tokens,
                                       stop_ids, generator, **asked)
        else:
            proposer = PROPOSERS[spec.method](spec, self.proposers)
            # the cost policy measures forward times at a runtime's first use (see profile.py)
            policy = POLICIES[spec.policy](spec, self.target, proposer.runtime)
            steps = speculative_decode(self.target, proposer, policy, ids, sampling, max_tokens,
                                       stop_ids, generator, **asked, shadow=spec.shadow)
        out = TextOut(self.tokenizer, stop)
        for step in steps:
            text, hit = out.push(step.tokens, final=step.finish_reason is not None)
            yield Chunk(text, step.tokens, replace(step, finish_reason="stop") if hit else step)
            if hit:
                return

    def generate(self, prompt: str | list[int], *, raw: bool = False,
                 on_text: Callable[[str], None] | None = None, **kwargs) -> Completion:
        """Run to completion; `on_text` sees each text delta as it is produced."""
        spec = kwargs.get("spec") or self.spec
        start = time.perf_counter()
        ids = self.encode(prompt, raw)
        chunks = []
        for chunk in self.stream(ids, **kwargs):
            chunks.append(chunk)
            if on_text is not None:
                on_text(chunk.text)
        steps = [c.step for c in chunks]
        return Completion(
            text="".join(c.text for c in chunks),
            token_ids=[t for c in chunks for t in c.token_ids],
            finish_reason=steps[-1].finish_reason or "length",
            stats=GenerationStats.from_steps(spec.method, spec.k if spec.method != "none" else 0,
                                             start, steps, spec.shadow),
            prompt_tokens=len(ids),
            logprobs=None if kwargs.get("logprobs") is None else [
                lp for s in steps for lp in s.logprobs],
            prompt_logprobs=None if kwargs.get("prompt_logprobs") is None else list(
                steps[0].prompt_logprobs))


    def generate_batch(self, prompts: list[str | list[int] | list[dict]], *,
                       sampling: SamplingConfig | list[SamplingConfig] | None = None,
                       max_tokens: int | list[int] = DEFAULT_MAX_TOKENS,
                       stop: tuple[str, ...] = (), raw: bool = False,
                       spec: SpecConfig | None = None, max_batch: int | None = None,
                       kv_budget_bytes: int = DEFAULT_KV_BUDGET_BYTES,
                       max_batch_tokens: int | None = None) -> list[Completion]:
        """Decode many prompts together: every step is one target pass over all the live ones
        (`forerun.batch_session`), each sequence still getting exactly its own output. A prompt
        is text (chat-templated unless `raw`), token ids, or a chat's messages. `sampling` and
        `max_tokens` may be one per prompt. Sequences wait for KV memory (`kv_budget_bytes`,
        reserved per sequence for its prompt + max_tokens) and for `max_batch`; a pass holds at
        most `max_batch_tokens` rows (prompts in chunks; None: whole prompts). -> one
        Completion per prompt, in order."""
        spec, n = spec or self.spec, len(prompts)
        samplings = sampling if isinstance(sampling, list) else [sampling or SamplingConfig()] * n
        budgets = max_tokens if isinstance(max_tokens, list) else [max_tokens] * n
        if len(samplings) != n or len(budgets) != n:
            raise ValueError("give one sampling config and one max_tokens per prompt, or one")
        session = BatchSession(self, kv_budget_bytes,
                               joint=spec.policy == "cost" and spec.method != "none",
                               max_batch=max_batch, max_batch_tokens=max_batch_tokens)
        seqs, texts = [], {}
        for prompt, s, budget in zip(prompts, samplings, budgets, strict=True):
            ids = (self.tokenizer.encode_chat(prompt) if prompt and isinstance(prompt[0], dict)
                   else self.encode(prompt, raw))
            seq = session.sequence(ids, s, budget, spec)
            seqs.append(seq)
            texts[id(seq)] = TextOut(self.tokenizer, stop)
        start = time.perf_counter()
        for seq in seqs:
            session.add(seq)
        while not session.idle:
            for seq, result in session.step():
                if seq.error is not None:
                    session.drop_all()
                    raise seq.error
                _, hit = texts[id(seq)].push(result.tokens,
                                             final=result.finish_reason is not None)
                if hit:
                    seq.finish = "stop"
                    session.drop(seq)
        k = spec.k if spec.method != "none" else 0
        return [Completion(texts[id(q)].sent_text, [t for st in q.steps for t in st.tokens],
                           q.finish or "length",
                           GenerationStats.from_steps(spec.method, k, start, q.steps,
                                                      spec.shadow),
                           prompt_tokens=len(q.prompt)) for q in seqs]

    def kv_peak_bytes(self, reset: bool = False) -> int:
        """The most KV-cache bytes batched decoding reserved at once (target and draft) since
        the last reset."""
        return sum(rt.kv_peak_bytes(reset) for _, rt in self._batches.values())

    def batch_curve(self, view: BatchRuntime) -> ForwardCurve:
        """Seconds of a pass over n rows of a batched view, measured at its first use."""
        role = next(r for r, (_, rt) in self._batches.items() if rt is view)
        if role not in self._batch_curves:
            self._batch_curves[role] = measure_batch_curve(view, self.target.config.vocab_size)
        return self._batch_curves[role]

    def batch_view(self, role: str, budget: int) -> BatchRuntime:
        """The batched view of the target or the draft ("target", "draft"), its KV cache sized
        by `budget` bytes; kept while the budget stays (its pool and its measured curve are
        reused)."""
        if self._batches.get(role, (None,))[0] != budget:
            runtime = self.target if role == "target" else self.draft
            self._batches[role] = (budget, batched_view(runtime, budget))
            self._batch_curves.pop(role, None)
        return self._batches[role][1]


def _find_stop(text: str, stops: tuple[str, ...], sent: int) -> int | None:
    """Where the earliest stop string begins in `text`, searching only unsent text."""
    hits = [i for s in stops if s and (i := text.find(s, sent)) >= 0]
    return min(hits) if hits else None


def _stop_prefix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` (which holds no whole stop string) that is a proper
    prefix of a stop string; O(len(text) + total stop length), see StopStrings."""
    matcher = StopStrings(stops)
    matcher.feed(text)
    return matcher.held
