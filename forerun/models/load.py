"""Opening models from any source a user has: catalog name, GGUF file, HF directory, HF hub id.

Owns: resolving a source string to a `ModelSource` (config + tokenizer, cheap to open) and
turning it into a runtime (see RUNTIMES: our torch Transformer with the weights dequantized to
the requested dtype, or llama.cpp running the GGUF file as it is). Opening is split from
loading so that checks such as a draft/target vocabulary mismatch fail before gigabytes load.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from forerun.heads import TargetIO
from forerun.models.catalog import CATALOG, ModelError, lookup, pull
from forerun.models.gguf_file import GGUFFile
from forerun.models.tokenizer import (
    TextTokenizer,
    tokenizer_from_gguf,
    tokenizer_from_gguf_sentencepiece,
    tokenizer_from_hf_dir,
)
from forerun.runtime.base import ModelConfig, Runtime
from forerun.runtime.torch_model import TorchRuntime, Transformer

SUPPORTED_ARCHS = ("llama", "qwen2")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # CPUs whose bf16 matmuls beat float32


def resolve_dtype(dtype: str, device: str) -> str:
    """"auto": bfloat16 on CUDA and on CPUs with native bf16 matmuls, float32 elsewhere."""
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        return "bfloat16"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "float32"
    return "bfloat16" if any(f in flags for f in BF16_CPU_FLAGS) else "float32"
DEFAULT_CONTEXT = 4096  # KV cache slots allocated unless the caller asks for more

# GGUF tensor name -> canonical name (see forerun.runtime.torch_model.CANONICAL_NAMES)
GGUF_NAMES = {
    "token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head",
    "attn_norm.weight": "attn_norm", "attn_q.weight": "wq", "attn_k.weight": "wk",
    "attn_v.weight": "wv", "attn_q.bias": "bq", "attn_k.bias": "bk", "attn_v.bias": "bv",
    "attn_output.weight": "wo", "ffn_norm.weight": "ffn_norm", "ffn_gate.weight": "w_gate",
    "ffn_up.weight": "w_up", "ffn_down.weight": "w_down",
}
HF_NAMES = {
    "model.embed_tokens.weight": "embed", "model.norm.weight": "norm", "lm_head.weight": "lm_head",
    "input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk", "self_attn.v_proj.weight": "wv",
    "self_attn.q_proj.bias": "bq", "self_attn.k_proj.bias": "bk", "self_attn.v_proj.bias": "bv",
    "self_attn.o_proj.weight": "wo", "post_attention_layernorm.weight": "ffn_norm",
    "mlp.gate_proj.weight": "w_gate", "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
}


@dataclass
class ModelSource:
    """An opened model: its shape and tokenizer are known, its weights not yet read."""

    name: str
    kind: str  # "gguf" or "hf"
    path: Path
    config: ModelConfig | None  # None: an architecture we can read but not run
    tokenizer: TextTokenizer
    gguf: GGUFFile | None = None

    def load(self, *, dtype: str = "auto", device: str = "cpu",
             context: int = DEFAULT_CONTEXT, runtime: str = "torch") -> Runtime:
        """`runtime`: a key of RUNTIMES; `dtype` applies to the torch runtime only."""
        if runtime not in RUNTIMES:
            raise ModelError(f"unknown runtime {runtime!r}; choose {', '.join(RUNTIMES)}")
        return RUNTIMES[runtime](self, dtype, device, context)


def load_transformer(src: ModelSource, dtype: str = "float32", device: str = "cpu"
                     ) -> Transformer:
    """Weights dequantized to `dtype` into our own Transformer, its linears plain nn.Linear
    (what `forerun train draft` trains; the torch runtime prepacks them)."""
    dtype = resolve_dtype(dtype, device)
    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype {dtype!r}; choose auto or {', '.join(DTYPES)}")
    if src.config is None:
        raise ModelError(f"{src.path}: architecture not supported by the torch runtime "
                         f"(supported: {', '.join(SUPPORTED_ARCHS)})")
    torch_dtype = DTYPES[dtype]
    weights = (_gguf_weights if src.kind == "gguf" else _hf_weights)(src, torch_dtype)
    with torch.device("meta"):
        model = Transformer(src.config)
    model = model.to_empty(device=device).to(torch_dtype)
    model.load_canonical({k: v.to(device) for k, v in weights.items()})
    del weights
    if src.gguf is not None:  # the file's pages we read, and the float32 copies' heap
        src.gguf.drop_pages()
    release_heap()
    return model.eval()


def release_heap() -> None:
    """Hand the heap's free pages back to the system (glibc keeps the dequantized float32
    copies' arenas resident after they are freed: ~0.5 GB for the 1.5B target); no-op
    elsewhere."""
    with contextlib.suppress(OSError, AttributeError):  # (not glibc)
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _load_torch(src: ModelSource, dtype: str, device: str, context: int) -> TorchRuntime:
    """Weights dequantized to `dtype` into our own Transformer."""
    return TorchRuntime(load_transformer(src, dtype, device), capacity=context, source=src.path)


def _load_llama_cpp(src: ModelSource, dtype: str, device: str, context: int) -> Runtime:
    """The GGUF file as it is, on llama.cpp's quantized kernels; `dtype` does not apply."""
    if src.kind != "gguf":
        raise ModelError(f"runtime llama.cpp runs GGUF files; {src.path} is a Hugging Face "
                         "directory (convert it with llama.cpp's convert_hf_to_gguf.py, or use "
                         "--runtime torch)")
    try:
        from forerun.runtime.llama_cpp import LlamaCppRuntime
    except (ImportError, OSError) as e:  # OSError: installed, but its shared library is broken
        raise ModelError(f"runtime llama.cpp needs llama-cpp-python ({e}): pip install "
                         "'forerun[llama]' (or `make install`; it compiles for a few minutes)"
                         ) from e
    config = src.config or _gguf_config(src.gguf)  # (an architecture only llama.cpp runs)
    try:
        return LlamaCppRuntime(src.path, config, context, gpu=device.startswith("cuda"))
    except RuntimeError as e:
        raise ModelError(str(e)) from e


