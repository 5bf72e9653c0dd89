"""An idempotency key held around a synchronous body: :func:`idempotent`.

The key's lease is taken *inside* ``async with backend.idempotent(...)`` on the loop, and the
body's outcome has to go back into that ``async with`` before the lease is released (the
fenced save of the result, a stored failure, or the key freed for a retry). So the loop's
task stays in the ``async with`` while the body runs in its thread, and the block's exit
hands the outcome over:

1. the body's thread posts the entry and waits; the loop enters ``backend.idempotent(...)``
   and answers with a replay, a lease, or an error (``InProgress`` when the key runs
   elsewhere and the call does not wait);
2. with a lease, the body runs in its thread under it (stopped with ``LeaseLost`` when the
   loop sees the lease lost, as in :func:`~asynclock.from_thread.hold`);
3. the block's exit posts the outcome and waits; the loop saves the result (fenced: a stale
   run's result is refused) and raises the body's error inside the ``async with``, which
   stores it (``store_errors``) or frees the key, then releases.
"""

from __future__ import annotations

import asyncio
from typing import Any

from .._core.backend import Backend
from .._core.exceptions import LeaseLost
from .._core.idempotency import Idempotent, IdempotentCall
from .._core.idempotency_rules import DEFAULT_KEEP, encode_result
from .._core.lease import Lease
from ._body import ExcInfo, GuardedBody
from ._handover import Exchange, guarded
from ._loop import LoopThread


class _Aborted(Exception):
    """Raised on the loop inside the ``async with`` to free the key without storing
    anything: a body that ended with a BaseException that is not an Exception (asyncio
    would stop the loop on the original), a result ``save()`` refused, a thread that gave
    up waiting. The body's thread raises its own error (if any)."""


class IdempotentBody:
    """What ``with idempotent(...) as op:`` yields: one call of the operation.

    ``replayed`` is True when the operation completed before: ``result`` is its stored
    result (decoded from JSON), and the body must not do the work again. Otherwise the body
    runs under ``lease`` (fencing token ``token``) and hands its result to :meth:`save`.
    """

    __slots__ = ("_rejected", "_saved", "key", "lease", "replayed", "result", "token")

    def __init__(self, call: IdempotentCall) -> None:
        self.key = call.key
        self.replayed = call.replayed
        self.result: Any = call.result
        self.token = call.token
        self.lease: Lease | None = call.lease
        self._saved = False
        self._rejected: BaseException | None = None

    def __repr__(self) -> str:
        state = "replayed" if self.replayed else "saved" if self._saved else "running"
        return f"<IdempotentBody {self.key!r} token={self.token} {state}>"

    @property
    def saved(self) -> bool:
        return self._saved

    def save(self, result: object) -> None:
        """Store ``result`` as the operation's result when the block exits, fenced by this
        call's token (``StaleToken`` / ``LeaseLost`` from the block if the lease is no
        longer live then; nothing is stored). Checked now: TypeError / ValueError if it
        cannot be stored (as ``IdempotentCall.save``), and the key is freed at the exit
        unless a later ``save()`` succeeds. An error the body raises after it is raised
        from the block, and the result is stored all the same."""
        if self.replayed:
            raise RuntimeError(f"idempotent operation {self.key!r} was replayed: nothing to save")
        if self._saved:
            raise RuntimeError(f"the result of idempotent operation {self.key!r} is saved already")
        try:
            encode_result(self.key, result)
        except (TypeError, ValueError) as exc:
            self._rejected = exc
            raise
        self._saved, self._rejected, self.result = True, None, result


