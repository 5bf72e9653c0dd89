"""Synchronous code under leases: asynclock.from_thread's four names.

A backend lives on an event loop; plain threads hold its leases through a LoopThread:
``hold`` around a body, ``idempotent`` around an operation that must run once, and
``guard`` for a body another pool runs under a lease held elsewhere. A lost lease stops
the body (LeaseLost in its thread).
Run: uv run python examples/from_thread.py
"""

from __future__ import annotations

import concurrent.futures
import tempfile
import time
from pathlib import Path
from typing import Any

import asynclock
import asynclock.testing
from asynclock.from_thread import LoopThread, guard, hold, idempotent

CHARGES: list[str] = []


def charge(thread: LoopThread, url: str, order_id: str) -> Any:
    with idempotent(thread, url, f"charge:{order_id}", ttl=5.0) as op:
        if op.replayed:
            return op.result
        CHARGES.append(order_id)
        receipt = {"order": order_id, "receipt": f"rcpt-{len(CHARGES)}", "token": op.token}
        op.save(receipt)  # stored, fenced by op.token, as the block exits
        return receipt


def main(tmp: Path) -> None:
    url = f"sqlite:///{tmp / 'locks.db'}"
    with LoopThread() as thread:
        with hold(thread, url, "report:7", ttl=5.0) as lease:
            print(f"report:7 held with token {lease.token}")

        first, again = charge(thread, url, "o-1"), charge(thread, url, "o-1")
        print(f"charge: {first['receipt']}, again: {again['receipt']}; charges: {len(CHARGES)}")

        # A lease the loop holds, and a job a thread pool runs under it.
        backend = thread.backend(url)
        claim = thread.run(backend.acquire("job:9", ttl=5.0))

        def job() -> str:
            with guard(claim, thread.loop):
                thread.call(asynclock.testing.force_loss, claim, "claim taken over")
                for _ in range(3000):  # 30 s of work, in steps: the interruption lands
                    time.sleep(0.01)  # between them (a thread's blocking call ends first)
            return "finished"  # never: the block raised LeaseLost

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            try:
                pool.submit(job).result(timeout=20)
            except asynclock.LeaseLost as exc:
                print(f"job stopped: {exc.reason}")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        main(Path(tmp))
