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


@pytest.mark.parametrize(("mode", "cls"), [("session", SessionDriver), ("lease", LeaseDriver)])
def test_postgres_driver_builds_the_class_its_mode_names(
    mode: str, cls: type[PostgresDriver]
) -> None:
    driver = PostgresDriver("postgresql://localhost/db", mode=mode)
    assert type(driver) is cls and driver.mode == mode
    assert type(PostgresDriver("postgresql://localhost/db")) is SessionDriver


def test_bad_mode_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="postgres mode must be 'session' or 'lease', got 'x'"):
        driver_from_url(URL + "?mode=x")
    with pytest.raises(ValueError, match="postgres mode must be 'session' or 'lease'"):
        PostgresDriver("postgresql://localhost/db", mode="x")
    with pytest.raises(ValueError, match="LeaseDriver is mode 'lease', got mode='session'"):
        LeaseDriver("postgresql://localhost/db", mode="session")
