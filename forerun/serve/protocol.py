"""The wire format: OpenAI request bodies (pydantic), response and stream-chunk bodies, errors.

Owns: what a request may contain and what is refused (with the field named in `param`), the
`speculation` extension field, and the JSON shapes of responses, stream chunks and errors
(`{"error": {"message", "type", "param", "code"}}`). Knows nothing of models or the worker.

Extensions beyond the OpenAI API: `speculation` ("off", or {"method", "k", "policy",
"ngram_min", "ngram_max", "stream_stats"}), and `top_k`, `min_p` and `repetition_penalty` as
vLLM accepts them. Logprobs are the target's (log-softmax of its raw logits, before penalties
and temperature, as vLLM reports by default), each token's text its own decoding.
As in vLLM, a temperature below GREEDY_BELOW is greedy (dividing logits by it would overflow).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from forerun.grammar import Grammar
from forerun.metrics import TokenLogprob
from forerun.serve.limits import MAX_K, MAX_LOGPROBS, MAX_N, MAX_SEED, MAX_STOP, MAX_STOP_CHARS

GREEDY_BELOW = 1e-5


class APIError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None
               ) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _encodable(text: str) -> str:
    text.encode("utf-8")  # a lone surrogate (JSON "\ud800") cannot reach the tokenizer
    return text


Text = Annotated[str, AfterValidator(_encodable)]


class Speculation(BaseModel):
    """Per-request speculation; unset fields take the server's values. The string "off" is
    short for {"method": "none"}."""

    model_config = ConfigDict(extra="forbid")

    method: str | None = Field(None, description="none, draft, ngram or suffix")
    k: int | None = Field(None, ge=0, le=MAX_K, description="draft tokens per verify step")
    policy: str | None = Field(None, description="fixed, adaptive or cost")
    ngram_min: int | None = Field(None, ge=1, le=MAX_K)
    ngram_max: int | None = Field(None, ge=1, le=MAX_K)
    stream_stats: bool = Field(False, description="running speculation stats in every chunk")
    shadow: bool | None = Field(None, description="draft and score, emit plain tokens")


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by both endpoints. Unknown fields are ignored, as OpenAI clients send
    fields a server may not know; known but unsupported ones are refused (see `unsupported`)."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, description="default 1, as OpenAI")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="extension; 0 or -1 = off")
    min_p: float | None = Field(None, ge=0, lt=1, description="extension")
    n: int | None = Field(None, ge=1, le=MAX_N)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = Field(None, description="extension (vLLM's); 1 = off")
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    speculation: Speculation | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None

    @field_validator("speculation", mode="before")
    @classmethod
    def _off(cls, value: Any) -> Any:
        if isinstance(value, str):
            if value != "off":
                raise ValueError('must be "off" or an object such as {"method": "ngram", "k": 4}')
            return {"method": "none"}
        return value


class StructuredOutputs(BaseModel):
    """vLLM's extension: exactly one of a JSON schema, a regex, a grammar (Lark or GBNF)."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    grammar: str | None = None


class CompletionRequest(_Sampling):
    prompt: Text | list[int] | list[Text] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: Text | None = None  # a tool message's answer to one


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None


def unsupported(req: CompletionRequest | ChatRequest) -> None:
    """Refuse fields we accept in the schema but cannot honour, naming each."""
    checks: list[tuple[str, bool, str]] = []
    if isinstance(req, CompletionRequest):
        checks += [("suffix", req.suffix is not None, "suffix is not supported"),
                   ("best_of", req.best_of not in (None, 1, req.n), "best_of is not supported")]
    for param, refused, message in checks:
        if refused:
            raise APIError(400, message, param=param, code="unsupported_parameter")


def grammar_wanted(req: CompletionRequest | ChatRequest) -> Grammar | None:
    """The grammar the output must match: `response_format` (json_object, json_schema) or
    `structured_outputs` (json, regex, grammar); None for free text."""
    fmt, extra = req.response_format or {"type": "text"}, req.structured_outputs
    kind = fmt.get("type", "text")
    if kind != "text" and extra is not None:
        raise APIError(400, "give response_format or structured_outputs, not both",
                       param="structured_outputs")
    if kind == "json_object":
        return Grammar("json_object")
    if kind == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise APIError(400, "response_format json_schema needs json_schema.schema, an "
                           "object", param="response_format")
        return Grammar("json_schema", json.dumps(schema))
    if kind != "text":
        raise APIError(400, f"response_format type {kind!r} is not one of text, json_object, "
                       "json_schema", param="response_format")
    if extra is None:
        return None
    given = [(k, v) for k, v in (("json", extra.json_), ("regex", extra.regex),
                                 ("grammar", extra.grammar)) if v is not None]
    if len(given) != 1:
        raise APIError(400, "structured_outputs takes exactly one of json, regex, grammar",
                       param="structured_outputs")
    (key, value), = given
    if key == "json":
        return Grammar("json_schema", json.dumps(value))
    return Grammar(key, value)


