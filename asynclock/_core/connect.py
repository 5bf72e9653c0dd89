"""``asynclock.connect(url)``: map a URL scheme to a backend module, imported lazily."""

from __future__ import annotations

import importlib
import re
import threading
from typing import Any

from .backend import Backend
from .clock import Clock
from .owner_label import check_owner_label

#: scheme -> (module, extra that provides its driver, or None for the core)
SCHEMES: dict[str, tuple[str, str | None]] = {
    "memory": ("asynclock.backends.memory", None),
    "sqlite": ("asynclock.backends.sqlite", None),
    "redis": ("asynclock.backends.redis", "redis"),
    "rediss": ("asynclock.backends.redis", "redis"),
    "unix": ("asynclock.backends.redis", "redis"),
    "redlock": ("asynclock.backends.redis.redlock", "redis"),
    "redis+sentinel": ("asynclock.backends.redis.sentinel", "redis"),
    "redis-sentinel": ("asynclock.backends.redis.sentinel", "redis"),
    "redis+cluster": ("asynclock.backends.redis.cluster", "redis"),
    # Refused with a clear ValueError (TLS is not supported on them yet).
    "rediss+sentinel": ("asynclock.backends.redis.sentinel", "redis"),
    "rediss+cluster": ("asynclock.backends.redis.cluster", "redis"),
    "postgresql": ("asynclock.backends.postgres", "postgres"),
    "postgres": ("asynclock.backends.postgres", "postgres"),
    "etcd": ("asynclock.backends.etcd", "etcd"),
    "zookeeper": ("asynclock.backends.zookeeper", "zookeeper"),
}


#: A URL's scheme (RFC 3986), after what urlsplit strips from the front and removes anywhere.
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
_STRIPPED = "".join(map(chr, range(0x21)))
_REMOVED = str.maketrans("", "", "\t\r\n")


def url_scheme(url: str) -> str:
    """The scheme of ``url``, in lower case ("" if none); never raises. (The backends split
    the rest: ``backends._common.urls``, whose ``url_scheme`` agrees: tests/test_urls.py.)"""
    match = _SCHEME.match(url.lstrip(_STRIPPED).translate(_REMOVED))
    return match.group(1).lower() if match else ""


#: Held while a backend module is imported: two threads connecting at once (a thread pool
#: warming ``redis://`` and ``redlock://``) imported the package and its submodule in
#: opposite orders and one died in an import deadlock (``_DeadlockError``).
_LOADING = threading.Lock()


def _load(module_name: str) -> Any:
    """The backend module, its package imported first (one order for every thread)."""
    with _LOADING:
        package = ".".join(module_name.split(".")[:3])  # asynclock.backends.<backend>
        importlib.import_module(package)
        return importlib.import_module(module_name)


def connect(
    url: str,
    *,
    clock: Clock | None = None,
    drift: float = 0.01,
    margin: float = 0.005,
    heartbeat: float = 1 / 3,
    release_timeout: float = 5.0,
    owner_label: str | None = None,
    **options: Any,
) -> Backend:
    """Create a backend for ``url``; use it as ``async with connect(url) as backend:``.

    Schemes: ``memory://``, ``sqlite:///path/to/file``, ``redis://``, ``rediss://``,
    ``unix://``, ``redlock://h1,h2,h3``, ``redis+sentinel://s1,s2,s3/service``,
    ``redis+cluster://n1,n2,n3``, ``postgresql://``, ``etcd://h1:2379,h2:2379``,
    ``zookeeper://h1:2181,h2:2181/chroot``.
    Extra keyword ``options`` go to the backend's driver (see its docs).

    ``owner_label`` (default ``host:pid``, like kazoo's lock identifier) is what this
    process calls itself: 1 to 100 bytes of UTF-8, printable (no control characters), else
    ``ValueError``. It travels in the owner every lease stores at the server, so another
    process reads it back as :attr:`Holder.label` (``asynclock holder``, ``list`` and
    ``watch`` show it), spans carry it as ``asynclock.owner_label`` and ``LockHeld`` names
    it where the busy answer says who holds (memory, SQLite, PostgreSQL ``mode=lease``).
    PostgreSQL ``mode=session`` cannot show another session's label (an advisory lock
    stores no value): ``Holder.label`` is None there, as ``Holder.owner`` is.
    """
    if not isinstance(url, str):
        raise TypeError(f"url must be a str like 'sqlite:///locks.db', not {type(url).__name__}")
    scheme = url_scheme(url)  # not urlsplit: some builds refuse a host list with [::1]
    if scheme not in SCHEMES:
        allowed = ", ".join(f"{s}://" for s in SCHEMES)
        shown = f"{scheme!r}" if scheme else "none"
        raise ValueError(f"unknown backend URL scheme {shown} in the URL; allowed: {allowed}")
    module_name, extra = SCHEMES[scheme]
    try:
        module = _load(module_name)
    except ModuleNotFoundError as exc:
        if extra is not None and not (exc.name or "").startswith("asynclock"):
            raise ModuleNotFoundError(
                f"the {scheme}:// backend needs the {exc.name!r} package: "
                f'pip install "asynclock[{extra}]"',
                name=exc.name,
            ) from exc
        raise
    label = check_owner_label(owner_label)  # before the driver opens anything
    driver = module.driver_from_url(url, **options)
    return Backend(
        driver,
        clock=clock,
        drift=drift,
        margin=margin,
        heartbeat=heartbeat,
        release_timeout=release_timeout,
        owner_label=label,
    )
