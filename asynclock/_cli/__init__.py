"""The ``asynclock`` command line: its subcommands (``asynclock demo``, …) and ``--version``.

Each subcommand lives in its own module and registers itself (:mod:`.registry`); this
module builds the parser from the registry and runs the chosen command. Output, plain
aligned text or (with ``pip install "asynclock[cli]"``) rich tables and panels, is
:mod:`.output`'s job for every command.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

import asynclock

from .registry import COMMAND_MODULES, COMMANDS

DESCRIPTION = """\
asynclock: distributed locks that are honest about time.

Every lock hands out a fencing token; a holder whose lease is lost is cancelled and
raises LeaseLost; a fence at the resource rejects writes that carry an old token."""


# What a pip user has: the installed package's docstrings (pydoc reads them) and, in the
# source distribution, the guides and examples. There is no web address to give yet.
EPILOG = """\
Start with "asynclock demo".

Documentation of the installed package, in its docstrings:
  python -m pydoc asynclock            the API: connect, Backend.lock, Lease, the errors
  python -m pydoc asynclock.fence      fences that reject stale writers at the resource
  python -m pydoc asynclock_fastapi    also asynclock_celery, asynclock_apscheduler
The guides (docs/) and runnable examples (examples/) come with the source
distribution, asynclock-{version}.tar.gz, not with the wheel."""


def _load_commands() -> None:
    for module in COMMAND_MODULES:
        importlib.import_module(f"{__name__}.{module}")


def build_parser() -> argparse.ArgumentParser:
    """The ``asynclock`` argument parser."""
    return _build()[0]


def _build() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    _load_commands()
    parser = argparse.ArgumentParser(
        prog="asynclock",
        description=DESCRIPTION,
        epilog=EPILOG.format(version=asynclock.__version__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"asynclock {asynclock.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    parsers: dict[str, argparse.ArgumentParser] = {}
    for command in COMMANDS.values():
        sub = subparsers.add_parser(
            command.name,
            help=command.help,
            description=command.description,
            epilog=command.epilog,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        command.add_arguments(sub)
        parsers[command.name] = sub
    return parser, parsers


def main(argv: Sequence[str] | None = None) -> int:
    parser, parsers = _build()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    from .._harness import kill_leftovers

    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None:
        reconfigure(errors="replace")
    try:
        return COMMANDS[args.command].run(args, parsers[args.command])
    except KeyboardInterrupt:
        print("\ninterrupted; the worker processes were stopped", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`asynclock demo | head`): stop quietly, like other tools.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    finally:
        kill_leftovers()
