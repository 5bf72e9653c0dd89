"""``serve_stats``: a running process's statistics and advice, for ``asynclock stats`` and
``asynclock advise`` (or ``curl``) in another process.

Opt-in, local only: a Unix socket (``"unix:/run/app/asynclock.sock"``, or any path with a
``/``) or a loopback TCP port (``"127.0.0.1:9181"``, ``"localhost:0"``: a free port). A
host that is not loopback is refused — the endpoint has no authentication, and lock names
and hold times are the application's business. The protocol is the smallest HTTP/1.0 that
``curl`` speaks: ``GET /`` answers the JSON of ``backend.stats()`` and, when collected,
``backend.advice()``; ``GET /advise?name=NAME`` the advice for one name or template. One
request per connection; each connection is bounded (5 s) and served on the backend's loop.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import logging
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

import anyio
import anyio.abc

if TYPE_CHECKING:
    from .._core.backend import Backend

#: Bound on one connection: reading the request and writing the answer (seconds).
CONNECTION_TIMEOUT = 5.0
_MAX_REQUEST = 8192
logger = logging.getLogger("asynclock")


def parse_address(address: str) -> tuple[str, str, int]:
    """``("unix", path, 0)`` or ``("tcp", host, port)`` for an address; ValueError if it is
    neither, or names a host that is not loopback."""
    if not isinstance(address, str) or not address:
        raise TypeError(f"address must be 'unix:/path' or '127.0.0.1:PORT', got {address!r}")
    if address.startswith("unix:"):
        path = address[5:]
        if not path:
            raise ValueError("address 'unix:' needs a path, e.g. 'unix:/run/app/asynclock.sock'")
        return "unix", path, 0
    if "/" in address:
        return "unix", address, 0
    host, sep, port_text = address.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(
            f"address {address!r} is neither a unix socket ('unix:/path') nor HOST:PORT "
            "on loopback ('127.0.0.1:9181', 'localhost:0')"
        )
    host = host.strip("[]") or "127.0.0.1"
    if host != "localhost":
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ValueError(
                f"address {address!r}: only loopback (127.0.0.1, ::1, localhost) or a unix "
                "socket: the stats endpoint has no authentication"
            )
    return "tcp", host, int(port_text)


def document(backend: Backend) -> dict[str, Any]:
    """What ``GET /`` answers."""
    from .._version import __version__

    collecting = backend.advice_collected
    return {
        "asynclock": __version__,
        "backend": backend.driver.display,
        "pid": os.getpid(),
        "stats": dataclasses.asdict(backend.stats()),
        "advice_collected": collecting,
        "advice": [a.as_dict() for a in backend.advice()] if collecting else None,
    }


def _answer(backend: Backend, target: str) -> tuple[int, dict[str, Any]]:
    path = urlsplit(target)
    if path.path in ("/", "/stats"):
        return 200, document(backend)
    if path.path == "/advise":
        names = parse_qs(path.query).get("name")
        if not names or not names[0]:
            return 400, {"error": "GET /advise?name=NAME: give a lock name or template"}
        if not backend.advice_collected:
            return 409, {"error": "advice is not being collected: call backend.collect_advice()"}
        return 200, {"backend": backend.driver.display, **backend.advise(names[0]).as_dict()}
    return 404, {"error": f"no {path.path}: GET / (stats) or GET /advise?name=NAME"}


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 409: "Conflict"}


async def _serve_one(backend: Backend, stream: anyio.abc.ByteStream) -> None:
    async with stream:
        with anyio.move_on_after(CONNECTION_TIMEOUT):
            request = b""
            while b"\n\n" not in request.replace(b"\r\n", b"\n"):
                try:
                    request += await stream.receive(4096)
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    break
                if len(request) > _MAX_REQUEST:
                    break
            line = request.split(b"\n", 1)[0].decode("latin-1").split()
            if len(line) >= 2 and line[0] == "GET":
                status, body = _answer(backend, line[1])
            else:
                status, body = 400, {"error": "send GET / or GET /advise?name=NAME"}
            payload = json.dumps(body).encode()
            head = (
                f"HTTP/1.0 {status} {_REASONS[status]}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
            )
            with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                await stream.send(head.encode() + payload)


@asynccontextmanager
async def serve_stats(backend: Backend, address: str) -> AsyncIterator[str]:
    """Serve ``backend``'s stats and advice at ``address`` while the block runs; yields the
    address bound (with the port chosen for ``":0"``). See the module docstring.

    The endpoint runs in the backend's own task group (the block's exceptions pass through
    unwrapped), and stops when the block ends or the backend closes. A unix socket file
    left by a process that died is replaced; one a live process serves is not (OSError).
    """
    from .._core.backend import Backend

    if not isinstance(backend, Backend):
        raise TypeError(f"serve_stats() takes an asynclock Backend, not {type(backend).__name__}")
    kind, host, port = parse_address(address)
    backend._ready()  # open, on its loop
    listener: anyio.abc.Listener[Any]
    if kind == "unix":
        _refuse_live_socket(host)
        listener = await anyio.create_unix_listener(host)
        bound = f"unix:{host}"
    else:
        tcp = await anyio.create_tcp_listener(local_host=host, local_port=port)
        sock = tcp.extra(anyio.abc.SocketAttribute.raw_socket)
        actual = sock.getsockname()
        shown = f"[{actual[0]}]" if sock.family == socket.AF_INET6 else actual[0]
        listener, bound = tcp, f"{shown}:{actual[1]}"

    async def handle(stream: anyio.abc.ByteStream) -> None:
        try:
            await _serve_one(backend, stream)
        except Exception:  # one bad connection must not stop the endpoint or the backend
            logger.warning("asynclock stats endpoint %s: a request failed", bound, exc_info=True)

    scope = anyio.CancelScope()
    stopped = anyio.Event()

    async def serve() -> None:
        try:
            with scope:
                await listener.serve(handle)
        finally:
            with anyio.CancelScope(shield=True):
                await listener.aclose()
            if kind == "unix":
                with suppress(FileNotFoundError):
                    os.unlink(host)
            stopped.set()

    backend._start_background(serve, f"asynclock stats endpoint {bound}")
    try:
        yield bound
    finally:
        scope.cancel()
        with anyio.CancelScope(shield=True), anyio.move_on_after(CONNECTION_TIMEOUT):
            await stopped.wait()


def _refuse_live_socket(path: str) -> None:
    """OSError if a process serves at ``path`` (binding would silently take its address:
    anyio replaces an existing socket file). A file nobody answers on is left to anyio."""
    import errno
    import stat

    try:
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            return
    except FileNotFoundError:
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        return  # nobody listens: a dead process's file
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, f"{path}: address in use (another process serves there)")


def fetch(address: str, target: str = "/", timeout: float = 5.0) -> tuple[int, Any]:
    """A blocking ``GET target`` from a :func:`serve_stats` endpoint: (status, JSON body).
    OSError if nobody answers there."""
    kind, host, port = parse_address(address)
    if kind == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(host)
        except OSError:
            sock.close()
            raise
    else:
        sock = socket.create_connection((host, port), timeout=timeout)
    with sock:
        sock.sendall(f"GET {target} HTTP/1.0\r\nHost: asynclock\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    parts = head.split(b" ", 2)
    if len(parts) < 2 or not parts[1].isdigit():
        raise OSError(f"{address} did not answer like an asynclock stats endpoint")
    try:
        return int(parts[1]), json.loads(body)
    except ValueError:
        raise OSError(f"{address} answered something that is not JSON") from None
