"""`forerun chat`: a conversation in the terminal, each reply streamed as it is generated.

Owns: the chat loop, its slash commands, and what Ctrl-C means here. Every turn renders the
whole conversation (the messages list) through the model's chat template and decodes afresh:
`Engine.generate` prefills from position 0 each call, so nothing of an earlier reply's cache
state can leak into the next.

Ctrl-C during a reply stops that reply between two decode steps (the engine is never left
mid-step); the text shown so far stays in the history as the assistant's turn, and the prompt
comes back. A reply stopped before any text also drops the user's message, so that the roles
still alternate. A second Ctrl-C before the step ends interrupts the step itself (the next
prefill starts over anyway). Ctrl-C at the prompt clears the line and says how to quit;
/exit and EOF (Ctrl-D) end with status 0.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, replace

import jinja2
from rich.markup import escape

from forerun.api import Completion, Engine, load_draft
from forerun.commands.options import (
    add_model_args,
    add_sampling_args,
    add_spec_args,
    err,
    load_config,
    load_engine,
    sampling_config,
    spec_config,
)
from forerun.heads import KINDS as HEAD_KINDS
from forerun.metrics import GenerationStats
from forerun.models.catalog import ModelError
from forerun.models.load import open_model
from forerun.propose import PROPOSERS, SpecConfig
from forerun.sampling import SamplingConfig
from forerun.stopping import ContextError, check_prompt

PROMPT = ">>> "
HELP = """commands:
  /help              this list
  /stats             after each reply, print acceptance rate, tok/s and mean
                     accepted length (on/off)
  /method NAME [K]   draft with NAME, K tokens a step, from the next reply on;
                     NAME: {methods}; /method alone shows the current one
  /reset             forget the conversation (the --system message stays)
  /exit              quit (so does Ctrl-D); Ctrl-C stops a reply, not the chat"""


def add_parser(sub) -> None:
    chat = sub.add_parser("chat", help="chat with the model in the terminal",
                          description="A multi-turn conversation through the model's chat "
                          "template, replies streamed. /help lists the commands; Ctrl-C stops "
                          "a reply; /exit or Ctrl-D quits.",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    chat.add_argument("--system", default=None, help="system message that opens the conversation")
    add_model_args(chat)
    add_spec_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=run)


def run(args) -> int:
    with suppress(ImportError):
        import readline  # noqa: F401  (importing it gives input() line editing and history)
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    chat = Chat(args, load_engine(args), sampling_config(args), spec_config(args))
    if chat.engine.tokenizer.chat_template is None:
        raise ModelError(f"{args.target} has no chat template, which `forerun chat` needs; "
                         "`forerun generate --raw` sends text as is")
    check_method(chat.engine, chat.spec)
    # Ctrl-C at the prompt is a hint, even where the chat was started with SIGINT ignored (a
    # shell's background job, nohup): Python then leaves it ignored, and only a reply took it
    signal.signal(signal.SIGINT, signal.default_int_handler)
    chat.reset()
    note(f"[dim]{escape(args.target)}, {escape(describe(chat.spec))}. /help lists the "
              "commands; /exit or Ctrl-D quits.")
    while True:
        try:
            line = input(PROMPT).strip()
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print()
            note("[dim](Ctrl-C stops a reply; /exit or Ctrl-D quits)")
            continue
        if line.startswith("/"):
            if not chat.command(line):
                return 0
        elif line:
            chat.reply(line)


@dataclass
class Chat:
    """The conversation and the settings the slash commands change between replies."""

    args: argparse.Namespace
    engine: Engine
    sampling: SamplingConfig
    spec: SpecConfig
    show_stats: bool = False
    messages: list[dict] = field(default_factory=list)

    def reset(self) -> None:
        system = self.args.system
        self.messages = [{"role": "system", "content": system}] if system else []

    def command(self, line: str) -> bool:
        """Run one slash command; False when the chat should end."""
        name, *words = line.split()
        if name == "/exit":
            return False
        if name == "/help":
            note(HELP.format(methods=", ".join(["none", *PROPOSERS])), markup=False)
        elif name == "/stats":
            self.show_stats = not self.show_stats
            note(f"[dim]stats after each reply: {'on' if self.show_stats else 'off'}")
        elif name == "/reset":
            self.reset()
            note("[dim]conversation cleared")
        elif name == "/method":
            self.switch(words)
        else:
            note(f"unknown command {escape(name)}; /help lists them")
        return True

    def switch(self, words: list[str]) -> None:
        """/method NAME [K]: the drafting of the next replies; a bad one changes nothing."""
        if not words:
            note(f"[dim]{escape(describe(self.spec))}")
            return
        if len(words) > 2 or (len(words) == 2 and not words[1].isdigit()):
            note("usage: /method NAME [K], K a whole number of draft tokens per step")
            return
        name, k = words[0], int(words[1]) if len(words) == 2 else self.spec.k
        try:
            spec = replace(self.spec, method=name, k=k,
                           lookup=self.spec.lookup and name in HEAD_KINDS)
            if name == "draft" and self.engine.draft is None:
                self.load_draft(spec)
            check_method(self.engine, spec)
        except (ValueError, ModelError) as e:
            note(f"[bold red]error:[/] {escape(str(e))}; still {escape(describe(self.spec))}")
            return
        self.spec = spec
        note(f"[dim]{escape(describe(spec))} from the next reply on")

    def load_draft(self, spec: SpecConfig) -> None:
        """Load --draft now: the chat began with a method that needed none."""
        args = self.args
        with err.status(f"loading the draft model {args.draft}"):
            draft_src = open_model(args.draft)
            draft = load_draft(open_model(args.target), draft_src, load_config(args))
        engine = self.engine
        self.engine = Engine.from_runtimes(engine.target, engine.tokenizer, draft, spec,
                                           engine.heads, draft_tokenizer=draft_src.tokenizer)

    def reply(self, text: str) -> None:
        """One turn: the user's message, then the model's reply streamed on stdout."""
        self.messages.append({"role": "user", "content": text})
        shown: list[str] = []
        try:
            ids = self.engine.tokenizer.encode_chat(self.messages)
            check_prompt(ids, self.engine.target.capacity)  # before any drafter sees it
            with ctrl_c_stops_reply() as pressed:
                def write(delta: str) -> None:
                    sys.stdout.write(delta)
                    sys.stdout.flush()
                    shown.append(delta)
                    if pressed.once:
                        raise ReplyStopped

                result = self.engine.generate(
                    ids, sampling=self.sampling, max_tokens=self.args.max_tokens,
                    stop=tuple(self.args.stop), spec=self.spec, on_text=write)
        except (ReplyStopped, KeyboardInterrupt):
            result = None
        except (ValueError, ModelError, jinja2.TemplateError) as e:  # ContextError among them
            self.messages.pop()
            hint = "; /reset starts a new conversation" if isinstance(e, ContextError) else ""
            note(f"[bold red]error:[/] {escape(str(e))}{hint}")
            return
        print()
        if result is None:
            note("[dim](reply stopped)")
            if shown:
                self.messages.append({"role": "assistant", "content": "".join(shown)})
            else:
                self.messages.pop()
            return
        self.messages.append({"role": "assistant", "content": result.text})
        if self.show_stats:
            note(stats_line(result.stats), style="dim", markup=False)
        if self.context_full(result):
            note(f"[dim]the context ({self.engine.target.capacity} tokens) is full: "
                 "/reset starts a new conversation, or raise --context")

    def context_full(self, result: Completion) -> bool:
        used = result.prompt_tokens + len(result.token_ids)
        return result.finish_reason == "length" and used >= self.engine.target.capacity


class ReplyStopped(Exception):
    """Raised from the text callback after Ctrl-C: generate() unwinds between two steps."""


@dataclass
class Pressed:
    once: bool = False


@contextmanager
def ctrl_c_stops_reply() -> Iterator[Pressed]:
    """While a reply streams, Ctrl-C marks it stopped (checked after each step's text); a
    second press raises KeyboardInterrupt at once. The previous handler returns after."""
    pressed = Pressed()

    def on_sigint(signum, frame) -> None:
        if pressed.once:
            raise KeyboardInterrupt
        pressed.once = True

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, previous)


def note(text: str, **kwargs) -> None:
    """A line on stderr, long lines left to the terminal to wrap (rich would break them)."""
    err.print(text, soft_wrap=True, highlight=False, **kwargs)


def check_method(engine: Engine, spec: SpecConfig) -> None:
    """Raise ValueError now, not at the next reply, if the engine lacks what the method needs
    (heads, a draft model): the method's own factory says so."""
    if spec.method != "none":
        PROPOSERS[spec.method](spec, engine.proposers)


def describe(spec: SpecConfig) -> str:
    if spec.method == "none":
        return "method none (plain decoding)"
    return f"method {spec.method}, k {spec.k}"


def stats_line(s: GenerationStats) -> str:
    speed = f"{s.new_tokens} tokens, {s.tokens_per_s:.1f} tok/s"
    if s.method == "none":
        return f"method none: {speed} (plain decoding, no drafts)"
    return (f"method {s.method}, k {s.k}: {speed}, acceptance {s.acceptance_rate:.2f}, "
            f"mean accepted length {s.mean_accepted_length:.2f}")
