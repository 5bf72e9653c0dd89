"""What PostgreSQL's refusals mean for a user, and what to change: no connection slot
(SQLSTATE 53300) and a full shared lock table (53200)."""

from __future__ import annotations

import re

import asyncpg  # type: ignore[import-untyped]  # no stubs; see fence/sql.py Protocols

from ..._core.exceptions import BackendUnavailable, ServerFull

#: A statement refused because the server's shared lock table has no room (SQLSTATE 53200).
_LOCK_TABLE_FULL = asyncpg.exceptions.OutOfMemoryError


def _ident(name: str) -> str:
    """``name`` as an SQL identifier in a hint (quoted unless plain lower case)."""
    if name.isidentifier() and name.isascii() and name == name.lower():
        return name
    return '"' + name.replace('"', '""') + '"'


def no_slot(display: str, carries: str, text: str) -> BackendUnavailable:
    """The server has no connection slot for us: say that a backend needs two, and which
    limit was reached (``text``: the server's message, scrubbed of secrets)."""
    named = re.search(r'for (role|database) "(.*)"', text)
    if named and named[1] == "role":
        role = _ident(named[2])
        fix = (
            f"role's CONNECTION LIMIT is reached: raise it to its other connections "
            f"+ 2 (ALTER ROLE {role} CONNECTION LIMIT n) or close some of them"
        )
    elif named:
        db = _ident(named[2])
        fix = (
            f"database's CONNECTION LIMIT is reached: raise it by 2 "
            f"(ALTER DATABASE {db} CONNECTION LIMIT n) or close other connections"
        )
    else:
        fix = (
            "server's max_connections is reached (the last "
            "superuser_reserved_connections slots are kept for superusers): raise "
            "max_connections (postgresql.conf, then restart) or close other connections"
        )
    return BackendUnavailable(
        f"{display}: no free connection slot ({text}). This backend needs two "
        f"connections to PostgreSQL: one pinned that carries {carries} and one for "
        f"LISTEN (release notifications). The {fix}."
    )


def table_full(display: str, what: str, exc: BaseException) -> ServerFull:
    """The error for a statement refused by a full shared lock table (SQLSTATE 53200)."""
    said = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return ServerFull(
        f"{display}: {what}: PostgreSQL's shared lock table is full ({said}). "
        "Every lock of every session on the server shares it, mode=session's advisory "
        "locks too: room for max_locks_per_transaction x (max_connections + "
        "max_prepared_transactions) locks (about 6,400 holds with the defaults). "
        "Nothing held was lost. Raise max_locks_per_transaction (needs a restart), hold "
        "fewer names at once, or use mode=lease (a table row per lock, no such ceiling)"
    )
