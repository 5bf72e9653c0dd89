"""Backend drivers, one module each. Use :func:`asynclock.connect` to pick one by URL.

To write a driver of your own, subclass :class:`Driver` and implement its atomic
primitives; the core does timing, renewal, retries and cancellation. Pass it to
:class:`asynclock.Backend` directly: ``async with asynclock.Backend(MyDriver()) as b:``.
"""

from .._core.driver import Busy, Driver, ExtendResult, LeaseRef, Record, Refused

__all__ = ("Busy", "Driver", "ExtendResult", "LeaseRef", "Record", "Refused")
