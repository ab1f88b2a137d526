"""Chat templates: untrusted Jinja2 code from model files, rendered in a bounded sandbox.

Owns: the environment chat templates compile in and the budget of each render. A template comes
from a GGUF file or a tokenizer_config.json that someone else wrote. Jinja2's
ImmutableSandboxedEnvironment keeps it away from Python's internals (jinja2 >= 3.1.6 closes the
known escapes); this module keeps it from taking the machine's time and memory:
- loops: every `for` iteration, and every item of a recursive `loop(...)` call, is counted
  against one budget of MAX_LOOP_STEPS per render, which also checks the render's deadline
  (RENDER_DEADLINE_S): nested loops multiply, the budget does not;
- values: the operations that can build a big string, list or number in one step (`*`, `+`,
  `**`, `%`, `~`, calls and filters with a size argument, replace, join, namespace assignments)
  are refused before they run when the result would pass MAX_VALUE_CHARS (or MAX_INT_BITS), and
  every call's and filter's result is checked after it;
- output: the render streams, and stops once it has written MAX_OUTPUT_CHARS.
Passing a bound raises TemplateBudgetError, a jinja2.TemplateError naming the bound.
Never tokenizes (see `forerun.models.tokenizer`).
"""

from __future__ import annotations

import functools
import json
import re
import time
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer

from forerun.models.catalog import ModelError

MAX_LOOP_STEPS = 250_000  # loop iterations per render, all loops together (~0.3 s)
RENDER_DEADLINE_S = 5.0  # wall-clock seconds per render, checked at every loop iteration
MAX_VALUE_CHARS = 1 << 22  # characters of one string, items of one list (4 Mi)
MAX_OUTPUT_CHARS = 1 << 22  # characters a render may write
MAX_INT_BITS = 1 << 12  # a number a template computes stays below 2 ** 4096
SIZED = (str, list, tuple)
FORMAT_WIDTH = re.compile(r"%[-#0 +]*(\d*)(?:\.(\d*))?|\{[^{}]*?:[^{}]*?(\d+)[^{}]*\}")


class TemplateBudgetError(jinja2.TemplateError):
    """A chat template ran past one of this module's bounds."""


@dataclass
class _Budget:
    deadline: float
    steps: int = 0

    def step(self) -> None:
        self.steps += 1
        if self.steps > MAX_LOOP_STEPS:
            raise TemplateBudgetError(f"the chat template ran over {MAX_LOOP_STEPS} loop "
                                      "iterations")
        if time.monotonic() > self.deadline:
            raise TemplateBudgetError(f"the chat template ran over {RENDER_DEADLINE_S} s")


_budget: ContextVar[_Budget] = ContextVar("chat_template_budget")


def _too_big(what: str, size: int, limit: int = MAX_VALUE_CHARS) -> None:
    if size > limit:
        raise TemplateBudgetError(f"the chat template would build {what} of {size}, over its "
                                  f"limit of {limit}")


def _check_result(value: Any) -> Any:
    if isinstance(value, SIZED):
        _too_big("a value", len(value))
    elif isinstance(value, int):
        _too_big("a number of bits", value.bit_length(), MAX_INT_BITS)
    return value


def _check_arguments(args: tuple, kwargs: dict) -> None:
    """No size argument (a width, a count, a repetition) over MAX_VALUE_CHARS."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool):
            _too_big("something sized", abs(value))


def _check_widths(text: str) -> None:
    """No %-format or str.format field wider (or more precise) than MAX_VALUE_CHARS."""
    for groups in FORMAT_WIDTH.findall(text):
        for digits in groups:
            if digits:
                _too_big("a formatted field", int(digits))


def _predict(name: str, args: tuple) -> None:
    """Operations whose result can be the product of their inputs' sizes: predict it."""
    if name == "replace" and len(args) >= 3 and all(isinstance(a, str) for a in args[:3]):
        s, old, new = args[:3]
        count = len(s) + 1 if not old else s.count(old)
        _too_big("a string", len(s) + count * max(0, len(new) - len(old)))
    elif name == "join" and len(args) >= 2 and isinstance(args[1], SIZED):
        sep, items = args[0], args[1]
        sep = sep if isinstance(sep, str) else ""
        _too_big("a string", sum(len(x) if isinstance(x, str) else 0 for x in items)
                 + len(sep) * max(0, len(items) - 1))
    elif name == "expandtabs" and args and isinstance(args[0], str):
        tab = args[1] if len(args) > 1 and isinstance(args[1], int) else 8
        _too_big("a string", len(args[0]) + args[0].count("\t") * tab)
    elif name == "indent" and args and isinstance(args[0], str):
        width = args[1] if len(args) > 1 else 4
        width = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        _too_big("a string", len(args[0]) + (args[0].count("\n") + 1) * width)