# runtime name -> loader(source, dtype, device, context)
RUNTIMES: dict[str, Callable[[ModelSource, str, str, int], Runtime]] = {
    "torch": _load_torch,
    "llama.cpp": _load_llama_cpp,
}


def open_model(source: str) -> ModelSource:
    """Resolve a catalog name, a .gguf path, a HF directory or a HF hub id."""
    path = Path(source).expanduser()
    if source in CATALOG:
        return _open_gguf(source, pull(source))
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelError(f"{path} is not a .gguf file")
        return _open_gguf(path.stem, path)
    if path.is_dir():
        return _open_hf_dir(path.name, path)
    if path.suffix == ".gguf" or source.startswith((".", "/", "~")):
        raise ModelError(f"no such file or directory: {path}")
    if source.count("/") == 1:
        return _open_hf_dir(source, _hub_snapshot(source))
    lookup(source)  # not a catalog name either: raises the error listing the known models
    raise AssertionError("unreachable")


# --- GGUF ---------------------------------------------------------------------------------------

def _open_gguf(name: str, path: Path) -> ModelSource:
    try:
        gguf = GGUFFile(path)
    except Exception as e:
        raise ModelError(f"{path} is not a readable GGUF file: {e}") from e
    fields = gguf.fields
    arch = fields.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:  # its tokenizer (a draft's across vocabularies) and,
        # on llama.cpp only, its weights (see _load_llama_cpp)
        return ModelSource(name, "gguf", path, None, _foreign(fields, path), gguf)
    return ModelSource(name, "gguf", path, _gguf_config(gguf), tokenizer_from_gguf(fields), gguf)


def _gguf_config(gguf: GGUFFile) -> ModelConfig:
    """The model's shape from its GGUF metadata (llama.cpp runs any architecture it knows
    from the file alone; our torch Transformer only SUPPORTED_ARCHS)."""
    fields = gguf.fields
    arch = fields.get("general.architecture")

    def f(key: str):
        return fields[f"{arch}.{key}"]

    n_vocab = fields.get(f"{arch}.vocab_size") or len(fields["tokenizer.ggml.tokens"])
    try:
        return ModelConfig(
            arch=arch, vocab_size=n_vocab, dim=f("embedding_length"),
            n_layers=f("block_count"), n_heads=f("attention.head_count"),
            n_kv_heads=f("attention.head_count_kv"), ffn_dim=f("feed_forward_length"),
            rope_theta=float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
            norm_eps=float(f("attention.layer_norm_rms_epsilon")),
            context_length=f("context_length"), qkv_bias="blk.0.attn_q.bias" in gguf.tensors,
            tied_embeddings="output.weight" not in gguf.tensors)
    except KeyError as e:
        raise ModelError(f"the GGUF metadata lacks {e} (architecture {arch})") from e


