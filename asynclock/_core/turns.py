"""A process's own line of waiters per name, first come first served, for drivers whose
server keeps no queue of its own (PostgreSQL) or keeps one entry per process (etcd's key
per name), and for the memory driver.

Only the head of a name's line asks the server; the others wait behind it without asking
and are woken one at a time: when the head leaves (granted or gone), the driver wakes the
next one (``wake(name, head)``), never every waiter of the name. A release therefore
costs the same whether 10 or 10,000 tasks of the process wait for the name (issue 45:
no thundering herd). Every operation is O(1): the line is an ordered dict (membership,
removal anywhere and the head without walking it).
"""

from __future__ import annotations

from collections import OrderedDict

#: How long a task behind the head of its line sleeps between attempts: it is woken when
#: its turn comes (``Turns.leave`` names it), so this only bounds a wake-up that got lost.
LINE_POLL = 10.0


class Turns:
    """Lines of waiting owners, one per name (see the module docstring)."""

    __slots__ = ("_lines",)

    def __init__(self) -> None:
        self._lines: dict[str, OrderedDict[str, None]] = {}

    def __bool__(self) -> bool:
        return bool(self._lines)

    def __len__(self) -> int:
        """How many names have a line."""
        return len(self._lines)

    def waiting(self, name: str) -> int:
        """How many owners wait in ``name``'s line."""
        line = self._lines.get(name)
        return 0 if line is None else len(line)

    def head(self, name: str) -> str | None:
        """The owner whose turn it is (first in line), or None if nobody waits."""
        line = self._lines.get(name)
        return None if line is None else next(iter(line))

    def second(self, name: str) -> str | None:
        """The owner right behind the head of ``name``'s line (next when the head leaves)."""
        line = self._lines.get(name)
        if line is None or len(line) < 2:
            return None
        it = iter(line)
        next(it)
        return next(it)

    def behind(self, name: str, owner: str) -> bool:
        """True if someone else is first in ``name``'s line (``owner`` must wait)."""
        line = self._lines.get(name)
        return line is not None and next(iter(line)) != owner

    def join(self, name: str, owner: str) -> None:
        """``owner`` waits for ``name`` (at the end of the line; kept where it is if in it)."""
        line = self._lines.get(name)
        if line is None:
            self._lines[name] = OrderedDict({owner: None})
        elif owner not in line:
            line[owner] = None

    def leave(self, name: str, owner: str) -> str | None:
        """``owner`` leaves ``name``'s line. Returns the owner first in line now if
        ``owner`` was first (the driver wakes it: its turn came), else None."""
        line = self._lines.get(name)
        if line is None or owner not in line:
            return None
        was_head = next(iter(line)) == owner
        del line[owner]
        if not line:
            del self._lines[name]
            return None
        return next(iter(line)) if was_head else None
