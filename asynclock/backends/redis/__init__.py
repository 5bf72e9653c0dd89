"""``redis://`` and ``redlock://``: the Redis drivers (see :mod:`.single` and :mod:`.redlock`).

The package is laid out as ``scripts`` (the Lua), ``wire`` (the connection), ``shared``
(what both drivers use), ``single`` (:class:`RedisDriver`) and ``redlock``
(:class:`RedlockDriver`); the names below stay importable from here as before.
"""

import redis as _redis  # a missing driver library fails here, named, even when re-imported

from .scripts import (
    ACQUIRE,
    JOIN_QUEUE,
    NO_QUEUE,
    REDLOCK_ACQUIRE,
    REDLOCK_RELEASE,
    RELEASE,
    RESPECT_QUEUE,
    SCRIPTS,
    SHAS,
)
from .shared import epoch_key, keys_for, scope_fence_key
from .single import RedisDriver, driver_from_url
from .wire import Deadlines, display_url, pack

del _redis

__all__ = (
    "ACQUIRE",
    "JOIN_QUEUE",
    "NO_QUEUE",
    "REDLOCK_ACQUIRE",
    "REDLOCK_RELEASE",
    "RELEASE",
    "RESPECT_QUEUE",
    "SCRIPTS",
    "SHAS",
    "Deadlines",
    "RedisDriver",
    "display_url",
    "driver_from_url",
    "epoch_key",
    "keys_for",
    "pack",
    "scope_fence_key",
)
