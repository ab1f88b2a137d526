"""`forerun chat` as a user types it: a real process on a pseudo-terminal (pexpect), tiny random
Llama models written as Hugging Face directories, float64 so that greedy replies repeat exactly.

Every wait is on output (a prompt, a message), never on time; the timeouts only bound a hang.
"""

import json
import os
import re
import shutil
import sys

import pytest
from tiny_files import byte_tokens, random_hf_weights, write_hf_dir

pexpect = pytest.importorskip("pexpect")

PROMPT = ">>> "
WAIT_S = 180  # a generous bound on any one wait: a loaded CPU, torch's import
POSITIONS = 8192  # the tiny models' max_position_embeddings: room for a reply that runs long
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
STATS = r"{method}: \d+ tokens, [\d.]+ tok/s, acceptance [\d.]+, mean accepted length [\d.]+"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A target and a draft over the same byte-level vocabulary (different random weights)."""
    root, tokens = tmp_path_factory.mktemp("chat"), byte_tokens()
    dirs = []
    for name, seed in (("target", 0), ("draft", 1)):
        write_hf_dir(root / name, random_hf_weights(len(tokens), seed), tokens)
        config = root / name / "config.json"
        config.write_text(json.dumps(json.loads(config.read_text())
                                     | {"max_position_embeddings": POSITIONS}))
        dirs.append(str(root / name))
    return dirs


@pytest.fixture(scope="module")
def endless(models, tmp_path_factory):
    """The target with its special tokens renamed and no eos_token: it has no stop token, so
    every reply runs to --max-tokens (the plain target's greedy reply to "hello" stops after
    49 tokens, which a fast machine writes before any Ctrl-C arrives)."""
    path = tmp_path_factory.mktemp("endless") / "target"
    shutil.copytree(models[0], path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        file = path / name
        text = file.read_text().replace("<|im_end|>", "<|end|>").replace("<|endoftext|>", "<|eot|>")
        file.write_text(text)
    config = path / "tokenizer_config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"eos_token": None}))
    return [str(path), models[1]]


def spawn(models, *args: str):
    target, draft = models
    env = {**os.environ, "TERM": "dumb", "NO_COLOR": "1"}  # plain text: no colours, no styles
    child = pexpect.spawn(sys.executable, ["-m", "forerun.cli", "chat", "--target", target,
                                           "--draft", draft, "--dtype", "float64", *args],
                          encoding="utf-8", codec_errors="replace", timeout=WAIT_S, env=env,
                          dimensions=(24, 200))
    child.expect_exact(PROMPT)
    return child


def say(child, line: str) -> str:
    """Send one line and return everything shown until the next prompt (echo included)."""
    child.sendline(line)
    child.expect_exact(PROMPT)
    return ANSI.sub("", child.before)


def interrupted_reply(child, line: str) -> str:
    """Send `line`, press Ctrl-C once its reply has begun, and return the part shown."""
    child.sendline(line)
    child.expect_exact(line + "\r\n")  # the echo; whatever comes next is the reply
    child.expect(".")
    shown = child.after
    child.sendintr()
    child.expect_exact("(reply stopped)")
    shown += child.before
    child.expect_exact(PROMPT)
    # the terminal echoes Ctrl-C as "^C" wherever in the reply's text it lands: not the reply's
    return ANSI.sub("", shown).replace("^C", "").strip()


def test_turns_stats_method_reset_and_exit(models):
    child = spawn(models, "--method", "none", "--max-tokens", "12")
    first = say(child, "hello")
    assert first.strip() != "hello", "no reply"
    assert "stats after each reply: on" in say(child, "/stats")
    assert re.search(r"method none: \d+ tokens, [\d.]+ tok/s", say(child, "tell me more"))

    assert "method ngram, k 3 from the next reply on" in say(child, "/method ngram 3")
    assert re.search(STATS.format(method="method ngram, k 3"), say(child, "and then?"))

    # a draft model the chat began without is loaded when first asked for
    assert "method draft, k 2 from the next reply on" in say(child, "/method draft 2")
    assert re.search(STATS.format(method="method draft, k 2"), say(child, "go on"))

    for bad, message in (("/method bogus", "unknown method 'bogus'"),
                         ("/method ngram x", "usage: /method NAME [K]"),
                         ("/method eagle", "needs trained heads"), ("/nope", "unknown command")):
        assert message in say(child, bad)
    assert "method draft, k 2" in say(child, "/method")
    assert "/reset" in say(child, "/help")

    assert "off" in say(child, "/stats")
    assert "conversation cleared" in say(child, "/reset")
    # a fresh conversation: the first reply again, now drafted (greedy decoding is lossless)
    assert say(child, "hello") == first
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_ctrl_c_stops_the_reply_not_the_chat(endless):
    # a reply of 8000 tokens: Ctrl-C, sent once it begins, comes long before its end
    child = spawn(endless, "--method", "ngram", "--max-tokens", str(POSITIONS - 192),
                  "--context", str(POSITIONS))
    first = interrupted_reply(child, "hello")
    assert first, "no reply before Ctrl-C"
    # the chat is alive and the engine clean: a fresh conversation begins with the same reply
    assert "conversation cleared" in say(child, "/reset")
    again = interrupted_reply(child, "hello")
    # a reply cut inside a multi-byte character ends in U+FFFD where the other may go on with
    # the whole character (or with the byte after an invalid lead): the last shown one may differ
    assert again, "no reply before the second Ctrl-C"
    n = min(len(first), len(again)) - 1
    assert again[:n] == first[:n]
    # Ctrl-C at the prompt: a hint, the prompt again; Ctrl-D then quits with status 0. A press
    # that lands while readline is still setting up the terminal can be lost (seen once, on a
    # loaded CI machine): press again, at most three times in all, before calling it a failure
    for _ in range(3):
        child.sendintr()
        if child.expect_exact(["/exit or Ctrl-D quits", pexpect.TIMEOUT],
                              timeout=WAIT_S / 3) == 0:
            break
    else:
        pytest.fail("Ctrl-C at the prompt showed no hint after three presses; the chat "
                    f"showed {child.before!r}")
    child.expect_exact(PROMPT)
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_a_conversation_over_the_context_is_refused_and_the_chat_goes_on(models):
    child = spawn(models, "--method", "none", "--max-tokens", "4", "--context", "64")
    refused = say(child, "x" * 80)
    assert "context holds 64" in refused and "/reset starts a new conversation" in refused
    assert say(child, "hi").strip() != "hi", "no reply after the refusal"
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_a_stopped_reply_stays_in_the_history_as_shown(endless, monkeypatch):
    """In process: Ctrl-C (a real SIGINT) arrives as the reply's first text is written."""
    import argparse
    import io
    import signal

    from forerun.commands import chat

    class Terminal(io.StringIO):
        def write(self, text: str) -> int:
            if text and not self.getvalue():
                signal.raise_signal(signal.SIGINT)  # handled at once, in this thread
            return super().write(text)

    parser = argparse.ArgumentParser()
    chat.add_parser(parser.add_subparsers())
    args = parser.parse_args(["chat", "--target", endless[0], "--dtype", "float64",
                              "--method", "ngram", "--max-tokens", "1000"])
    session = chat.Chat(args, chat.load_engine(args), chat.sampling_config(args),
                        chat.spec_config(args))
    monkeypatch.setattr(sys, "stdout", terminal := Terminal())
    handler = signal.getsignal(signal.SIGINT)
    session.reply("hello")
    shown = terminal.getvalue().removesuffix("\n")
    assert shown and session.messages == [{"role": "user", "content": "hello"},
                                          {"role": "assistant", "content": shown}]
    assert signal.getsignal(signal.SIGINT) is handler  # the chat's own handler is gone
