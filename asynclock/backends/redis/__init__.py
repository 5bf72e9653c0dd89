"""``redis://`` and ``redlock://``: the Redis drivers (see :mod:`.single` and :mod:`.redlock`).

The package is laid out as ``scripts`` (the Lua), ``wire`` (the connection), ``shared``
(what both drivers use), ``single`` (:class:`RedisDriver`) and ``redlock``
(:class:`RedlockDriver`). Exported here: what users and operators call: the two drivers,
``driver_from_url``, and the key names a lock uses (``keys_for``, ``epoch_key``).
"""

import redis as _redis  # a missing driver library fails here, named, even when re-imported

from .keys import epoch_key, keys_for
from .redlock import RedlockDriver
from .single import RedisDriver, driver_from_url

del _redis

__all__ = ("RedisDriver", "RedlockDriver", "driver_from_url", "epoch_key", "keys_for")
