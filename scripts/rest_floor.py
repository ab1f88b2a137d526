"""The floor of head drafting: what a head costs on steps where it drafts nothing.

Plain decoding against heads (+ prompt lookup, automatic budget) on one Spec-Bench question,
alternating in one process, then each once under cProfile: inter-token latency, tokens drafted,
and the host's seconds a step outside the target's own pass (`_submit`, llama.cpp's decode).
With a head that seldom drafts (a weak one, or chat where the budget rests) the difference
is the price of resting: probes, the lookup match, verification's bookkeeping.

    python scripts/rest_floor.py --heads DIR --category writing --rounds 3
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
from importlib.resources import files

from forerun.api import Engine, LoadConfig
from forerun.propose import SpecConfig
from forerun.propose.heads import AUTO_TREE
from forerun.sampling import SamplingConfig


def host_ms_per_step(engine: Engine, prompt: str, spec: SpecConfig, tokens: int) -> dict:
    """One generation under cProfile: its steps and the host's ms a step outside the passes."""
    profile = cProfile.Profile()
    profile.enable()
    out = engine.generate(prompt, spec=spec, max_tokens=tokens, sampling=SamplingConfig())
    profile.disable()
    stats = pstats.Stats(profile)
    passes = sum(v[3] for k, v in stats.stats.items() if k[2] == "_submit")
    steps = max(1, out.stats.target_forward_passes - 1)  # decode passes (not the prefill)
    return {"steps": steps, "host_ms": round(1e3 * (stats.total_tt - passes) / steps, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", required=True, help="a trained head's folder")
    ap.add_argument("--method", default="eagle")
    ap.add_argument("--category", default="writing", help="Spec-Bench category (first question)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--runtime", default="llama.cpp")
    ap.add_argument("--json", action="store_true", help="print only the JSON result")
    args = ap.parse_args()
    rows = files("forerun.bench").joinpath("workloads/spec_bench/question.jsonl")
    rows = [json.loads(line) for line in rows.read_text().splitlines()]
    prompt = next(r for r in rows if r["category"] == args.category)["turns"][0]
    spec = SpecConfig(args.method, 16, tree=AUTO_TREE, tree_topk=2, lookup=True)
    engine = Engine(spec=spec, load=LoadConfig(runtime=args.runtime, heads=args.heads))
    arms = {"plain": SpecConfig("none"), "heads": spec}
    engine.generate(prompt, spec=spec, max_tokens=8)  # one-off costs
    runs: dict[str, list[dict]] = {name: [] for name in arms}
    for r in range(args.rounds):
        for name in sorted(arms, reverse=bool(r % 2)):
            s = engine.generate(prompt, spec=arms[name], max_tokens=args.max_tokens,
                                sampling=SamplingConfig()).stats
            runs[name].append({"itl_ms": round(s.itl_s * 1e3, 2), "drafted": s.drafted,
                               "passes": s.target_forward_passes})
    result = {}
    for name, spec_ in arms.items():
        itl = [run["itl_ms"] for run in runs[name]]
        result[name] = {"itl_ms_median": statistics.median(itl), "runs": runs[name],
                        **host_ms_per_step(engine, prompt, spec_, args.max_tokens)}
    result["itl_ratio"] = round(result["heads"]["itl_ms_median"]
                                / result["plain"]["itl_ms_median"], 3)
    if args.json:
        print(json.dumps(result))
        return
    for name in arms:
        r = result[name]
        print(f"{name:6s} ITL median {r['itl_ms_median']:.2f} ms  runs "
              f"{[x['itl_ms'] for x in r['runs']]}  drafted {[x['drafted'] for x in r['runs']]}"
              f"  host {r['host_ms']} ms a step (cProfile, {r['steps']} steps)")
    print(f"heads / plain ITL: {result['itl_ratio']}")


if __name__ == "__main__":
    main()
