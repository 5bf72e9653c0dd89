"""``zookeeper://h1:2181,h2:2181,h3:2181/chroot`` — locks in a ZooKeeper ensemble
(consensus: ZAB), with kazoo's lock recipe, so kazoo's ``Lock`` and ours exclude each other.

URL: ``zookeeper://[user:password@]host[:port][,host[:port]...][/chroot][?option=value&...]``
(port 2181 by default; the chroot must exist). Options, in the query or as keyword
arguments to :func:`asynclock.connect`:

* ``prefix`` — a znode path prepended to every lock's node (default ``""``: the lock
  ``NAME`` is the node ``/NAME`` under the chroot, exactly kazoo's ``Lock(zk, "/NAME")``);
* ``session_timeout`` — the session timeout to ask for, seconds (default 10.0; the server
  bounds it by its ``minSessionTimeout``/``maxSessionTimeout``, and the driver uses what
  it granted);
* ``timeout`` — deadline of every call to ZooKeeper and of connecting, seconds (default 5.0);
* ``restart_grace`` — after the ensemble's data is new (a fresh ensemble, or one that lost
  its data), no grant until this many seconds after the wipe marker's creation (default:
  the first ttl asked for; 0 turns it off), as Redis's option of that name;
* ``user``/``password`` — digest authentication (also from the URL's user info).

Needs the ``zookeeper`` extra (kazoo). See docs/backends/zookeeper.md for how sessions,
ttls, tokens and partitions behave.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl, unquote

from ..._core.validation import check_seconds
from .._common.asyncio_only import require_asyncio
from .._common.options import Options, check_restart_grace
from .._common.urls import (
    parse_multi_host_url,
    password_spilled,
    refuse_raw_brackets,
    spilled_message,
)
from ._kazoo import Zk
from .driver import ZooKeeperDriver

DEFAULT_PORT = 2181
DEFAULT_TIMEOUT = 5.0
DEFAULT_SESSION_TIMEOUT = 10.0
_OPTIONS = ("prefix", "session_timeout", "timeout", "restart_grace", "user", "password")
#: The options of zookeeper:// (URL query and keywords alike).
OPTIONS = Options("zookeeper", _OPTIONS, _OPTIONS)


def _znode_path(value: str, what: str) -> str:
    """'' or an absolute znode path without a trailing slash."""
    if value in ("", "/"):
        return ""
    if not value.startswith("/") or value.endswith("/") or "//" in value:
        raise ValueError(
            f"zookeeper:// {what} must be an absolute znode path like /locks, got {value!r}"
        )
    return value


def driver_from_url(url: str, **options: Any) -> ZooKeeperDriver:
    require_asyncio("the ZooKeeper backend (zookeeper://)", "the kazoo bridge")
    refuse_raw_brackets(url, "zookeeper")
    try:
        return _driver_from_url(url, options)
    except ValueError:
        if password_spilled(url):
            raise ValueError(spilled_message("zookeeper://")) from None
        raise


def _driver_from_url(url: str, options: dict[str, Any]) -> ZooKeeperDriver:
    parts = parse_multi_host_url(url)
    user: str | None = None
    password: str | None = None
    if parts.userinfo is not None:
        user, password = parts.username, parts.password or ""
    if not parts.hosts:
        raise ValueError(
            "zookeeper:// URL needs at least one host, like zookeeper://127.0.0.1:2181"
        )
    chroot = _znode_path(unquote(parts.path), "chroot (the URL's path)")
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    OPTIONS.check(pairs, options)
    merged: dict[str, Any] = {**dict(pairs), **options}
    prefix = merged.get("prefix", "")
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str, not {type(prefix).__name__}")
    prefix = _znode_path(prefix, "prefix")
    timeout = check_seconds(merged.get("timeout", DEFAULT_TIMEOUT), "timeout", text=True)
    session_timeout = check_seconds(
        merged.get("session_timeout", DEFAULT_SESSION_TIMEOUT), "session_timeout", text=True
    )
    restart_grace = check_restart_grace(merged.get("restart_grace"))
    user = merged.get("user", user)
    password = merged.get("password", password)
    for what, value in (("user", user), ("password", password)):
        if value is not None and not isinstance(value, str):  # never show the value
            raise TypeError(f"zookeeper:// {what} must be a str, not {type(value).__name__}")
    if password is not None and not user:
        raise ValueError("zookeeper:// password given without a user")
    shown = ",".join(h.address(DEFAULT_PORT) for h in parts.hosts)
    display = f"zookeeper://{shown}{chroot}"
    hosts = shown + chroot
    auth = (user, password or "") if user else None

    def factory(on_state: Callable[[str], None]) -> Zk:
        return Zk(hosts, session_timeout=session_timeout, auth=auth, on_state=on_state)

    return ZooKeeperDriver(
        factory,
        prefix=prefix,
        chroot=chroot,
        timeout=timeout,
        display=display,
        secret=password or None,
        restart_grace=restart_grace,
    )


__all__ = ("ZooKeeperDriver", "driver_from_url")