class _IdempotentExchange(Exchange):
    """The loop's task in ``async with backend.idempotent(...)`` and the body's thread."""

    __slots__ = ("body", "call", "outcome")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.call: IdempotentCall | None = None
        self.body: IdempotentBody | None = None
        #: The body's error, as the block's exit saw it.
        self.outcome: BaseException | None = None

    def begin(self, guard: Idempotent) -> None:
        self._post_and_wait(lambda: self._loop.create_task(self._run(guard)))

    def finish(self, error: BaseException | None) -> None:
        self.outcome = error
        self._end()

    async def _run(self, guard: Idempotent) -> None:
        try:
            with self._scoped():  # cancelled if the body's thread gave up waiting
                async with guard as call:
                    self.call = call
                    if call.replayed:
                        return
                    assert call.lease is not None
                    await self.until_end(call.lease, shield=True)
                    await self._settle(call)
        except BaseException as exc:
            if not isinstance(exc, _Aborted):
                self.error = exc
            if not isinstance(exc, Exception):
                raise
        finally:
            self._signal()

    async def _settle(self, call: IdempotentCall) -> None:
        """Inside the ``async with``: the body's outcome, as the block's exit saw it."""
        body, error = self.body, self.outcome
        if self.gave_up:
            raise _Aborted("the body's thread gave up waiting for the key")
        if body is not None and body.saved:
            await call.save(body.result)  # stored whatever the body did after save()
        if error is not None:
            if not isinstance(error, Exception) or error is getattr(body, "_rejected", None):
                raise _Aborted(repr(error))
            raise error
        if body is not None and body._rejected is not None:
            raise _Aborted("its result was refused, and nothing else was saved")


class IdempotentHold:
    """What :func:`idempotent` returns: ``with`` it around the body."""

    __slots__ = ("_body", "_exchange", "_guard", "_thread")

    def __init__(self, thread: LoopThread, guard: Idempotent) -> None:
        self._thread = thread
        self._guard = guard
        self._exchange: _IdempotentExchange | None = None
        self._body: GuardedBody | None = None

    def __enter__(self) -> IdempotentBody:
        exchange = self._exchange = _IdempotentExchange(self._thread.loop)
        exchange.begin(self._guard)
        if exchange.error is not None:
            raise exchange.error
        assert exchange.call is not None
        body = exchange.body = IdempotentBody(exchange.call)
        if body.lease is not None:  # not replayed: the body runs under the key's lease
            self._body = guarded(exchange, body.lease)
        return body

    def __exit__(self, *exc_info: *ExcInfo) -> None:
        exchange, guarded_body = self._exchange, self._body
        assert exchange is not None, "exit without enter"
        if guarded_body is None:
            return  # replayed: nothing ran, nothing to hand back
        error = exc_info[1]
        try:
            guarded_body.__exit__(*exc_info)
        except BaseException as exc:  # the loss of the lease (LeaseLost)
            error = exc
        exchange.finish(error)
        found = exchange.error
        # The body's own error stands (its LeaseLost too, which has the body's cause);
        # anything else the loop met (a refused save, an unreachable server) is raised.
        both_lost = isinstance(error, LeaseLost) and isinstance(found, LeaseLost)
        if found is not None and found is not error and not both_lost:
            raise found from error
        if error is not None and error is not exc_info[1]:
            raise error


def idempotent(
    thread: LoopThread,
    target: str | Backend,
    key: str,
    *,
    ttl: float,
    fingerprint: object = None,
    keep: float = DEFAULT_KEEP,
    wait: float | None = None,
    store_errors: tuple[type[Exception], ...] = (),
) -> IdempotentHold:
    """Run a synchronous operation at most once per ``key``: ``backend.idempotent`` on
    ``thread``'s backend for ``target`` (the same arguments, the same rules: see
    docs/idempotency.md)::

        with idempotent(thread, url, f"charge:{order_id}", ttl=30) as op:
            if op.replayed:
                return op.result
            receipt = charge(order_id, fencing_token=op.token)
            op.save(receipt)

    The entry raises what ``backend.idempotent`` raises (``InProgress``,
    ``IdempotencyKeyReused``, ``ReplayedFailure``, ``RestartGrace`` …). A body that runs is
    under the key's lease as in :func:`hold` (stopped with ``LeaseLost`` when it is lost).
    Its outcome goes back through the block's exit: the result given to ``op.save()`` is
    stored (fenced), a body that saves nothing stores ``None``, an error is stored if it is
    one of ``store_errors`` and otherwise frees the key; then the lease is released. The
    arguments are checked here, in the caller's thread.
    """
    guard = thread.backend(target).idempotent(
        key, ttl=ttl, fingerprint=fingerprint, keep=keep, wait=wait, store_errors=store_errors
    )
    return IdempotentHold(thread, guard)
