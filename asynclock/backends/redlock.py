"""``redlock://host1:port,host2:port,…``: see :mod:`asynclock.backends.redis.redlock`.

Kept so ``asynclock.backends.redlock`` (and ``connect("redlock://…")``) import as before.
"""

from .redis.redlock import RedlockDriver, driver_from_url, parse_url

__all__ = ("RedlockDriver", "driver_from_url", "parse_url")
