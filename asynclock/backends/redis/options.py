"""URL options of the Redis drivers: a ``redis://``, ``rediss://``, ``unix://`` or
``redlock://`` URL and ``connect()``'s keywords, checked and split once per ``connect()``
into one :class:`NodeURL` per server and the driver's own options.

Names are checked by the options declaration every backend uses
(:class:`asynclock.backends._common.options.Options`); values here: the database number, the
timeouts, Redlock's own node timeouts, the key prefix and the restart grace.
"""

from __future__ import annotations

import inspect
import ipaddress
import os.path
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode

from ..._core.validation import check_seconds
from .._common.options import Options, check_restart_grace
from .._common.urls import Host, URLParts, parse_multi_host_url, refuse_raw_brackets, split_url
from .keys import check_prefix

#: RedisDriver's own keyword options (the rest go to redis-py).
REDIS_KEYWORDS = ("socket_timeout", "connect_timeout", "prefix", "fair", "restart_grace")
#: Options of ours a redis:// URL query may carry (the node applies the timeouts).
_REDIS_URL_OWN = ("restart_grace", "socket_timeout", "connect_timeout")
#: RedlockDriver's own keyword options, and those its URL query may carry.
REDLOCK_KEYWORDS = ("node_timeout", "connect_timeout", "prefix", "restart_grace")
_REDLOCK_URL_OWN = (*REDLOCK_KEYWORDS, "tls")

#: What asynclock sets on every Redis connection itself (a URL or option may not).
_MANAGED = {
    "decode_responses": "an option asynclock sets itself: asynclock reads raw bytes "
    "(decode_responses=False)",
}
#: Timeouts a URL query may carry (redis-py's and ours): finite seconds > 0.
_URL_TIMEOUTS = {"socket_timeout", "socket_connect_timeout", "connect_timeout", "node_timeout"}
#: redis-py timeouts a redlock:// URL may not carry, and the option that sets each.
_REDLOCK_OWN = {"socket_timeout": "node_timeout", "socket_connect_timeout": "connect_timeout"}
#: redis-py options that take a string in a URL query, besides its URL parsers' own.
_REDIS_STR_OPTIONS = {
    "client_name",
    "username",
    "password",
    "path",
    "ssl_ca_certs",
    "ssl_ca_path",
    "ssl_cert_reqs",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_password",
    "ssl_ciphers",
}
#: Spellings of this host's loopback address that reach the same server (one socket can
#: listen on all of them, and ``localhost`` resolves to one of them).
_LOOPBACK = {"localhost", "localhost.localdomain", "ip6-localhost", "127.0.0.1", "::1"}
_NO_BRACKETS = "pass password= (and username=) to asynclock.connect()"


@dataclass(frozen=True, slots=True)
class NodeURL:
    """One Redis server's URL, split once: what redis-py gets and what messages show."""

    #: For redis-py: asynclock's own query options removed.
    url: str
    #: ``scheme://user@host:port/db`` (``unix:///path``): no password, no query.
    display: str
    #: The password as given (to keep it out of messages), or "".
    password: str
    #: Which server it reaches, as far as the URL tells: loopback spellings folded into
    #: one, IP addresses canonical, a socket path normalised; the database left out (two
    #: databases of one server are one node).
    identity: str

    @classmethod
    def of(cls, url: str) -> NodeURL:
        """A node URL as given (a driver built directly, not by ``connect()``)."""
        parts = split_url(url)
        return _node(parts, parse_qsl(parts.query, keep_blank_values=True))


def display_url(url: str) -> str:
    """``url`` without its password (and without the query string)."""
    return NodeURL.of(url).display


