"""A guarded FastAPI holder in a process of its own, for tests that SIGSTOP it.

``python -m tests.support.fastapi_holder LOCK_URL LEDGER_URL PORT`` serves
``POST /sync/{key}``: under ``@locks.guard("sync:{key}", ttl=1)`` it PUTs
``/items/{key}`` to the ledger with ``FencingAuth``. With ``?freeze=true`` the process
stops itself (SIGSTOP) right after the token was put on that request, before it is sent:
the whole process (its event loop, its renewals) is frozen at a known point until the test
sends SIGCONT.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import anyio
import httpx
import uvicorn
from fastapi import Depends, FastAPI

import asynclock
from asynclock_fastapi import FencingAuth, Locks, guard_lease, install


def build(lock_url: str, ledger_url: str) -> FastAPI:
    locks = Locks(lock_url)
    app = install(FastAPI(lifespan=locks.lifespan))

    @app.post("/sync/{key}")
    @locks.guard("sync:{key}", ttl=1)
    async def sync(
        key: str, freeze: bool = False, lease: asynclock.Lease = Depends(guard_lease)
    ) -> dict[str, Any]:
        async def hook(request: httpx.Request) -> None:
            if freeze:  # after FencingAuth (httpx runs request hooks after the auth flow)
                os.kill(os.getpid(), signal.SIGSTOP)

        async with httpx.AsyncClient(
            base_url=ledger_url, auth=FencingAuth(), event_hooks={"request": [hook]}, timeout=30
        ) as ledger:
            # Shielded: once the process runs again the request goes out, as a request
            # already on the wire would, even though the loss is noticed meanwhile.
            with anyio.CancelScope(shield=True):
                answer = await ledger.put(f"/items/{key}", json={"value": f"holder {lease.token}"})
        return {"token": lease.token, "ledger": answer.status_code}

    return app


if __name__ == "__main__":
    lock_url, ledger_url, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    uvicorn.run(build(lock_url, ledger_url), host="127.0.0.1", port=port, log_level="info")
