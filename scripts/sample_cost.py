"""Plain decoding with `sample()` against torch.multinomial: A/B rounds in one process,
interleaved, per-token wall time. The old path drew every token with multinomial; `sample()`
takes a one-hot row's token directly (greedy) and draws other rows by inverse CDF (--temperature).
Since `next_token` and `greedy_accept`, greedy decoding takes the argmax without either, so
only --temperature > 0 still compares the two.

    python scripts/sample_cost.py --runtime llama.cpp --question 374 --rounds 9
    python scripts/sample_cost.py --runtime llama.cpp --question 374 --rounds 9 --temperature 0.7
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from importlib.resources import files

import torch

import forerun.sampling
import forerun.verify
from forerun.api import Engine, LoadConfig
from forerun.propose import SpecConfig
from forerun.sampling import SamplingConfig, sample


def multinomial_only(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    flat = probs.reshape(-1, probs.shape[-1])  # [R, V]
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runtime", default="llama.cpp")
    ap.add_argument("--question", type=int, default=374, help="Spec-Bench question id")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    args = ap.parse_args()
    rows = files("forerun.bench").joinpath("workloads/spec_bench/question.jsonl")
    rows = [json.loads(line) for line in rows.read_text().splitlines()]
    prompt = next(r for r in rows if r["question_id"] == args.question)["turns"][0]
    engine = Engine(draft=None, spec=SpecConfig("none"), load=LoadConfig(runtime=args.runtime))
    engine.generate(prompt, max_tokens=8)  # one-off costs
    arms = {"multinomial": multinomial_only, "sample()": sample}
    ms: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(args.rounds):
        for name in sorted(arms, reverse=bool(r % 2)):
            forerun.sampling.sample = forerun.verify.sample = arms[name]
            start = time.perf_counter()
            sampling = SamplingConfig(temperature=args.temperature, seed=r)
            out = engine.generate(prompt, max_tokens=args.max_tokens, sampling=sampling)
            ms[name].append(1000 * (time.perf_counter() - start) / len(out.token_ids))
    for name, v in ms.items():
        print(f"{name:12s} ms/token median {statistics.median(v):.2f}  "
              f"runs {sorted(round(x, 1) for x in v)}")


if __name__ == "__main__":
    main()
