"""Several names at once: ``backend.lock_all(names, ttl=...)`` holds all of them or none.

Two workers (two backends, as two processes would be) move money between the same two
accounts in opposite directions, 10 times each, at the same time. Each transfer locks
both accounts. Taken naively, A locking alice then bob while B locks bob then alice
deadlocks the first time they cross. ``lock_all`` always takes names in sorted order
(whatever order you give them in), so they only queue behind each other.

Then the all-or-nothing parts: with bob held elsewhere, a ``blocking=False`` attempt
fails naming bob and alice is left free (no half-held set), and when one lease of a held
set is lost the whole body is cancelled and the block raises ``LeaseLost`` naming it.

Run: uv run python examples/lock_all.py [URL]   (default: a SQLite file in a temp dir)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import anyio
import anyio.lowlevel

import asynclock
import asynclock.testing

ALICE, BOB = "acct:alice", "acct:bob"
BALANCES = {ALICE: 100, BOB: 100}


async def transfer(backend: asynclock.Backend, source: str, target: str) -> None:
    # The order given here does not matter: lock_all takes ALICE then BOB every time.
    async with backend.lock_all([source, target], ttl=10.0) as held:
        assert set(held) == {source, target}  # held[name].token: that name's fencing token
        amount = BALANCES[source]
        await anyio.lowlevel.checkpoint()  # a read-modify-write with an await between
        BALANCES[source] = amount - 1
        BALANCES[target] += 1


async def worker(backend: asynclock.Backend, source: str, target: str) -> None:
    for _ in range(10):
        await transfer(backend, source, target)


async def is_free(backend: asynclock.Backend, name: str) -> bool:
    try:
        async with backend.lock(name, ttl=5.0, blocking=False):
            pass
    except asynclock.LockHeld:
        return False
    return True


async def main(url: str) -> None:
    async with asynclock.connect(url) as a, asynclock.connect(url) as b:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(worker, a, ALICE, BOB)
                tg.start_soon(worker, b, BOB, ALICE)
        print("20 transfers in opposite directions finished: no deadlock")
        print(f"balances: alice={BALANCES[ALICE]} bob={BALANCES[BOB]} (total 200)")

        # All or nothing: bob is busy, so nothing is held, not even alice.
        async with b.lock(BOB, ttl=10.0):
            try:
                async with a.lock_all([ALICE, BOB], ttl=10.0, blocking=False):
                    raise AssertionError("bob is held by b")
            except asynclock.LockHeld as busy:
                print(f"busy: {busy.name!r}; alice left free: {await is_free(b, ALICE)}")

        # Losing any one lease cancels the body; the others are released.
        try:
            async with a.lock_all([ALICE, BOB], ttl=10.0) as held:
                asynclock.testing.force_loss(held[BOB], "renewal refused (simulated)")
                await anyio.sleep_forever()  # cancelled by the loss
        except asynclock.LeaseLost as lost:
            print(f"lost {lost.name!r}: {lost.reason}; body cancelled")
        print(f"both free again: {await is_free(b, ALICE) and await is_free(b, BOB)}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        anyio.run(main, sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as tmp:
            anyio.run(main, f"sqlite:///{Path(tmp) / 'locks.db'}")
