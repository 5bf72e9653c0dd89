"""``redis://``, ``redlock://``, ``redis+sentinel://`` and ``redis+cluster://``: the Redis
drivers (see :mod:`.single`, :mod:`.redlock`, :mod:`.sentinel` and :mod:`.cluster`).

The package is laid out as ``scripts`` (the Lua), ``wire`` (the connection), ``single``
(:class:`RedisDriver`), ``redlock`` (:class:`RedlockDriver`), and for Redis as people deploy
it ``routed`` (a driver per primary), ``sentinel`` (:class:`SentinelDriver`), ``cluster``
(:class:`ClusterDriver`) and ``replication`` (``wait_replicas``). Exported here: what users
and operators call: the drivers, ``driver_from_url``, the key names a lock uses
(``keys_for``, ``epoch_key``) and :class:`NotReplicated`.
"""

import redis as _redis  # a missing driver library fails here, named, even when re-imported

from .cluster import ClusterDriver
from .keys import epoch_key, keys_for
from .redlock import RedlockDriver
from .replication import NotReplicated
from .sentinel import SentinelDriver
from .single import RedisDriver, driver_from_url

del _redis

__all__ = (
    "ClusterDriver",
    "NotReplicated",
    "RedisDriver",
    "RedlockDriver",
    "SentinelDriver",
    "driver_from_url",
    "epoch_key",
    "keys_for",
)
