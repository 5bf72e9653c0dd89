"""Argument checks shared by every backend: say what was wrong and what is allowed."""

from __future__ import annotations

import math

MAX_NAME_BYTES = 512
#: The longest lease ttl, in seconds (7 days). Every backend can honour it: PostgreSQL's
#: ``idle_session_timeout`` (session mode) is an int of milliseconds (at most ~24.8 days),
#: Redis ``PX`` an int64 of milliseconds, a lease row an interval. A lease is renewed every
#: ttl/3 for as long as it is held, so a long hold never needs a long ttl.
MAX_TTL = 7 * 24 * 3600.0


def check_name(name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(f"lock name must be a str, not {type(name).__name__}")
    if not name:
        raise ValueError("lock name must be a non-empty str (1 to 512 UTF-8 bytes)")
    if len(name) <= MAX_NAME_BYTES // 4 and name.isascii():
        return name  # one byte per character: no need to encode
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"lock name must be encodable as UTF-8, but it has a lone surrogate "
            f"{name[exc.start]!r} at index {exc.start}: use any str of 1 to "
            f"{MAX_NAME_BYTES} UTF-8 bytes without lone surrogates"
        ) from None
    if size > MAX_NAME_BYTES:
        raise ValueError(f"lock name is {size} UTF-8 bytes; at most {MAX_NAME_BYTES} are allowed")
    return name


def _number(what: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number of seconds, not {type(value).__name__}")
    f = float(value)
    if math.isnan(f):
        raise ValueError(f"{what} must be a number of seconds, not NaN")
    return f


def check_ttl(ttl: object, *, what: str = "ttl") -> float:
    f = _number(what, ttl)
    if not (0 < f < math.inf):
        raise ValueError(f"{what} must be a finite number of seconds > 0, got {ttl!r}")
    return f


def check_lease_ttl(ttl: object) -> float:
    """A lease's ttl: what the server is asked to keep the lease for (at most MAX_TTL)."""
    f = check_ttl(ttl)
    if f > MAX_TTL:
        raise ValueError(
            f"ttl must be at most {MAX_TTL:g} seconds (7 days), got {ttl!r}; the lease is "
            "renewed every ttl/3 while held, so hold as long as you like with a short ttl "
            "(bound the hold with max_hold)"
        )
    return f


def check_seconds(value: object, what: str) -> float:
    """A backend's duration option, as a number or (from a URL query) a string: finite, > 0."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"{what} must be a number of seconds, got {value!r}") from None
    return check_ttl(value, what=what)


def check_timeout(timeout: object) -> float | None:
    if timeout is None:
        return None
    f = _number("timeout", timeout)
    if f < 0:
        raise ValueError(
            f"timeout must be None (wait forever) or a number of seconds >= 0, got {timeout!r}"
        )
    return f


def check_token(token: object) -> int:
    if isinstance(token, bool) or not isinstance(token, int):
        raise TypeError(f"fencing token must be an int, not {type(token).__name__}")
    if not (0 < token < 2**63):
        # (A huge int is not shown: printing one of over 4,300 digits raises ValueError.)
        got = str(token) if token.bit_length() <= 64 else f"an int of {token.bit_length()} bits"
        raise ValueError(
            f"fencing token must be a positive 64-bit int (1 to 2**63 - 1, as every "
            f"lease's token is), got {got}"
        )
    return token
