"""Leader election over the lock machinery (etcd's ``concurrency.Election`` beside its Mutex).

A term is a lease like any other: its token is a fencing token, its holder's work is
cancelled when it is lost (G3, G4), and a successor's token is larger (G2). What a lock
does not have is an *identity* others can read: it travels in the owner string the
server stores (``<owner id>.<identity as UTF-8 hex>``, hex so that every driver stores it
as it stores any owner), and :meth:`Backend.leader` reads it back through
:meth:`Driver.holder`.
"""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio

from .context import LEASES, ExcInfo, enter_body, leave_body, refuse_nested
from .exceptions import AsynclockError, BackendUnavailable, LeaseLost
from .misuse import AsyncContextOnly, refuse_sync_iteration
from .validation import MAX_TTL, check_lease_ttl, check_name, check_not_reserved

if TYPE_CHECKING:
    from .acquisition import Acquisition
    from .driver import Driver
    from .lease import Lease

#: The separator between the owner id (hex) and the encoded identity.
IDENTITY_MARK = "."
MAX_IDENTITY_BYTES = 200
#: First wait before re-campaigning after a lost term; doubles per loss in a row (up to
#: the ttl).
BACKOFF_START = 0.05
#: Doublings after which the backoff is past any ttl (``BACKOFF_START * 2**25 > MAX_TTL``):
#: the exponent stops there, so a long run of lost terms never overflows a float.
MAX_DOUBLINGS = 25
assert BACKOFF_START * 2**MAX_DOUBLINGS > MAX_TTL


@dataclass(frozen=True, slots=True)
class Leader:
    """Who leads ``name`` right now, as the server sees it.

    ``identity`` is the leader's identity, or None when the name is held by a plain lock
    (not through :meth:`Backend.leadership`).
    """

    identity: str | None
    token: int


def default_identity() -> str:
    """``host:pid``: tells an operator which process leads."""
    return f"{socket.gethostname()}:{os.getpid()}"


def check_identity(identity: object) -> str:
    if identity is None:
        return default_identity()
    if not isinstance(identity, str):
        raise TypeError(f"identity must be a str or None, not {type(identity).__name__}")
    size = len(identity.encode("utf-8", "surrogatepass"))
    if not 0 < size <= MAX_IDENTITY_BYTES:
        raise ValueError(
            f"identity must be 1 to {MAX_IDENTITY_BYTES} UTF-8 bytes, got {size} bytes"
        )
    return identity


def owner_tag(identity: str) -> str:
    return IDENTITY_MARK + identity.encode("utf-8", "surrogatepass").hex()


def identity_of(owner: str) -> str | None:
    """The identity encoded in an owner string, or None for a plain lock's owner."""
    _, mark, encoded = owner.partition(IDENTITY_MARK)
    if not mark:
        return None
    try:
        return bytes.fromhex(encoded).decode("utf-8", "surrogatepass")
    except ValueError:
        return None


class Term(AsyncContextOnly):
    """One term of leadership: elected until its lease is lost or released.

    ``lease`` is the term's lease (its ``token`` fences the leader's writes). In
    ``async for term in backend.leadership(...)``, guard the body with ``async with term:``:
    the body is cancelled when the term is lost, the term is released when the block
    exits, and the loop campaigns again.
    """

    __slots__ = ("_quiet", "_scope", "identity", "lease")
    _usage = "term"
    #: What it says of itself in ``AlreadyHeld`` (``context.refuse_nested``).
    kind = "leadership"

    def __init__(self, lease: Lease, identity: str, *, quiet: bool) -> None:
        self.lease = lease
        self.identity = identity
        self._quiet = quiet
        self._scope: anyio.CancelScope | None = None

    @property
    def name(self) -> str:
        return self.lease.name

    @property
    def token(self) -> int:
        return self.lease.token

    def __repr__(self) -> str:
        return f"<Term {self.name!r} identity={self.identity!r} token={self.token}>"

    async def __aenter__(self) -> Term:
        if self._scope is not None:
            raise RuntimeError("this term is already entered")
        lease = self.lease
        if lease.released:
            raise RuntimeError("this term has ended; campaign again for a new one")
        scope = anyio.CancelScope()
        task = lease._grantor.current_task()  # a hold of this task (AlreadyHeld)
        try:
            # A term lost before its body begins: the body never runs (LeaseLost), or, in
            # `async for` (quiet), starts cancelled and the loop campaigns again.
            enter_body(self, lease, task, scope, LEASES.get(), start_cancelled=self._quiet)
        except LeaseLost as exc:
            await lease._grantor.release(lease, quiet=True)
            raise LeaseLost(lease.name, lease.token, lease.lost.reason or exc.reason) from None
        self._scope = scope
        return self

    async def __aexit__(self, *exc_info: *ExcInfo) -> bool:
        lease, scope = self.lease, self._scope
        assert scope is not None, "Term.__aexit__ without __aenter__"
        leave_body(self)
        self._scope = None
        try:
            swallowed = bool(scope.__exit__(*exc_info))
        finally:
            await lease._grantor.release(lease, quiet=True)
        if lease.lost.reason is not None and (swallowed or exc_info[0] is None):
            if self._quiet:
                return True  # the loop campaigns again; the loss was logged by the backend
            raise LeaseLost(lease.name, lease.token, lease.lost.reason) from None
        return swallowed


