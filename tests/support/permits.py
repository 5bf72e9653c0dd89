"""Helpers for semaphore tests: knowing that a waiter is queued at the server."""

from __future__ import annotations

import anyio

import asynclock
from asynclock._core.permit_store import Answer, Full


def queued(sem: asynclock.Semaphore) -> anyio.Event:
    """Set once a blocking attempt through ``sem`` was answered "full": its waiter holds a
    place in the queue at the server (the store's grant, wrapped; the call is the real one)."""
    store = sem._store
    real = store.grant
    event = anyio.Event()

    async def grant(owner: str, ttl: float, *, queue: bool = False) -> Answer:
        answer = await real(owner, ttl, queue=queue)
        if queue and isinstance(answer, Full):
            event.set()
        return answer

    store.grant = grant  # type: ignore[method-assign]
    return event