def logprobs_wanted(req: CompletionRequest | ChatRequest) -> int | None:
    """Alternatives per token the request asks logprobs with (None: no logprobs)."""
    if isinstance(req, CompletionRequest):
        n, param = req.logprobs, "logprobs"
    else:
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        n, param = (req.top_logprobs or 0) if req.logprobs else None, "top_logprobs"
    if n is not None and not 0 <= n <= MAX_LOGPROBS:
        raise APIError(400, f"{param} must be in [0, {MAX_LOGPROBS}], got {n}", param=param)
    return n


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP:
        raise APIError(400, f"at most {MAX_STOP} stop strings, got {len(stops)}", param="stop")
    for s in stops:
        if len(s) > MAX_STOP_CHARS:
            raise APIError(400, f"a stop string may have at most {MAX_STOP_CHARS} characters, "
                           f"got {len(s)}", param="stop")
    return tuple(s for s in stops if s)


def chat_messages(messages: list[Message]) -> list[dict]:
    """The messages as chat templates expect them: text content; developer -> system."""
    out = []
    for m in messages:
        content = m.content if isinstance(m.content, str) or m.content is None else "".join(
            part.text for part in m.content)
        role = "system" if m.role == "developer" else m.role
        msg = {"role": role, "content": content or ""} | ({"name": m.name} if m.name else {})
        if m.tool_calls:  # templates read function.arguments as an object
            msg["tool_calls"] = [_template_call(c) for c in m.tool_calls]
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call["function"]) if isinstance(call.get("function"), dict) else {}
    if isinstance(fn.get("arguments"), str):
        with contextlib.suppress(json.JSONDecodeError):  # else written as it is
            fn["arguments"] = json.loads(fn["arguments"])
    return {**call, "function": fn}


# --- responses ----------------------------------------------------------------------------------

class Shape:
    """Builds the response and stream-chunk bodies of one request (one id, one timestamp)."""

    def __init__(self, chat: bool, model: str, token_text: Callable[[int], str] = str):
        self.chat, self.model, self.token_text = chat, model, token_text
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, choices: list[dict], usage: dict) -> dict:
        return self._head("chat.completion" if self.chat else "text_completion") | {
            "choices": choices, "usage": usage}

    def choice(self, index: int, text: str | None, finish_reason: str, speculation: dict,
               logprobs: Sequence[TokenLogprob] | None = None,
               tool_calls: list[dict] | None = None, prefix: str = "",
               prefix_logprobs: dict | None = None) -> dict:
        """One choice; `prefix` (a completion's echoed prompt) comes before the text, and its
        `prefix_logprobs` columns before the text's."""
        body = ({"message": {"role": "assistant", "content": text} | (
            {"tool_calls": tool_calls} if tool_calls else {})} if self.chat else
            {"text": prefix + (text or "")})
        lps = self.logprobs(logprobs, len(prefix))
        if prefix_logprobs is not None and lps is not None:
            lps = {key: prefix_logprobs[key] + lps[key] for key in lps}
        return {"index": index, **body, "logprobs": lps,
                "finish_reason": finish_reason, "speculation": speculation}

    def logprobs(self, lps: Sequence[TokenLogprob] | None, offset: int = 0) -> dict | None:
        """OpenAI's logprobs object: chat's `content` list, or the completions' legacy columns
        (`text_offset` counted from `offset`, the characters before these tokens)."""
        if lps is None:
            return None
        text = self.token_text
        if self.chat:
            def entry(token: int, logprob: float) -> dict:
                t = text(token)
                return {"token": t, "logprob": logprob, "bytes": list(t.encode())}
            return {"content": [entry(lp.token, lp.logprob) | {
                "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]}
        tokens = [text(lp.token) for lp in lps]
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [_by_text(lp.top, text) for lp in lps],
                "text_offset": _offsets(tokens, offset)}

    def prompt_logprobs(self, ids: list[int], lps: Sequence[TokenLogprob | None]) -> dict:
        """The completions' legacy columns for an echoed prompt: its first token has no
        logprob and no alternatives (null), as in OpenAI's and vLLM's."""
        text = self.token_text
        tokens = [text(t) for t in ids]
        return {"tokens": tokens,
                "token_logprobs": [None if lp is None else lp.logprob for lp in lps],
                "top_logprobs": [None if lp is None else _by_text(lp.top, text) for lp in lps],
                "text_offset": _offsets(tokens, 0)}

    def chunk(self, index: int, text: str | None, finish_reason: str | None = None,
              speculation: dict | None = None, role: bool = False,
              logprobs: dict | None = None, tool_calls: list[dict] | None = None) -> dict:
        if self.chat:
            delta = ({"role": "assistant"} if role else {}) | (
                {"content": text} if text is not None else {}) | (
                {"tool_calls": tool_calls} if tool_calls else {})
            choice = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text or ""}
        choice |= {"logprobs": logprobs, "finish_reason": finish_reason}
        if speculation is not None:
            choice["speculation"] = speculation
        return self._head("chat.completion.chunk" if self.chat else "text_completion") | {
            "choices": [choice]}

    def usage_chunk(self, usage: dict) -> dict:
        return self._head("chat.completion.chunk" if self.chat else "text_completion") | {
            "choices": [], "usage": usage}


def _offsets(tokens: list[str], start: int) -> list[int]:
    """Each token's character offset in the text, the first at `start`."""
    out = []
    for t in tokens:
        out.append(start)
        start += len(t)
    return out


def _by_text(top: Sequence[tuple[int, float]], text: Callable[[int], str]) -> dict[str, float]:
    """The completions' {text: logprob} of the alternatives; where two tokens read the same
    (bytes of one character), the likelier one's."""
    out: dict[str, float] = {}
    for token, logprob in top:
        out.setdefault(text(token), logprob)
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
