"""Locks on a Redis primary behind Sentinel, through a failover.

A holder keeps a lock while a sentinel promotes a replica. The backend hears the sentinels
announce the new primary (about a second after the promotion; the old primary stays a
writable master for about ten more), and the holder loses its lease at that moment, with
the failover as the reason: its work is cancelled before the new primary grants the name
to anyone. The next holder gets a larger token (a failover's tokens start above every token
the old primary handed out), once the restart grace after the failover has passed.
``wait_replicas=1`` makes each grant and renewal count only once a replica has it.

Run against a Sentinel deployment you may fail over (it asks a sentinel for
``SENTINEL FAILOVER``), with at least two replicas for ``wait_replicas=1``:

    uv run python examples/redis_failover.py redis+sentinel://127.0.0.1:26379/mymaster
"""

from __future__ import annotations

import sys

import anyio
import redis.asyncio

import asynclock


async def fail_over(url: str) -> None:
    """Ask the first sentinel of ``url`` to promote a replica (what an operator or a dead
    primary would cause)."""
    hosts, service = url.split("://", 1)[1].split("/")[:2]
    host, port = hosts.split(",")[0].rsplit(":", 1)
    sentinel = redis.asyncio.Redis(host=host, port=int(port))
    try:
        await sentinel.execute_command("SENTINEL", "FAILOVER", service)  # type: ignore[no-untyped-call]
    finally:
        await sentinel.aclose()


async def main(url: str) -> None:
    async with asynclock.connect(url, wait_replicas=1) as backend:
        held = anyio.Event()
        first = 0

        async def hold() -> None:
            nonlocal first
            try:
                async with backend.lock("report:nightly", ttl=5.0) as lease:
                    first = lease.token
                    print("holding 'report:nightly'")
                    held.set()
                    await anyio.sleep(30)  # the work; cancelled by the failover
            except asynclock.LeaseLost as lost:
                print(f"lost in the failover: {'failover' in lost.reason}")

        async with anyio.create_task_group() as tg:
            tg.start_soon(hold)
            await held.wait()
            await fail_over(url)
        async with backend.lock("report:nightly", ttl=5.0, timeout=30) as lease:
            print(f"next holder's token is larger: {lease.token > first}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    anyio.run(main, sys.argv[1])
