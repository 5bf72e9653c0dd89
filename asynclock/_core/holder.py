"""Who holds a lock right now, as the server sees it (``backend.holder(name)``)."""

from __future__ import annotations

from dataclasses import dataclass

from .owner_label import label_of


@dataclass(frozen=True, slots=True)
class Holder:
    """The live holder of a lock name, as the backend's server sees it at the time of asking.

    A snapshot for operators and dashboards, not a permission: the lease may end the
    moment after. Fence writes with your own lease's token instead.

    Attributes:
        name: the lock name.
        owner: the live lease's owner id (:attr:`asynclock.Lease.owner`), or ``None``
            where the backend cannot know it (PostgreSQL ``mode=session``, a lock held by
            another session).
        token: the live lease's fencing token, or ``None`` where the backend cannot
            know it (as for ``owner``).
        remaining: seconds the lease has left on the server's clock if it is not
            renewed, or ``None`` where the server keeps no expiry (PostgreSQL
            ``mode=session``: the lock lasts as long as the holder's session; a Redis key
            with no expiry, written by something other than asynclock).
        grace_until: set while the server grants nothing because it lost its data a short
            while ago (its restart grace; see :class:`asynclock.RestartGrace`): the end, as
            a Unix time on the server's clock. ``owner`` and ``token`` are then ``None``
            (a holder from before the loss may still be working, unknown to the server)
            and ``remaining`` is the time left of the grace.
        detail: what else the server says of this holder, for operators (a claimed row:
            its table, who claimed it and whether its claim is stuck), or ``None``.
        label: the holder process's owner label (``connect(url, owner_label=...)``,
            default ``host:pid``), read out of ``owner``; ``None`` where ``owner`` is
            ``None`` or carries no label (another client's owner, an asynclock before
            labels). Not escaped: it may hold any printable character, and a server's
            value can be written by anything; escape it before printing it to a terminal.
        kind: what is held: ``"lock"`` (:meth:`asynclock.Backend.holder`), ``"permit"``
            (a semaphore's permit: :meth:`asynclock.Semaphore.holders`), or a read-write
            lock's ``"write"`` (the writer; ``token`` is its writer epoch), ``"read"`` (a
            reader; ``token`` is the epoch it reads) or ``"intent"`` (a writer waiting for
            it: new readers wait behind it; ``token`` is ``None``) from
            :meth:`asynclock.RWLock.holders`.
        slot: a permit's slot (0 .. limit-1; its ``token`` is that slot's), else ``None``.
        limit: a permit's semaphore limit as the server stores it, else ``None``.
    """

    name: str
    owner: str | None
    token: int | None
    remaining: float | None
    grace_until: float | None = None
    detail: str | None = None
    label: str | None = None
    kind: str = "lock"
    slot: int | None = None
    limit: int | None = None

    def __post_init__(self) -> None:
        if self.label is None and self.owner is not None:
            object.__setattr__(self, "label", label_of(self.owner))
