"""`forerun train draft`: a draft model distilled toward the target (GKD, on-policy distillation).

Owns: the examples (a prompt and a fixed continuation: the target's greedy reply to a question,
or the second half of a text window), the student (the draft model as our own Transformer,
trainable: every weight, or LoRA adapters through `peft`), its differentiable pass and its
sampling, the divergence to the target, and held-out acceptance before and after (`distil`).

GKD (Agarwal et al., 2024, "On-Policy Distillation of Language Models"): at each step, with
probability `student_mix` the continuation is sampled from the student itself (on-policy: the
text a draft will actually propose), else it is the example's fixed continuation; the loss is a
divergence between the target's next-token distribution p and the student's q at every
continuation position. fkl = KL(p || q), rkl = KL(q || p), tvd = 1/2 sum |p - q|, which is one
minus the probability that speculative sampling accepts the draft's token (DistillSpec, Zhou et
al., 2024). The optimizer, schedule and checkpoints are `loop.fit`'s; saving is `export`'s.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from forerun.runtime.base import Runtime
from forerun.runtime.torch_model import Transformer, attend, rms_norm, rope_tables
from forerun.train.collection import chat_replies
from forerun.train.config import TrainConfig
from forerun.train.corpus import chat_prompts, chunked, read_texts, text_files, user_questions
from forerun.train.loop import fit

DIVERGENCES = ("fkl", "rkl", "tvd")
LORA_TARGETS = ["wqkv", "wo", "w_gate_up", "w_down"]  # every linear of a block; not embeddings
DRAFT_LEN = 4  # the greedy chain the held-out `chain` figure drafts from each position
SEED_STRIDE = 1_000_003  # step s's generator: seed * SEED_STRIDE + s


@dataclass(frozen=True)
class Example:
    prompt: list[int]  # token ids the continuation follows (chat template applied)
    continuation: list[int]  # the target's greedy reply, or the text's own next tokens


# --- the student --------------------------------------------------------------------------------

def student_logits(model: Transformer, ids: list[int]) -> torch.Tensor:
    """[T, V] the model's next-token logits at every position of `ids`, differentiable: one
    causal pass without a cache (the layers' own q/k/v, attention and MLP)."""
    cfg, param = model.cfg, model.embed.weight
    T = len(ids)
    cos, sin = rope_tables(cfg, T, param.dtype, param.device)  # [T, hd]
    mask = torch.ones(T, T, dtype=torch.bool, device=param.device).tril()
    x = model.embed(torch.tensor(ids, device=param.device))  # [T, D]
    for layer in model.layers:
        q, k, v = layer.qkv(x, cos, sin)  # [H, T, hd], [Hkv, T, hd], [Hkv, T, hd]
        x = layer.finish(x, attend(q, k, v, mask))
    return F.linear(rms_norm(x, model.norm, cfg.norm_eps), model.lm_weight())  # [T, V]


@torch.no_grad()
@torch.autocast("cpu", enabled=False)  # one row a step reads the weights: casting them costs more
def sample(model: Transformer, prompt: list[int], n: int, temperature: float,
           generator: torch.Generator, stop_ids: frozenset[int]) -> list[int]:
    """Up to `n` tokens the model samples after `prompt` (greedy at temperature 0), ending with a
    stop token if it samples one; a KV cache of its own, so each token costs one row."""
    cfg, param = model.cfg, model.embed.weight
    capacity = len(prompt) + n
    cos, sin = rope_tables(cfg, capacity, param.dtype, param.device)
    shape = (cfg.n_kv_heads, capacity, cfg.head_dim)
    caches = [(param.new_zeros(shape), param.new_zeros(shape)) for _ in model.layers]
    out: list[int] = []
    ids, start = prompt, 0
    while len(out) < n:
        T = len(ids)
        mask = None if T == 1 else torch.cat([torch.ones(T, start, dtype=torch.bool),
                                              torch.ones(T, T, dtype=torch.bool).tril()], 1)
        x = model.embed(torch.tensor(ids, device=param.device))  # [T, D]
        for layer, (k, v) in zip(model.layers, caches, strict=True):
            x = layer(x, cos[start:start + T], sin[start:start + T], k, v, start, mask)
        logits = F.linear(rms_norm(x[-1], model.norm, cfg.norm_eps), model.lm_weight())  # [V]
        if temperature > 0:
            probs = (logits.double() / temperature).softmax(-1)
            token = int(torch.multinomial(probs.cpu(), 1, generator=generator))
        else:
            token = int(logits.argmax())
        out.append(token)
        if token in stop_ids:
            break
        ids, start = [token], start + T
    return out


def trainable(model: Transformer, lora_rank: int, lora_alpha: float) -> torch.nn.Module:
    """What the optimizer sees: the model with every weight trainable (lora_rank 0), or wrapped by
    `peft` with LoRA adapters on every block's linears (the rest frozen). peft wraps our own
    modules cleanly: they are plain nn.Linear until the torch runtime prepacks them."""
    if lora_rank == 0:
        return model.requires_grad_(True)
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:
        raise ValueError("LoRA needs peft: pip install 'forerun[train]' (or --lora-rank 0 for "
                         "a full fine-tune)") from e
    return get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=lora_alpha,
                                            target_modules=LORA_TARGETS, lora_dropout=0.0))


