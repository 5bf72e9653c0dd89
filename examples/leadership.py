"""A leader loop that notices when it loses its term, and campaigns again.

``async for term in backend.leadership(...)`` campaigns, yields a term, and campaigns
again once the term ends. The body, guarded by ``async with term:``, is cancelled the
moment the term is lost; the loop does not raise, so check ``term.lease.lost`` after the
block to tell a lost term from one you ended yourself. Here an operator (another backend,
as another process would) breaks the leader's lock: the leader's next renewal is refused,
its work is cancelled, it says why, and it is elected again with a larger token, so a late
write from its first term stays fenced off.

Run: uv run python examples/leadership.py [URL]   (default: a SQLite file in a temp dir)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import anyio

import asynclock


async def lead(backend: asynclock.Backend, elected: anyio.Event) -> None:
    tokens: list[int] = []
    async for term in backend.leadership("scheduler", ttl=1.0, identity="node-a"):
        tokens.append(term.token)
        async with term:  # the body is cancelled if the term is lost
            print(f"node-a leads with token {term.token}")
            if len(tokens) == 2:
                break  # leaving the loop releases the term
            elected.set()
            await anyio.sleep_forever()  # the leader's work, fenced with term.token
        # Back here the term has ended: lost (the body was cancelled), or left normally.
        if term.lease.lost:
            print(f"node-a lost its term (token {term.token}): {term.lease.lost.reason}")
            print("node-a campaigns again")
    assert tokens[1] > tokens[0]
    print(f"node-a leads again with token {tokens[1]} (larger than {tokens[0]})")


async def main(url: str) -> None:
    async with asynclock.connect(url) as node_a, asynclock.connect(url) as operator:
        elected = anyio.Event()
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(lead, node_a, elected)
                await elected.wait()
                print(f"operator breaks the lock: {await operator.break_lock('scheduler')}")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        default = f"sqlite:///{Path(tmp) / 'locks.db'}"
        anyio.run(main, sys.argv[1] if len(sys.argv) > 1 else default)
