"""Multi-host URLs parse alike on every Python build (issue 21 item 7).

``urllib.parse.urlsplit("redlock://127.0.0.1:1,[::1]:2")`` raises "Invalid IPv6 URL" on
builds with the bracketed-host check (Debian's 3.11.2) and not on others, so these URLs are
split by ``asynclock.backends._common.urls``. CI runs this file on every Python the package claims.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest

import asynclock
from asynclock._harness.deployment import check_url, join_url
from asynclock._harness.deployment import split_url as split_endpoints
from asynclock.backends._common.urls import Host, parse_multi_host_url, split_url, url_scheme
from asynclock.backends.etcd.driver import EtcdDriver
from asynclock.backends.redis.options import parse_url
from asynclock.backends.redis.redlock import RedlockDriver


@pytest.mark.parametrize(
    "url",
    [
        "redis://u:p@h:1/0?x=1#f",
        "redis://[::1]:6379/2",
        "rediss://h",
        "sqlite:///tmp/locks.db",
        "sqlite:///C:/locks.db?synchronous=full",
        "memory://",
        " REDIS://h",
        "/tmp/locks.db",
        "1x:y",
        "//host/path",
        "localhost:6379",
        "unix:///run/redis.sock?db=1",
        "postgresql://u:p%2Fw@[::1]:5432/db?mode=lease",
        "",
    ],
)
def test_single_host_urls_split_as_urlsplit_does(url: str) -> None:
    parts, expected = split_url(url), urlsplit(url)
    assert (parts.scheme, parts.authority, parts.path, parts.query, parts.fragment) == (
        expected.scheme,
        expected.netloc,
        expected.path,
        expected.query,
        expected.fragment,
    )


@pytest.mark.parametrize(
    ("url", "hosts"),
    [
        ("redlock://127.0.0.1:1,[::1]:2", [("127.0.0.1", 1), ("::1", 2)]),
        ("redlock://[::1]:1,127.0.0.1:2", [("::1", 1), ("127.0.0.1", 2)]),
        (
            "etcd://h1,h2:2380, [2001:db8::7] ,h3:",
            [("h1", None), ("h2", 2380), ("2001:db8::7", None), ("h3", None)],
        ),
        ("redlock://[::ffff:127.0.0.1]:7", [("::ffff:127.0.0.1", 7)]),
        ("etcd://localhost", [("localhost", None)]),
        ("redlock:///0", []),
    ],
)  # fmt: skip
def test_host_lists(url: str, hosts: list[tuple[str, int | None]]) -> None:
    parts = parse_multi_host_url(url)
    assert [(h.host, h.port) for h in parts.hosts] == hosts
    assert parts.userinfo is None and parts.username is None and parts.password is None


def test_userinfo_path_query_fragment() -> None:
    parts = parse_multi_host_url("REDLOCK://al%40ice:pa[ss]@w:rd@h1:1,[::1]:2/3?tls=1&x=%2F#frag")
    assert parts.scheme == "redlock"
    assert parts.userinfo == "al%40ice:pa[ss]@w:rd"  # up to the last "@"; no host in there
    assert (parts.username, parts.password) == ("al@ice", "pa[ss]@w:rd")
    assert parts.hosts == (Host("h1", 1), Host("::1", 2))
    assert (parts.path, parts.query, parts.fragment) == ("/3", "tls=1&x=%2F", "frag")
    assert parse_multi_host_url("etcd://user@h").password is None
    assert [h.address(6379) for h in parts.hosts] == ["h1:1", "[::1]:2"]
    assert Host("::1", None).address() == "[::1]" and Host("h", None).address(9) == "h:9"
    assert url_scheme("Redlock://127.0.0.1:1,[::1]:2") == "redlock"


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("redlock://h1,,h2", r"redlock:// URL has an empty host in its host list; write host"),
        ("redlock://h1,", "empty host"),
        ("etcd://[::1:2379", r"'\[::1:2379' has '\[' without '\]'"),
        ("etcd://[::1]2379", r"'2379' after \[::1\] is not a :port"),
        ("etcd://[127.0.0.1]:2379", r"\[127.0.0.1\] is not an IPv6 address"),
        ("etcd://[h1]", r"\[h1\] is not an IPv6 address"),
        ("redlock://::1:6379", r"'::1:6379' looks like an IPv6 address; put it in brackets"),
        ("redlock://h]1:6379", r"stray bracket in 'h\]1:6379'"),
        ("redlock://h1:63a9", r"the port of 'h1:63a9' is not a number"),
        ("redlock://h1:٣", r"the port of 'h1:٣' is not a number"),
        ("redlock://h1:70000", r"the port of 'h1:70000' must be 1 to 65535"),
        ("redlock://h1:0", "must be 1 to 65535"),
        ("redlock://:6379", r"':6379' has no host name before the port"),
    ],
)  # fmt: skip
def test_bad_host_lists_say_what_is_wrong(url: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse_multi_host_url(url)


def test_a_password_that_ended_the_host_part_early_is_not_quoted() -> None:
    # An unencoded "/" ends the authority: the host list would be "user:se" and the rest
    # of the password the path. The message must quote neither.
    for url in ("etcd://user:Qv9/x7:Zk@h1:2379", "redlock://user:Qv9?x7:Zk@h1,h2"):
        with pytest.raises(ValueError, match="percent-encode it") as info:
            parse_multi_host_url(url)
        assert "Qv9" not in str(info.value) and "Zk" not in str(info.value)


def test_connect_builds_multi_host_drivers() -> None:
    """connect() reads the scheme and each driver its host list without urlsplit (no I/O)."""
    redlock = asynclock.connect("redlock://127.0.0.1:1,[::1]:2?node_timeout=0.5").driver
    assert isinstance(redlock, RedlockDriver)
    assert redlock.display == "redlock://127.0.0.1:1,[::1]:2/0"
    nodes, display, ours = parse_url("redlock://u:p@h1,[::1]:2/3?tls=yes&node_timeout=1")
    assert [node.url for node in nodes] == ["rediss://u:p@h1:6379/3", "rediss://u:p@[::1]:2/3"]
    assert (display, ours) == ("redlock://u@h1:6379,[::1]:2/3", {"node_timeout": "1"})
    with pytest.raises(ValueError, match="needs at least one host"):
        parse_url("redlock:///0")
    with pytest.raises(ValueError, match="are the same Redis server"):
        asynclock.connect("redlock://127.0.0.1:6379,[::ffff:127.0.0.1]:6379")
    etcd = asynclock.connect("etcd://u:pa%5Bss%5D@127.0.0.1,[::1]:2380").driver
    assert isinstance(etcd, EtcdDriver)
    assert etcd.display == "etcd://127.0.0.1:2379,[::1]:2380"
    with pytest.raises(ValueError, match=r"etcd:// URL: the port of 'h:x' is not a number"):
        asynclock.connect("etcd://h1,h:x")
    with pytest.raises(ValueError, match="needs at least one host"):
        asynclock.connect("etcd://")


def test_the_drill_reads_host_lists_too() -> None:
    url = "redlock://u:p@127.0.0.1:1,[::1]:2/0?x=1"
    assert check_url(url, ("kill",), False) == "redlock"
    scheme, auth, endpoints, rest = split_endpoints(url)
    assert (scheme, auth, endpoints, rest) == (
        "redlock",
        "u:p@",
        [("127.0.0.1", 1), ("::1", 2)],
        "/0?x=1",
    )
    assert join_url(scheme, auth, endpoints, rest) == url
    with pytest.raises(ValueError, match=r"10\.1\.2\.3 is not a loopback address"):
        check_url("redlock://127.0.0.1:1,10.1.2.3:2,[::1]:3", ("pause",), False)


@pytest.mark.parametrize(
    "url",
    [
        "redis://:Qv9[x]s3cr3t@127.0.0.1:6379/0",
        "rediss://user:Qv9]s3cr3t@127.0.0.1:6379/0",
        "redlock://:Qv9[s3cr3t@127.0.0.1:1,127.0.0.2:2",
        "postgresql://locker:Qv9[x]s3cr3t@127.0.0.1:5432/db",
        "etcd://root:Qv9[x]s3cr3t@127.0.0.1:2379",
    ],
)
def test_a_raw_bracket_in_a_password_is_told_to_percent_encode_on_every_backend(url: str) -> None:
    """Issue 21 item 6, on every URL backend: a raw '[' or ']' in the user info made the
    URL parser quote part of the password ("'x]s3cr3t' does not appear to be an IPv4 or
    IPv6 address") or say "Invalid IPv6 URL". Now: percent-encode, and nothing quoted."""
    with pytest.raises(ValueError, match="percent-encode") as caught:
        asynclock.connect(url)
    assert "s3cr3t" not in str(caught.value) and "Qv9" not in str(caught.value)


@pytest.mark.parametrize(
    "url",
    ["Redlock://h1,[::1]:2", "  redis://x", "\tre\ndis://x", "1x:y", "a/b:c", "no-scheme",
     "", "rediss+sentinel://s/m", "sqlite:///p", "x:", ":x", "a.b-c+d://h"],
)  # fmt: skip
def test_connect_reads_the_scheme_as_the_url_splitter_does(url: str) -> None:
    """``connect()`` reads a URL's scheme itself (the core needs only that); the backends'
    splitter reads the whole URL: they agree on every kind of text."""
    from asynclock._core.connect import url_scheme as core_scheme

    assert core_scheme(url) == url_scheme(url)
