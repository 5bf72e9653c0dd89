"""How a backend takes part in the conformance suite."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import asynclock


@dataclass(frozen=True)
class BackendSpec:
    """One backend under test, on a server the test session started.

    ``sabotage(backend, name)`` deletes the live lease of ``name`` behind the holder's back
    using raw server access (not asynclock), so the next renewal is refused.
    ``multiprocess`` says whether separate processes share locks through ``url``.
    """

    id: str
    url: str
    sabotage: Callable[[asynclock.Backend, str], Awaitable[None]]
    multiprocess: bool = True
    options: dict[str, Any] = field(default_factory=dict)

    def connect(self, **extra: Any) -> asynclock.Backend:
        return asynclock.connect(self.url, **{**self.options, **extra})