def _node(parts: URLParts, query: Sequence[tuple[str, str]]) -> NodeURL:
    rest = f"?{urlencode(query)}" if query else ""
    url = f"{parts.scheme}://{parts.authority}{parts.path}{rest}"
    if parts.scheme == "unix":
        userinfo = parts.authority.rpartition("@")[0]
        path = unquote(parts.path)
        identity = "unix:" + os.path.normpath(os.path.abspath(path))
        return NodeURL(url, f"unix://{parts.path}", _password(userinfo), identity)
    split = parse_multi_host_url(parts)
    if len(split.hosts) > 1:
        raise ValueError(
            f"{parts.scheme}:// URL takes one host, got {len(split.hosts)}; for a quorum of "
            "independent servers use redlock://host1:6379,host2:6379,host3:6379"
        )
    host = split.hosts[0] if split.hosts else Host("localhost", None)
    host = Host(host.host.lower(), host.port)
    user = f"{split.username}@" if split.username else ""
    path = parts.path if parts.path not in ("", "/") else "/0"
    display = f"{parts.scheme}://{user}{host.address()}{path}"
    return NodeURL(url, display, split.password or "", _identity(host))


def _password(userinfo: str) -> str:
    return unquote(userinfo.partition(":")[2]) if ":" in userinfo else ""


def _identity(host: Host) -> str:
    name = host.host.rstrip(".")
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        pass
    else:
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        name = ip.compressed
    if name in _LOOPBACK:
        name = "loopback"
    return f"{name}:{host.port or 6379}"


def read_redis_url(url: str, options: dict[str, Any]) -> tuple[NodeURL, dict[str, Any]]:
    """``connect()``'s redis://, rediss:// or unix:// URL and keywords, checked and split:
    (the node, RedisDriver's keyword arguments)."""
    parts = split_url(url)
    refuse_raw_brackets(parts, parts.scheme, _NO_BRACKETS)
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    _check(parts, pairs, options, url_own=_REDIS_URL_OWN, keywords=REDIS_KEYWORDS)
    mine = {*_REDIS_URL_OWN, "socket_connect_timeout"}
    ours: dict[str, Any] = {k: v for k, v in pairs if k in mine}
    if "socket_connect_timeout" in ours:  # redis-py's name for our connect_timeout
        ours.setdefault("connect_timeout", ours.pop("socket_connect_timeout"))
    node = _node(parts, [(k, v) for k, v in pairs if k not in mine])
    ours.update(options)
    for key in ("socket_timeout", "connect_timeout"):
        ours[key] = check_seconds(ours.get(key, 1.0), key, text=True)
    ours["prefix"] = check_prefix(ours.get("prefix", "asynclock:"))
    ours["fair"] = bool(ours.get("fair", True))
    ours["restart_grace"] = check_restart_grace(ours.get("restart_grace"))
    return node, ours


def parse_url(url: str) -> tuple[list[NodeURL], str, dict[str, str]]:
    """A ``redlock://`` URL -> (one node per host, the display without password, the
    driver's own options found in the query)."""
    parts = split_url(url)
    # Not urlsplit: builds with its bracketed-host check refuse "h1:6379,[::1]:6380".
    split = parse_multi_host_url(parts)
    if not split.hosts:
        raise ValueError(
            "redlock:// needs at least one host: redlock://host1:6379,host2:6379,host3:6379"
        )
    refuse_raw_brackets(parts, "redlock", _NO_BRACKETS)
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    _check(parts, pairs, {}, url_own=_REDLOCK_URL_OWN, keywords=REDLOCK_KEYWORDS)
    query = {k: v for k, v in pairs if v}  # an empty value is no option (as redis-py reads it)
    tls = query.pop("tls", "").lower() in ("1", "true", "yes", "on")
    ours = {k: query.pop(k) for k in list(query) if k in REDLOCK_KEYWORDS}  # not redis-py's
    scheme = "rediss" if tls else "redis"
    db = parts.path.strip("/") or "0"
    rest = f"?{urlencode(query)}" if query else ""
    userinfo = f"{split.userinfo}@" if split.userinfo else ""
    user = f"{split.username}@" if split.username else ""
    password = split.password or ""
    nodes = []
    for host in split.hosts:
        address = host.address(6379)
        nodes.append(
            NodeURL(
                f"{scheme}://{userinfo}{address}/{db}{rest}",
                f"{scheme}://{user}{address}/{db}",
                password,
                _identity(Host(host.host.lower(), host.port)),
            )
        )
    shown = ",".join(host.address(6379) for host in split.hosts)
    return nodes, f"redlock://{user}{shown}/{db}", ours


