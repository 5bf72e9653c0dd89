"""Synchronous code that holds asynclock leases (the bridge every sync integration uses).

A backend lives on an event loop; a synchronous body (a Celery task, an APScheduler job in
a thread pool, a script) runs on a thread of its own. Four names bridge them (anyio's
blocking portal does the same with one object; these are the shapes the integrations
need):

* :class:`LoopThread` — one asyncio event loop on a background thread, and the backends
  open on it (opened at first use, closed, releasing what they hold, by ``close()``).
  Calls cross with ``asyncio.run_coroutine_threadsafe``: one hop per call (anyio's
  blocking portal costs two or three per task start, measured as a third of a no-op
  Celery task's throughput).
* :func:`hold` — ``with hold(thread, url, name, ttl=…) as lease:`` one lease for one
  body. Where the backend's driver has blocking calls (one Redis server: ``redis://``,
  ``rediss://``, ``unix://``), the body's thread acquires and releases itself, one script
  round trip each (the driver's own scripts: tokens, the fair queue and the restart grace
  are the same), and the loop is only told, without being waited for, to renew and watch
  the lease. Otherwise, and whenever that one attempt does not get the name (busy, a
  restart grace, an error), the body's thread asks the loop and waits: the loop acquires
  (waiting and queueing as ``backend.acquire`` does), watches the lease and releases it
  when the body is over, each step one wake-up of a lock both threads share.
* :func:`idempotent` — ``with idempotent(thread, url, key, ttl=…) as op:`` an idempotency
  key around a body: a replay, or the body under the key's lease, whose outcome (the result
  given to ``op.save()``, or its error) goes back into ``backend.idempotent``'s
  ``async with`` through the block's exit.
* :func:`guard` — ``with guard(lease, loop):`` (a body in a pool's thread), ``async with
  guard(lease, loop):`` (a coroutine on another event loop) or ``guard(lease,
  loop).run(runner, fn)`` (a coroutine this thread runs on its own ``asyncio.Runner``): a
  body run by another pool under a lease held elsewhere, stopped when it is lost.

How a body is stopped when its lease is lost: ``LeaseLost`` is raised in the body's
thread. On the main thread by a signal (``SIGUSR2``), whose handler raises it: it
interrupts ``time.sleep``, ``Event.wait``, ``socket.recv``, ``subprocess.run`` and
pure-Python loops (PEP 475). On any other thread by ``PyThreadState_SetAsyncExc``, at the
thread's next bytecode: it cannot interrupt a blocking system call (the exception waits
until the call returns). A coroutine under a guard is cancelled instead, also one run by
``guard(...).run()`` inside a ``hold`` on the same thread (never an interruption inside
its event loop). Whichever way, the block raises ``LeaseLost`` if the lease was lost, even
if the body caught the interruption.

Why each case, as Celery taught it: the handler is installed at the first guarded body of
a process and stays (a late signal must never meet ``SIG_DFL``, which ends the process;
billiard resets ``SIGUSR2`` after ``worker_process_init``), and it is a no-op unless a
guard is inside its body. Never ``SIGUSR1``: Celery's soft time limit owns it. A signal
that arrives while the thread runs C code outside a blocking call is seen by Python only
after that call returns, so until the handler has raised, the signal is sent again every
25 ms. A guard's exit and the interrupt are serialised by the guard's lock: once the body
has left, nothing is sent to the thread.

The other names this module had (``Handover``, ``BodyGuard``, ``run_body``,
``stop_on_loss`` …) still import, with a ``DeprecationWarning``: they were the parts of
these four.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from ._body import guard
from ._handover import hold
from ._idempotent import idempotent
from ._loop import LoopThread

__all__ = ("LoopThread", "guard", "hold", "idempotent")

#: The names this module exported before the four above: where each lives now.
_DEPRECATED = {
    "CLOSE_TIMEOUT": ("_loop", "LoopThread.close()'s default timeout"),
    "INTERRUPT_SIGNAL": ("_guard", "the signal hold() and guard() interrupt a main thread with"),
    "RESEND": ("_guard", "how often that signal is sent again"),
    "AsyncLeaseLost": ("_guard", "catch asynclock.LeaseLost"),
    "BodyGuard": ("_guard", "use guard(lease, loop)"),
    "ensure_handler": ("_guard", "hold() and guard() install the handler"),
    "lost_error": ("_guard", "lease.check()"),
    "stop_on_loss": ("_guard", "use guard(lease, loop)"),
    "Guarded": ("_handover", "use hold() or idempotent()"),
    "Handover": ("_handover", "use hold()"),
    "run_body": ("_handover", "use `with hold(...)`"),
}


def _deprecated(name: str) -> Any:
    found = _DEPRECATED.get(name)
    if found is None:
        raise AttributeError(f"module 'asynclock.from_thread' has no attribute {name!r}")
    module, instead = found
    warnings.warn(
        f"asynclock.from_thread.{name} is deprecated and will be removed: {instead}",
        DeprecationWarning,
        stacklevel=3,
    )
    from importlib import import_module

    return getattr(import_module(f"{__name__}.{module}"), name)


if not TYPE_CHECKING:  # type checkers see the four names only
    __getattr__ = _deprecated
