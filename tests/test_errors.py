"""The one driver-error mapper every driver uses (asynclock._core.errors)."""

from __future__ import annotations

import pytest

from asynclock import BackendUnavailable, LockHeld
from asynclock._core.errors import map_errors


def test_library_errors_become_backend_unavailable_without_the_secret() -> None:
    errors = map_errors("redis://127.0.0.1:6379/0", "s3cret")
    with pytest.raises(BackendUnavailable) as caught, errors("acquire failed"):
        raise ConnectionError("AUTH s3cret refused")
    assert str(caught.value) == "redis://127.0.0.1:6379/0: acquire failed: AUTH *** refused"
    assert isinstance(caught.value.__cause__, ConnectionError)


def test_asynclock_errors_and_cancellation_pass_through() -> None:
    errors = map_errors("memory://")
    with pytest.raises(LockHeld), errors("acquire failed"):
        raise LockHeld("x", 1.0)
    with pytest.raises(KeyboardInterrupt), errors("acquire failed"):
        raise KeyboardInterrupt


def test_explain_reads_known_errors_and_an_empty_message_names_the_type() -> None:
    def explain(exc: BaseException) -> str | None:
        return "permission denied" if isinstance(exc, PermissionError) else None

    errors = map_errors("sqlite:///x.db", explain=explain)
    assert str(errors.unavailable("open failed", PermissionError("x"))).endswith(
        "open failed: permission denied"
    )
    assert str(errors.unavailable("open failed", TimeoutError())).endswith(": TimeoutError")
    already = BackendUnavailable("as it is")
    assert errors.unavailable("open failed", already) is already
