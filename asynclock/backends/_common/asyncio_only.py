"""Backends whose driver library runs only on asyncio (redis-py, asyncpg) refuse other event
loops up front, with a message that says so, instead of failing deep inside the driver with
``RuntimeError: no running event loop``. memory:// and sqlite:// run on any anyio backend."""

from __future__ import annotations

import asyncio
import sys


def running_async_library() -> str | None:
    """``"asyncio"``, ``"trio"``, or None when neither is running in this thread (or the
    caller is not inside one's run, e.g. a sync ``connect()`` before the loop starts)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        return "asyncio"
    trio = sys.modules.get("trio")  # never imported here: if trio runs, it is loaded
    if trio is not None:
        try:
            trio.lowlevel.current_trio_token()
        except RuntimeError:
            pass
        else:
            return "trio"
    return None


def require_asyncio(what: str, library: str) -> None:
    """Raise RuntimeError if an event loop other than asyncio runs here (call it before any
    I/O: at connect(), when the running loop is known then, and again at open)."""
    running = running_async_library()
    if running is None or running == "asyncio":
        return
    raise RuntimeError(
        f"{what} needs asyncio ({library} runs only on asyncio), but this code runs under "
        f"{running}. Run it under asyncio (asyncio.run(main()) or anyio.run(main, "
        f"backend='asyncio')), or use memory:// or sqlite://, which work under {running} too."
    )
