"""The correctness path on Redis: the lock gives a token, RedisFence checks it at the data.

Two holders of one lock name write an invoice kept in Redis. The first holder's lease is
lost (we force it, as a long pause would); the second acquires with a larger token and
writes. The first holder's late write carries the old token: the fence's Lua
compare-and-set refuses it atomically, raises StaleToken, and nothing is written.

Run against any Redis you may write keys to (it uses keys under "example:"):

    uv run python examples/redis_fenced_write.py redis://localhost:6379/0
"""

from __future__ import annotations

import sys

import anyio
import redis.asyncio

import asynclock
import asynclock.testing
from asynclock.fence import RedisFence

fence = RedisFence()  # high-water mark next to the data, at "{example:invoice:42}:asynclock-fence"
KEY = "example:invoice:42"


async def main(url: str) -> str:
    client = redis.asyncio.Redis.from_url(url)
    try:
        await client.delete(KEY)
        async with asynclock.connect(url) as backend:
            first = await backend.acquire("invoice:42", ttl=5.0)
            await fence.set(client, KEY, "total=100", first.token)  # the one line (G8)
            print(f"first holder wrote total=100 with token {first.token}")
            asynclock.testing.force_loss(first, "pretend a long GC pause")

            async with backend.lock("invoice:42", ttl=5.0, timeout=5) as second:
                await fence.set(client, KEY, "total=200", second.token)
                print(f"second holder wrote total=200 with token {second.token}")

            try:
                await fence.set(client, KEY, "total=999", first.token)
            except asynclock.StaleToken as stale:
                print(f"late write rejected: {stale}")
            await first.release()  # a reported no-op: the lease is already lost
        raw = await client.get(KEY)
        value = raw.decode() if isinstance(raw, bytes) else str(raw)
        print(f"invoice: {value}")
        return value
    finally:
        await client.aclose()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: redis_fenced_write.py redis://host:6379/0")
    anyio.run(main, sys.argv[1])
