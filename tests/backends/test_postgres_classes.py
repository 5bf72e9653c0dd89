"""One driver class per PostgreSQL mode, chosen by ``?mode=`` (no server needed: no I/O)."""

from __future__ import annotations

import pytest

from asynclock.backends.postgres import (
    LeaseDriver,
    PostgresDriver,
    SessionDriver,
    driver_from_url,
)

URL = "postgresql://u:secret@localhost:5432/db"


@pytest.mark.parametrize(
    ("query", "cls", "mode"),
    [
        ("", SessionDriver, "session"),
        ("?mode=session", SessionDriver, "session"),
        ("?mode=lease", LeaseDriver, "lease"),
    ],
)
def test_mode_picks_the_driver_class(query: str, cls: type[PostgresDriver], mode: str) -> None:
    driver = driver_from_url(URL + query)
    assert type(driver) is cls and isinstance(driver, PostgresDriver)
    assert driver.mode == mode
    assert "secret" not in repr(driver)


def test_bad_mode_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="postgres mode must be 'session' or 'lease', got 'x'"):
        driver_from_url(URL + "?mode=x")
    with pytest.raises(TypeError, match="PostgresDriver is the base of SessionDriver"):
        PostgresDriver("postgresql://localhost/db")
    with pytest.raises(ValueError, match="LeaseDriver is mode 'lease', got mode='session'"):
        LeaseDriver("postgresql://localhost/db", mode="session")
