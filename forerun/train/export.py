"""Writing a trained draft model where `--draft` reads it: a Hugging Face folder and a GGUF file.

Owns: our Transformer's fused weights back to canonical ones (`canonical_weights`), the folder
(config.json, model.safetensors under HF's tensor names, the tokenizer's files: copied from an
HF source, written from the tokenizer of a GGUF one) and the GGUF file, written through the
`gguf` package: the source GGUF's metadata copied key by key with its types (tokenizer, chat
template, architecture), or, from an HF source, built from its config and tokenizer; matrices
in f16 (or f32), norms and biases in f32, q/k rows of llama models permuted as llama.cpp's
converter does. The loaders in `forerun.models.load` read both back.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

from forerun.models.load import GGUF_NAMES, HF_NAMES, ModelSource
from forerun.runtime.torch_model import Transformer

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                      "special_tokens_map.json", "vocab.json", "merges.txt",
                      "chat_template.jinja")
GGUF_DTYPES = ("f16", "f32")
SKIPPED_GGUF_KEYS = ("general.architecture", "general.file_type", "general.quantization_version")
GGUF_NORMAL, GGUF_CONTROL, GGUF_UNUSED = 1, 3, 5  # llama.cpp's token types (special = control)


def canonical_weights(model: Transformer) -> dict[str, torch.Tensor]:
    """Canonical name -> tensor (see torch_model.CANONICAL_NAMES): q/k/v and gate/up unfused."""
    cfg = model.cfg
    q_size, kv_size = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    w = {"embed": model.embed.weight, "norm": model.norm}
    if model.lm_head is not None:
        w["lm_head"] = model.lm_head.weight
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}."
        wq, wk, wv = layer.wqkv.weight.split([q_size, kv_size, kv_size])
        gate, up = layer.w_gate_up.weight.chunk(2)
        w |= {p + "attn_norm": layer.attn_norm, p + "wq": wq, p + "wk": wk, p + "wv": wv,
              p + "wo": layer.wo.weight, p + "ffn_norm": layer.ffn_norm,
              p + "w_gate": gate, p + "w_up": up, p + "w_down": layer.w_down.weight}
        if layer.wqkv.bias is not None:
            bq, bk, bv = layer.wqkv.bias.split([q_size, kv_size, kv_size])
            w |= {p + "bq": bq, p + "bk": bk, p + "bv": bv}
    return {k: v.detach().contiguous() for k, v in w.items()}


def save_hf(model: Transformer, src: ModelSource, out: Path) -> None:
    """out/config.json, out/model.safetensors and the tokenizer's files."""
    from safetensors.torch import save_file

    cfg = model.cfg
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({
        "model_type": cfg.arch, "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "intermediate_size": cfg.ffn_dim,
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.context_length, "attention_bias": cfg.qkv_bias,
        "tie_word_embeddings": cfg.tied_embeddings,
        "torch_dtype": str(model.embed.weight.dtype).removeprefix("torch.")}, indent=2) + "\n")
    hf = {v: k for k, v in HF_NAMES.items()}  # canonical -> HF name (a layer's: its suffix)
    tensors = {}
    for name, t in canonical_weights(model).items():
        if name.startswith("layers."):
            _, i, sub = name.split(".")
            tensors[f"model.layers.{i}.{hf[sub]}"] = t
        else:
            tensors[hf[name]] = t
    save_file(tensors, str(out / "model.safetensors"))
    if src.kind == "hf":
        for name in HF_TOKENIZER_FILES:
            if (src.path / name).is_file():
                shutil.copy(src.path / name, out / name)
        return
    tok = src.tokenizer
    tok.tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": tok.bos_token, "eos_token": tok.eos_token, "add_bos_token": tok.add_bos,
        "chat_template": tok.chat_template}, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": sorted(tok.stop_ids)}) + "\n")


def save_gguf(model: Transformer, src: ModelSource, path: Path, dtype: str = "f16") -> None:
    """The model as a GGUF file at `path` (matrices in `dtype`, f16 or f32)."""
    import gguf

    if dtype not in GGUF_DTYPES:
        raise ValueError(f"unknown GGUF dtype {dtype!r}; choose {', '.join(GGUF_DTYPES)}")
    cfg = model.cfg
    writer = gguf.GGUFWriter(str(path), cfg.arch)
    if src.kind == "gguf":
        _copy_metadata(writer, src.path)
    else:
        _metadata_from_hf(writer, model, src)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16"
                         else gguf.LlamaFileType.ALL_F32)
    names = {v: k for k, v in GGUF_NAMES.items()}  # canonical -> GGUF name (a layer's: suffix)
    for name, t in canonical_weights(model).items():
        array = t.float().cpu().numpy()
        if name.startswith("layers."):
            _, i, sub = name.split(".")
            key = f"blk.{i}.{names[sub]}"
            if cfg.arch == "llama" and sub in ("wq", "wk"):  # the converter's RoPE row order
                array = _permute(array, cfg.n_heads if sub == "wq" else cfg.n_kv_heads)
        else:
            key = names[name]
        if dtype == "f16" and array.ndim == 2:
            array = array.astype(np.float16)
        writer.add_tensor(key, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows of llama models (load's `_unpermute` undoes
    it)."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
             .swapaxes(1, 2).reshape(w.shape))


def _copy_metadata(writer, source: Path) -> None:
    """Every key of the source GGUF, with its value type, but those the writer sets itself
    (architecture, file type) and those of its quantization."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in SKIPPED_GGUF_KEYS:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub)


def _metadata_from_hf(writer, model: Transformer, src: ModelSource) -> None:
    """An HF source's config and tokenizer as GGUF keys (byte-level BPE: tokenizer.json's)."""
    cfg, tok = model.cfg, src.tokenizer
    writer.add_block_count(cfg.n_layers)
    writer.add_context_length(cfg.context_length)
    writer.add_embedding_length(cfg.dim)
    writer.add_feed_forward_length(cfg.ffn_dim)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.n_kv_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    vocab = tok.vocab
    tokens = sorted(vocab, key=vocab.get)
    special = set(tok.tokenizer.get_added_tokens_decoder())
    types = [GGUF_CONTROL if vocab[t] in special else GGUF_NORMAL for t in tokens]
    pad = range(len(tokens), cfg.vocab_size)  # an LM head padded past the tokenizer's ids
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if cfg.arch == "qwen2" else "default")
    writer.add_token_list([*tokens, *(f"[PAD{i}]" for i in pad)])
    writer.add_token_types([*types, *(GGUF_UNUSED for _ in pad)])
    merges = json.loads((src.path / "tokenizer.json").read_text())["model"].get("merges", [])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    for token, add in ((tok.eos_token, writer.add_eos_token_id),
                       (tok.bos_token, writer.add_bos_token_id)):
        if token is not None and token in vocab:
            add(vocab[token])
    writer.add_add_bos_token(tok.add_bos)
    if tok.chat_template:
        writer.add_chat_template(tok.chat_template)
