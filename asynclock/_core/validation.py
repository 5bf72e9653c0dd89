"""Argument checks shared by every backend: say what was wrong and what is allowed."""

from __future__ import annotations

import math

MAX_NAME_BYTES = 512
#: Lock names that start with this are asynclock's own (idempotency keys live under
#: ``"\x00asynclock.idempotency:"``): ``lock()``, ``acquire()`` and ``leadership()``
#: refuse them, so no user lock can ever share a name with one.
RESERVED_PREFIX = "\x00asynclock."
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


def check_not_reserved(name: str) -> str:
    """``name`` (already checked), unless it is in asynclock's own namespace."""
    if name.startswith(RESERVED_PREFIX):
        raise ValueError(
            f"lock name {name[:40]!r} starts with {RESERVED_PREFIX!r}, which asynclock keeps "
            "for its own records (idempotency keys); use any other name"
        )
    return name


def _number(what: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number of seconds, not {type(value).__name__}")
    f = float(value)
    if math.isnan(f):
        raise ValueError(f"{what} must be a number of seconds, not NaN")
    return f


#: The drift and margin :func:`asynclock.connect` uses unless told otherwise.
DEFAULT_DRIFT, DEFAULT_MARGIN = 0.01, 0.005


def check_seconds(
    value: object,
    what: str,
    *,
    zero: bool = False,
    lease: bool = False,
    text: bool = False,
    drift: float = DEFAULT_DRIFT,
    margin: float = DEFAULT_MARGIN,
) -> float:
    """``value`` as seconds, or a ``TypeError``/``ValueError`` that names ``what`` and says
    what is allowed: every seconds option of asynclock and its integrations is checked by
    this one function, where it is declared.

    A finite number > 0 (``zero=True``: >= 0); ``text=True`` also takes a str of one (a URL
    query option). ``lease=True``: a lease's ttl, which is also at most
    :data:`asynclock.MAX_TTL` and long enough to leave time after ``drift`` and ``margin``
    (a backend's, by default those of :func:`asynclock.connect`).
    """
    if text and isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"{what} must be a number of seconds, got {value!r}") from None
    f = _number(what, value)
    if not (0 <= f < math.inf) or (f == 0 and not zero):
        bound = ">= 0" if zero else "> 0"
        raise ValueError(f"{what} must be a finite number of seconds {bound}, got {value!r}")
    if lease:
        if f > MAX_TTL:
            raise ValueError(
                f"{what} must be at most {MAX_TTL:g} seconds (7 days), got {value!r}; the "
                "lease is renewed every ttl/3 while held, so hold as long as you like with a "
                "short ttl (bound the hold with max_hold)"
            )
        if f * (1 - drift) - margin <= 0:
            raise no_time_left(what, f, drift, margin)
    return f


def no_time_left(what: str, ttl: float, drift: float, margin: float) -> ValueError:
    """The error for a ttl that leaves no time after ``drift`` and ``margin`` (G3)."""
    return ValueError(
        f"{what}={ttl:g}s leaves no time after drift ({drift:.0%}) and margin "
        f"({margin:g}s); use a ttl of at least {2 * margin + 0.001:g}s"
    )


def check_ttl(ttl: object, *, what: str = "ttl") -> float:
    return check_seconds(ttl, what)


def check_lease_ttl(ttl: object) -> float:
    """A lease's ttl: what the server is asked to keep the lease for (at most MAX_TTL);
    the drift/margin minimum is the backend's, checked at acquire."""
    return check_seconds(ttl, "ttl", lease=True, drift=0.0, margin=0.0)


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


def check_timing(drift: float, margin: float, heartbeat: float, release_timeout: float) -> None:
    """The timing options of :class:`asynclock.Backend`."""
    if not (0 <= drift < 0.5):
        raise ValueError(f"drift must be a fraction in [0, 0.5), got {drift!r}")
    if not (0 <= margin < math.inf):
        raise ValueError(f"margin must be a finite number of seconds >= 0, got {margin!r}")
    if not (0 < heartbeat < 1):
        raise ValueError(f"heartbeat must be a fraction of ttl in (0, 1), got {heartbeat!r}")
    check_ttl(release_timeout, what="release_timeout")


def check_scope(scope: object) -> str:
    if not isinstance(scope, str):
        raise TypeError(f"token_scope must be a str or None, not {type(scope).__name__}")
    try:
        return check_name(scope)
    except ValueError as exc:
        raise ValueError(f"token_scope: {exc} (it is validated like a lock name)") from None


def check_lock_args(
    name: object,
    ttl: object,
    timeout: object,
    blocking: object,
    max_hold: object,
    *,
    internal: bool = False,
) -> tuple[str, float, float | None, bool, float | None]:
    """The arguments of ``lock()``/``acquire()`` checked: (name, ttl, timeout, blocking,
    max_hold); ``internal``: a name in asynclock's own namespace is allowed (an idempotency
    key's hold)."""
    # Fast path for the usual call, `backend.lock(name, ttl=...)` (made on every hold).
    if (
        type(name) is str
        and 0 < len(name) <= MAX_NAME_BYTES // 4
        and name.isascii()
        and name[0] != "\x00"  # RESERVED_PREFIX: the slow path decides
        and (type(ttl) is float or type(ttl) is int)
        and 0 < ttl <= MAX_TTL
        and timeout is None
        and blocking is True
        and max_hold is None
    ):
        return name, float(ttl), None, True, None
    name = check_name(name)
    if not internal:
        check_not_reserved(name)
    ttl_f = check_lease_ttl(ttl)
    timeout_f = check_timeout(timeout)
    if not isinstance(blocking, bool):
        raise TypeError(f"blocking must be True or False, not {type(blocking).__name__}")
    if not blocking and timeout_f is not None:
        raise ValueError("timeout only applies to blocking=True; pass one or the other")
    hold = None if max_hold is None else check_ttl(max_hold, what="max_hold")
    return name, ttl_f, timeout_f, blocking, hold
