"""The resource side: read the writer's fencing token from a request header (G8 over HTTP).

The token is only half of the fence; the other half is the check *atomic with the write*,
which the existing fences do (``asynclock.fence.SQLFence`` in the write's transaction,
``RedisFence`` in one Lua call). A stale token raises ``StaleToken``, which the handler
:func:`asynclock_fastapi.install` adds turns into 412 Precondition Failed.
"""

from __future__ import annotations

import inspect
from typing import Annotated, Any

from fastapi import Header, HTTPException, Request

from ._locks import DEFAULT_HEADER, check_header_name

#: Fencing tokens are positive 64-bit ints (they fit SQL BIGINT and Redis INCR).
MAX_TOKEN = 2**63 - 1


class FencingToken:
    """Dependency: the request's fencing token, an int from header ``header``.

    ``token: int = Depends(fencing_token)`` reads ``Fencing-Token``;
    ``Depends(FencingToken("X-Fence"))`` reads another header. Answers, before your
    endpoint runs: **428** when the header is missing, **400** when it is not one positive
    integer (saying what is allowed). The header shows in the route's OpenAPI parameters.
    """

    def __init__(self, header: str = DEFAULT_HEADER) -> None:
        self.header = check_header_name(header, "FencingToken header")
        description = f"fencing token of the writer's lease (a positive integer up to {MAX_TOKEN})"
        annotation = Annotated[str | None, Header(alias=self.header, description=description)]
        # FastAPI reads a dependency's parameters from its signature: declare the header
        # (for validation-free reading and the OpenAPI docs) under this instance's name.
        self.__signature__ = inspect.Signature(
            [
                inspect.Parameter("request", inspect.Parameter.KEYWORD_ONLY, annotation=Request),
                inspect.Parameter(
                    "value", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation
                ),
            ],
            return_annotation=int,
        )

    def __repr__(self) -> str:
        return f"FencingToken({self.header!r})"

    async def __call__(self, request: Request, value: Any = None) -> int:
        return self.parse(request.headers.getlist(self.header))

    def parse(self, values: list[str]) -> int:
        """The token from the header's values, or HTTPException 428/400."""
        if not values:
            raise HTTPException(
                428,
                detail=f"this write is fenced: send the writer's lease token in the "
                f"{self.header} header (a positive integer)",
            )
        if len(values) > 1:
            raise HTTPException(
                400, detail=f"{self.header} header given {len(values)} times; send it once"
            )
        raw = values[0].strip()
        if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= MAX_TOKEN:
            shown = raw if len(raw) <= 40 else raw[:40] + "..."
            raise HTTPException(
                400,
                detail=f"malformed {self.header} header {shown!r}: it must be one positive "
                f"integer (decimal digits, 1 to {MAX_TOKEN})",
            )
        return int(raw)


#: ``token: int = Depends(fencing_token)``: the ``Fencing-Token`` header as an int.
fencing_token = FencingToken()


def fence_responses(header: str = DEFAULT_HEADER) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI responses of a fenced route (``install`` adds them; or pass to responses=)."""
    return {
        400: {"description": f"Malformed {header} header: it must be one positive integer"},
        412: {
            "description": f"Precondition Failed: the {header} is older than the newest token "
            "this resource accepted (a stale writer); nothing was written"
        },
        428: {"description": f"Precondition Required: the {header} header is missing"},
    }
