"""The Runtime protocol: what the engine, verifier and proposers may ask of a model backend.

Owns: the seam between speculative decoding and the code that runs a transformer.
A runtime holds one sequence (batch 1) and its KV cache. Tokens are appended at the end of the
cache; `truncate(n)` rolls back to the first n cache slots, which is free for a static cache.
`fork()` gives another runtime over the same weights with a cache of its own, so that several
sequences can be decoded in turn (the server holds one fork per concurrent request).
What a runtime can do (hidden layers, CUDA graphs, a reduced vocabulary, ...) is declared in
its `capabilities`, never probed; its `curve` slot holds the forward-time curve
`forerun.profile` calibrated for it (None until then), owned by the runtime, not by a cache.
Never samples, never tokenizes.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from forerun.profile import LiveCurve


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder; read from GGUF metadata or a HF config.json."""

    arch: str  # "llama" or "qwen2"
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    rope_theta: float
    norm_eps: float
    context_length: int
    qkv_bias: bool
    tied_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


@dataclass
class ForwardOutput:
    # [T, V] ([1, V] if last_only) on the CPU; float32, or float64 for float64 models
    logits: torch.Tensor
    # layer -> [T, D], every row even under last_only; layer i = block i's output, -1 = the
    # final normed state the LM head reads
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class Resume:
    """The first rows of a pass whose lower layers are already computed: the hidden states
    entering layer `layer` of the pass's first m rows, whose keys and values at layers
    0..layer-1 the cache already holds at those rows' slots (an early-exit draft wrote them, for
    the same tokens at the same positions). The pass runs layers 0..layer-1 for its other rows
    only, and layers layer.. for every row."""

    layer: int  # E: the first layer the resumed rows run
    hidden: torch.Tensor  # [m, D] the output of layer E-1 (block E-1) of rows 0..m-1

    @property
    def rows(self) -> int:
        return self.hidden.shape[0]


@dataclass(frozen=True)
class Capabilities:
    """What a runtime can do, declared once (never probed with getattr)."""

    hidden_layers: bool = False  # returns every block's output and the final normed state per row
    final_hidden: bool = False  # returns the final normed state (layer -1), if not the blocks'
    hidden_costs_logits: bool = False  # a hidden row costs an LM-head row (stock llama.cpp)
    reduced_vocab: bool = False  # logits over a kept subset of the vocabulary (limit_vocab)
    static_passes: bool = False  # static decode passes (a one-sequence warm_up() records them)
    cuda_graphs: bool = False  # replays static decode passes as CUDA graphs
    tree_masks: bool = True  # a pass may verify a token tree (tree_mask, positions)
    max_batch: int = 0  # batched runtimes: most sequences in one pass (0 = as many as fit)
    greedy_many: bool = False  # greedy_many(prompts, ...) decodes many prompts at once
    curve_on_disk: bool = False  # calibration_key() names its forward-time curve on disk
    kv_copy: bool = False  # batched runtimes: read_kv / write_kv copy a member's cached K/V
    # (prefix caching)
    kv_grow: bool = False  # batched runtimes: grow raises a member's reservation as it decodes
    # (regions that start at the prompt; preemption when memory runs out)
    skip_layers: bool = False  # without_layers(skip, capacity) builds a draft of this model
    # with some layers left out, over the same weights (layer-skip self-speculation)
    resume_rows: bool = False  # forward(..., resume=Resume) starts a pass's first rows at a
    # layer from given hidden states (early exit's KV reuse; the draft that computes them is
    # forerun.runtime.early_exit.ExitDraft, over this runtime's cache)

    def exposes(self, layers: Collection[int]) -> bool:
        """Whether a forward can return the hidden states of these layers (-1 = final)."""
        return (not layers or self.hidden_layers
                or (self.final_hidden and set(layers) <= {-1}))


class Runtime(Protocol):
    config: ModelConfig
    capabilities: Capabilities
    curve: LiveCurve | None  # its calibrated forward-time curve (forerun.profile); None = none yet

    @property
    def length(self) -> int:
        """Number of tokens whose keys and values are in the cache."""
        ...

    @property
    def capacity(self) -> int:
        """Most tokens the cache can hold (the usable context length)."""
        ...

    def forward(
        self,
        tokens: torch.Tensor,  # [T] int64, appended at cache slots length .. length+T-1
        *,
        positions: torch.Tensor | None = None,  # [T]; default: the slots (a chain)
        tree_mask: torch.Tensor | None = None,  # [T, T] bool among the new tokens; default causal
        last_only: bool = False,  # logits for the last token only (prefill)
        hidden_layers: tuple[int, ...] = (),  # layer outputs to return; -1 = final normed
        hidden_from: int = 0,  # ... of rows hidden_from.. only ([T - hidden_from, D])
        # resume: Resume | None = None, only where capabilities.resume_rows (the torch runtime):
        # its first rows start at a layer from given hidden states (early exit)
    ) -> ForwardOutput: ...

    def truncate(self, length: int) -> None:
        """Keep the first `length` cache slots; later slots are overwritten by the next forward."""
        ...

    def keep(self, start: int, rows: list[int]) -> None:
        """After a tree pass that appended tokens at slot `start`: keep only its tokens `rows`
        (indices into that pass, ascending: a root-to-node path, whose positions are start,
        start+1, ...) as slots start.., and drop every other token of the pass."""
        ...

    def fork(self) -> Runtime:
        """A runtime sharing these weights, with an empty cache of its own (one more sequence)."""
        ...
