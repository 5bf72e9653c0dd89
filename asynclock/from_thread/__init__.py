"""Synchronous code that holds asynclock leases (the bridge every sync integration uses).

A backend lives on an event loop; a synchronous body (a Celery task, an APScheduler job in
a thread pool, a script) runs on a thread of its own. This module is the bridge:

* :class:`LoopThread` — one asyncio event loop on a background thread, and the backends
  open on it (opened at first use, closed, releasing what they hold, by :meth:`close`).
  Calls cross with ``asyncio.run_coroutine_threadsafe``: one hop per call (anyio's
  blocking portal costs two or three per task start, measured as a third of a no-op
  Celery task's throughput).
* :class:`Handover` — one lease for one body. Where the backend's driver has blocking
  calls (one Redis server: ``redis://``, ``rediss://``, ``unix://``), the body's thread
  acquires and releases itself, one script round trip each on a plain redis-py connection
  (the driver's own scripts: tokens, the fair queue and the restart grace are the same),
  and the loop is only told, without being waited for, to renew and watch the lease.
  Otherwise, and whenever that one attempt does not get the name (busy, a restart grace,
  an error), the body's thread asks the loop and waits: the loop acquires (waiting and
  queueing as ``backend.acquire`` does), watches the lease and releases it when the body
  is over, each step one wake-up of a lock both threads share.
* :class:`BodyGuard` — stops the body when the lease is lost: ``LeaseLost`` is raised in
  the body's thread. On the main thread by a signal (``SIGUSR2``), whose handler raises
  it: it interrupts ``time.sleep``, ``Event.wait``, ``socket.recv``, ``subprocess.run`` and
  pure-Python loops (PEP 475). On any other thread by ``PyThreadState_SetAsyncExc``, at the
  thread's next bytecode: it cannot interrupt a blocking system call (the exception waits
  until the call returns). For a body that runs as a coroutine on another loop, a
  ``cancel`` callback instead.
* :func:`hold` — the three together: ``with hold(thread, url, name, ttl=…) as lease:``.

Why each case, as Celery taught it: the handler is installed at the first guarded body of
a process and stays (a late signal must never meet ``SIG_DFL``, which ends the process;
billiard resets ``SIGUSR2`` after ``worker_process_init``), and it is a no-op unless a
guard is inside its body. Never ``SIGUSR1``: Celery's soft time limit owns it. A signal
that arrives while the thread runs C code outside a blocking call is seen by Python only
after that call returns, so until the handler has raised, the signal is sent again every
:data:`RESEND` seconds. A guard's exit and the interrupt are serialised by the guard's
lock: once :meth:`BodyGuard.leave` has run, nothing is sent to the thread.
"""

from ._guard import (
    INTERRUPT_SIGNAL,
    RESEND,
    AsyncLeaseLost,
    BodyGuard,
    ensure_handler,
    lost_error,
    stop_on_loss,
)
from ._handover import Guarded, Handover, hold, run_body
from ._loop import CLOSE_TIMEOUT, LoopThread

__all__ = (
    "CLOSE_TIMEOUT",
    "INTERRUPT_SIGNAL",
    "RESEND",
    "AsyncLeaseLost",
    "BodyGuard",
    "Guarded",
    "Handover",
    "LoopThread",
    "ensure_handler",
    "hold",
    "lost_error",
    "run_body",
    "stop_on_loss",
)