def merged(module: torch.nn.Module) -> Transformer:
    """The trained Transformer, LoRA adapters (if any) merged into its weights."""
    if isinstance(module, Transformer):
        return module.requires_grad_(False)
    return module.merge_and_unload().requires_grad_(False)


# --- the objective and the figures -------------------------------------------------------------

def divergence(p_logits: torch.Tensor, q_logits: torch.Tensor, kind: str) -> torch.Tensor:
    """Mean over rows of a divergence between the target's p and the student's q, both [R, V]
    logits (p's carry no gradient)."""
    V = min(p_logits.shape[-1], q_logits.shape[-1])  # a padded LM head's extra rows: never tokens
    logp = p_logits[:, :V].float().log_softmax(-1)  # [R, V]
    logq = q_logits[:, :V].float().log_softmax(-1)  # [R, V]
    if kind == "fkl":
        return (logp.exp() * (logp - logq)).sum(-1).mean()
    if kind == "rkl":
        return (logq.exp() * (logq - logp)).sum(-1).mean()
    if kind == "tvd":
        return 0.5 * (logp.exp() - logq.exp()).abs().sum(-1).mean()
    raise ValueError(f"unknown divergence {kind!r}; choose {', '.join(DIVERGENCES)}")


def agreement(p_logits: torch.Tensor, q_logits: torch.Tensor) -> dict[str, float]:
    """Sums over rows [R, V] of what speculative decoding would accept at each position of the
    target's text: `accept` sum min(p, q) (the chance a token sampled from q is accepted, at
    temperature 1), `greedy` [argmax q == argmax p], `chain` the tokens a greedy draft of
    DRAFT_LEN from that position gets accepted (exact for greedy decoding: the draft sees the
    target's text while it agrees), `kl` KL(p || q); `rows` how many."""
    V = min(p_logits.shape[-1], q_logits.shape[-1])
    logp, logq = (x[:, :V].float().log_softmax(-1) for x in (p_logits, q_logits))  # [R, V]
    match = (logp.argmax(-1) == logq.argmax(-1)).long()  # [R]
    R = match.shape[0]
    chain = sum(int(match[t:t + DRAFT_LEN].cumprod(0).sum()) for t in range(R))
    return {"accept": float(torch.minimum(logp.exp(), logq.exp()).sum()),
            "greedy": float(match.sum()), "chain": float(chain),
            "kl": float((logp.exp() * (logp - logq)).sum()), "rows": R}


def teacher_logits(target: Runtime, ids: list[int]) -> torch.Tensor:
    """[T, V] the target's next-token logits at every position of `ids` (its cache left empty)."""
    target.truncate(0)
    logits = target.forward(torch.tensor(ids)).logits
    target.truncate(0)
    return logits


def rows_of(example: Example, logits: torch.Tensor) -> torch.Tensor:
    """The rows of [T, V] logits that predict the continuation's tokens."""
    return logits[len(example.prompt) - 1:-1]


def held_out(model: Transformer, target: Runtime, examples: list[Example],
             progress: bool = True) -> dict[str, float]:
    """Held-out figures (see `agreement`), per continuation token over `examples`."""
    sums = {"accept": 0.0, "greedy": 0.0, "chain": 0.0, "kl": 0.0, "rows": 0}
    with torch.no_grad():
        for ex in tqdm(examples, desc="held-out acceptance", unit="example", leave=False,
                       disable=not progress):
            ids = ex.prompt + ex.continuation
            got = agreement(rows_of(ex, teacher_logits(target, ids)),
                            rows_of(ex, student_logits(model, ids)))
            sums = {k: sums[k] + got[k] for k in sums}
    n = max(1, sums["rows"])
    return {"accept": round(sums["accept"] / n, 4), "greedy": round(sums["greedy"] / n, 4),
            "chain": round(sums["chain"] / n, 4), "kl": round(sums["kl"] / n, 4),
            "tokens": sums["rows"], "examples": len(examples)}


# --- the data -----------------------------------------------------------------------------------

def replies(replier, questions: list[str], cfg: TrainConfig, cache: Path,
            progress: bool = True) -> list[Example]:
    """Each question with the target's greedy reply (`chat_replies`: batched on llama.cpp),
    kept in `cache` (JSON, keyed by the question) so a resumed run does not answer again. The
    prompt keeps its last seq_len - chat_tokens tokens."""
    tok = replier.tokenizer
    known: dict[str, list[int]] = json.loads(cache.read_text()) if cache.is_file() else {}
    todo = [q for q in dict.fromkeys(questions) if q not in known]
    for j, reply in tqdm(chat_replies(replier, todo, cfg.chat_tokens), total=len(todo),
                         desc="the target answers", unit="question", disable=not progress):
        known[todo[j]] = list(reply)
        cache.write_text(json.dumps(known))
    keep = max(1, cfg.seq_len - cfg.chat_tokens)
    return [Example(tok.encode_prompt(q)[-keep:], known[q]) for q in questions if known[q]]


