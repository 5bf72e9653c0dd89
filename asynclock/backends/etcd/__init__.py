"""``etcd://h1:2379,h2:2379,h3:2379`` — locks in an etcd v3 cluster (consensus: a
partitioned minority stops instead of answering wrongly).

URL: ``etcd://[user:password@]host[:port][,host[:port]...][/][?option=value&...]``
(port 2379 by default). Options, in the query or as keyword arguments to
:func:`asynclock.connect`:

* ``prefix`` — prepended to every lock name (default ``""``: the lock ``NAME`` uses keys
  ``NAME/<lease>``, exactly like ``etcdctl lock NAME``, so the two exclude each other);
* ``timeout`` — deadline of every call to etcd, seconds (default 3.0);
* ``tls`` — ``true`` to use TLS with the system's CAs (implied by ``ca``/``cert``);
  ``ca`` (CA bundle file), ``cert`` and ``key`` (client certificate and key files),
  ``server_name`` (the name to check the server certificate against);
* ``user``/``password`` — etcd authentication (also from the URL's user info).

See docs/backends/etcd.md for how leases, ttls and partitions behave.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from ..._core.backend import Backend
from ..._core.lease import Lease
from ..._core.validation import check_seconds
from .._common.asyncio_only import require_asyncio
from .._common.options import Options
from .._common.urls import (
    parse_multi_host_url,
    password_spilled,
    refuse_raw_brackets,
    spilled_message,
)
from ._session import requested_ttl
from .client import TLS, Endpoints, EtcdClient
from .driver import EtcdDriver

DEFAULT_PORT = 2379
DEFAULT_TIMEOUT = 3.0
_OPTIONS = ("prefix", "timeout", "tls", "ca", "cert", "key", "server_name", "user", "password")
#: The options of etcd:// (URL query and keywords alike).
OPTIONS = Options("etcd", _OPTIONS, _OPTIONS)


def _flag(value: object, what: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{what} must be true or false, got {value!r}")


def _read(path: object, what: str) -> bytes:
    if not isinstance(path, (str, Path)):
        raise TypeError(f"{what} must be a file path, not {type(path).__name__}")
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{what}: cannot read {str(path)!r}: {exc.strerror}") from None


def driver_from_url(url: str, **options: Any) -> EtcdDriver:
    require_asyncio("the etcd backend (etcd://)", "grpc.aio")
    refuse_raw_brackets(url, "etcd")
    try:
        return _driver_from_url(url, options)
    except ValueError:
        if password_spilled(url):
            raise ValueError(spilled_message("etcd://")) from None
        raise


def _driver_from_url(url: str, options: dict[str, Any]) -> EtcdDriver:
    # Not urlsplit: builds with its bracketed-host check refuse "h1:2379,[::1]:2379".
    parts = parse_multi_host_url(url)
    user: str | None = None
    password: str | None = None
    if parts.userinfo is not None:
        user, password = parts.username, parts.password or ""
    if not parts.hosts:
        raise ValueError("etcd:// URL needs at least one host, like etcd://127.0.0.1:2379")
    if parts.path not in ("", "/"):
        raise ValueError(
            f"etcd:// URL takes no path (got {parts.path!r}); use ?prefix=... to namespace locks"
        )
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    OPTIONS.check(pairs, options)
    merged: dict[str, Any] = {**dict(pairs), **options}
    prefix = merged.get("prefix", "")
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str, not {type(prefix).__name__}")
    timeout = check_seconds(merged.get("timeout", DEFAULT_TIMEOUT), "timeout", text=True)
    user = merged.get("user", user)
    password = merged.get("password", password)
    for what, value in (("user", user), ("password", password)):
        if value is not None and not isinstance(value, str):  # never show the value
            raise TypeError(f"etcd:// {what} must be a str, not {type(value).__name__}")
    if password is not None and not user:
        raise ValueError("etcd:// password given without a user")
    tls: TLS | None = None
    if any(k in merged for k in ("ca", "cert", "key")) or _flag(merged.get("tls", False), "tls"):
        if ("cert" in merged) != ("key" in merged):
            raise ValueError("etcd:// client TLS needs both cert and key (files), or neither")
        tls = TLS(
            ca=_read(merged["ca"], "ca") if "ca" in merged else None,
            cert=_read(merged["cert"], "cert") if "cert" in merged else None,
            key=_read(merged["key"], "key") if "key" in merged else None,
            server_name=merged.get("server_name") or None,
        )
    hosts = [(h.host, DEFAULT_PORT if h.port is None else h.port) for h in parts.hosts]
    shown = ",".join(h.address(DEFAULT_PORT) for h in parts.hosts)
    endpoints = Endpoints(hosts, tls=tls, user=user or None, password=password)
    display = f"etcd://{shown}"
    client = EtcdClient(endpoints, timeout=timeout, display=display)
    return EtcdDriver(client, prefix=prefix, display=display)


def granted_ttl(backend: Backend, lease: Lease) -> int | None:
    """Whole seconds etcd granted the session lease behind ``lease`` (``None`` if it is not
    held on this etcd backend). The local deadline still follows ``lease.ttl``."""
    driver = backend.driver
    if not isinstance(driver, EtcdDriver):
        return None
    return driver.granted_ttl(lease.owner)


__all__ = ("EtcdDriver", "driver_from_url", "granted_ttl", "requested_ttl")
