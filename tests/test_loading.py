"""Weight loading from the sources users have: a HF directory (config.json + safetensors +
tokenizer.json) and a GGUF file, both built here from the same random weights; a hub id
offline; bad paths. The two loaders must give the same logits; a loaded GGUF's pages are let go
and read again when needed."""

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from tiny_files import byte_tokens, random_hf_weights, write_gguf, write_hf_dir

from forerun.models.catalog import ModelError
from forerun.models.load import open_model

SUBPROCESS_TIMEOUT_S = 120  # a fresh interpreter importing torch, on a busy machine


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    tokens = byte_tokens()
    weights = random_hf_weights(len(tokens))
    write_hf_dir(root / "hf", weights, tokens)
    write_gguf(root / "tiny.gguf", weights, tokens)
    return root / "hf", root / "tiny.gguf"


def test_hf_dir_and_gguf_give_the_same_model(sources):
    hf, gg = open_model(str(sources[0])), open_model(str(sources[1]))
    assert replace(gg.config, norm_eps=1e-6) == hf.config  # GGUF keeps eps as float32
    assert hf.tokenizer.vocab == gg.tokenizer.vocab
    text = "def f(x):\n    return x  # héllo"
    ids = hf.tokenizer.encode(text)
    assert ids == gg.tokenizer.encode(text) and hf.tokenizer.decode(ids) == text
    a = hf.load(dtype="float64").forward(torch.tensor(ids)).logits
    b = gg.load(dtype="float64").forward(torch.tensor(ids)).logits
    assert torch.allclose(a, b, atol=1e-5)  # GGUF stores float32: float32 rounding only


def test_a_loaded_gguf_lets_go_of_its_file_pages_and_reads_them_again(sources):
    """Once the torch runtime has copied the weights out, the GGUF's mapped pages are dropped
    (they would count in the server's resident memory); a later read maps them again."""
    gg = open_model(str(sources[1]))
    name = next(iter(gg.gguf.tensors))
    before = gg.gguf.raw(name).copy()
    first = gg.load(dtype="float64").forward(torch.tensor([1, 2, 3])).logits
    assert (gg.gguf.raw(name) == before).all()
    gg.gguf.drop_pages()
    again = gg.load(dtype="float64").forward(torch.tensor([1, 2, 3])).logits
    assert torch.equal(first, again)


def test_chat_template_and_stop_tokens_from_hf_dir(sources):
    tok = open_model(str(sources[0])).tokenizer
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.vocab["<|im_end|>"] in tok.stop_ids
    assert tok.encode_prompt("hi")[0] == tok.vocab["<|im_start|>"]


def test_hub_id_offline_fails_clearly(tmp_path):
    """huggingface_hub reads HF_HUB_OFFLINE when it is imported (an earlier test may already
    have imported it in this process), so the offline case runs in a fresh interpreter with the
    variable set before any import, and an empty cache: the error must be forerun's, naming
    the hub, and its cause the offline mode (not a network failure)."""
    code = ("from forerun.models.load import open_model\n"
            "open_model('Qwen/Qwen2.5-Coder-1.5B-Instruct')\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("forerun.models.catalog.ModelError") and "Hugging Face hub" in last
    assert "LocalEntryNotFoundError" in last and "outgoing traffic has been disabled" in last


@pytest.mark.parametrize("source", ["./missing.gguf", "/no/such/dir", "not-a-model"])
def test_bad_sources_fail_clearly(source):
    with pytest.raises(ModelError):
        open_model(source)


def test_non_gguf_file_fails_clearly(tmp_path):
    bad = tmp_path / "weights.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelError, match="not a readable GGUF"):
        open_model(str(bad))
