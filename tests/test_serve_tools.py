"""Tool calls through `forerun serve` with the real `openai` client (forerun.serve.tools).

A tiny float64 model whose chat template renders `tools` and earlier `tool_calls` the way
Qwen2.5's does (Hermes-style `<tool_call>` blocks), in an in-process server with draft-model
speculation. A random model never calls a tool by itself, so the calls here are forced by
`tool_choice` ("required", or a named function), which runs through structured output: the
call is valid JSON naming one of the tools, its arguments under the tool's schema. Checked:
the call comes back in `message.tool_calls` (and as stream deltas, the same call), the
conversation round-trips (the assistant's call and the tool's answer sent back are rendered),
and the refusals are 400s naming the field. The parser itself is checked on hand-written text,
split at every position as a stream would deliver it.
"""

from __future__ import annotations

import json
import shutil

import pytest
from test_serve import NAME, ThreadServer, client, model_dirs, post, server  # noqa: F401

from forerun import Engine, LoadConfig, SpecConfig
from forerun.serve.app import ServeConfig, create_app
from forerun.serve.tools import ToolText, parse_calls
from forerun.serve.worker import Worker

TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n{\"name\": \""
    "{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n"
    "</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "the weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 8},
                                  "unit": {"enum": ["c", "f"]}}}}}
TIME = {"type": "function", "function": {
    "name": "time", "parameters": {"type": "object", "additionalProperties": False,
                                   "required": ["zone"],
                                   "properties": {"zone": {"enum": ["utc", "cet"]}}}}}
ASK = [{"role": "user", "content": "weather in Oslo?"}]


@pytest.fixture(scope="module")
def tool_server(model_dirs, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("tools")
    target, draft = root / "target", root / "draft"
    shutil.copytree(model_dirs[0], target)
    shutil.copytree(model_dirs[1], draft)
    for d in (target, draft):  # its template renders tools; its context holds them (bytes)
        config = json.loads((d / "tokenizer_config.json").read_text())
        (d / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": TEMPLATE}))
        config = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 1024}))
    engine = Engine(str(target), str(draft), spec=SpecConfig("draft", 3, "fixed"),
                    load=LoadConfig(dtype="float64", draft_dtype="float64"))
    with ThreadServer(create_app(Worker(engine, slots=4, max_queue=8), ServeConfig(NAME))) as s:
        yield s.base


def _args(call) -> dict:
    return json.loads(call.function.arguments)


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                  "function": {"name": "time"}}])
def test_a_forced_call_comes_back_in_tool_calls(tool_server, choice):
    c = client(tool_server)
    out = c.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER, TIME],
                                    tool_choice=choice, max_tokens=200, temperature=0)
    message, finish = out.choices[0].message, out.choices[0].finish_reason
    assert finish == "tool_calls" and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    args = _args(call)
    if call.function.name == "weather":
        assert set(args) == {"city", "unit"} and args["unit"] in "cf" and len(args["city"]) <= 8
    else:
        assert call.function.name == "time" and args["zone"] in ("utc", "cet")
    if isinstance(choice, dict):
        assert call.function.name == "time"


def test_a_streamed_call_equals_the_whole_one_and_the_conversation_round_trips(tool_server):
    c = client(tool_server)
    args = dict(model=NAME, messages=ASK, tools=[WEATHER], tool_choice="required",
                max_tokens=200, temperature=0)
    whole = c.chat.completions.create(**args).choices[0].message.tool_calls[0]
    deltas, reasons = [], []
    for chunk in c.chat.completions.create(stream=True, **args):
        if chunk.choices:
            deltas += chunk.choices[0].delta.tool_calls or []
            reasons.append(chunk.choices[0].finish_reason)
    assert len(deltas) == 1 and deltas[0].index == 0
    assert (deltas[0].function.name, _args(deltas[0])) == (whole.function.name, _args(whole))
    assert reasons[-1] == "tool_calls"
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": whole.id, "type": "function", "function": {
            "name": whole.function.name, "arguments": whole.function.arguments}}]},
        {"role": "tool", "tool_call_id": whole.id, "content": "12 degrees"}]
    reply = c.chat.completions.create(model=NAME, messages=history, tools=[WEATHER],
                                      max_tokens=8, temperature=0)
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls


@pytest.mark.parametrize(("fields", "param", "text"), [
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type", "function tools"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools.0.function", "function.name"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not among"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "must be"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "takes no response_format"),
])
def test_bad_tool_requests_are_clear_400s(tool_server, fields, param, text):
    r = post(tool_server, "/v1/chat/completions", {"model": NAME, "messages": ASK,
                                                   "max_tokens": 4} | fields)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and text in r.json()["error"]["message"]


def test_tools_on_a_model_whose_template_has_none_are_refused(server):  # noqa: F811
    r = post(server, "/v1/chat/completions", {"model": NAME, "messages": ASK, "max_tokens": 4,
                                              "tools": [WEATHER]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    ok = post(server, "/v1/chat/completions", {"model": NAME, "messages": ASK, "max_tokens": 4,
                                               "tools": [WEATHER], "tool_choice": "none"})
    assert ok.status_code == 200  # "none": the tools are not rendered, nothing is parsed


TEXT = ('Let me check. <tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n'
        '</tool_call><tool_call>{"name": "time", "arguments": {}}</tool_call>')


def test_calls_are_parsed_out_of_text_whole_and_in_any_split():
    content, calls = parse_calls(TEXT)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("weather", {"city": "Oslo"}), ("time", {})]
    assert parse_calls("no call <tool_call>not json</tool_call>") == (
        "no call <tool_call>not json</tool_call>", [])
    for cut in range(len(TEXT) + 1):
        split, text, names = ToolText(), "", []
        for piece in (TEXT[:cut], TEXT[cut:]):
            out, calls = split.push(piece)
            text += out
            names += [c["function"]["name"] for c in calls]
        text += split.finish()
        assert names == ["weather", "time"], cut
        assert text.strip() == "Let me check.", (cut, text)
