"""QSpec (Zhao et al. 2024): the target's own weights at a lower precision draft for it; the target
verifies at its own precision, so the output is the target's exactly (the usual verifier).

Owns: the choice of the draft's form (`QSpecConfig`) and where it is kept. Three forms:
- `torch` (a torch target): a copy of its linear weights in int8 (W8A16), int8 with 8-bit
  activations (W8A8) or int4 (W4A16), on torch's kernels (`forerun.runtime.quantized`);
- `llama.cpp` under a torch target loaded from a GGUF file: the same file on llama.cpp's
  kernels. A bfloat16 target from the default Q4_K_M file is W4A16 (the file's own 4-bit values,
  dequantized); llama.cpp runs them as W4A8 (it quantizes activations to 8 bits inside its
  matmuls): QSpec's pairing, the bfloat16 model's output at close to llama.cpp's cost. With
  `qtype`, the file requantized first;
- `llama.cpp` under a llama.cpp target: its file requantized to `qtype` (Q4_0 unless given)
  by llama.cpp's own quantizer, kept in the model cache with its SHA-256
  (`forerun.models.requantize`).
Drafting itself is the draft-model method's (`DraftModelProposer`: autoregressive, q from the
same sampling settings, rollback by truncation) over that runtime. The draft's weights are
loaded once per engine (`ProposerContext.shared`, else the sequence's stores) and each sequence
drafts on a runtime of its own over them (its own KV cache): the first on the loaded one, later
ones (forks, batch members) on forks of it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from forerun.models.load import open_model
from forerun.models.requantize import QTYPES, requantized
from forerun.propose.base import Needs, ProposerContext
from forerun.propose.draft_model import DraftModelProposer
from forerun.runtime.base import Runtime
from forerun.runtime.quantized import quantized_runtime
from forerun.runtime.torch_model import TorchRuntime

STORE = "qspec"  # the stores' key prefix of a sequence's draft runtime (and the engine's weights)
RUNTIMES = ("auto", "torch", "llama.cpp")
BITS = (8, 4)  # the torch draft's weight bits
ACTIVATION_BITS = (16, 8)  # the torch draft's activations: bfloat16, or 8 bits per call
LLAMA_DEFAULT_QTYPE = "Q4_0"  # a llama.cpp target's draft, unless --qspec-type says otherwise


@dataclass(frozen=True)
class QSpecConfig:
    runtime: str = "auto"  # the draft's runtime: torch, llama.cpp, or auto (llama.cpp where the
    # target's file is a GGUF and llama-cpp-python is installed, else torch)
    bits: int = 8  # torch draft: weight bits
    activations: int = 16  # torch draft: activation bits (8: W8A8, with 8-bit weights only)
    qtype: str | None = None  # llama.cpp draft: requantize the file to this type first (None:
    # the file as it is under a torch target, LLAMA_DEFAULT_QTYPE under a llama.cpp one)

    def __post_init__(self):
        if self.runtime not in RUNTIMES:
            raise ValueError(f"qspec runtime must be one of {', '.join(RUNTIMES)}, got "
                             f"{self.runtime!r}")
        if self.bits not in BITS or self.activations not in ACTIVATION_BITS:
            raise ValueError(f"qspec bits must be one of {BITS} and activation bits one of "
                             f"{ACTIVATION_BITS}, got {self.bits} and {self.activations}")
        if self.bits == 4 and self.activations == 8:
            raise ValueError("qspec: torch has no CPU kernel for 4-bit weights with 8-bit "
                             "activations; use --qspec-bits 8 (W8A8) or --qspec-runtime "
                             "llama.cpp (W4A8)")
        if self.qtype is not None and self.qtype not in QTYPES:
            raise ValueError(f"qspec type must be one of {', '.join(QTYPES)}, got "
                             f"{self.qtype!r}")

    @property
    def precision(self) -> str:
        """The torch draft's precision (a key of forerun.runtime.quantized.PRECISIONS)."""
        return "int4" if self.bits == 4 else "w8a8" if self.activations == 8 else "int8"

    def draft_runtime(self, target: Runtime) -> str:
        """The draft's runtime for `target`: the given one, or auto's choice."""
        if self.runtime != "auto":
            return self.runtime
        if not isinstance(target, TorchRuntime):
            return "llama.cpp"
        gguf = target.source is not None and target.source.suffix == ".gguf"
        return "llama.cpp" if gguf and importlib.util.find_spec("llama_cpp") else "torch"


class QSpecProposer(DraftModelProposer):
    """The draft-model method whose draft is the target's own weights at a lower precision."""

    name = "qspec"
    needs = Needs(grammar=True, shared_store=True)  # its draft runtime is kept in the stores


class DraftWeights:
    """A draft runtime loaded once; each sequence drafts on one of its own over its weights."""

    def __init__(self, runtime: Runtime):
        self.runtime, self.lent = runtime, False

    def take(self) -> Runtime:
        """The loaded runtime for the first sequence, a fork (same weights, its own cache) for
        every later one."""
        if self.lent:
            return self.runtime.fork()
        self.lent = True
        return self.runtime


def qspec_proposer(cfg: QSpecConfig, ctx: ProposerContext) -> QSpecProposer:
    """A proposer for one sequence of `ctx.target`; its draft runtime is built once per store
    and reused by the sequence's later proposers."""
    target = ctx.target
    runtime = cfg.draft_runtime(target)
    if runtime == "torch":
        if not isinstance(target, TorchRuntime):
            raise ValueError(f"qspec's torch draft quantizes the torch model's weights; the "
                             f"target runs on {type(target).__name__}: use --qspec-runtime "
                             "llama.cpp")
        key = f"{STORE}:torch:{cfg.precision}"
    else:
        key = f"{STORE}:llama.cpp:{_qtype(cfg, target) or 'as-is'}"
    engine = ctx.shared if ctx.shared is not None else ctx.stores
    if key not in ctx.stores:
        if key not in engine:
            engine[key] = DraftWeights(_build(cfg, target, runtime))
        ctx.stores[key] = engine[key].take()
    return QSpecProposer(ctx.stores[key], target.config.vocab_size)


def _build(cfg: QSpecConfig, target: Runtime, runtime: str) -> Runtime:
    """The draft runtime of `cfg` for `target`: loaded (and requantized) now."""
    if runtime == "torch":
        return quantized_runtime(target, cfg.precision)
    source = target.source
    if source is None or source.suffix != ".gguf":
        raise ValueError(f"qspec's llama.cpp draft runs the target's GGUF file; this target "
                         f"was loaded from {source or 'no file'}: use --qspec-runtime torch")
    qtype = _qtype(cfg, target)
    path = Path(source) if qtype is None else requantized(Path(source), qtype)
    draft = open_model(str(path)).load(runtime="llama.cpp", context=target.capacity)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"{path}: {draft.config.vocab_size} tokens, the target "
                         f"{target.config.vocab_size}")
    return draft


def _qtype(cfg: QSpecConfig, target: Runtime) -> str | None:
    """The type a llama.cpp draft's file is requantized to (None: the target's file as is)."""
    return cfg.qtype or (None if isinstance(target, TorchRuntime) else LLAMA_DEFAULT_QTYPE)
