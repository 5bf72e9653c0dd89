"""Helpers for your own tests: an in-process backend and a way to make a lease be lost."""

from __future__ import annotations

from typing import Any

from ._core.backend import Backend
from ._core.connect import connect
from ._core.lease import Lease

__all__ = ("force_loss", "memory_backend")


def memory_backend(**options: Any) -> Backend:
    """A fresh ``memory://`` backend: ``async with memory_backend() as backend: ...``."""
    return connect("memory://", **options)


def force_loss(lease: Lease, reason: str = "forced by asynclock.testing") -> None:
    """Make ``lease`` lost right now, as if its renewal had been refused.

    The holder's ``async with`` body is cancelled and the block raises ``LeaseLost`` with
    ``reason``. The server-side lease is left to be released on exit (owner-checked).
    """
    lease._backend._lose(lease, reason)
