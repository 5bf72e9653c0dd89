"""Every backend declares its options once, and an unknown one fails the same way on each:
a URL option is a ValueError (configuration text), a keyword a TypeError (a call argument),
both naming the scheme, the option(s) and what is allowed. No I/O: connect() only."""

from __future__ import annotations

import re
import urllib.parse
from typing import Any

import pytest

import asynclock
from asynclock.backends._common import urls
from asynclock.backends.redis import options as redis_options

URLS = {
    "memory": "memory://",
    "sqlite": "sqlite:///x.db",
    "redis": "redis://h:6379/0",
    "rediss": "rediss://h:6379/0",
    "unix": "unix:///tmp/r.sock",
    "redlock": "redlock://a,b,c",
    "postgresql": "postgresql://u@h/db",
    "etcd": "etcd://h:2379",
    "zookeeper": "zookeeper://h:2181",
}


@pytest.mark.parametrize("scheme", [s for s in URLS if s != "memory"])
def test_an_unknown_url_option_is_the_same_value_error_everywhere(scheme: str) -> None:
    url = URLS[scheme]
    with pytest.raises(ValueError) as one:
        asynclock.connect(f"{url}?colour=red")
    assert re.fullmatch(rf"unknown {scheme}:// URL option 'colour'; allowed: .+", str(one.value))
    with pytest.raises(ValueError) as two:
        asynclock.connect(f"{url}?colour=red&size=9")
    assert str(two.value).startswith(f"unknown {scheme}:// URL options 'colour', 'size'; allowed")


@pytest.mark.parametrize("scheme", list(URLS))
def test_an_unknown_keyword_is_the_same_type_error_everywhere(scheme: str) -> None:
    with pytest.raises(TypeError) as one:
        asynclock.connect(URLS[scheme], colour="red")
    tail = "memory:// takes no options" if scheme == "memory" else "allowed: .+"
    assert re.fullmatch(rf"unknown {scheme}:// option 'colour'; {tail}", str(one.value))
    with pytest.raises(TypeError, match=rf"unknown {scheme}:// options 'colour', 'size'"):
        asynclock.connect(URLS[scheme], colour="red", size=9)


def test_allowed_lists_the_declared_options() -> None:
    with pytest.raises(ValueError, match=r"allowed: synchronous, busy_timeout$"):
        asynclock.connect("sqlite:///x.db?journal=off")
    with pytest.raises(TypeError, match=r"allowed: prefix, timeout, tls, ca, cert, key"):
        asynclock.connect("etcd://h", journal="off")
    with pytest.raises(ValueError, match=r"or a custom setting 'prefix\.name'$"):
        asynclock.connect("postgresql://u@h/db?journal=off")


def test_a_redis_url_is_split_once_per_connect(monkeypatch: pytest.MonkeyPatch) -> None:
    """connect() reads the scheme without splitting the URL, the driver the rest (one
    split); nothing else of ours splits it again (urllib's urlsplit runs only in
    redis-py, once per node, when it builds the node's connection pool)."""
    calls: list[str] = []
    original = urls.split_url

    def counted(url: str) -> urls.URLParts:
        calls.append(url)
        return original(url)

    split = urllib.parse.urlsplit
    urlsplits: list[str] = []

    def urlsplit(url: str, *args: Any, **kwargs: Any) -> Any:
        urlsplits.append(url)
        return split(url, *args, **kwargs)

    monkeypatch.setattr(urls, "split_url", counted)
    monkeypatch.setattr(redis_options, "split_url", counted)
    monkeypatch.setattr(urllib.parse, "urlsplit", urlsplit)
    for url, nodes in (
        ("redis://u:p@h:6380/2?restart_grace=3&client_name=x", 1),
        ("unix:///tmp/r.sock?db=3", 1),
        ("redlock://u:p@a,[::1]:2,c/1?node_timeout=0.5&tls=1", 3),
    ):
        calls.clear()
        urlsplits.clear()
        backend = asynclock.connect(url)
        assert calls == [url], url
        assert len(urlsplits) == nodes, urlsplits
        assert "p@" not in backend.driver.display


def test_a_redis_url_with_two_hosts_points_to_redlock() -> None:
    with pytest.raises(ValueError, match=r"takes one host, got 2; .*use redlock://"):
        asynclock.connect("redis://a:6379,b:6379/0")


def test_node_urls_keep_our_options_from_redis_py() -> None:
    node, ours = redis_options.read_redis_url(
        "redis://bob:s3cret@H:6380/2?restart_grace=3&socket_connect_timeout=0.5&client_name=x",
        {},
    )
    assert node.url == "redis://bob:s3cret@H:6380/2?client_name=x"
    assert (node.display, node.password, node.identity) == (
        "redis://bob@h:6380/2",
        "s3cret",
        "h:6380",
    )
    assert (ours["restart_grace"], ours["connect_timeout"]) == (3.0, 0.5)
