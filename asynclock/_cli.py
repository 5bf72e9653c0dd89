"""The ``asynclock`` command line: ``asynclock demo`` (the stale-holder story) and ``--version``.

Works without ``rich`` (plain aligned text); with ``pip install "asynclock[cli]"`` the demo
prints tables and panels.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
from collections.abc import Sequence
from urllib.parse import urlsplit

import asynclock

DESCRIPTION = """\
asynclock: distributed locks that are honest about time.

Every lock hands out a fencing token; a holder whose lease is lost is cancelled and
raises LeaseLost; a fence at the resource rejects writes that carry an old token."""

DEMO_DESCRIPTION = """\
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

DEMO_EPILOG = """\
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


def build_parser() -> argparse.ArgumentParser:
    """The ``asynclock`` argument parser."""
    return _build()[0]


def _build() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(
        prog="asynclock",
        description=DESCRIPTION,
        epilog='Start with "asynclock demo". Docs: the README and docs/ of the project.',
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"asynclock {asynclock.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    demo = commands.add_parser(
        "demo",
        help="watch a frozen lock holder lose its lease and get fenced off (no server needed)",
        description=DEMO_DESCRIPTION,
        epilog=DEMO_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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
    return parser, demo


def _check_url(parser: argparse.ArgumentParser, url: str) -> None:
    scheme = urlsplit(url).scheme.lower()
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


def main(argv: Sequence[str] | None = None) -> int:
    parser, demo_parser = _build()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.url is not None:
        _check_url(demo_parser, args.url)
    if not hasattr(signal, "SIGSTOP"):
        print(
            f"asynclock demo: this platform ({sys.platform}) has no SIGSTOP, which the demo "
            "uses to freeze a worker; run it on Linux or macOS.",
            file=sys.stderr,
        )
        return 2

    import anyio

    from . import _demo

    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None:
        reconfigure(errors="replace")
    color = not args.no_color and sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    out = _demo.make_output(color)
    try:
        return anyio.run(_demo.run, args.url, args.ttl, out)
    except KeyboardInterrupt:
        print("\ninterrupted; the worker processes were stopped", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`asynclock demo | head`): stop quietly, like other tools.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    finally:
        _demo.kill_leftovers()


if __name__ == "__main__":
    raise SystemExit(main())
