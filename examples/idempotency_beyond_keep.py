"""An invoice sent once, however late the duplicate: keep, then a unique constraint.

An idempotency key keeps its record ``keep`` seconds (at most 30 days): a duplicate inside
that window gets the stored answer without running. One that arrives later finds no
record and would run again, so the operation also writes a row with a unique constraint
in the application's own table, in the same transaction as its effect: the row is the
permanent record. Here the record's ``keep`` is 1 second, so the late duplicate is
seconds away instead of a month.
Run: uv run python examples/idempotency_beyond_keep.py
"""

from __future__ import annotations

import sqlite3
import tempfile
from pathlib import Path
from typing import Any

import anyio

import asynclock

SENT: list[str] = []


async def send_invoice(
    backend: asynclock.Backend, db: sqlite3.Connection, invoice_id: str, *, keep: float
) -> dict[str, Any]:
    async with backend.idempotent(f"invoice:{invoice_id}", ttl=10.0, keep=keep) as op:
        if op.replayed:
            return {**op.result, "answer": "replayed"}
        try:
            with db:  # one transaction: the row and the effect it records
                db.execute("INSERT INTO invoices (invoice_id) VALUES (?)", (invoice_id,))
                SENT.append(invoice_id)  # the e-mail, in real life (with op.token)
        except sqlite3.IntegrityError:
            result = {"invoice": invoice_id, "answer": "sent before (unique constraint)"}
            await op.save(result)
            return result
        result = {"invoice": invoice_id, "answer": "sent"}
        await op.save(result)
        return result
    raise AssertionError("unreachable: a lost lease raises LeaseLost")


async def main(tmp: Path) -> None:
    db = sqlite3.connect(tmp / "app.db")
    db.execute("CREATE TABLE invoices (invoice_id TEXT PRIMARY KEY)")
    async with asynclock.connect(f"sqlite:///{tmp / 'locks.db'}") as backend:
        first = await send_invoice(backend, db, "inv-7", keep=1.0)
        retry = await send_invoice(backend, db, "inv-7", keep=1.0)
        print(f"first: {first['answer']}; a retry within keep: {retry['answer']}")
        await anyio.sleep(1.5)  # past keep: the record is gone
        late = await send_invoice(backend, db, "inv-7", keep=1.0)
        print(f"a duplicate after keep: {late['answer']}")
    print(f"invoices sent: {len(SENT)}")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        anyio.run(main, Path(tmp))
