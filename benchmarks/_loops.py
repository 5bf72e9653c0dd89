"""The event loop a benchmark runs on: ``--loop asyncio|uvloop|both`` (issue 23).

uvloop is the loop most FastAPI (uvicorn) and many worker deployments run; with ``both``
(the default) a benchmark prints its tables once per loop, asyncio first."""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

T = TypeVar("T")
LOOPS = ("asyncio", "uvloop")


def add_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--loop",
        choices=[*LOOPS, "both"],
        default="both",
        help="event loop: asyncio, uvloop, or both, the tables once each (default both)",
    )


def chosen(args: argparse.Namespace) -> list[str]:
    """The loops ``--loop`` names, in order."""
    return list(LOOPS) if args.loop == "both" else [args.loop]


def run(loop: str, func: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``anyio.run(func, *args)`` on ``loop`` ("asyncio" or "uvloop")."""
    return anyio.run(func, *args, backend_options={"use_uvloop": loop == "uvloop"})


def heading(loop: str) -> None:
    print(f"\n== event loop: {loop}", flush=True)
