"""The `forerun` command line: one subcommand per module of `forerun.commands`.

Owns: the top-level parser and turning expected errors (bad input) into a one-line message and
exit status 2. Everything a command runs is the library; nothing imports this module.
"""

from __future__ import annotations

import argparse
import sys

from forerun.commands import COMMANDS
from forerun.commands.options import EXIT_USAGE, err
from forerun.models.catalog import ModelError
from forerun.sampling import SamplingError
from forerun.stopping import ContextError

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="forerun", description="Lossless speculative decoding: the target model's exact "
        "output, generated faster by drafting several tokens and verifying them in one pass.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (ModelError, SamplingError, ContextError, ValueError) as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)  # one line
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