def _bounded_filter(name: str, func):
    passes_first = getattr(func, "jinja_pass_arg", None) is not None  # a context or environment

    @functools.wraps(func)  # keeps jinja_pass_arg: the compiler passes the same arguments
    def bounded(*args, **kwargs):
        _check_arguments(args, kwargs)
        values = args[1:] if passes_first else args
        if name == "join" and values:  # join(items, d="")
            _predict("join", (values[1] if len(values) > 1 else kwargs.get("d", ""), values[0]))
        elif name == "indent" and values:  # indent(s, width=4)
            _predict("indent", (values[0], values[1] if len(values) > 1
                                else kwargs.get("width", 4)))
        else:
            _predict(name, values)
        return _check_result(func(*args, **kwargs))

    return bounded


class BoundedNamespace(Namespace):
    """`namespace()`: its attributes are the one store a loop can grow; they are checked."""

    def __setitem__(self, name: str, value: Any) -> None:
        super().__setitem__(name, _check_result(value))


class LoopBudget(Extension):
    """What the rewritten templates call: every loop iteration, and every `~` concatenation."""

    def iterate(self, iterable):
        # a template rendered without `render` gets a budget per loop
        budget = _budget.get(None) or _Budget(time.monotonic() + RENDER_DEADLINE_S)
        for item in iterable:
            budget.step()
            yield item

    def concat(self, *parts) -> str:
        texts = [str(p) for p in parts]
        _too_big("a string", sum(map(len, texts)))
        return "".join(texts)


def _call(method: str, *args: nodes.Expr, lineno: int) -> nodes.Call:
    return nodes.Call(nodes.ExtensionAttribute(LoopBudget.identifier, method, lineno=lineno),
                      list(args), [], None, None, lineno=lineno)


class _Bound(NodeTransformer):
    """Rewrites a parsed template: loops iterate through LoopBudget.iterate, a recursive loop's
    `loop(items)` too, and `a ~ b` goes through LoopBudget.concat."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        node = self.generic_visit(node)
        node.iter = _call("iterate", node.iter, lineno=node.lineno)
        return node

    def visit_Call(self, node: nodes.Call) -> nodes.Call:
        node = self.generic_visit(node)
        if isinstance(node.node, nodes.Name) and node.node.name == "loop" and node.args:
            node.args[0] = _call("iterate", node.args[0], lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Call:
        node = self.generic_visit(node)
        return _call("concat", *node.nodes, lineno=node.lineno)


class ChatTemplateSandbox(ImmutableSandboxedEnvironment):
    """Jinja2's immutable sandbox with the bounds of this module."""

    intercepted_binops = frozenset({"*", "+", "**", "%"})

    def __init__(self):
        super().__init__(trim_blocks=True, lstrip_blocks=True,
                         extensions=["jinja2.ext.loopcontrols", LoopBudget])
        self.filters["tojson"] = lambda x, indent=None, **_: json.dumps(
            x, ensure_ascii=False, indent=indent)
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        self.globals["namespace"] = BoundedNamespace
        self.globals["raise_exception"] = _raise_template_error
        self.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)

    def _parse(self, source, name, filename):
        tree = super()._parse(source, name, filename)
        tree = _Bound().visit(tree)
        tree.set_environment(self)
        return tree

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, SIZED) and isinstance(n, int):
                    _too_big("a repetition", len(seq) * max(n, 0))
            if isinstance(left, int) and isinstance(right, int):
                _too_big("a number of bits", left.bit_length() + right.bit_length(),
                         MAX_INT_BITS)
        elif operator == "+" and isinstance(left, SIZED) and isinstance(right, SIZED):
            _too_big("a concatenation", len(left) + len(right))
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            if abs(left) > 1 and right > 0:
                _too_big("a number of bits", right * abs(left).bit_length(), MAX_INT_BITS)
        elif operator == "%" and isinstance(left, str):
            _check_widths(left)
            _check_arguments(right if isinstance(right, tuple) else (right,), {})
        return _check_result(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # Jinja's signature
        _check_arguments(args, kwargs)
        bound = getattr(__obj, "__wrapped__", __obj)  # str.format, as the sandbox wraps it
        owner, name = getattr(bound, "__self__", None), getattr(bound, "__name__", "")
        if isinstance(owner, str):
            if name in ("format", "format_map"):
                _check_widths(owner)
            _predict(name, (owner, *args))
        return _check_result(super().call(__context, __obj, *args, **kwargs))


def _raise_template_error(message: str):
    raise ModelError(f"chat template error: {message}")


def compile_template(source: str) -> jinja2.Template:
    return ChatTemplateSandbox().from_string(source)


def render(template: jinja2.Template, **variables) -> str:
    """Render within the budget: MAX_LOOP_STEPS, RENDER_DEADLINE_S, MAX_OUTPUT_CHARS."""
    token = _budget.set(_Budget(time.monotonic() + RENDER_DEADLINE_S))
    try:
        out, size = [], 0
        for piece in template.generate(**variables):
            size += len(piece)
            if size > MAX_OUTPUT_CHARS:
                raise TemplateBudgetError(f"the chat template wrote over {MAX_OUTPUT_CHARS} "
                                          "characters")
            out.append(piece)
        return "".join(out)
    finally:
        _budget.reset(token)
