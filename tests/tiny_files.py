"""Tiny model files written in tests: a byte-level BPE tokenizer, random Llama weights, and the
same weights as a Hugging Face directory (config.json + safetensors + tokenizer.json) or a GGUF
file (with llama.cpp's q/k row permutation)."""

import json
from dataclasses import dataclass

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

DIM, LAYERS, HEADS, KV_HEADS, FFN, CTX = 32, 2, 4, 2, 48, 128
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_tokens() -> list[str]:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    return sorted(alphabet) + SPECIAL


def random_hf_weights(vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    w = {"model.embed_tokens.weight": r(vocab, DIM), "model.norm.weight": 1 + r(DIM),
         "lm_head.weight": r(vocab, DIM)}
    hd = DIM // HEADS
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": 1 + r(DIM),
              p + "self_attn.q_proj.weight": r(HEADS * hd, DIM),
              p + "self_attn.k_proj.weight": r(KV_HEADS * hd, DIM),
              p + "self_attn.v_proj.weight": r(KV_HEADS * hd, DIM),
              p + "self_attn.o_proj.weight": r(DIM, HEADS * hd),
              p + "post_attention_layernorm.weight": 1 + r(DIM),
              p + "mlp.gate_proj.weight": r(FFN, DIM), p + "mlp.up_proj.weight": r(FFN, DIM),
              p + "mlp.down_proj.weight": r(DIM, FFN)}
    return w


def write_hf_dir(path, weights, tokens):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": len(tokens), "hidden_size": DIM,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "intermediate_size": FFN, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6, "max_position_embeddings": CTX, "tie_word_embeddings": False}))
    save_file(weights, str(path / "model.safetensors"))
    tok = Tokenizer(BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "chat_template":
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"}))


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows of llama-architecture models."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
             .swapaxes(1, 2).reshape(w.shape))


@dataclass(frozen=True)
class Quantized:
    """A GGUF tensor already in a quantized type: `data` its blocks' bytes, [rows, row bytes]."""
    data: np.ndarray
    qtype: int  # gguf.GGMLQuantizationType


def random_kquant_weights(vocab: int, dim: int, layers: int, ffn: int, seed: int = 0):
    """Llama weights whose matrices are random Q4_K blocks and the LM head random Q6_K blocks
    (the K-quants of a Q4_K_M file), each block's scale set so activations stay O(1); the
    embeddings and norms float32. Shapes for llama.cpp's AMX buffers: dim and ffn multiples of
    256, vocab of 32."""
    import gguf

    rng = np.random.default_rng(seed)

    def kquant(rows: int, cols: int, qtype) -> Quantized:
        block, per_row = gguf.GGML_QUANT_SIZES[qtype][1], cols // 256
        data = rng.integers(0, 256, (rows, per_row, block), dtype=np.uint8)
        scale = np.frombuffer(np.float16(0.5 / np.sqrt(cols)).tobytes(), np.uint8)
        if qtype == gguf.GGMLQuantizationType.Q4_K:  # d, dmin, scales[12], qs[128]
            data[:, :, 0:2], data[:, :, 2:4] = scale, scale
        else:  # Q6_K: ql[128], qh[64], scales[16] (int8, kept small), d
            data[:, :, 192:208] = rng.integers(0, 16, (rows, per_row, 16), dtype=np.uint8)
            data[:, :, 208:210] = scale
        return Quantized(data.reshape(rows, per_row * block), qtype)

    q4, q6 = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K
    w = {"model.embed_tokens.weight": torch.from_numpy(rng.standard_normal((vocab, dim),
                                                                            np.float32)),
         "model.norm.weight": torch.ones(dim), "lm_head.weight": kquant(vocab, dim, q6)}
    for i in range(layers):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": torch.ones(dim),
              p + "post_attention_layernorm.weight": torch.ones(dim)}
        w |= {p + name: kquant(rows, cols, q4) for name, rows, cols in (
            ("self_attn.q_proj.weight", dim, dim), ("self_attn.k_proj.weight", dim, dim),
            ("self_attn.v_proj.weight", dim, dim), ("self_attn.o_proj.weight", dim, dim),
            ("mlp.gate_proj.weight", ffn, dim), ("mlp.up_proj.weight", ffn, dim),
            ("mlp.down_proj.weight", dim, ffn))}
    return w


def write_gguf(path, weights, tokens, merges=(), shape=(DIM, LAYERS, HEADS, KV_HEADS, FFN),
               context=CTX):
    """`merges`: BPE merges ("a b"); llama.cpp refuses to load a file with none; `shape`:
    (dim, layers, heads, kv heads, ffn); a `Quantized` weight is written as it is."""
    import gguf

    dim, layers, heads, kv_heads, ffn = shape
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(context)
    writer.add_embedding_length(dim)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - len(SPECIAL)) + [3] * len(SPECIAL))
    writer.add_token_merges(list(merges))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
             "output_norm.weight", "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight":
                 "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
                 "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight":
                 "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
                 "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight":
                 "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
    for key, tensor in weights.items():
        if key in names:
            name = names[key]
        else:
            layer, sub = key.split(".")[2], ".".join(key.split(".")[3:])
            name = f"blk.{layer}.{per_layer[sub]}"
        if isinstance(tensor, Quantized):  # random blocks: no row order to keep
            writer.add_tensor(name, tensor.data, raw_dtype=tensor.qtype)
            continue
        array = tensor.numpy()
        if name.endswith("attn_q.weight"):
            array = llama_cpp_permute(array, heads)
        elif name.endswith("attn_k.weight"):
            array = llama_cpp_permute(array, kv_heads)
        writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
