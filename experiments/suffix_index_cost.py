"""What does a `suffix` drafting step cost as the global index grows, and what memory does the
index take? (issue 44: at most 1 ms a step with 10M tokens indexed.)

Fills a `TokenIndex` of each size with synthetic outputs (documents of 100-800 tokens over a
150k vocabulary, Zipf-distributed, a third of each copied from an earlier document so that
matches run long, as repeated agentic outputs do), then times one drafting step on it, the
global index's part of `SuffixProposer.propose`: `speculate` (lookup, continuations, tree;
k = 16, factor 1, floor 0.1) after contexts that continue an indexed document (hits) and after
fresh text (misses). Prints the index's bytes, the process's peak RSS, and the step's median,
p99 and max per size: flat means the lookup does not read the text.

    python experiments/suffix_index_cost.py --sizes 1e5,1e6,1e7
"""

import argparse
import resource
import time

import numpy as np

from forerun.propose.suffix import SuffixConfig, speculate
from forerun.propose.suffix_index import MAX_MATCH, TokenIndex

VOCAB, ZIPF, COPY_SHARE = 151_936, 1.1, 1 / 3
LOOKUPS, K = 2000, 16


def corpus(tokens: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Documents totalling `tokens`: Zipf tokens, each with a third copied from an earlier one."""
    stream = (rng.zipf(ZIPF, tokens) % VOCAB).astype(np.int64)
    docs, at = [], 0
    while at < tokens:
        n = int(rng.integers(100, 800))
        doc = stream[at:at + n].copy()
        if docs and len(doc) > 30:
            src = docs[int(rng.integers(max(0, len(docs) - 5000), len(docs)))]
            span = min(len(src), int(len(doc) * COPY_SHARE))
            start = int(rng.integers(0, len(doc) - span + 1))
            doc[start:start + span] = src[:span]
        docs.append(doc)
        at += n
    return docs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1e5,1e6,1e7", help="index sizes in tokens")
    args = p.parse_args()
    rng, cfg = np.random.default_rng(0), SuffixConfig(factor=1.0, min_prob=0.1)
    print(f"{'tokens':>10} {'index MB':>9} {'peak RSS MB':>11} {'fill s':>7} "
          f"{'hit ms p50/p99/max':>20} {'miss ms p50/p99/max':>20} {'hit nodes':>10}")
    for size in (int(float(s)) for s in args.sizes.split(",")):
        docs = corpus(size, rng)
        index = TokenIndex(size + len(docs))  # holds them all (the separators too)
        start = time.perf_counter()
        for d in docs:
            index.add_document(d.tolist())
        fill = time.perf_counter() - start
        hits, misses, nodes = [], [], []
        for _ in range(LOOKUPS):
            doc = docs[int(rng.integers(0, len(docs)))]
            cut = int(rng.integers(1, len(doc)))
            hit = doc[max(0, cut - MAX_MATCH):cut].tolist()
            miss = (rng.zipf(ZIPF, MAX_MATCH) % VOCAB).tolist()
            for context, times in ((hit, hits), (miss, misses)):
                t = time.perf_counter()
                tree = speculate(index, context, K, cfg)
                times.append(time.perf_counter() - t)
                if times is hits:
                    nodes.append(len(tree.tokens))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"{size:>10,} {index.nbytes / 2**20:>9.0f} {peak:>11.0f} {fill:>7.1f} "
              f"{_ms(hits):>20} {_ms(misses):>20} {np.mean(nodes):>10.1f}", flush=True)
        del index, docs


def _ms(times: list[float]) -> str:
    t = np.array(times) * 1e3
    return f"{np.median(t):.3f}/{np.percentile(t, 99):.3f}/{t.max():.3f}"


if __name__ == "__main__":
    main()
