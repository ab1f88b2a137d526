"""A request's sampling options, checked: the `SamplingConfig` a request body asks for.

Owns: temperature (OpenAI's default 1, greedy below GREEDY_BELOW), top-k / top-p / min-p, the
penalties and logit bias (`forerun.processors`; logit_bias keys are token ids as strings, as
OpenAI sends them) and the grammar of structured output (`forerun.grammar`, compiled here once
so that a bad one is a 400 before anything is queued; a tool_choice that forces a call is a
grammar too, `forerun.serve.tools`). Every refusal names its field.
"""

from __future__ import annotations

from forerun.grammar import Grammar, GrammarError, state_for
from forerun.models.tokenizer import TextTokenizer
from forerun.processors import Processing, ProcessingError
from forerun.sampling import SamplingConfig, SamplingError
from forerun.serve.protocol import (
    GREEDY_BELOW,
    APIError,
    ChatRequest,
    CompletionRequest,
    grammar_wanted,
)
from forerun.serve.tools import check_tools, tool_choice_grammar

OPENAI_TEMPERATURE = 1.0  # OpenAI's default when a request gives none
PENALTY_FIELDS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias")


def request_sampling(body: CompletionRequest | ChatRequest, tokenizer: TextTokenizer,
                     vocab: int) -> SamplingConfig:
    temperature = OPENAI_TEMPERATURE if body.temperature is None else body.temperature
    try:
        return SamplingConfig(
            temperature=0.0 if temperature < GREEDY_BELOW else temperature,
            top_k=max(0, body.top_k or 0), top_p=1.0 if body.top_p is None else body.top_p,
            min_p=body.min_p or 0.0, seed=body.seed, processing=processing(body, vocab),
            grammar=grammar(body, tokenizer, vocab))
    except SamplingError as e:
        raise APIError(400, str(e)) from e


def processing(body: CompletionRequest | ChatRequest, vocab: int) -> Processing:
    """Penalties and logit bias, each checked."""
    bias: dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        if not key.lstrip("-").isdigit() or not 0 <= int(key) < vocab:
            raise APIError(400, f"logit_bias keys must be token ids in [0, {vocab}), got "
                           f"{key!r}", param="logit_bias")
        bias[int(key)] = value
    try:
        return Processing.of(1.0 if body.repetition_penalty is None else body.repetition_penalty,
                             body.presence_penalty or 0.0, body.frequency_penalty or 0.0, bias)
    except ProcessingError as e:
        param = next((f for f in PENALTY_FIELDS if f in str(e)), None)
        raise APIError(400, str(e), param=param) from e


def grammar(body: CompletionRequest | ChatRequest, tokenizer: TextTokenizer,
            vocab: int) -> Grammar | None:
    """The request's grammar, compiled against the model's tokenizer (a bad one: 400): its
    structured output's, or the one its tool_choice forces."""
    wanted = grammar_wanted(body)
    if isinstance(body, ChatRequest):
        forced = tool_choice_grammar(check_tools(body.tools), body.tool_choice)
        if forced is not None and wanted is not None:
            raise APIError(400, "a tool_choice that forces a call takes no response_format",
                           param="tool_choice")
        wanted = wanted or forced
    if wanted is not None:
        try:
            state_for(wanted, tokenizer, vocab)
        except (GrammarError, ValueError, RuntimeError, TypeError) as e:  # (llguidance's own)
            param = ("response_format" if body.response_format else "structured_outputs"
                     if body.structured_outputs else "tool_choice")
            raise APIError(400, str(e), param=param) from e
    return wanted
