"""The ``Idempotency-Key`` header: the key in it, and what an idempotent route declares
(its :class:`IdempotencyInfo`, its OpenAPI answers)."""

from __future__ import annotations

from typing import Any

from asynclock.idempotency import MAX_KEY_BYTES

#: Attribute on an idempotent endpoint: its :class:`IdempotencyInfo` (OpenAPI, tools).
IDEMPOTENT_ATTR = "__asynclock_idempotent__"
#: Marker in the header parameter's schema: ``install`` documents the operation's answers.
SCHEMA_MARK = "x-asynclock-idempotency"
#: The longest key in the header: the core's limit (its values are ASCII: one byte each).
MAX_KEY_CHARS = MAX_KEY_BYTES
_ALLOWED_KEY = (
    f"a structured-field string of 1 to {MAX_KEY_CHARS} characters: printable ASCII in "
    'double quotes, \\" and \\\\ escaped (e.g. "8e03978e-40d5"); a bare value of visible '
    "ASCII without quotes or backslashes is taken as it is"
)


class IdempotencyInfo:
    """What ``@locks.idempotent`` does on a route, for OpenAPI and tools."""

    __slots__ = ("header", "keep", "replay_header", "required", "ttl", "wait")

    def __init__(
        self, header: str, replay_header: str, required: bool, ttl: float, keep: float, wait: float
    ) -> None:
        self.header = header
        self.replay_header = replay_header
        self.required = required
        self.ttl = ttl
        self.keep = keep
        self.wait = wait


def parse_key(raw: str) -> str:
    """The key in an ``Idempotency-Key`` header value, or ValueError saying what is allowed.

    The draft makes the value an RFC 8941 structured-field string (``"..."``); clients
    that send the bare key (Stripe's SDKs) are common, so a bare value of visible ASCII
    without quotes or backslashes is taken as it is.
    """
    if len(raw) >= 2 and raw[0] == '"' and raw[-1] == '"':
        chars: list[str] = []
        escaped = False
        for c in raw[1:-1]:
            if escaped:
                if c not in '"\\':
                    raise ValueError(f"\\{c} is not an escape; allowed: {_ALLOWED_KEY}")
                chars.append(c)
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"' or not " " <= c <= "~":
                raise ValueError(f"{c!r} may not appear unescaped; allowed: {_ALLOWED_KEY}")
            else:
                chars.append(c)
        if escaped:
            raise ValueError(f"the value ends inside an escape; allowed: {_ALLOWED_KEY}")
        key = "".join(chars)
    else:
        bad = next((c for c in raw if c in '"\\' or not "!" <= c <= "~"), None)
        if bad is not None:
            raise ValueError(f"{bad!r} is not allowed in a bare key; allowed: {_ALLOWED_KEY}")
        key = raw
    if not 1 <= len(key) <= MAX_KEY_CHARS:
        raise ValueError(f"the key is {len(key)} characters long; allowed: {_ALLOWED_KEY}")
    return key


def idempotency_responses(header: str) -> dict[str, dict[str, Any]]:
    """The OpenAPI answers of an idempotent operation (the draft's, and this library's)."""
    retry = {"Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}}}
    return {
        "400": {
            "description": f"The {header} header is missing (where required), malformed or "
            "sent more than once"
        },
        "409": {
            "description": f"A request with this {header} is still being processed; retry "
            "after Retry-After seconds to get its answer",
            "headers": retry,
        },
        "410": {
            "description": f"The request with this {header} was processed, but its response "
            "was too large to keep and cannot be replayed"
        },
        "422": {
            "description": f"This {header} was used with a different request (method, path, "
            "query or body)"
        },
        "503": {
            "description": "The lock server cannot be reached, or the key's lease was lost "
            "while the request ran; retry after Retry-After seconds",
            "headers": retry,
        },
    }


def idempotency_info(endpoint: object) -> IdempotencyInfo | None:
    """The :class:`IdempotencyInfo` of an idempotent endpoint, else None."""
    info = getattr(endpoint, IDEMPOTENT_ATTR, None)
    return info if isinstance(info, IdempotencyInfo) else None