def read_redlock_options(options: dict[str, Any]) -> dict[str, Any]:
    """``connect()``'s keywords for a redlock:// URL, checked (names and values)."""
    _check(URLParts("redlock", "", "", "", ""), [], options, url_own=(), keywords=REDLOCK_KEYWORDS)
    for key in ("node_timeout", "connect_timeout"):
        if key in options:
            options[key] = check_seconds(options[key], key, text=True)
    check_prefix(options.get("prefix", "asynclock:"))
    return options


def check_distinct(nodes: Sequence[NodeURL]) -> None:
    """Refuse a node given twice (before any I/O): it would count twice toward the quorum,
    so two clients could both reach "a quorum" at once (G1)."""
    seen: dict[str, int] = {}
    for i, node in enumerate(nodes):
        first = seen.setdefault(node.identity, i)
        if first != i:
            raise ValueError(
                f"redlock:// nodes {first + 1} and {i + 1} ({_shown(nodes[first])} and "
                f"{_shown(node)}) are the same Redis server; every node must be a distinct "
                "server, or one server's vote counts twice toward the quorum"
            )


def _shown(node: NodeURL) -> str:
    """A node as a message names it: its address (a socket's path), nothing else."""
    if node.display.startswith("unix://"):
        return node.display
    return node.display.partition("://")[2].rpartition("@")[2].partition("/")[0]


def _check(
    parts: URLParts,
    pairs: Sequence[tuple[str, str]],
    options: dict[str, Any],
    *,
    url_own: Sequence[str],
    keywords: Sequence[str],
) -> None:
    """Refuse a Redis URL or option that would only fail at open (or be ignored): a
    non-integer database, an unknown option, one that asynclock sets itself, a bad
    timeout. For ``connect()``, so a configuration error is a ValueError there, never
    "unavailable"."""
    from redis.asyncio.connection import URL_QUERY_ARGUMENT_PARSERS

    scheme = parts.scheme
    if scheme in ("redis", "rediss", "redlock"):
        db = unquote(parts.path).strip("/")
        if db and not db.isdigit():
            raise ValueError(
                f"the {scheme}:// URL path is the database number "
                f"({scheme}://host:6379/0), got {db!r}"
            )
    declared = Options(
        scheme,
        {*URL_QUERY_ARGUMENT_PARSERS, *_REDIS_STR_OPTIONS, *url_own},
        _redis_keywords(scheme) | set(keywords),
        managed=_MANAGED,
    )
    declared.check(pairs, options)
    for key, value in pairs:
        if key == "db" and not value.isdigit():
            raise ValueError(f"{scheme}:// URL option db must be an integer, got {value!r}")
        if scheme == "redlock" and key in _REDLOCK_OWN:
            raise ValueError(f"redlock:// sets each node's {key} itself: use {_REDLOCK_OWN[key]}")
        if key in _URL_TIMEOUTS:
            try:
                check_seconds(value, key, text=True)
            except ValueError as exc:
                raise ValueError(f"{scheme}:// URL option {exc}") from None


def _redis_keywords(scheme: str) -> set[str]:
    """The keyword arguments redis-py's connection pool and connections accept."""
    from redis.asyncio import connection as rc

    cls = {"rediss": rc.SSLConnection, "unix": rc.UnixDomainSocketConnection}.get(
        scheme, rc.Connection
    )
    names = {"connection_class", "max_connections"}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None:
            names |= set(inspect.signature(init).parameters)
    return names - {"self", "args", "kwargs", *_MANAGED}
