"""The server's Prometheus metrics: one registry per server (so tests can run several).

Owns: metric names, help texts and buckets, and the derived gauges (acceptance rate, mean
accepted length, acceptance per draft position), which use the definitions of forerun.metrics
over every sequence since the server started. Written by the worker thread and the HTTP
middleware, read by `GET /metrics`; prometheus_client's metrics are thread-safe.
"""

from __future__ import annotations

import threading
from collections import deque

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Enum,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from forerun.serve.limits import SPEC_POLICIES

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
SPEC_MODES = ("full", "reduced", "off")
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
DRAFT_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)
RECENT_STEPS = 256  # verify steps behind forerun_acceptance_rate_recent

disable_created_metrics()  # no `*_created` timestamp series beside every counter


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("forerun_requests", "HTTP requests answered, by path and status",
                                ["path", "status"], registry=r)
        self.finished = Counter("forerun_sequences_finished", "generated sequences (choices) "
                                "ended, by reason: stop, length, cancelled, error", ["reason"],
                                registry=r)
        self.prompt_tokens = Counter("forerun_prompt_tokens", "prompt tokens admitted",
                                     registry=r)
        self.generation_tokens = Counter("forerun_generation_tokens", "tokens generated",
                                         registry=r)
        self.drafted = Counter("forerun_draft_tokens", "draft tokens proposed", registry=r)
        self.accepted = Counter("forerun_accepted_tokens", "draft tokens accepted", registry=r)
        self.verify_steps = Counter("forerun_verify_steps", "verify steps (target passes after "
                                    "the prefill)", registry=r)
        self.forward_passes = Counter("forerun_target_forward_passes", "target forward passes "
                                      "(prefills + verify steps)", registry=r)
        self.drafted_at = Counter("forerun_draft_tokens_at_position", "draft tokens proposed at "
                                  "each draft position (0 = first)", ["position"], registry=r)
        self.accepted_at = Counter("forerun_accepted_tokens_at_position", "draft tokens "
                                   "accepted at each draft position", ["position"], registry=r)
        self.acceptance_at = Gauge("forerun_acceptance_by_position", "P(draft token i accepted "
                                   "| at least i+1 drafted), since start", ["position"],
                                   registry=r)
        Gauge("forerun_acceptance_rate", "accepted / drafted draft tokens, since start",
              registry=r).set_function(self._acceptance_rate)
        Gauge("forerun_acceptance_rate_recent", f"accepted / drafted draft tokens over the "
              f"last {RECENT_STEPS} verify steps that drafted (acceptance over time)",
              registry=r).set_function(self._recent_acceptance)
        Gauge("forerun_mean_accepted_length", "mean over verify steps of accepted + 1 "
              "(includes the bonus/recovered token), since start",
              registry=r).set_function(self._mean_accepted_length)
        self.ttft = Histogram("forerun_time_to_first_token_seconds", "request arrival to its "
                              "first token (queueing included)", buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("forerun_inter_token_latency_seconds", "gap between tokens after "
                             "the first (a step's gap shared by its tokens)", buckets=ITL_BUCKETS,
                             registry=r)
        self.queue_depth = Gauge("forerun_queue_depth", "requests waiting for a slot", registry=r)
        self.running = Gauge("forerun_requests_running", "requests holding a slot", registry=r)
        self.slots = Gauge("forerun_slots", "decode slots (max concurrent requests)", registry=r)
        self.mode = Enum("forerun_speculation_mode", "speculation under the current load: full, "
                         "reduced (k halved) or off", states=list(SPEC_MODES), registry=r)
        self.spec_policy = Enum("forerun_spec_policy", "--spec-policy: adaptive (the batch cost "
                                "policy chooses every k), always (each request's own) or off",
                                states=list(SPEC_POLICIES), registry=r)
        self.kv_budget = Gauge("forerun_kv_cache_budget_bytes", "KV cache memory of the batch "
                               "(per model)", registry=r)
        self.batch_size = Gauge("forerun_batch_size", "requests in the last target pass",
                                registry=r)
        self.batch_sizes = Histogram("forerun_batch_size_per_pass", "requests in each target "
                                     "pass", buckets=BATCH_BUCKETS, registry=r)
        self.pass_drafts = Gauge("forerun_draft_tokens_last_pass", "draft tokens verified in "
                                 "the last target pass (all its requests)", registry=r)
        self.drafts_per_pass = Histogram("forerun_draft_tokens_per_pass", "draft tokens "
                                         "verified in each target pass (all its requests)",
                                         buckets=DRAFT_BUCKETS, registry=r)
        self.shadow_steps = Counter("forerun_shadow_verify_steps", "verify steps of shadow "
                                    "requests (counted in the draft and accepted tokens as if "
                                    "they speculated; they emitted one token each)", registry=r)
        self.passes = Counter("forerun_batch_passes", "target passes with decoding requests "
                              "that could draft, by what speculation did: full (each its k), "
                              "reduced (fewer) or off (none)", ["speculation"], registry=r)
        self.preemptions = Gauge("forerun_preemptions", "requests preempted (cache freed, "
                                 "recomputed later) for want of KV memory, since start",
                                 registry=r)
        self._lock = threading.Lock()
        self._totals = [0, 0, 0]  # drafted, accepted, verify steps
        self._at: dict[int, list[int]] = {}  # position -> [drafted, accepted]
        self._recent: deque[tuple[int, int]] = deque(maxlen=RECENT_STEPS)  # (drafted, accepted)

    def observe_step(self, drafted: int, accepted: int, tokens: int, prefill: bool,
                     shadow: bool = False) -> None:
        self.forward_passes.inc()
        self.generation_tokens.inc(tokens)
        if prefill:
            return
        self.verify_steps.inc()
        self.shadow_steps.inc(shadow)
        self.drafted.inc(drafted)
        self.accepted.inc(accepted)
        with self._lock:
            totals = self._totals
            totals[0] += drafted
            totals[1] += accepted
            totals[2] += 1
            if drafted:
                self._recent.append((drafted, accepted))
            for i in range(drafted):
                at = self._at.setdefault(i, [0, 0])
                at[0] += 1
                at[1] += i < accepted
                self.drafted_at.labels(str(i)).inc()
                self.accepted_at.labels(str(i)).inc(i < accepted)
                self.acceptance_at.labels(str(i)).set(at[1] / at[0])

    def observe_pass(self, size: int, drafted: int, wanted: int) -> None:
        """A pass of `size` requests verified `drafted` draft tokens where its drafting
        requests asked for up to `wanted` (their k, capped by load shedding)."""
        self.batch_size.set(size)
        self.batch_sizes.observe(size)
        self.pass_drafts.set(drafted)
        self.drafts_per_pass.observe(drafted)
        if wanted:
            self.passes.labels("off" if not drafted else "reduced" if drafted < wanted
                               else "full").inc()

    def watch_kv(self, held) -> None:
        """A gauge of the KV-cache bytes the running requests hold, read off `held()`."""
        Gauge("forerun_kv_cache_bytes_in_use", "KV cache memory the running requests hold "
              "(target and draft)", registry=self.registry).set_function(held)

    def watch_prefix_cache(self, cache) -> None:
        """Gauges read off the batch's PrefixCache (None: no prefix cache, they read 0)."""
        r = self.registry
        Gauge("forerun_prefix_cache_hit_tokens", "prompt tokens whose KV came from the prefix "
              "cache, since start", registry=r).set_function(lambda: cache.hits if cache else 0)
        Gauge("forerun_prefix_cache_lookup_tokens", "prompt tokens looked up in the prefix "
              "cache, since start", registry=r).set_function(
            lambda: cache.lookups if cache else 0)
        Gauge("forerun_prefix_cache_bytes", "KV bytes the prefix cache holds",
              registry=r).set_function(lambda: cache.bytes if cache else 0)

    def watch_online(self, distiller) -> None:
        """Gauges read off the online distiller (`forerun.train.online.OnlineDistiller`)."""
        r = self.registry
        for name, text, read in (
                ("head_version", "the version of the Medusa head drafting now (0 = as loaded; "
                 "one more per update swapped in)", lambda: distiller.live_version),
                ("updates", "trainer updates run since start", lambda: distiller.updates),
                ("positions", "wrong positions handed to the trainer since start",
                 lambda: distiller.buffer.added),
                ("buffer_positions", "positions the trainer's ring holds now",
                 lambda: len(distiller.buffer)),
                ("train_seconds", "the trainer's compute time since start",
                 lambda: distiller.train_seconds),
                ("loss", "the last training step's loss (cross-entropy to the target)",
                 lambda: distiller.last_loss),
                ("memory_bytes", "what the trainer holds (ring, its copy of the head, AdamW's "
                 "moments, a snapshot waiting)", lambda: distiller.nbytes)):
            Gauge(f"forerun_online_distill_{name}", text, registry=r).set_function(read)

    def set_mode(self, mode: str) -> None:
        self.mode.state(mode)

    def _acceptance_rate(self) -> float:
        with self._lock:
            drafted, accepted, _ = self._totals
        return accepted / drafted if drafted else 0.0

    def _mean_accepted_length(self) -> float:
        with self._lock:
            _, accepted, steps = self._totals
        return (accepted + steps) / steps if steps else 0.0

    def _recent_acceptance(self) -> float:
        with self._lock:
            drafted = sum(d for d, _ in self._recent)
            accepted = sum(a for _, a in self._recent)
        return accepted / drafted if drafted else 0.0

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
