# Celery ships no type information, so its decorators are untyped.
# mypy: disable-error-code="untyped-decorator"
"""A Celery app whose tasks hold a lock for each run and fence their writes with its token.

In production run a worker (``celery -A examples.celery_app worker``) with a real broker
and set ``asynclock_url``; here the tasks run eagerly, in this process, on an embedded
SQLite lock file, so the example needs no server. Run: uv run python examples/celery_app.py
"""

from __future__ import annotations

import logging
import sqlite3
import tempfile
import time
from pathlib import Path

from celery import Celery

import asynclock
from asynclock.fence import SQLFence
from asynclock_celery import LockedTask
from asynclock_celery.testing import force_loss

TMP = Path(tempfile.mkdtemp(prefix="asynclock-celery-"))
LEDGER = TMP / "ledger.db"
fence = SQLFence()

app = Celery("example", broker="memory://", backend="cache+memory://")
app.conf.update(
    asynclock_url=f"sqlite:///{TMP / 'locks.db'}",  # e.g. "redis://localhost:6379/1"
    task_always_eager=True,  # this demo only: run tasks in this process
)


def save(account: int, text: str, token: int) -> None:
    """The protected write: the fence rejects it if a newer token was already seen."""
    conn = sqlite3.connect(LEDGER, isolation_level=None)
    try:
        with fence.sqlite_transaction(conn, f"acct:{account}", token):
            conn.execute("INSERT INTO ledger VALUES (?, ?, ?)", (account, token, text))
    finally:
        conn.close()


# on_busy="wait" (the default): a run that finds the account locked waits for it, here at
# most 60 s; on_busy="retry", "skip" or "fail" would send it back, drop it or fail it.
@app.task(bind=True, base=LockedTask, lock="acct:{account}", lock_ttl=30, lock_timeout=60)
def sync_account(self: LockedTask, account: int, text: str) -> int:
    save(account, text, token=self.lease.token)  # the token goes to the resource
    return int(self.request.fencing_token)


@app.task(bind=True, base=LockedTask, lock="acct:{account}", lock_ttl=30)
def interrupted(self: LockedTask, account: int) -> str:
    try:
        force_loss(self.lease, "demo: the lease was lost mid-run")  # as a long pause would
        time.sleep(30)  # LeaseLost interrupts the body here
    except asynclock.LeaseLost:
        return "swallowed the loss"  # the run still fails: it went on without the lock
    return "not reached"


def main() -> None:
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    with sqlite3.connect(LEDGER) as conn:
        fence.create_sqlite(conn)
        conn.execute("CREATE TABLE ledger (account INTEGER, token INTEGER, text TEXT)")
    for text in ("first sync", "second sync"):
        token = sync_account.delay(7, text).get()
        print(f"sync_account(7) ran holding 'acct:7' with fencing token {token}")
    result = interrupted.delay(7)
    print(f"interrupted(7) ended {result.state}: {type(result.result).__name__}")
    with sqlite3.connect(LEDGER) as conn:
        for account, token, text in conn.execute("SELECT * FROM ledger ORDER BY token"):
            print(f"ledger: account {account}, token {token}: {text}")


if __name__ == "__main__":
    main()
