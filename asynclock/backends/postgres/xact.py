"""A transaction on the pinned connection that always ends, cancellation included.

``async with conn.transaction():`` ends with a ROLLBACK on any exception, but under anyio a
cancelled task is cancelled again at that ROLLBACK's own await: the statement is cut off,
asyncpg forgets the transaction, and the server keeps it open on the connection. A
read-write lock or semaphore grant cancelled while it waited for its name's advisory lock
left exactly that: the name's advisory lock and row locks held by an idle transaction, so
every later grant and release of the name, in every process, waited behind it, and the
backend's next ``conn.transaction()`` raised ``InterfaceError`` ("manually started
transaction"). Here the end (COMMIT, or ROLLBACK on any exception) runs shielded, for at
most :data:`SETTLE_TIMEOUT`; a connection whose transaction could not be ended is
terminated, which ends it at the server (the next call reconnects).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager

import anyio
import asyncpg  # type: ignore[import-untyped]  # no stubs; see fence/sql.py Protocols

#: Seconds a transaction's COMMIT or ROLLBACK gets, shielded, before the connection is
#: terminated instead.
SETTLE_TIMEOUT = 5.0


@asynccontextmanager
async def transaction(conn: asyncpg.Connection) -> AsyncIterator[None]:
    """``async with conn.transaction():`` whose BEGIN and end are shielded and bounded
    (see the module). A BEGIN or COMMIT without an answer in time raises
    ``ConnectionDoesNotExistError`` (one of the connection errors callers turn into
    ``BackendUnavailable``)."""
    tx = conn.transaction()
    # BEGIN shielded too: cut off on its way, it may have begun a transaction asyncpg
    # does not know of (a cancellation is delivered at the body's first await instead).
    await _shielded(conn, tx.start(), "BEGIN")
    try:
        yield
    except BaseException:
        ended = False
        with anyio.move_on_after(SETTLE_TIMEOUT, shield=True):
            try:
                await tx.rollback()
                ended = True
            except Exception:
                pass  # the connection is terminated just below
        if not ended and not conn.is_closed():
            conn.terminate()
        raise
    await _shielded(conn, tx.commit(), "COMMIT")


async def _shielded(conn: asyncpg.Connection, statement: Awaitable[None], what: str) -> None:
    done = False
    with anyio.move_on_after(SETTLE_TIMEOUT, shield=True):
        await statement
        done = True
    if not done:
        conn.terminate()
        raise asyncpg.exceptions.ConnectionDoesNotExistError(
            f"{what} got no answer within {SETTLE_TIMEOUT:g}s; the connection was closed"
        )
