"""Partitions across processes (issue 43): a member in another process is SIGKILLed; its
partitions are free within its ttl and the member left takes them all within ttl + one
renewal interval (plus the round trips)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import anyio
import pytest

from tests.support.spec import BackendSpec

pytestmark = pytest.mark.anyio

COUNT, TTL, HEARTBEAT = 64, 1.5, 1 / 3


@pytest.fixture(params=["sqlite", "redis"])
def proc_spec(request: pytest.FixtureRequest) -> BackendSpec:
    result: BackendSpec = request.getfixturevalue(f"spec_{request.param}")
    return result


async def test_sigkill_frees_within_ttl(proc_spec: BackendSpec, lock_name: str) -> None:
    spec = proc_spec
    cfg = {
        "url": spec.url,
        "options": spec.options,
        "group": lock_name,
        "count": COUNT,
        "ttl": TTL,
        "parent": os.getpid(),
    }
    async with spec.connect(heartbeat=HEARTBEAT) as backend:
        async with backend.partitions(lock_name, count=COUNT, ttl=TTL) as member:
            process = await anyio.open_process(
                [sys.executable, "-m", "tests.support.partition_worker", json.dumps(cfg)]
            )
            try:
                assert process.stdout is not None
                lines = process.stdout
                buffer = b""
                with anyio.fail_after(20):  # the child takes half
                    while True:
                        buffer += await lines.receive()
                        *done, buffer = buffer.split(b"\n")
                        if any(len(json.loads(line)["owned"]) == COUNT // 2 for line in done):
                            break
                changes = member.changes()
                with anyio.fail_after(10):
                    while len(await changes.__anext__()) != COUNT // 2:
                        pass
                process.send_signal(signal.SIGKILL)
                killed = time.monotonic()
                with anyio.fail_after(TTL + TTL * HEARTBEAT + 3):
                    while len(await changes.__anext__()) != COUNT:
                        pass
                took = time.monotonic() - killed
                print(
                    f"\n{spec.id}: SIGKILLed member's {COUNT // 2} partitions taken in {took:.2f}s"
                )
                assert took <= TTL + TTL * HEARTBEAT + 1
                assert [o.member for o in await member.holders()] == [member.id] * COUNT
            finally:
                if process.returncode is None:
                    process.kill()
                await process.wait()
