"""Generation metrics: what one decode step reports, and the summary of a whole generation.

Owns: `Step` (one target forward pass and the tokens it produced, with their log-probabilities
when asked: `TokenLogprob`) and `GenerationStats`.
Definitions:
- acceptance_rate = accepted draft tokens / drafted tokens;
- mean_accepted_length = mean over verify steps of (accepted + 1): it includes the recovered or
  bonus token, so plain decoding scores 1.0 and the ceiling is k + 1;
- per_position_acceptance[i] = P(draft token i accepted | at least i + 1 tokens were drafted);
- target_forward_passes counts the prefill and every verify step;
- ttft_s = time to the first token (prefill + first sample); itl_s = mean gap between tokens after
  the first; tokens_per_s = new tokens / wall time (prefill included).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of an emitted token (log-softmax of its raw logits at that
    position, before penalties and temperature) and its `top` alternatives, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Step:
    tokens: list[int]  # emitted by this step (after stop / max-token truncation)
    drafted: int  # draft tokens proposed (0 for the prefill step and plain decoding)
    accepted: int  # draft tokens accepted
    time: float  # perf_counter() when the step finished
    finish_reason: str | None = None  # "stop" or "length" on the last step
    prefill: bool = False
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token, where the sequence asks
    # on the prefill step, where asked (`echo`): one per prompt token, the first None (nothing
    # precedes it), token i from the target's row i - 1 of the prompt's pass
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


@dataclass
class GenerationStats:
    method: str
    k: int
    new_tokens: int = 0
    target_forward_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    acceptance_rate: float = 0.0
    mean_accepted_length: float = 0.0
    per_position_acceptance: list[float] = field(default_factory=list)
    ttft_s: float = 0.0
    itl_s: float = 0.0
    tokens_per_s: float = 0.0
    wall_s: float = 0.0
    # shadow speculation: drafted, accepted, the acceptance figures and the mean accepted length
    # are what speculation would have had; one token was emitted a pass
    shadow: bool = False

    @classmethod
    def from_steps(cls, method: str, k: int, start: float, steps: list[Step],
                   shadow: bool = False) -> GenerationStats:
        s = cls(method=method, k=k, shadow=shadow)
        if not steps:
            return s
        verify = [st for st in steps if not st.prefill]
        s.new_tokens = sum(len(st.tokens) for st in steps)
        s.target_forward_passes = len(steps)
        s.drafted = sum(st.drafted for st in verify)
        s.accepted = sum(st.accepted for st in verify)
        s.acceptance_rate = s.accepted / s.drafted if s.drafted else 0.0
        s.mean_accepted_length = (sum(st.accepted + 1 for st in verify) / len(verify)
                                  if verify else 0.0)
        depth = max((st.drafted for st in verify), default=0)
        s.per_position_acceptance = [
            sum(st.accepted > i for st in verify) / max(1, sum(st.drafted > i for st in verify))
            for i in range(depth)]
        s.ttft_s = steps[0].time - start
        s.wall_s = steps[-1].time - start
        s.itl_s = (s.wall_s - s.ttft_s) / (s.new_tokens - 1) if s.new_tokens > 1 else 0.0
        s.tokens_per_s = s.new_tokens / s.wall_s if s.wall_s > 0 else 0.0
        return s

    def to_dict(self) -> dict:
        return asdict(self)
