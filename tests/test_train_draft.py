"""`forerun train draft` on tiny models written here: distillation (GKD) lowers the KL to the
target and raises held-out acceptance, full fine-tune and LoRA (peft); the saved draft loads
through `--draft` as a Hugging Face folder and as a GGUF file (torch, and llama.cpp where it is
installed) and drafts losslessly; training resumes from its checkpoint; bad input fails
clearly."""

import contextlib
import importlib.util
import json
import random

import pytest
import torch
from tiny_files import SPECIAL, byte_tokens, random_hf_weights, write_gguf, write_hf_dir

from forerun import cli
from forerun.api import Engine, LoadConfig
from forerun.models.load import load_transformer, open_model
from forerun.propose import SpecConfig
from forerun.train import TrainConfig
from forerun.train import loop as train_loop
from forerun.train.draft import agreement, divergence, student_logits

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "a", "stitch", "in",
         "time", "saves", "nine", "every", "good", "boy", "deserves", "fudge", "pack", "my", "box",
         "with", "five", "dozen", "liquor", "jugs"]
# distinct sentences: no held-out window repeats a training one
TEXT = " ".join(" ".join(random.Random(i).choices(WORDS, k=9)) + "." for i in range(200))
NOISE = 0.1  # the draft: the target's weights plus this much noise (it agrees now and then)
PROMPT = [5, 9, 3, 17, 40, 2, 8]


def pair(tmp_path, kind: str = "hf"):
    """A tiny target and a draft of the same shape and tokenizer, its weights noisy."""
    tokens = byte_tokens() if kind == "hf" else [*byte_tokens()[:-len(SPECIAL)], "ab", *SPECIAL]
    weights = random_hf_weights(len(tokens), seed=0)
    g = torch.Generator().manual_seed(1)
    noisy = {k: v + NOISE * torch.randn(v.shape, generator=g) for k, v in weights.items()}
    if kind == "hf":
        write_hf_dir(tmp_path / "target", weights, tokens)
        write_hf_dir(tmp_path / "draft", noisy, tokens)
        return tmp_path / "target", tmp_path / "draft"
    # llama.cpp needs a merge
    write_gguf(tmp_path / "target.gguf", weights, tokens, merges=["a b"])
    write_gguf(tmp_path / "draft.gguf", noisy, tokens, merges=["a b"])
    return tmp_path / "target.gguf", tmp_path / "draft.gguf"


def train_draft(tmp_path, target, draft, *extra: str) -> dict:
    (tmp_path / "corpus.txt").write_text(TEXT)
    out = tmp_path / "out"
    code = cli.main(["train", "draft", "--target", str(target), "--draft", str(draft),
                     "--dtype", "float64", "--draft-dtype", "float64", "--train-dtype",
                     "float32", "--text", str(tmp_path / "corpus.txt"), "--chat", "0",
                     "--seq-len", "32", "--chat-tokens", "8", "--max-tokens", "1600",
                     "--out", str(out), "--json", *extra])
    assert code == 0
    return json.loads((out / "train_report.json").read_text())


@pytest.mark.parametrize("lora", ["0", "8"])
def test_distillation_lowers_the_kl_and_raises_held_out_acceptance(tmp_path, lora):
    """Full fine-tune and LoRA: on held-out windows of the text (never trained on), the KL to
    the target falls and the acceptance (sampled: sum min(p, q); greedy agreement) rises."""
    target, draft = pair(tmp_path)
    report = train_draft(tmp_path, target, draft, "--steps", "60", "--lr", "1e-2",
                         "--lora-rank", lora)
    before, after = report["before"], report["after"]
    assert report["held_out_examples"] >= 4 and before["tokens"] == after["tokens"] > 0
    assert after["kl"] < 0.7 * before["kl"]
    assert after["accept"] > before["accept"] + 0.05
    assert after["greedy"] > before["greedy"]
    assert 0 < report["on_policy_steps"] < report["steps"]  # the GKD mix: both kinds of step


def test_saved_draft_loads_through_draft_in_both_formats(tmp_path):
    """The saved folder and GGUF give the trained model's logits, draft losslessly for the
    target (greedy output = plain), and the GGUF runs on llama.cpp where it is installed."""
    target, draft = pair(tmp_path, "gguf")
    train_draft(tmp_path, target, draft, "--steps", "8", "--lora-rank", "4", "--gguf-dtype",
                "f32")
    out = tmp_path / "out"
    tokens = torch.tensor(PROMPT)
    folder = open_model(str(out)).load(dtype="float64")
    gguf = open_model(str(out / "draft.gguf")).load(dtype="float64")
    saved = folder.forward(tokens).logits
    assert torch.allclose(gguf.forward(tokens).logits, saved, atol=1e-4)  # f32 matrices
    stock = open_model(str(draft)).load(dtype="float64").forward(tokens).logits
    assert not torch.allclose(saved, stock, atol=1e-3)  # training changed the weights
    plain = Engine(str(target), None, spec=SpecConfig("none"), load=LoadConfig(dtype="float64"))
    want = plain.generate(PROMPT, max_tokens=16).token_ids
    for path in (out, out / "draft.gguf"):
        engine = Engine(str(target), str(path), spec=SpecConfig("draft", k=3),
                        load=LoadConfig(dtype="float64", draft_dtype="float64"))
        assert engine.generate(PROMPT, max_tokens=16).token_ids == want
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed: the GGUF was checked on torch only")
    llama = open_model(str(out / "draft.gguf")).load(runtime="llama.cpp", context=64)
    assert torch.allclose(llama.forward(tokens).logits.double(), saved, atol=1e-2)


