"""The URLs of Redis as people deploy it: ``redis+sentinel://`` (a primary behind Sentinel)
and ``redis+cluster://`` (Redis Cluster), checked and split once per ``connect()``.

* ``redis+sentinel://[user:password@]s1:26379,s2:26379,s3:26379/<service_name>[/<db>]``;
  also Lettuce's ``redis-sentinel://[user:password@]s1:26379,…[/<db>]#<service_name>``.
  ``user:password`` are the data nodes' (the primary's); the sentinels' own are the
  options ``sentinel_username`` and ``sentinel_password``.
* ``redis+cluster://[user:password@]n1:6379,n2:6379,…`` (the seed nodes; database 0 only,
  as Redis Cluster has no other).

Options (URL query or ``connect()`` keyword), besides the ``redis://`` ones
(``socket_timeout``, ``connect_timeout``, ``prefix``, ``fair``, ``restart_grace``):
``wait_replicas`` (``WAIT N`` after every grant and renewal; default 0: off) and
``wait_timeout`` (seconds, default 1.0). TLS is not supported on these schemes yet (a
clear ``ValueError``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlencode

from ..._core.validation import check_seconds
from .._common.options import check_restart_grace
from .._common.urls import Host, URLParts, parse_multi_host_url, refuse_raw_brackets, split_url
from .keys import check_prefix
from .options import NodeURL, _check, _identity
from .replication import Wait

#: The schemes, and what each deploys.
SENTINEL_SCHEMES = ("redis+sentinel", "redis-sentinel")
CLUSTER_SCHEMES = ("redis+cluster",)
#: Options of ours these URLs' queries (and ``connect()``) may carry.
DEPLOY_KEYWORDS = (
    "socket_timeout",
    "connect_timeout",
    "prefix",
    "fair",
    "restart_grace",
    "wait_replicas",
    "wait_timeout",
)
SENTINEL_KEYWORDS = (*DEPLOY_KEYWORDS, "sentinel_username", "sentinel_password")
_DEFAULT_PORT = {"sentinel": 26379, "cluster": 6379}
_TLS_OPTIONS = ("ssl", "ssl_")
_NO_TLS = (
    "TLS is not supported on {scheme}:// yet; for TLS use rediss:// to one server, or "
    "reach the deployment over a private network (or a TLS tunnel)"
)


@dataclass(frozen=True, slots=True)
class Deployment:
    """A ``redis+sentinel://`` or ``redis+cluster://`` URL, split: where to start (the
    sentinels or the cluster's seed nodes), how to reach a data node found there, and the
    driver's own options."""

    kind: str  # "sentinel" or "cluster"
    #: The sentinels (or seed nodes) as given.
    seeds: tuple[NodeURL, ...]
    #: ``redis+sentinel://user@s1:26379,s2:26379/mymaster/0``: no password, no query.
    display: str
    #: The Sentinel service (master) name; "" for a cluster.
    service: str = ""
    db: int = 0
    #: The data nodes' user info as written (percent-encoded), or "".
    userinfo: str = ""
    username: str = ""
    password: str = ""
    #: redis-py options for the data nodes' connections (URL query, as text).
    query: tuple[tuple[str, str], ...] = ()
    #: The driver's keyword arguments (checked).
    options: dict[str, Any] = field(default_factory=dict)

    def node(self, host: str, port: int) -> NodeURL:
        """The data node at ``host:port`` (a primary a sentinel named, a cluster node)."""
        address = Host(host, port).address()
        auth = f"{self.userinfo}@" if self.userinfo else ""
        rest = f"?{urlencode(self.query)}" if self.query else ""
        role = "primary" if self.kind == "sentinel" else "node"
        return NodeURL(
            f"redis://{auth}{address}/{self.db}{rest}",
            f"{self.display} ({role} {address})",
            self.password,
            _identity(Host(host.lower(), port)),
        )