def _foreign(fields: dict, path: Path) -> TextTokenizer:
    """A model our torch runtime cannot run: still read its tokenizer (byte-level BPE, or
    SentencePiece through transformers where installed), so vocabulary checks can name it and
    it can draft across vocabularies on llama.cpp."""
    try:
        return tokenizer_from_gguf(fields)
    except ModelError:
        if fields.get("tokenizer.ggml.model") == "llama":
            sentencepiece = tokenizer_from_gguf_sentencepiece(path)
            if sentencepiece is not None:
                return sentencepiece
        from tokenizers import Tokenizer
        from tokenizers.models import WordLevel

        vocab = {t: i for i, t in enumerate(fields.get("tokenizer.ggml.tokens", []))}
        return TextTokenizer(Tokenizer(WordLevel(vocab, unk_token=None)), None, None, None,
                             False, frozenset())


def target_io(src: ModelSource, runtime: Runtime) -> TargetIO:
    """The target's token embeddings and LM head rows, for heads that draft from its features:
    the torch runtime's own tensors, or for another runtime those two read from the file."""
    if isinstance(runtime, TorchRuntime):  # its own tensors, in memory
        model = runtime.model
        return TargetIO(model.embed.weight.detach(), model.lm_weight().detach())
    read = _gguf_weights if src.kind == "gguf" else _hf_weights
    w = read(src, torch.float32, names=("embed", "lm_head"))
    return TargetIO(w["embed"], w.get("lm_head", w["embed"]))


def _gguf_weights(src: ModelSource, dtype: torch.dtype,
                  names: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
    """Canonical name -> tensor; `names`: only these canonical names."""
    from gguf.quants import dequantize

    cfg, weights = src.config, {}
    for info in src.gguf.tensors.values():
        parts = info.name.split(".")
        if parts[0] == "blk":
            key = ".".join(parts[2:])
            if key not in GGUF_NAMES:
                continue
            name = f"layers.{parts[1]}.{GGUF_NAMES[key]}"
        elif info.name in GGUF_NAMES:
            name = GGUF_NAMES[info.name]
        else:
            continue
        if names is not None and name not in names:
            continue
        array = dequantize(src.gguf.raw(info.name), info.qtype)  # float32 [out, in]
        if cfg.arch == "llama" and name.endswith((".wq", ".wk")):
            # llama.cpp's converter interleaves q/k rows for its RoPE; undo to the HF layout.
            heads = cfg.n_heads if name.endswith(".wq") else cfg.n_kv_heads
            array = _unpermute(array, heads)
        # np.array copies: the memory map is read-only
        weights[name] = torch.from_numpy(np.array(array, dtype=np.float32)).to(dtype)
    return weights


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    rows = w.shape[0]
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
             .swapaxes(1, 2).reshape(w.shape))


# --- Hugging Face -------------------------------------------------------------------------------

def _hub_snapshot(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=[
            "*.json", "*.safetensors", "tokenizer*", "*.jinja"]))
    except Exception as e:  # offline, unknown repo, gated, ...
        known = ", ".join(sorted(CATALOG))
        raise ModelError(f"could not fetch {repo_id!r} from the Hugging Face hub "
                         f"({type(e).__name__}: {str(e).splitlines()[0][:200]}). Use a catalog "
                         f"name ({known}), a local .gguf file or a local HF directory.") from e


def _open_hf_dir(name: str, path: Path) -> ModelSource:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelError(f"{path} has no config.json; expected a Hugging Face model directory")
    hf = json.loads(config_file.read_text())
    arch = hf.get("model_type")
    if arch not in SUPPORTED_ARCHS:
        raise ModelError(f"{path}: model_type {arch!r} is not supported "
                         f"({', '.join(SUPPORTED_ARCHS)})")
    config = ModelConfig(
        arch=arch, vocab_size=hf["vocab_size"], dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"], n_heads=hf["num_attention_heads"],
        n_kv_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
        ffn_dim=hf["intermediate_size"], rope_theta=float(hf.get("rope_theta", 10000.0)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        context_length=hf.get("max_position_embeddings", DEFAULT_CONTEXT),
        qkv_bias=bool(hf.get("attention_bias", arch == "qwen2")),
        tied_embeddings=bool(hf.get("tie_word_embeddings", False)))
    return ModelSource(name, "hf", path, config, tokenizer_from_hf_dir(path))


def _hf_weights(src: ModelSource, dtype: torch.dtype,
                names: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(src.path.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{src.path} has no .safetensors files")
    weights = {}
    for file in files:
        for key, tensor in load_file(file).items():
            if key.startswith("model.layers."):
                parts = key.split(".")
                sub = ".".join(parts[3:])
                if sub in HF_NAMES:
                    weights[f"layers.{parts[2]}.{HF_NAMES[sub]}"] = tensor.to(dtype)
            elif key in HF_NAMES:
                weights[HF_NAMES[key]] = tensor.to(dtype)
    return weights if names is None else {k: v for k, v in weights.items() if k in names}
