"""Celery tasks that hold an asynclock lease for their execution.

``pip install "asynclock[celery]"``::

    from asynclock_celery import LockedTask

    @app.task(bind=True, base=LockedTask, lock="report:{customer_id}", lock_ttl=30)
    def build_report(self, customer_id):
        db.save(report, fencing_token=self.lease.token)

The lease is taken when the task *runs* (never at enqueue), renewed in the background,
released owner-checked after the body, and its loss stops the body with ``LeaseLost``.
"""

from __future__ import annotations

try:
    import celery  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        'asynclock_celery needs Celery, which is not installed: pip install "asynclock[celery]"'
    ) from exc

from ._policy import ON_BUSY
from ._runtime import close_runtime
from ._task import LockedTask, locked

__all__ = ("ON_BUSY", "LockedTask", "close_runtime", "locked")
