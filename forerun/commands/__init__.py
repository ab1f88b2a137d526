"""The CLI's commands, one module each, every one with `add_parser(subparsers)` and `run(args)`.

Owns: the list of commands in the order `forerun --help` shows them. A command module imports
the library and `forerun.commands.options`, never `forerun.cli` or another command.
"""

from __future__ import annotations

from forerun.commands import bench, chat, check, generate, models, profile, serve, train, tune

COMMANDS = (generate, chat, check, models, bench, profile, serve, train, tune)
