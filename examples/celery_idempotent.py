# Celery ships no type information, so its decorators are untyped.
# mypy: disable-error-code="untyped-decorator"
"""An idempotent Celery task: a re-sent (or redelivered) charge returns the stored receipt
instead of charging the card again.

In production run a worker (``celery -A examples.celery_idempotent worker``) with a real
broker and ``acks_late=True``; here the tasks run eagerly, in this process, on an embedded
SQLite lock file, so the example needs no server.
Run: uv run python examples/celery_idempotent.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from celery import Celery

from asynclock_celery import LockedTask

TMP = Path(tempfile.mkdtemp(prefix="asynclock-celery-idem-"))

app = Celery("example", broker="memory://", backend="cache+memory://")
app.conf.update(
    asynclock_url=f"sqlite:///{TMP / 'locks.db'}",  # e.g. "redis://localhost:6379/1"
    task_always_eager=True,  # this demo only: run tasks in this process
)

charged: list[tuple[str, int]] = []  # what the payment provider saw


class CardDeclined(Exception):
    """Stored and replayed: a declined card is declined again, never charged twice."""


@app.task(
    bind=True,
    base=LockedTask,
    idempotent=True,
    idempotency_key="charge:{order_id}",
    idempotency_fingerprint=("amount",),
    idempotency_store_errors=(CardDeclined,),
    acks_late=True,
    lock_ttl=30,
)
def charge(self: LockedTask, order_id: str, amount: int) -> dict[str, Any]:
    if amount > 1000:
        raise CardDeclined(f"over the limit: {amount}")
    charged.append((order_id, amount))  # the side effect that must happen once
    return {"receipt": f"r-{order_id}-{self.lease.token}", "amount": amount}


def outcome(order_id: str, amount: int) -> str:
    result = charge.delay(order_id, amount)
    if result.state == "SUCCESS":
        return f"{result.result}"
    return f"{result.state} {type(result.result).__name__}"


def main() -> None:
    print("first send:   ", outcome("A-1", 25))
    print("sent again:   ", outcome("A-1", 25))  # replayed: the card is not charged again
    print("other amount: ", outcome("A-1", 30))  # same key, another request: refused
    print("declined:     ", outcome("B-2", 5000))
    print("sent again:   ", outcome("B-2", 5000))  # the stored failure, replayed
    print(f"charges made: {charged}")


if __name__ == "__main__":
    main()
