"""PostgreSQL ``mode=session`` at its server's ceiling: advisory locks live in the shared
lock table (``max_locks_per_transaction x (max_connections + max_prepared_transactions)``).
Reaching it refuses the new acquisitions with :class:`asynclock.ServerFull`, naming the
setting and the way out, and loses nothing already held (issue 45 item 4: every held lease
used to be lost with the first refusal, the session dropped as "state unknown")."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import anyio
import pytest

import asynclock
import asynclock.testing
from tests.support.pg_servers import PgServer, running_pg

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def small_lock_table() -> Iterator[PgServer]:
    """A fresh server whose lock table has room for a few hundred locks."""
    conf = "max_locks_per_transaction = 10\nmax_connections = 20\n"
    with running_pg(prefix="asynclock-pg-ceiling-", extra_conf=conf) as server:
        yield server


async def test_the_lock_table_ceiling_refuses_new_holds_and_loses_none(
    small_lock_table: PgServer,
) -> None:
    held: list[asynclock.Lease] = []
    url = small_lock_table.url() + "?mode=session"
    with anyio.fail_after(60):
        async with asynclock.connect(url) as backend:
            async with contextlib.AsyncExitStack() as stack:
                with pytest.raises(asynclock.ServerFull) as info:
                    for i in range(5000):  # far beyond the table's room
                        lease = await stack.enter_async_context(
                            backend.lock(f"ceiling:{i}", ttl=2.0, blocking=False)
                        )
                        held.append(lease)
                text = str(info.value)
                assert "max_locks_per_transaction" in text and "mode=lease" in text, text
                assert "Nothing held was lost" in text
                assert len(held) > 100, len(held)
                # A second refusal, then renewals while the table is still full: the
                # renewal check cannot read pg_locks, and every hold is still renewed.
                with pytest.raises(asynclock.ServerFull):
                    await stack.enter_async_context(backend.lock("one-more", ttl=2.0))
                for _ in range(3):
                    await asynclock.testing.next_renewal_round(backend)
                assert not [lease for lease in held if lease.lost]
                assert backend.stats().losses == 0
                # A question that reads pg_locks is refused the same way while it is full.
                with pytest.raises(asynclock.ServerFull, match="validate"):
                    await backend.validate(held[0].name, held[0].token)
                # Released newest first: a hold lost meanwhile would raise LeaseLost here.
                await stack.aclose()  # LIFO: the newest hold first
            # All released; the room is back.
            async with backend.lock("one-more", ttl=2.0, timeout=5) as lease:
                assert lease.token > held[-1].token
            assert not [lease for lease in held if lease.lost]