def test_an_hf_source_gives_a_gguf_with_its_tokenizer(tmp_path):
    """From a Hugging Face draft, the GGUF's metadata is built from its config and tokenizer:
    the same tokens, the same logits as the saved folder."""
    target, draft = pair(tmp_path)
    train_draft(tmp_path, target, draft, "--steps", "2", "--gguf-dtype", "f32")
    out = tmp_path / "out"
    folder, gguf = open_model(str(out)), open_model(str(out / "draft.gguf"))
    assert gguf.tokenizer.vocab == folder.tokenizer.vocab
    assert gguf.tokenizer.encode("hello <|im_end|>") == folder.tokenizer.encode("hello <|im_end|>")
    tokens = torch.tensor(PROMPT)
    assert torch.allclose(gguf.load(dtype="float64").forward(tokens).logits,
                          folder.load(dtype="float64").forward(tokens).logits, atol=1e-4)


def test_questions_are_answered_by_the_target_and_held_out_prompts_evaluated(tmp_path):
    """--questions: the target's replies are the fixed continuations (kept in replies.json,
    reused by a second run); --held-out: prompts answered for the figures, never trained on."""
    target, draft = pair(tmp_path)
    asked, held = tmp_path / "asked.jsonl", tmp_path / "held.jsonl"
    asked.write_text("".join(json.dumps({"prompt": f"question {i}: the fox?"}) + "\n"
                             for i in range(4)))
    held.write_text("".join(json.dumps({"prompt": f"held {i}"}) + "\n" for i in range(6)))
    out = tmp_path / "out"
    args = ["train", "draft", "--target", str(target), "--draft", str(draft), "--dtype",
            "float64", "--draft-dtype", "float64", "--train-dtype", "float32", "--chat", "0",
            "--questions", str(asked), "--held-out", str(held), "--held-out-count", "3",
            "--seq-len", "48", "--chat-tokens", "6", "--steps", "3", "--out", str(out),
            "--json"]
    assert cli.main(args) == 0
    report = json.loads((out / "train_report.json").read_text())
    assert report["examples"] == 4 and report["held_out_examples"] == 3
    replies = json.loads((out / "replies.json").read_text())
    assert len(replies) == 4 + 3 and all(0 < len(r) <= 6 for r in replies.values())
    assert cli.main(args) == 0  # resumed: the checkpoint's steps are done, the replies kept
    assert json.loads((out / "replies.json").read_text()) == replies


def test_training_resumes_where_it_stopped(tmp_path, monkeypatch):
    """A run broken after its first checkpoint and run again ends with the weights of an
    unbroken run (each step's data depends on its index alone)."""
    monkeypatch.setattr(train_loop, "CHECKPOINT_EVERY", 3)
    cfg = TrainConfig("draft", steps=8, lr=1e-2)
    data = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))

    def run(checkpoint, stop_at=None):
        torch.manual_seed(1)
        model = torch.nn.Linear(4, 1)

        def step_loss(step):
            if step == stop_at:
                raise KeyboardInterrupt
            return model(data[step]).pow(2).sum()

        with contextlib.suppress(KeyboardInterrupt):  # the run breaks off at `stop_at`
            train_loop.fit(model, step_loss, cfg.steps, cfg, checkpoint, progress=False)
        return model

    whole = run(tmp_path / "a.pt")
    run(tmp_path / "b.pt", stop_at=5)  # checkpoint at step 3; steps 3, 4 redone
    resumed = run(tmp_path / "b.pt")
    assert torch.allclose(whole.weight, resumed.weight) and torch.allclose(whole.bias,
                                                                           resumed.bias)


def test_divergences_and_agreement_on_known_distributions():
    """tvd = 1 - sum min(p, q); the KL of a distribution to itself is 0; greedy chains count
    consecutive agreements up to DRAFT_LEN."""
    p = torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.0, 2.0, -1.0], [0.0, 1.0, 0.0], [1.0, 0.5, 0.0]])
    got = agreement(p, q)
    assert got["rows"] == 3 and got["greedy"] == 2.0 and got["chain"] == 0 + 2 + 1
    assert abs(float(divergence(p, q, "tvd")) - (1 - got["accept"] / 3)) < 1e-6
    assert float(divergence(p, p, "fkl")) == pytest.approx(0, abs=1e-7)
    assert float(divergence(p, q, "rkl")) > 0
    with pytest.raises(ValueError, match="unknown divergence"):
        divergence(p, q, "js")


def test_student_pass_equals_the_runtime(tmp_path):
    """The differentiable pass (no cache) gives the torch runtime's logits."""
    _, draft = pair(tmp_path)
    src = open_model(str(draft))
    model = load_transformer(src, "float64")
    assert torch.allclose(student_logits(model, PROMPT),
                          src.load(dtype="float64").forward(torch.tensor(PROMPT)).logits,
                          atol=1e-9)


def test_bad_input_fails_clearly(tmp_path, capsys):
    target, draft = pair(tmp_path)
    base = ["train", "draft", "--target", str(target), "--draft", str(draft), "--chat", "0"]
    assert cli.main([*base, "--out", str(tmp_path / "o")]) == 2
    assert "nothing to train on" in capsys.readouterr().err
    assert cli.main([*base, "--text", str(tmp_path / "missing")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert cli.main([*base, "--seq-len", "8", "--chat-tokens", "8"]) == 2
    assert "--chat-tokens < --seq-len" in capsys.readouterr().err