def text_examples(tok, cfg: TrainConfig) -> list[Example]:
    """cfg.text's windows of seq_len tokens, up to cfg.max_tokens tokens in all: each window's
    first half the prompt, its second half the continuation."""
    out: list[Example] = []
    half = cfg.seq_len // 2
    for window in chunked(tok, read_texts(text_files(cfg.text)), cfg.seq_len):
        if len(out) * cfg.seq_len >= cfg.max_tokens:
            break
        out.append(Example(window[:half], window[half:]))
    return out


def split(examples: list[Example], fraction: float) -> tuple[list[Example], list[Example]]:
    """(training, held-out): every (1/fraction)-th example held out (at least one, when two)."""
    every = max(2, round(1 / fraction)) if fraction > 0 and len(examples) > 1 else 0
    held = [e for i, e in enumerate(examples) if every and i % every == every - 1]
    return [e for e in examples if e not in held] or examples, held


def examples(replier, cfg: TrainConfig, out: Path, held_questions: tuple[str, ...] = (),
             progress: bool = True) -> tuple[list[Example], list[Example]]:
    """(training, held-out) examples: the written chat questions (cfg.chat) and the user's
    `--questions` with the target's replies, then cfg.text's windows; held out, every
    (1/cfg.held_out)-th of them, or `held_questions` (evaluation only: the bench's own sets
    are welcome here, nothing is trained on them) answered by the target."""
    questions = [*chat_prompts()[:cfg.chat], *user_questions(cfg.questions)]
    pool = replies(replier, questions, cfg, out / "replies.json", progress) if questions else []
    pool += text_examples(replier.tokenizer, cfg) if cfg.text else []
    if not pool:
        raise ValueError("nothing to train on: give --questions, --text or --chat N")
    if held_questions:
        return pool, replies(replier, list(held_questions), cfg, out / "replies.json", progress)
    return split(pool, cfg.held_out)


def _digest(examples: list[Example]) -> str:
    """Names a set of held-out examples (before.json is theirs alone)."""
    return hashlib.sha1(json.dumps([asdict(e) for e in examples]).encode()).hexdigest()[:12]


# --- the whole run ------------------------------------------------------------------------------

def distil(model: Transformer, target: Runtime, train_set: list[Example],
           held: list[Example], cfg: TrainConfig, out: Path, stop_ids: frozenset[int],
           progress: bool = True) -> tuple[Transformer, dict]:
    """GKD on `train_set`, resumable from out/checkpoint.pt; -> the trained model (adapters
    merged) and the report: held-out figures before (measured once, kept in out/before.json)
    and after, steps, seconds."""
    if cfg.divergence not in DIVERGENCES:
        raise ValueError(f"unknown divergence {cfg.divergence!r}; choose "
                         f"{', '.join(DIVERGENCES)}")
    if not 0 <= cfg.student_mix <= 1 or cfg.lora_rank < 0 or cfg.temperature < 0:
        raise ValueError("need 0 <= --student-mix <= 1, --lora-rank >= 0, --temperature >= 0")
    out.mkdir(parents=True, exist_ok=True)
    # measured once: a resumed run's model is no longer the one before training
    before_file, key = out / "before.json", _digest(held)
    kept = json.loads(before_file.read_text()) if before_file.is_file() else {}
    if kept.get("held_out") != key:
        kept = {"held_out": key, "figures": held_out(model, target, held, progress)}
        before_file.write_text(json.dumps(kept))
    before = kept["figures"]
    module = trainable(model, cfg.lora_rank, cfg.lora_alpha)
    student = model  # the same modules: peft wraps their linears in place
    steps = cfg.total_steps(len(train_set))
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(cfg.seed))
    on_policy = [0]

    def step_loss(step: int) -> torch.Tensor:
        ex = train_set[int(order[step % len(train_set)])]
        g = torch.Generator().manual_seed(cfg.seed * SEED_STRIDE + step)
        continuation = ex.continuation
        if float(torch.rand((), generator=g)) < cfg.student_mix:  # on-policy: the student's text
            continuation = sample(student, ex.prompt, max(1, len(ex.continuation)),
                                  cfg.temperature, g, stop_ids)
            on_policy[0] += 1
        now = Example(ex.prompt, continuation)
        ids = now.prompt + now.continuation
        p = rows_of(now, teacher_logits(target, ids))  # [R, V]
        return divergence(p, rows_of(now, student_logits(student, ids)), cfg.divergence)

    seconds = fit(module, step_loss, steps, cfg, out / "checkpoint.pt", "train draft", progress)
    model = merged(module)
    after = held_out(model, target, held, progress)
    return model, {"before": before, "after": after, "steps": steps,
                   "on_policy_steps": on_policy[0], "train_s": round(seconds, 1),
                   "examples": len(train_set), "held_out_examples": len(held),
                   "train_tokens": sum(len(e.continuation) for e in train_set),
                   "config": asdict(cfg)}
