"""Resource-side guards (G8): reject a write whose fencing token is older than the newest seen.

A fence keeps a high-water mark per key *at the protected resource* and checks it
atomically with the write. Equal tokens pass (the same holder writing again); lower ones
raise :class:`~asynclock.StaleToken` and nothing is written.
"""

from .redis import RedisFence
from .sql import SQLFence

__all__ = ("RedisFence", "SQLFence")
