"""URLs with a host list (``redlock://h1:6379,[::1]:6380/0``, ``etcd://h1,h2``), split
without :func:`urllib.parse.urlsplit`'s netloc parsing.

Python builds disagree about a netloc with a bracket in it: those with the bracketed-host
check (Debian's patched 3.11.2, later upstream releases) raise "Invalid IPv6 URL" for
``127.0.0.1:1,[::1]:2``, since they read the whole host list as one host; others accept it.
So a URL that may carry several hosts is split here, by RFC 3986's own pattern (which
never raises), and its host list item by item. tests/test_urls.py pins the cases; CI runs
it on every Python the package claims (.ci/run).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from urllib.parse import unquote

#: RFC 3986, appendix B: scheme, authority, path, query, fragment. Matches any string.
_REST = r"(?://([^/?#]*))?([^?#]*)(?:\?([^#]*))?(?:#(.*))?"
_URI = re.compile(r"(?:([^:/?#]+):)?" + _REST, re.DOTALL)
_NO_SCHEME = re.compile(_REST, re.DOTALL)
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")
#: What urlsplit strips from the ends (C0 controls and space) and removes anywhere.
_STRIPPED = "".join(map(chr, range(0x21)))
_REMOVED = str.maketrans("", "", "\t\r\n")


@dataclass(frozen=True, slots=True)
class URLParts:
    """A URL split into its five parts (``authority`` as written: userinfo and hosts)."""

    scheme: str  # lower case; "" if the URL has none
    authority: str
    path: str
    query: str
    fragment: str


def split_url(url: str) -> URLParts:
    """Split ``url`` into its five parts; never raises (any string is a URI reference)."""
    url = url.lstrip(_STRIPPED).translate(_REMOVED)
    match = _URI.fullmatch(url)
    assert match is not None  # the pattern matches every string
    scheme, authority, path, query, fragment = match.groups()
    if scheme is not None and not _SCHEME.fullmatch(scheme):
        # Not a scheme ("1x:y"): the whole text is a reference without one, as urlsplit
        # reads it.
        scheme = None
        again = _NO_SCHEME.fullmatch(url)
        assert again is not None
        authority, path, query, fragment = again.groups()
    return URLParts((scheme or "").lower(), authority or "", path, query or "", fragment or "")


def url_scheme(url: str) -> str:
    """The scheme of ``url``, in lower case ("" if none); never raises."""
    return split_url(url).scheme


@dataclass(frozen=True, slots=True)
class Host:
    """One host of a host list: ``host`` without brackets, ``port`` None if not given."""

    host: str
    port: int | None

    def address(self, default_port: int | None = None) -> str:
        """``host:port`` as written in a URL (an IPv6 address in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        port = self.port if self.port is not None else default_port
        return host if port is None else f"{host}:{port}"


@dataclass(frozen=True, slots=True)
class MultiHostURL:
    """``scheme://[userinfo@]host[:port],host[:port],.../path?query#fragment``."""

    scheme: str
    #: As written (percent-encoded), or None when the URL has no ``@``.
    userinfo: str | None
    hosts: tuple[Host, ...]
    path: str
    query: str
    fragment: str

    @property
    def username(self) -> str | None:
        if self.userinfo is None:
            return None
        return unquote(self.userinfo.partition(":")[0])

    @property
    def password(self) -> str | None:
        if self.userinfo is None or ":" not in self.userinfo:
            return None
        return unquote(self.userinfo.partition(":")[2])


def parse_multi_host_url(url: str | URLParts) -> MultiHostURL:
    """Split a URL whose authority is a comma-separated host list.

    Each host is ``name``, ``name:port``, ``1.2.3.4[:port]`` or ``[IPv6][:port]``; a port
    is 1 to 65535. An empty host list gives ``hosts == ()`` (the caller says what it
    needs). The userinfo ends at the last ``@`` of the authority. Raises ValueError that
    names the scheme and the host at fault, and never quotes the userinfo: if a ``/``,
    ``?`` or ``#`` in a password ended the authority early (so part of the password would
    be in a message), the error says to percent-encode it instead.
    """
    parts = url if isinstance(url, URLParts) else split_url(url)
    label = f"{parts.scheme}://" if parts.scheme else "the"
    userinfo, at, hosts = parts.authority.rpartition("@")
    try:
        parsed = tuple(_host(item.strip(), label) for item in hosts.split(",")) if hosts else ()
    except ValueError:
        if password_spilled(parts):
            raise ValueError(spilled_message(label)) from None
        raise
    return MultiHostURL(
        parts.scheme, userinfo if at else None, parsed, parts.path, parts.query, parts.fragment
    )


def password_spilled(url: str | URLParts) -> bool:
    """Did a ``/``, ``?`` or ``#`` in the userinfo end the authority early (so the rest
    of the password is in the path, query or fragment, where a message would quote it)?"""
    parts = url if isinstance(url, URLParts) else split_url(url)
    return "@" not in parts.authority and "@" in parts.path + parts.query + parts.fragment


def spilled_message(label: str) -> str:
    return (
        f"{label} URL is malformed; if the password has '/', '?' or '#', percent-encode it "
        "(urllib.parse.quote(password, safe='')). The parser's own words are withheld: "
        "they would show part of the password"
    )


def _host(item: str, label: str) -> Host:
    usage = "write host[:port],host[:port],... (an IPv6 address in brackets: [::1]:port)"
    if not item:
        raise ValueError(f"{label} URL has an empty host in its host list; {usage}")
    if item.startswith("["):
        address, closed, rest = item[1:].partition("]")
        if not closed:
            raise ValueError(f"{label} URL: {item!r} has '[' without ']'; {usage}")
        try:
            ipaddress.IPv6Address(address)
        except ValueError:
            raise ValueError(
                f"{label} URL: [{address}] is not an IPv6 address (brackets are for IPv6 "
                "addresses only)"
            ) from None
        if rest and not rest.startswith(":"):
            raise ValueError(f"{label} URL: {rest!r} after [{address}] is not a :port; {usage}")
        return Host(address, _port(rest[1:], item, label) if rest else None)
    if "[" in item or "]" in item:
        raise ValueError(f"{label} URL: stray bracket in {item!r}; {usage}")
    if item.count(":") > 1:
        raise ValueError(
            f"{label} URL: {item!r} looks like an IPv6 address; put it in brackets: "
            "[addr] or [addr]:port"
        )
    host, colon, port_text = item.partition(":")
    if not host:
        raise ValueError(f"{label} URL: {item!r} has no host name before the port; {usage}")
    return Host(host, _port(port_text, item, label) if colon else None)


def _port(text: str, item: str, label: str) -> int | None:
    if not text:
        return None  # "host:" is "host" (as urlsplit reads it)
    if not (text.isascii() and text.isdigit()):
        raise ValueError(f"{label} URL: the port of {item!r} is not a number")
    port = int(text)
    if not 0 < port < 65536:
        raise ValueError(f"{label} URL: the port of {item!r} must be 1 to 65535")
    return port


def refuse_raw_brackets(
    url: str | URLParts,
    scheme: str,
    instead: str = "pass user= and password= to asynclock.connect()",
) -> None:
    """A '[' or ']' in the user info, not percent-encoded: URL parsers read it as the start
    of an IPv6 address ("Invalid IPv6 URL", or "'Qv9' does not appear to be an IPv4 or IPv6
    address", quoting part of the password). Say what to do; quote nothing of it."""
    parts = url if isinstance(url, URLParts) else split_url(url)
    userinfo = parts.authority.rpartition("@")[0]
    if "[" in userinfo or "]" in userinfo:
        raise ValueError(
            f"{scheme}:// URL: the user name or password has '[' or ']', which a URL allows "
            "only percent-encoded ('%5B', '%5D'): percent-encode them "
            f"(urllib.parse.quote(password, safe='')), or {instead} instead of putting them "
            "in the URL"
        )
