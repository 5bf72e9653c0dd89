"""Idempotency keys: charge a card once per order, however often the request comes.

A payment handler keyed by the order: the first request charges and stores the receipt;
a retry gets the stored receipt back without charging; the same key with another amount
is refused; and a first executor that stalls past its ttl (a long GC pause, a frozen VM)
is replaced, and its late save is rejected, so it cannot overwrite the receipt of the run
that replaced it. (Its side effects before the save are another matter: send the token,
op.token, to whatever it writes, as examples/fencing.py does.)
Run: uv run python examples/idempotency.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

import asynclock
import asynclock.testing

CHARGES: list[tuple[str, int]] = []


async def charge(order_id: str, amount: int) -> dict[str, Any]:
    CHARGES.append((order_id, amount))
    return {"order": order_id, "amount": amount, "receipt": f"rcpt-{len(CHARGES)}"}


async def main(tmp: Path) -> None:
    url = f"sqlite:///{tmp / 'locks.db'}"
    async with asynclock.connect(url) as backend:

        @backend.idempotent_function("pay:{order_id}", ttl=5.0, fingerprint=("amount",))
        async def pay(order_id: str, amount: int) -> dict[str, Any]:
            return await charge(order_id, amount)

        first = await pay("o-1", 1200)
        retry = await pay("o-1", 1200)
        print(f"first: {first['receipt']}; retry: {retry['receipt']}; charges: {len(CHARGES)}")
        try:
            await pay("o-1", 9900)
        except asynclock.IdempotencyKeyReused as exc:
            print(f"other amount refused: {exc}")

        # A stalled first executor. Its body runs in code that cannot be interrupted (the
        # shield stands for it) and stops renewing (as a frozen process would).
        replaced = anyio.Event()

        async def stalled(*, task_status: anyio.abc.TaskStatus[None]) -> None:
            try:
                async with backend.idempotent("pay:o-2", ttl=0.5) as op:
                    assert op.lease is not None
                    asynclock.testing.force_loss(op.lease, "pretend a long pause")
                    task_status.started()
                    with anyio.CancelScope(shield=True):
                        await replaced.wait()
                        try:
                            await op.save({"order": "o-2", "receipt": "from the stalled run"})
                        except asynclock.StaleToken as exc:
                            print(f"late save rejected: {exc}")
            except asynclock.LeaseLost as exc:
                print(f"stalled executor stopped: {exc.reason}")

        async with anyio.create_task_group() as tg:
            await tg.start(stalled)
            # Another process, in real life: waits until the stalled lease expires.
            async with asynclock.connect(url) as other:
                async with other.idempotent("pay:o-2", ttl=5.0, wait=10) as op:
                    await op.save(await charge("o-2", 500))
                    print(f"replacement ran with token {op.token} and saved")
                replaced.set()

        async with backend.idempotent("pay:o-2", ttl=5.0) as op:
            print(f"stored for o-2: {op.result['receipt']} (token {op.token})")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        anyio.run(main, Path(tmp))
