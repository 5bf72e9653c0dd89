"""Claims: rows of your own table taken as work items, each under a lease of the session
whose completion is fenced by the row's claim token (docs/claims.md).

The life of a claim is written once, here, on the session's hook for leases granted
outside ``acquire`` (:class:`~.holds.Holds`); the server's part is a
:class:`ClaimStore` (PostgreSQL: ``asynclock/backends/postgres/claims.py``, its
statements in ``claim_sql.py``). A claimed row:

* is a lease of the session (name ``claim:<table>:<id>``, a private owner): renewed by the
  store's ``extend`` (one statement for every claimed row of a table in a round), lost
  when the renewal is refused or its local deadline passes (G3, G4), counted in
  ``stats()``, told to observers, reachable by ``asynclock.testing.force_loss``;
* ``async with claim:`` runs its work in a cancel scope cancelled when it is lost; a claim
  lost (or past its deadline: a frozen worker) before its block begins raises
  ``LeaseLost`` there, and its body never runs;
* ``complete()`` and ``fail()`` are one conditional write each on the claim token (G5,
  G8): a worker whose row was reclaimed writes nothing and gets ``StaleToken``. A
  completion the database refuses (a constraint, a value of the wrong type) raises the
  database's error unchanged and leaves the claim held and usable (``fail()``, or the
  batch's exit gives the row back with the error recorded);
* rows neither completed nor failed go back to 'ready' when the batch ends.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self

from .bounds import cleanup
from .claim_store import ClaimedRow, ClaimStore, Finish
from .context import ExcInfo
from .exceptions import BackendUnavailable, StaleToken
from .holds import Holds
from .lease import Lease, LossSignal
from .misuse import AsyncContextOnly
from .validation import MAX_TTL, check_lease_ttl

#: The most rows one ``take()`` claims (a claim is one short transaction holding row locks).
MAX_LIMIT = 1000
#: Longest backoff of ``fail()`` without ``retry_in`` (seconds): 1, 2, 4, ... up to this.
MAX_BACKOFF = 300.0


@dataclass(frozen=True, slots=True)
class ClaimOptions:
    """The checked options of ``backend.claims()`` the core uses."""

    ttl: float
    max_attempts: int
    identity: str

    @classmethod
    def checked(cls, ttl: object, max_attempts: object, identity: object) -> ClaimOptions:
        ttl_f = check_lease_ttl(ttl)
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int):
            raise TypeError(f"max_attempts must be an int >= 1, not {type(max_attempts).__name__}")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1 (claims per row), got {max_attempts}")
        if identity is not None and not isinstance(identity, str):
            raise TypeError(f"identity must be a str or None, not {type(identity).__name__}")
        return cls(ttl_f, max_attempts, identity or f"{socket.gethostname()}:{os.getpid()}")


def check_limit(limit: object) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"limit must be an int from 1 to {MAX_LIMIT}, not {type(limit).__name__}")
    if not 1 <= limit <= MAX_LIMIT:
        raise ValueError(
            f"limit must be from 1 to {MAX_LIMIT} rows per take() (each claim is one "
            f"transaction holding row locks), got {limit}"
        )
    return limit


def check_retry_in(retry_in: object) -> float | None:
    if retry_in is None:
        return None
    if isinstance(retry_in, bool) or not isinstance(retry_in, (int, float)):
        raise TypeError("retry_in must be None or a number of seconds >= 0")
    if not 0 <= retry_in <= MAX_TTL or math.isnan(retry_in):
        raise ValueError(f"retry_in must be from 0 to {MAX_TTL:g} seconds, got {retry_in!r}")
    return float(retry_in)


class Claims:
    """Claim rows of one table: ``async with claims.take(limit=N) as batch:``.

    Made by ``backend.claims(table, ttl=...)`` (PostgreSQL only); cheap, no I/O. The
    table's columns are checked on first use. See docs/claims.md.
    """

    def __init__(self, holds: Holds, store: ClaimStore, options: ClaimOptions) -> None:
        self._holds = holds
        self._store = store
        self.ttl = options.ttl
        self.max_attempts = options.max_attempts
        #: Written to ``claimed_by`` of every row this object claims.
        self.identity = options.identity
        self.table = store.table
        self.id_column = store.id_column

    def __repr__(self) -> str:
        return f"<asynclock Claims {self.table!r} ttl={self.ttl:g}>"

    async def create_table(self) -> None:
        """Create the table if it does not exist: ``id bigint`` identity primary key,
        ``payload jsonb``, ``result jsonb`` and the claim columns, with a partial index for
        claiming in id order, in one transaction. An existing table is left as is (then
        :meth:`ensure_columns` adds missing claim columns)."""
        self._holds.ready()
        await self._store.create_table()

    async def ensure_columns(self) -> None:
        """Add the claim columns the table lacks (with their defaults) and the claiming
        index, in one transaction; the table must exist."""
        self._holds.ready()
        await self._store.ensure_columns()

    def take(self, limit: int = 1) -> ClaimBatch:
        """``async with claims.take(limit=N) as batch:`` claims up to ``limit`` rows now
        (from 1 to :data:`MAX_LIMIT`; fewer, or none, if fewer are claimable: it does not
        wait). Rows not completed or failed when the block ends are given back."""
        return ClaimBatch(self, check_limit(limit))

    async def _claim(self, limit: int) -> list[Claim]:
        holds = self._holds
        holds.ready()
        await holds.checkpoint_if_cancelled()  # cancelled already: claim nothing
        t_send = holds.clock.now()  # before the claim is sent (G3)
        # Shielded (G6): once sent, the claim may commit, so its rows must reach the batch,
        # whose exit gives them back if the caller was cancelled meanwhile. Bounded by the
        # backend's release_timeout, as every shielded call is (no timer per claim).
        rows = await holds.shielded(
            self._store.claim(limit, self.identity, self.ttl, self.max_attempts)
        )
        if rows is None:
            raise BackendUnavailable(
                f"{self._store.display}: claim on {self.table!r} got no answer within "
                f"{holds.bounds.timeout:g}s; rows it may have claimed come back after the "
                f"ttl ({self.ttl:g}s)"
            )
        return [self._grant(row, t_send) for row in rows]

    async def _complete_many(self, deferred: Sequence[Claim]) -> int:
        """Send deferred completions, one store call per set of result columns."""
        holds = self._holds
        holds.check_loop()
        groups: dict[tuple[str, ...], list[Claim]] = {}
        for claim in deferred:
            assert claim._deferred is not None
            groups.setdefault(tuple(claim._deferred), []).append(claim)
        written = 0
        refused: Claim | None = None
        current: int | None = None
        for columns, claims in groups.items():
            call: Coroutine[Any, Any, Sequence[Finish]]
            if len(claims) == 1:  # one round trip, as complete() (the batch read is a second)
                (one,) = claims
                call = self._complete_one(one, one._deferred or {})
            else:
                rows = [(c.id, c.token, tuple((c._deferred or {}).values())) for c in claims]
                call = self._store.complete_many(columns, rows)
            try:
                answers = await holds.end_many([c.lease for c in claims], call)
            except BackendUnavailable:
                for claim in claims:
                    claim._unknown("complete")
                raise
            except Exception as exc:
                # Refused by the database: nothing of this set written; held again, not
                # deferred, and given back by the block's end with this error recorded.
                for claim in claims:
                    claim._deferred = None
                    claim._error = f"{type(exc).__name__}: {exc}"[:2000]
                raise
            if answers is None:
                for claim in claims:
                    claim._unknown("complete")
                raise BackendUnavailable(f"claim complete() on {self.table!r}: no answer")
            for claim, answer in zip(claims, answers, strict=True):
                claim._finished = True
                self._store.untrack(claim.lease.owner)
                if answer.status is None:
                    holds.lose(claim.lease, "the row was reclaimed, completed or given back")
                    if refused is None:
                        refused, current = claim, answer.current
                else:
                    holds.finish(claim.lease)
                    written += 1
        if refused is not None:
            raise StaleToken(f"{self.table}:{refused.id}", refused.token, current)
        return written

    async def _complete_one(self, claim: Claim, results: Mapping[str, Any]) -> list[Finish]:
        return [await self._store.complete(claim.id, claim.token, results)]

    def _grant(self, claimed: ClaimedRow, t_send: float) -> Claim:
        owner = "claim:" + self._holds.new_owner()
        self._store.track(owner, claimed.id)
        lease = self._holds.adopt(
            f"claim:{self.table}:{claimed.id}", owner, claimed.token, self.ttl, t_send
        )
        return Claim(self, lease, claimed)

    async def _give_back(self, claims: Sequence[Claim]) -> None:
        live = [c for c in claims if not c._finished]
        if not live:
            return
        for claim in live:
            claim._finished = True
            self._holds.finish(claim.lease)
            self._store.untrack(claim.lease.owner)
        # Shielded and bounded like a release; if it fails the rows come back anyway once
        # their claims expire (logged, not raised over the block's own outcome).
        await cleanup(
            self._store.give_back([(c.id, c.token, c._error) for c in live]),
            self._holds.bounds,
            f"giving back {len(live)} claimed rows of {self.table!r}",
        )


class ClaimBatch(AsyncContextOnly):
    """``async with claims.take(limit=N) as batch:`` — the rows claimed (iterable, sized)."""

    _usage = "claims.take(limit=...)"

    def __init__(self, claims: Claims, limit: int) -> None:
        self._claims = claims
        self._limit = limit
        self._items: list[Claim] = []
        self._entered = False

    async def __aenter__(self) -> Self:
        if self._entered:
            raise RuntimeError("a take() batch is entered once; call claims.take() again")
        self._entered = True
        self._items = await self._claims._claim(self._limit)
        return self

    async def __aexit__(self, *exc_info: *ExcInfo) -> None:
        try:
            await self.flush()
        except Exception:
            if exc_info[1] is None:
                raise
            # The block is already leaving with its own exception (a cancellation
            # included): that one propagates. What the flush met is on the claims: a
            # refused one is lost (``claim.lost``), one the database refused is given back
            # below with its error recorded.
        finally:
            await self._claims._give_back(self._items)

    async def flush(self) -> int:
        """Send the completions deferred by :meth:`Claim.complete_later` now, in one round
        trip (per set of result columns), each fenced as :meth:`Claim.complete` is; the
        block's end does it too. Returns how many were written.

        Raises:
            StaleToken: for the first deferred completion refused (its row was reclaimed or
                given back); the others were written, and every refused claim is lost
                (``claim.lost`` says why).
            BackendUnavailable: no answer; as for ``complete()``, those rows come back
                after their ttl unless the write landed.
            Any error of the database's own, unchanged: nothing of that set of columns was
                written, and those claims are held again, no longer deferred (``fail()``
                them, or let the block's end give them back with the error recorded).
        """
        deferred = [c for c in self._items if c._deferred is not None and not c._finished]
        if not deferred:
            return 0
        return await self._claims._complete_many(deferred)

    def __iter__(self) -> Iterator[Claim]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __repr__(self) -> str:
        return f"<ClaimBatch {self._claims.table!r} {len(self._items)} rows>"


class Claim(AsyncContextOnly):
    """One claimed row: ``.id``, ``.row`` (its columns as claimed), ``.token``, ``.lease``.

    ``async with claim:`` runs the row's work in a cancel scope cancelled when the claim
    is lost (then the block raises :class:`~asynclock.LeaseLost`; a claim lost before the
    block begins raises there, and the body never runs); ``await claim.complete(**results)``
    or ``await claim.fail(error)`` finish it, fenced.
    """

    _usage = "a claim from `async with claims.take(...) as batch: for claim in batch:`"
    #: What it says of itself in messages.
    kind = "claim"

    def __init__(self, claims: Claims, lease: Lease, claimed: ClaimedRow) -> None:
        self._claims = claims
        #: The claim's lease (renewed by the backend; ``force_loss`` takes the claim too).
        self.lease = lease
        self.id = claimed.id
        self.row: Mapping[str, Any] = claimed.row
        self.token: int = lease.token
        self._finished = False
        self._entered = False
        #: The error the block ended with, recorded when the row is given back.
        self._error: str | None = None
        #: The results of a completion deferred to the batch (``complete_later``).
        self._deferred: dict[str, Any] | None = None

    def __repr__(self) -> str:
        state = (
            "lost"
            if self.lost
            else "finished"
            if self._finished
            else "deferred"
            if self._deferred is not None
            else "claimed"
        )
        return f"<Claim {self._claims.table}:{self.id!r} token={self.token} {state}>"

    @property
    def lost(self) -> LossSignal:
        """Set (with a reason) once the claim is lost; ``await claim.lost`` waits for it."""
        return self.lease.lost

    def remaining(self) -> float:
        """Seconds until the local deadline (0 once lost or finished)."""
        return self.lease.remaining()

    def check(self) -> None:
        """Raise :class:`~asynclock.LeaseLost` if the claim is lost or past its deadline."""
        self.lease.check()

    async def __aenter__(self) -> Self:
        if self._entered:
            raise RuntimeError(f"{self!r} is already entered")
        if self._finished:
            raise RuntimeError(f"{self!r} is finished; its work is done")
        self._claims._holds.enter(self, self.lease)
        self._entered = True
        return self

    async def __aexit__(self, *exc_info: *ExcInfo) -> bool:
        self._entered = False
        if isinstance(exc_info[1], Exception) and not self._finished:
            self._error = f"{type(exc_info[1]).__name__}: {exc_info[1]}"[:2000]
        return self._claims._holds.exit(self, exc_info, ended=self._finished)

    async def complete(self, **results: Any) -> None:
        """Mark the row done and write ``results`` (column=value) in one conditional UPDATE,
        only if the row still carries this claim's token.

        Raises:
            StaleToken: the row was reclaimed (or given back); nothing was written.
            ValueError: a result column the table lacks, or a claim column.
            RuntimeError: the claim was already completed or failed.
            BackendUnavailable: no answer; the claim is no longer renewed, so the row is
                claimed again after its ttl unless the completion had landed.
            Any error of the database's own (a CHECK constraint, a value of the wrong
            type) unchanged: nothing was written and the claim is still held (``fail()``
            it, or let the batch give it back).
        """
        claims = self._claims
        store = claims._store
        if not store.knows(results):
            await store.check_results(results)
        call = store.complete(self.id, self.token, results)
        await self._finish(call, "complete")

    async def complete_later(self, **results: Any) -> None:
        """:meth:`complete`, deferred: the row is completed with ``results`` when its
        batch's block ends (or at ``await batch.flush()``), in one round trip with every
        other deferred completion of the batch, each still fenced on its own token. Until
        then the claim stays held and renewed. A block that raises after this call still
        completes the row, as if ``complete()`` had been called here.

        Where ``complete()`` raises ``StaleToken`` at the call, a deferred completion is
        refused at the flush (which raises it); see docs/claims.md, "Completing a batch at
        once".

        Raises:
            ValueError: a result column the table lacks, or a claim column (at once).
            RuntimeError: the claim was already completed, failed or deferred.
        """
        if self._finished or self._deferred is not None:
            raise RuntimeError(f"{self!r} is already finished or deferred; a claim completes once")
        await self._claims._store.check_results(results)
        self._deferred = results

    async def fail(self, error: object, *, retry_in: float | None = None) -> bool:
        """Record ``error`` (its ``str``) and give the row back to be retried after
        ``retry_in`` seconds (default: 1, 2, 4, ... per attempt, at most 300). A row
        claimed ``max_attempts`` times is parked instead (status 'parked', never claimed
        again). Returns True if parked. Fenced like :meth:`complete` (StaleToken)."""
        delay = check_retry_in(retry_in)
        claims = self._claims
        call = claims._store.fail(self.id, self.token, str(error), delay, claims.max_attempts)
        return await self._finish(call, "fail") == "parked"

    async def _finish(self, call: Any, what: str) -> str:
        if self._finished or self._deferred is not None:
            call.close()
            raise RuntimeError(f"{self!r} is already finished; {what}() runs once per claim")
        claims = self._claims
        holds = claims._holds
        try:
            holds.check_loop()
        except BaseException:
            call.close()
            raise
        # Sent even for a claim lost here: the write is fenced at the server, which
        # refuses it (StaleToken) if the row was reclaimed, and takes it if not yet.
        # Out of renewal while the write is on its way; renewed again if the database
        # refused it (the claim is still ours: the error propagates unchanged).
        try:
            result: Finish | None = await holds.end(self.lease, call)
        except BackendUnavailable:
            self._unknown(what)
            raise
        if result is None:
            self._unknown(what)
            raise BackendUnavailable(f"claim {what}() on {claims.table!r}: no answer")
        self._finished = True
        claims._store.untrack(self.lease.owner)
        if result.status is None:
            holds.lose(self.lease, "the row was reclaimed, completed or given back")
            raise StaleToken(f"{claims.table}:{self.id}", self.token, result.current)
        holds.finish(self.lease)
        return result.status

    def _unknown(self, what: str) -> None:
        """No answer to a completing write: it may have landed. Not renewed any more (the
        row is claimed again after its ttl unless it landed), and not finished again."""
        self._finished = True
        self._claims._store.untrack(self.lease.owner)
        self._claims._holds.lose(
            self.lease, f"{what}() got no answer: the row comes back after its ttl unless it landed"
        )
