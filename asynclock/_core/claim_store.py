"""What a server does for claims (``_core/claims.py`` is the life of a claim): the rows it
claimed, its answer to a completing write, and the :class:`ClaimStore` protocol
(PostgreSQL's: ``asynclock/backends/postgres/claims.py``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from .keeper import Keeper


class ClaimedRow(NamedTuple):
    """One row the store claimed: its id, its claim token, its columns as claimed.
    (Tuples, not frozen dataclasses: one is made per claimed row and per completion, and
    a frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``.)"""

    id: Any
    token: int
    row: dict[str, Any]


class Finish(NamedTuple):
    """A store's answer to a completing write: the row's status after it (None: refused,
    the row no longer carries the token) and the token it carries now."""

    status: str | None
    current: int | None


class ClaimStore(Keeper, Protocol):
    """The server's part of claims (one table): claiming, renewing, finishing rows.

    As a :class:`~.driver.Keeper` its ``extend`` renews claimed rows (their leases, by the
    owner :meth:`track` tied to a row id) and its ``release`` gives one row back. Every
    write is conditional on the row's claim token (G5, G8).
    """

    #: The table as the user named it (``schema.table``), for names and messages.
    table: str
    #: The id column's name.
    id_column: str

    async def create_table(self) -> None: ...

    async def ensure_columns(self) -> None: ...

    async def claim(
        self, limit: int, claimed_by: str, ttl: float, max_attempts: int
    ) -> list[ClaimedRow]:
        """Claim up to ``limit`` claimable rows now, each with a new token, for ``ttl``."""
        ...

    def track(self, owner: str, row_id: Any) -> None:
        """The lease ``owner`` holds row ``row_id`` (``extend`` and ``release`` find it)."""
        ...

    def untrack(self, owner: str) -> None: ...

    def knows(self, results: Mapping[str, Any]) -> bool:
        """True: ``results``' columns were checked already (no need to :meth:`check_results`)."""
        ...

    async def check_results(self, results: Mapping[str, Any]) -> None:
        """ValueError for a result column the table lacks, a claim column or the id."""
        ...

    async def complete(self, row_id: Any, token: int, results: Mapping[str, Any]) -> Finish:
        """Mark the row done with ``results``, only while it carries ``token``. A statement
        the database refuses raises its own error (nothing written)."""
        ...

    async def complete_many(
        self, columns: tuple[str, ...], rows: Sequence[tuple[Any, int, Sequence[Any]]]
    ) -> list[Finish]:
        """:meth:`complete` for many rows (id, token, the values of ``columns``) in one
        round trip, all or nothing: one answer per row, in order. A statement the database
        refuses for any row raises its own error and writes nothing."""
        ...

    async def fail(
        self, row_id: Any, token: int, error: str, retry_in: float | None, max_attempts: int
    ) -> Finish:
        """Record ``error`` and give the row back for a retry (or park it)."""
        ...

    async def give_back(self, rows: Sequence[tuple[Any, int, str | None]]) -> None:
        """Rows (id, token, error or None) still carrying their token go back to 'ready'."""
        ...
