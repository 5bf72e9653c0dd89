"""Helpers for testing your own locked tasks, and the ``locked_task_runner`` fixture.

``run_eagerly(task, args, kwargs)`` runs a task in this process through Celery's own
``Task.apply`` (the tracer a worker uses) holding a real lease; ``force_loss(lease)`` makes
a running task's lease be lost, as if its renewal had been refused. The fixture
``locked_task_runner`` is ``run_eagerly`` on the ``pytest --asynclock-url`` server: the
``asynclock`` pytest plugin loads this module as a plugin when Celery is installed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import asynclock
import asynclock.testing

from ._runtime import URL_SETTING, get_runtime

__all__ = ("force_loss", "run_eagerly")


def run_eagerly(
    task: Any,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    url: str | None = None,
    **options: Any,
) -> Any:
    """Run ``task`` now, in this process, as a worker would; returns Celery's EagerResult.

    ``url``: the lock server for this run (default: the app's ``asynclock_url``, else
    ``memory://``). ``options`` go to ``Task.apply`` (e.g. ``throw=True``).
    """
    conf = task.app.conf
    previous = conf.get(URL_SETTING)
    conf[URL_SETTING] = url or previous or "memory://"
    try:
        return task.apply(tuple(args), dict(kwargs or {}), **options)
    finally:
        conf[URL_SETTING] = previous


def force_loss(lease: asynclock.Lease, reason: str = "forced by asynclock_celery.testing") -> None:
    """Make a task's lease (``self.lease``, ``current_lease()``) lost now, from the body or
    any thread: the body is interrupted with ``LeaseLost`` and the run fails."""
    get_runtime().call(asynclock.testing.force_loss, lease, reason)


try:
    import pytest
except ImportError:  # pragma: no cover - run_eagerly and force_loss need no pytest
    pytest = None  # type: ignore[assignment]

if pytest is not None:

    @pytest.fixture
    def locked_task_runner(request: pytest.FixtureRequest) -> Callable[..., Any]:
        """``runner(task, args=(), kwargs=None, **apply_options)`` runs an asynclock_celery
        task eagerly with a real lease on the ``--asynclock-url`` server (loaded by the
        ``asynclock`` pytest plugin when Celery is installed)."""
        from asynclock.pytest_plugin import backend_url

        url = backend_url(request.config)

        def run(task: Any, args: Any = (), kwargs: Any = None, **options: Any) -> Any:
            return run_eagerly(task, args, kwargs, url=url, **options)

        return run