def read_deployment_url(url: str, options: dict[str, Any]) -> Deployment:
    """``connect()``'s ``redis+sentinel://`` or ``redis+cluster://`` URL and keywords,
    checked before any I/O (ValueError/TypeError that say what is allowed)."""
    parts = split_url(url)
    scheme = parts.scheme
    kind = "sentinel" if scheme in SENTINEL_SCHEMES else "cluster"
    if scheme.startswith("rediss"):
        raise ValueError(_NO_TLS.format(scheme=scheme))
    refuse_raw_brackets(parts, scheme, "pass password= (and username=) to asynclock.connect()")
    split = parse_multi_host_url(parts)
    what = "sentinel" if kind == "sentinel" else "cluster node"
    usage = (
        f"{scheme}://s1:26379,s2:26379,s3:26379/<service_name>[/<db>]"
        if kind == "sentinel"
        else f"{scheme}://node1:6379,node2:6379,node3:6379"
    )
    if not split.hosts:
        raise ValueError(f"{scheme}:// needs at least one {what}: {usage}")
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    keywords = SENTINEL_KEYWORDS if kind == "sentinel" else DEPLOY_KEYWORDS
    for key, _ in [*pairs, *((k, "") for k in options)]:
        if key.startswith(_TLS_OPTIONS):
            raise ValueError(_NO_TLS.format(scheme=scheme))
    _check(URLParts(scheme, "", "", "", ""), pairs, options, url_own=keywords, keywords=keywords)
    service, db = _service_and_db(parts, kind, scheme, usage)
    ours: dict[str, Any] = {k: v for k, v in pairs if k in keywords}
    if "socket_connect_timeout" in dict(pairs):  # redis-py's name for connect_timeout
        ours.setdefault("connect_timeout", dict(pairs)["socket_connect_timeout"])
    query = tuple((k, v) for k, v in pairs if k not in keywords and k != "socket_connect_timeout")
    ours.update(options)
    redis_options = {k: ours.pop(k) for k in list(ours) if k not in keywords}
    checked = _checked(ours, kind)
    checked.update(redis_options)
    port = _DEFAULT_PORT[kind]
    user = f"{split.username}@" if split.username else ""
    shown = ",".join(h.address(port) for h in split.hosts)
    tail = f"/{quote(service, safe='')}/{db}" if kind == "sentinel" else ""
    dep = Deployment(
        kind,
        (),
        f"{scheme}://{user}{shown}{tail}",
        service,
        db,
        split.userinfo or "",
        split.username or "",
        split.password or "",
        query,
        checked,
    )
    if kind == "cluster":  # the seeds are data nodes
        seeds = tuple(dep.node(h.host, h.port or port) for h in split.hosts)
    else:
        seeds = tuple(_sentinel(h, port, checked) for h in split.hosts)
    check_distinct_seeds(seeds, scheme)
    return replace(dep, seeds=seeds)


def _service_and_db(parts: URLParts, kind: str, scheme: str, usage: str) -> tuple[str, int]:
    segments = [unquote(s) for s in parts.path.split("/") if s]
    if kind == "cluster":
        if segments not in ([], ["0"]):
            raise ValueError(
                f"{scheme}:// has no database number but 0 (Redis Cluster has only database "
                f"0), got path {parts.path!r}: {usage}"
            )
        return "", 0
    if parts.fragment:  # Lettuce: redis-sentinel://host:26379/0#mymaster
        service, db_text = unquote(parts.fragment), segments[0] if segments else "0"
        if len(segments) > 1:
            raise ValueError(f"{scheme}:// with #<service_name> takes only /<db> as its path")
    else:
        if not segments:
            raise ValueError(
                f"{scheme}:// needs the service (master) name the sentinels monitor, as the "
                f"URL's path: {usage}"
            )
        if len(segments) > 2:
            raise ValueError(f"{scheme}:// path is /<service_name>[/<db>], got {parts.path!r}")
        service, db_text = segments[0], segments[1] if len(segments) > 1 else "0"
    if not service:
        raise ValueError(f"{scheme}:// needs the service (master) name: {usage}")
    if not db_text.isdigit():
        raise ValueError(
            f"{scheme}:// database must be a number (/<service_name>/<db>), got {db_text!r}"
        )
    return service, int(db_text)


def _checked(ours: dict[str, Any], kind: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("socket_timeout", "connect_timeout"):
        out[key] = check_seconds(ours.get(key, 1.0), key, text=True)
    out["prefix"] = check_prefix(ours.get("prefix", "asynclock:"))
    fair = ours.get("fair", True)
    out["fair"] = (
        fair.lower() not in ("0", "false", "no", "off") if isinstance(fair, str) else bool(fair)
    )
    out["restart_grace"] = check_restart_grace(ours.get("restart_grace"))
    out["wait"] = Wait.of(ours.get("wait_replicas", 0), ours.get("wait_timeout", 1.0))
    if kind == "sentinel":
        for key in ("sentinel_username", "sentinel_password"):
            value = ours.get(key)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{key} must be a str, got {type(value).__name__}")
            out[key] = value or ""
    return out


def _sentinel(host: Host, port: int, options: dict[str, Any]) -> NodeURL:
    address = host.address(port)
    user, password = options["sentinel_username"], options["sentinel_password"]
    auth = ""
    if user or password:
        auth = f"{quote(user, safe='')}:{quote(password, safe='')}@"
    return NodeURL(
        f"redis://{auth}{address}/0",
        f"sentinel {address}",
        password,
        _identity(Host(host.host.lower(), host.port or port)),
    )


def check_distinct_seeds(seeds: Sequence[NodeURL], scheme: str) -> None:
    """Refuse a sentinel (or seed node) named twice: a typo, and a sentinel's answer would
    count twice."""
    seen: set[str] = set()
    for seed in seeds:
        if seed.identity in seen:
            raise ValueError(f"{scheme}:// names the same host twice ({seed.identity})")
        seen.add(seed.identity)
