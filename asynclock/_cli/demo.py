"""``asynclock demo``: the stale-holder story (played by :mod:`asynclock._cli.story`)."""

from __future__ import annotations

import argparse
import math
import signal
import sys

import asynclock

from .output import wants_color
from .registry import Command, register

DESCRIPTION = """\
Watch a lock holder freeze past its lease and get fenced off: real processes, no server.

Two worker processes share one lock, by default on the embedded SQLite backend (a
temporary file). The resource is a SQLite ledger guarded by asynclock.fence.SQLFence.

  1. worker 1 takes the lock (token N) and writes to the ledger through the fence;
  2. worker 2 tries the same lock, finds it held, and waits;
  3. worker 1 is frozen with SIGSTOP (a long GC pause, a frozen VM) with a write on
     its way; its heartbeat stops, so its lease expires on the lock server;
  4. worker 2 gets the lock with token N+1 and writes through the fence;
  5. worker 1 is resumed with SIGCONT: its `async with` body is cancelled and raises
     LeaseLost, and its late write, still carrying token N, is rejected (StaleToken).

It prints the story, a timeline in milliseconds and the ledger, and exits 0 only if
everything happened as told (1 if not; 2 on bad options or without SIGSTOP)."""

EPILOG = """\
examples:
  asynclock demo
  asynclock demo --ttl 0.5 --no-color
  asynclock demo --url sqlite:////tmp/locks.db"""


def _ttl(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not (math.isfinite(value) and 0.1 <= value <= 60):
        raise argparse.ArgumentTypeError(f"must be between 0.1 and 60 seconds, got {text!r}")
    return value


def add_arguments(demo: argparse.ArgumentParser) -> None:
    demo.add_argument(
        "--url",
        metavar="URL",
        help="lock backend the workers share, any asynclock URL except memory:// "
        "(default: a temporary SQLite file, sqlite:///...)",
    )
    demo.add_argument(
        "--ttl",
        type=_ttl,
        default=1.0,
        metavar="SECONDS",
        help="lease time-to-live; worker 1 stays frozen about this long (default: 1.0)",
    )
    demo.add_argument(
        "--no-color",
        action="store_true",
        help="plain output without colors (default: colors only on a terminal; NO_COLOR is "
        "honoured)",
    )


def _check_url(parser: argparse.ArgumentParser, url: str) -> None:
    scheme = url.partition(":")[0].strip().lower()  # (urlsplit refuses some host lists)
    if scheme == "memory":
        parser.error(
            "--url memory:// keeps locks inside one process, but the demo's workers are "
            "separate processes; use a shared backend such as sqlite:///demo.db"
        )
    try:
        asynclock.connect(url)  # builds the driver only: checks scheme and options, no I/O
    except (ValueError, TypeError) as exc:
        parser.error(f"--url: {exc}")
    except ModuleNotFoundError as exc:
        parser.error(f"--url: the {scheme}:// backend is not available here ({exc})")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.url is not None:
        _check_url(parser, args.url)
    if not hasattr(signal, "SIGSTOP"):
        print(
            f"asynclock demo: this platform ({sys.platform}) has no SIGSTOP, which the demo "
            "uses to freeze a worker; run it on Linux or macOS.",
            file=sys.stderr,
        )
        return 2

    import anyio

    from . import story as _demo

    # Looked up on the story's module, so a test can hand the story another renderer.
    out = _demo.make_output(wants_color(args.no_color))
    return anyio.run(_demo.run, args.url, args.ttl, out)


COMMAND = register(
    Command(
        name="demo",
        help="watch a frozen lock holder lose its lease and get fenced off (no server needed)",
        description=DESCRIPTION,
        epilog=EPILOG,
        add_arguments=add_arguments,
        run=run,
    )
)
