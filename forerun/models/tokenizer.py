"""Tokenizers and chat templates, from GGUF metadata or a Hugging Face directory.

Owns: text <-> token ids, the chat template, the stop tokens, and incremental detokenization for
streaming. BPE runs in the `tokenizers` library; chat templates render in a bounded Jinja2 sandbox
(`forerun.models.chat_template`: they are untrusted code). Never touches weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from forerun.models.catalog import ModelError
from forerun.models.chat_template import compile_template, render

# Pre-tokenizer split patterns by GGUF `tokenizer.ggml.pre` (as in the models' tokenizer.json).
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GGUF_CONTROL, GGUF_USER_DEFINED = 3, 4  # llama.cpp token types that are added/special tokens
REPLACEMENT_CHAR = "\ufffd"


@dataclass
class TextTokenizer:
    """A `tokenizers.Tokenizer` plus what generation needs: template, BOS, stop ids."""

    tokenizer: Tokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    add_bos: bool
    stop_ids: frozenset[int]
    _template: jinja2.Template | None = field(default=None, repr=False)

    @property
    def vocab(self) -> dict[str, int]:
        return self.tokenizer.get_vocab(with_added_tokens=True)

    def frequent_ids(self, size: int) -> list[int]:
        """A drafter's reduced vocabulary: the `size` lowest ids plus every added/special token.

        A byte-level BPE numbers its tokens in merge order, and merges are learned most frequent
        first, so low ids are the frequent tokens (FR-Spec counts frequencies on a corpus; the
        merge rank is the count the tokenizer's own training already made)."""
        if size < 1:
            raise ValueError(f"a reduced vocabulary needs at least 1 token, got {size}")
        total = self.tokenizer.get_vocab_size(with_added_tokens=True)
        added = self.tokenizer.get_added_tokens_decoder()
        return sorted(set(range(min(size, total))) | set(added) | set(self.stop_ids))

    def encode(self, text: str, *, add_special: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos and self.bos_token is not None:
            bos = self.tokenizer.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos, *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_text(self, token: int) -> str:
        """One token's own text, special tokens included (a logprob's `token`)."""
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        if self.chat_template is None:
            raise ModelError("this model has no chat template; use --raw to send the prompt as is")
        if self._template is None:
            self._template = compile_template(self.chat_template)
        return render(self._template, messages=messages,
                      add_generation_prompt=add_generation_prompt,
                      bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                      **({"tools": tools} if tools else {}))

    def encode_prompt(self, prompt: str, *, raw: bool = False, system: str | None = None) -> list:
        """Token ids for a user prompt: through the chat template unless `raw`."""
        if raw or self.chat_template is None:
            return self.encode(prompt)
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}]
        return self.encode_chat(messages)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids for a whole conversation (`[{"role": ..., "content": ...}, ...]`) through
        the chat template (with `tools` where its template renders them), ending where the
        assistant's next reply begins."""
        # The template writes BOS itself where the model wants it.
        return self.encode(self.apply_chat_template(messages, tools=tools), add_special=False)

    def renders_tools(self) -> bool:
        """Its chat template reads a `tools` variable (a tool-calling model's)."""
        return self.chat_template is not None and "tools" in self.chat_template


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas without splitting UTF-8 characters.

    Decodes only a window (the last emitted tokens plus the new ones) and diffs it against the
    same window without the new ones, so each push costs O(window), not O(sequence)."""

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer, self.ids = tokenizer, []
        self.prefix_offset = self.read_offset = 0  # window start; end of already-emitted ids

    def push(self, ids: list[int], final: bool = False) -> str:
        self.ids.extend(ids)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if text.endswith(REPLACEMENT_CHAR) and not final:  # an incomplete character: wait
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix):]


def tokenizer_from_gguf(fields: dict) -> TextTokenizer:
    """Build the tokenizer from GGUF `tokenizer.ggml.*` metadata (BPE / gpt2 family)."""
    kind = fields.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelError(f"tokenizer type {kind!r} in this GGUF is not supported "
                         "(forerun reads byte-level BPE tokenizers: Qwen2, SmolLM2, Llama 3)")
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    types: list[int] = fields.get("tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = fields.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("qwen2", "deepseek-r1-qwen"):
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"), byte_level])
    elif pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind_ in zip(tokens, types, strict=True)
                            if kind_ in (GGUF_CONTROL, GGUF_USER_DEFINED)])

    def token(key: str) -> str | None:
        idx = fields.get(key)
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    eos = token("tokenizer.ggml.eos_token_id")
    stops = {vocab[t] for t in (eos, token("tokenizer.ggml.eot_token_id"), "<|im_end|>",
                                "<|endoftext|>", "<|eot_id|>") if t is not None and t in vocab}
    return TextTokenizer(tok, fields.get("tokenizer.chat_template"),
                         token("tokenizer.ggml.bos_token_id"), eos,
                         bool(fields.get("tokenizer.ggml.add_bos_token", False)), frozenset(stops))


def tokenizer_from_gguf_sentencepiece(path: Path) -> TextTokenizer | None:
    """A SentencePiece tokenizer (GGUF `tokenizer.ggml.model` llama, as Gemma's) rebuilt by
    transformers' GGUF converter, where transformers is installed (None where it is not): read
    for drafting across vocabularies (forerun.propose.cross_vocab), never to run the model."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            convert_gguf_tokenizer,
            get_gguf_tokenizer,
        )
    except ImportError:
        return None
    arch, spec, config = get_gguf_tokenizer(str(path))
    tok, _ = convert_gguf_tokenizer(arch, spec)
    vocab = tok.get_vocab(with_added_tokens=True)
    stops = {vocab[t] for t in (config.get("eos_token"), "<end_of_turn>", "<|im_end|>")
             if t is not None and t in vocab}
    return TextTokenizer(tok, None, config.get("bos_token"), config.get("eos_token"),
                         bool(config.get("add_bos_token")), frozenset(stops))


def tokenizer_from_hf_dir(path: Path) -> TextTokenizer:
    """Load tokenizer.json and tokenizer_config.json (chat template, special tokens)."""
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        raise ModelError(f"{path} has no tokenizer.json")
    tok = Tokenizer.from_file(str(tok_file))
    config = _read_json(path / "tokenizer_config.json")
    gen = _read_json(path / "generation_config.json")

    def token_text(value) -> str | None:
        return value.get("content") if isinstance(value, dict) else value

    bos, eos = token_text(config.get("bos_token")), token_text(config.get("eos_token"))
    vocab = tok.get_vocab(with_added_tokens=True)
    eos_ids = gen.get("eos_token_id", [])
    stops = set(eos_ids if isinstance(eos_ids, list) else [eos_ids])
    stops |= {vocab[t] for t in (eos, "<|im_end|>", "<|endoftext|>", "<|eot_id|>") if t in vocab}
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    return TextTokenizer(tok, template, bos, eos, bool(config.get("add_bos_token", False)),
                         frozenset(stops))


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}
