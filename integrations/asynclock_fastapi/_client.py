"""``FencingAuth``: an httpx auth that sends the current lease's token with every request."""

from __future__ import annotations

from collections.abc import Generator

import asynclock
from asynclock import Lease

try:
    import httpx
except ImportError as exc:  # pragma: no cover - httpx comes with the fastapi extra
    raise ImportError(
        "asynclock_fastapi.FencingAuth needs httpx: pip install 'asynclock[fastapi]'"
    ) from exc

from ._common import DEFAULT_HEADER, check_header_name


class FencingAuth(httpx.Auth):
    """Add the lease's fencing token to each outgoing request: ``Fencing-Token: 42``.

    ::

        async with httpx.AsyncClient(auth=FencingAuth()) as client:   # in a guarded route
            await client.put("http://ledger/invoices/42", json=...)

    Args:
        lease: the lease whose token to send; default: ``asynclock.current_lease()`` at the
            time of each request (the guard's lease inside a guarded route).
        header: the header name (default ``Fencing-Token``).
        check: call ``lease.check()`` first, so a lease known to be lost sends nothing
            (raises ``LeaseLost``). The fence at the service still decides: a request can
            leave in time and arrive late.

    Raises (per request):
        LookupError: no ``lease`` given and no lease is held in this context.
    """

    requires_request_body = False
    requires_response_body = False

    def __init__(
        self, lease: Lease | None = None, *, header: str = DEFAULT_HEADER, check: bool = True
    ) -> None:
        if lease is not None and not isinstance(lease, Lease):
            raise TypeError(f"lease must be an asynclock Lease, not {type(lease).__name__}")
        self.lease = lease
        self.header = check_header_name(header, "FencingAuth header")
        self.check = bool(check)

    def __repr__(self) -> str:
        return f"FencingAuth(lease={self.lease!r}, header={self.header!r})"

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        lease = self.lease if self.lease is not None else asynclock.current_lease()
        if self.check:
            lease.check()
        request.headers[self.header] = str(lease.token)
        yield request
