"""Tool calls (OpenAI `tools` / `tool_choice`) for models whose chat template renders tools.

Owns: checking the `tools` list, the grammar that `tool_choice: "required"` or a named function
imposes (through structured output, so the call is valid JSON naming a given function with
arguments under its schema), and reading calls out of the model's text: Hermes-style
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, as Qwen2.5's template asks
for. `ToolText` does it incrementally for streams: text before the first block streams as
content; a block is held until it closes, then becomes one `tool_calls` delta.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from forerun.grammar import JSON_LAYOUT, Grammar
from forerun.serve.protocol import APIError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def check_tools(tools: list[Any] | None) -> list[dict] | None:
    """The tools as the chat template takes them; 400 naming the first malformed entry."""
    if not tools:
        return None
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise APIError(400, "only function tools are supported", param=f"tools.{i}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(400, "a tool needs function.name", param=f"tools.{i}.function")
        if not isinstance(fn.get("parameters", {}), dict):
            raise APIError(400, "function.parameters must be a JSON schema object",
                           param=f"tools.{i}.function.parameters")
    return [{"type": "function", "function": t["function"]} for t in tools]


def tool_choice_grammar(tools: list[dict] | None, choice: Any) -> Grammar | None:
    """The grammar a `tool_choice` forces: None for "auto" / "none" / absent; for "required"
    one call of any tool, for {"type": "function", "function": {"name"}} a call of that one."""
    if choice in (None, "auto", "none"):
        return None
    if not tools:
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    if choice == "required":
        chosen = tools
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        chosen = [t for t in tools if t["function"]["name"] == name]
        if not chosen:
            raise APIError(400, f"tool_choice names {name!r}, which is not among the tools",
                           param="tool_choice")
    else:
        raise APIError(400, 'tool_choice must be "none", "auto", "required" or '
                       '{"type": "function", "function": {"name": ...}}', param="tool_choice")
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": t["function"]["name"]},
                             "arguments": t["function"].get("parameters") or {"type": "object"}}}
             for t in chosen]
    schema = (calls[0] if len(calls) == 1 else {"anyOf": calls}) | {"x-guidance": JSON_LAYOUT}
    return Grammar("lark", f'start: "{OPEN}\\n" call "\\n{CLOSE}"\ncall: %json '
                              f"{json.dumps(schema)}")


def parse_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content before the first call or None, the calls in OpenAI's shape). A block that is
    not JSON with a string name stays text."""
    calls, content = [], text
    for match in BLOCK.finditer(text):
        call = _call(match.group(1))
        if call is None:
            continue
        if not calls:
            content = text[:match.start()]
        calls.append(call)
    if not calls:
        return text, []
    return (content.strip() or None), calls


def _call(body: str) -> dict | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": value["name"], "arguments": arguments if isinstance(
                arguments, str) else json.dumps(arguments, ensure_ascii=False)}}


class ToolText:
    """A stream's text split into content deltas and tool calls, as it arrives."""

    def __init__(self):
        self.pending, self.calls, self.in_call = "", [], False

    def push(self, text: str) -> tuple[str, list[dict]]:
        """-> (content to send now, calls completed by this text)."""
        self.pending += text
        out, calls = "", []
        while True:
            if self.in_call:
                end = self.pending.find(CLOSE)
                if end < 0:
                    return out, calls
                call = _call(self.pending[:end].strip())
                block = OPEN + self.pending[:end + len(CLOSE)]
                self.pending, self.in_call = self.pending[end + len(CLOSE):], False
                if call is None:
                    out += block  # not a call after all: it was text
                else:
                    calls.append(call)
                    self.calls.append(call)
                continue
            start = self.pending.find(OPEN)
            if start >= 0:
                head = self.pending[:start]
                out += head if self.calls or head.strip() else ""
                self.pending, self.in_call = self.pending[start + len(OPEN):], True
                continue
            keep = _partial_open(self.pending)  # might be the start of "<tool_call>"
            out += self.pending[:len(self.pending) - keep]
            self.pending = self.pending[len(self.pending) - keep:]
            return out, calls

    def finish(self) -> str:
        """What is left when the stream ends (an unclosed block is text)."""
        rest = (OPEN if self.in_call else "") + self.pending
        self.pending, self.in_call = "", False
        return rest


def _partial_open(text: str) -> int:
    """The length of the longest suffix of `text` that begins "<tool_call>"."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