class Leadership(AsyncContextOnly):
    """``async with backend.leadership(name, ttl=...) as term`` or ``async for term in ...``.

    See :meth:`Backend.leadership`.
    """

    __slots__ = ("_acq", "_identity", "_losses", "_name", "_term", "_ttl")
    _usage = "backend.leadership(...)"

    def __init__(self, acq: Acquisition, name: str, ttl: float, identity: str | None) -> None:
        self._acq = acq
        self._name = check_not_reserved(check_name(name))
        self._ttl = check_lease_ttl(ttl)  # as lock() does: the term is a lease
        self._identity = check_identity(identity)
        self._term: Term | None = None
        self._losses = 0

    @property
    def name(self) -> str:
        return self._name

    @property
    def identity(self) -> str:
        return self._identity

    def __repr__(self) -> str:
        return f"<Leadership {self._name!r} identity={self._identity!r} ttl={self._ttl:g}>"

    async def _campaign(self, *, quiet: bool) -> Term:
        """Wait until elected (blocking acquire: the waiter sleeps until a release)."""
        stack = LEASES.get()
        if stack:  # campaigning inside this task's own hold of the name would never win
            refuse_nested(self._acq, self._name, stack, self._acq.current_task())
        lease = await self._acq.acquire(
            self._name, self._ttl, None, True, None, owner_tag(self._identity)
        )
        return Term(lease, self._identity, quiet=quiet)

    # -- one term ---------------------------------------------------------------------------

    async def __aenter__(self) -> Term:
        if self._term is not None:
            raise RuntimeError("this leadership is already entered; make one per `async with`")
        term = await self._campaign(quiet=False)
        await term.__aenter__()
        self._term = term
        return term

    async def __aexit__(self, *exc_info: *ExcInfo) -> bool:
        term, self._term = self._term, None
        assert term is not None, "Leadership.__aexit__ without __aenter__"
        return await term.__aexit__(*exc_info)

    # -- terms, one after another ------------------------------------------------------------

    def __aiter__(self) -> Leadership:
        return self

    if not TYPE_CHECKING:

        def __iter__(self):
            raise refuse_sync_iteration(self._usage)

    async def __anext__(self) -> Term:
        previous, self._term = self._term, None
        if previous is not None:
            lease = previous.lease
            if previous._scope is None and not lease.released:
                # The body did not guard the term with `async with term:`: end it now.
                await self._acq.release(lease, quiet=True)
            if lease.lost.reason is not None:
                self._losses += 1
                if self._acq.clock.now() - lease.acquired_at >= 2 * self._ttl:
                    self._losses = 1  # a long term: this loss starts a new series
                # Back off before campaigning again, so a flapping leader (a loaded
                # machine, a flaky network) does not hammer the server.
                doublings = min(self._losses - 1, MAX_DOUBLINGS)
                delay = min(self._ttl, BACKOFF_START * 2**doublings)
                await anyio.sleep(delay * (0.5 + random.random() / 2))
            else:
                self._losses = 0
        term = await self._campaign(quiet=True)
        self._term = term
        return term


async def find_leader(driver: Driver, name: str) -> Leader | None:
    """:meth:`Backend.leader` once the backend is open and ``name`` checked: the holder,
    with the identity read out of its owner string."""
    if not driver.tells_owner:
        raise NotImplementedError(
            f"{driver.display} does not store a lock's owner at the server, so it cannot "
            "tell who holds or leads a name"
        )
    try:
        found = await driver.holder(name)
    except (AsynclockError, NotImplementedError):
        raise
    except Exception as exc:
        raise BackendUnavailable(f"{driver.display}: leader failed: {exc!r}") from exc
    if found is None or found.owner is None or found.token is None:
        return None  # free, or held by something that is not an asynclock lease
    return Leader(identity_of(found.owner), found.token)
