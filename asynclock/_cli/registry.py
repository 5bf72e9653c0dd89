"""The subcommand registry: each command says how to parse its options and how to run.

A command module builds a :class:`Command` and passes it to :func:`register` when it is
imported; :mod:`asynclock._cli` imports the modules named in ``COMMAND_MODULES`` and builds
one ``argparse`` sub-parser per registered command, in registration order. ``run`` gets the
parsed options and its own sub-parser (for usage errors, exit code 2) and returns the exit
code; output goes through :mod:`asynclock._cli.output`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

#: Modules (under asynclock._cli) that register a command when imported.
COMMAND_MODULES = ("demo", "drill", "ops", "remote")


@dataclass(frozen=True)
class Command:
    """One ``asynclock NAME`` subcommand."""

    name: str
    #: One line for ``asynclock --help``.
    help: str
    #: ``asynclock NAME --help``: what it does, then examples.
    description: str
    epilog: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, argparse.ArgumentParser], int]


COMMANDS: dict[str, Command] = {}


def register(command: Command) -> Command:
    """Add ``command``; a second command of the same name is a programming error."""
    if command.name in COMMANDS:
        raise ValueError(f"asynclock command {command.name!r} is registered twice")
    COMMANDS[command.name] = command
    return command
