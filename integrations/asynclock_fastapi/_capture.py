"""An idempotent request's response and body: the response held back until it is stored
(``Capture``), the stored response replayed, an exception answered by the app's handler,
and the request body as its fingerprint sees it."""

from __future__ import annotations

import base64
import hashlib
import inspect
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import Request, Response
from starlette.concurrency import run_in_threadpool

from asynclock import AsynclockError
from asynclock.idempotency import canonical_json

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]


class Capture:
    """One response held back by ``ResponsePhase`` until it is complete and stored.

    ``on_complete`` (the key dependency's) is awaited with the whole response before any
    of it is sent; if it raises, nothing was sent and the error answers instead. If it
    calls :meth:`hold`, the response waits for :meth:`flush` (an answer not stored goes
    out once its key is free, so a retry sent when it arrives runs).
    """

    __slots__ = ("_forward", "_hold", "active", "messages", "on_complete")

    def __init__(self, on_complete: Callable[[Capture], Awaitable[None]]) -> None:
        self.active = True
        self.messages: list[Message] = []
        self.on_complete = on_complete
        self._hold = False
        self._forward: Send | None = None

    def hold(self) -> None:
        """Keep the complete response until :meth:`flush` (called from ``on_complete``)."""
        self._hold = True

    async def flush(self) -> None:
        """Send a response :meth:`hold` kept (nothing if there is none)."""
        forward, self._forward = self._forward, None
        held, self.messages = self.messages, []
        if forward is not None:
            for m in held:
                await forward(m)

    @property
    def status(self) -> int:
        return int(self.messages[0]["status"])

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(bytes(n), bytes(v)) for n, v in self.messages[0].get("headers", ())]

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages[1:])

    async def send(self, message: Message, forward: Send) -> None:
        kind = message["type"]
        if kind not in ("http.response.start", "http.response.body") or message.get("trailers"):
            # A file sent by path, trailers: not a response this can keep. It goes out as
            # it is, and nothing is stored (the key is freed when the request ends).
            self.active = False
            held, self.messages = self.messages, []
            for m in held:
                await forward(m)
            await forward(message)
            return
        self.messages.append(message)
        if kind == "http.response.body" and not message.get("more_body", False):
            self.active = False
            await self.on_complete(self)  # may raise: then nothing was sent
            if self._hold:
                self._forward = forward
                return
            for m in self.messages:
                await forward(m)

    def discard(self) -> None:
        self.active = False
        self.messages = []
        self._forward = None


def replay_response(result: object, replay_header: str) -> Response:
    """The stored response of ``result`` (see ``_stored``), or 410 for one too large."""
    if isinstance(result, dict) and result.get("v") == 1 and "body" in result:
        response = Response(
            content=base64.b64decode(result["body"]), status_code=int(result["status"])
        )
        # Raw, so a header sent twice (Set-Cookie, Link) is replayed twice.
        response.raw_headers.extend(
            (str(n).encode("latin-1"), str(v).encode("latin-1"))
            for n, v in result.get("headers", ())
        )
        response.raw_headers.append((replay_header.lower().encode("latin-1"), b"true"))
        return response
    status = result.get("status") if isinstance(result, dict) else None
    return Response(
        content=json.dumps(
            {
                "detail": "the request with this Idempotency-Key was processed, but its "
                "response was too large to keep, so it cannot be replayed; do not retry it "
                "(send a new key for a new request)",
                "status": status,
            }
        ).encode(),
        status_code=410,
        media_type="application/json",
        headers={replay_header: "true"},
    )


async def render(request: Request, exc: Exception) -> Response | None:
    """The response the app's handler for ``exc`` makes (``HTTPException``, a validation
    error, your own), or None if it has none. asynclock's own errors are not the route's
    outcome (a lost lease, the lock server gone): they are never rendered here."""
    if isinstance(exc, AsynclockError):
        return None
    handlers = request.scope.get("starlette.exception_handlers")
    if not handlers:
        return None
    exception_handlers, status_handlers = handlers
    handler = None
    status = getattr(exc, "status_code", None)
    if isinstance(status, int):
        handler = status_handlers.get(status)
    if handler is None:
        for cls in type(exc).__mro__[:-2]:  # not Exception, BaseException: the server's 500
            if cls in exception_handlers:
                handler = exception_handlers[cls]
                break
    if handler is None:
        return None  # an unexpected error: the server's 500, and the key is freed
    if inspect.iscoroutinefunction(handler):
        response = await handler(request, exc)
    else:
        response = await run_in_threadpool(handler, request, exc)
    return response if isinstance(response, Response) else None


async def body_of(request: Request) -> bytes:
    """The request body as its fingerprint sees it.

    * JSON (``application/json``, ``application/*+json``): its value, as canonical JSON
      (keys sorted, no whitespace, ASCII with ``\\u`` escapes, numbers as Python parses
      them: ``1.50`` is ``1.5``, ``1e2`` is ``100.0``, but ``1`` and ``1.0`` differ), so a
      client that serialises the same value again (other spacing, key order, escapes) sends
      the same request. A body that is not such JSON (unparsable, a duplicate key, NaN,
      nested deeper than ``asynclock.idempotency.MAX_DEPTH``) counts by its bytes.
    * A form FastAPI parsed already (its stream is consumed): its fields, names, values,
      and each upload's name, type and a SHA-256 of its contents (so a multipart body's
      boundary, which a client picks anew for each request, is not part of it, and another
      file is).
    * Anything else: its bytes.
    """
    try:
        raw = await request.body()
    except RuntimeError:
        return await _form_of(request)
    return _canonical(raw) if _is_json(request.headers.get("content-type")) else raw


def _is_json(content_type: str | None) -> bool:
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found = dict(pairs)
    if len(found) != len(pairs):
        raise ValueError("a duplicate key")
    return found


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _canonical(raw: bytes) -> bytes:
    try:
        value = json.loads(raw, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
        return canonical_json(value, "the request body").encode("ascii")
    except (ValueError, TypeError, RecursionError):
        return raw


async def _form_of(request: Request) -> bytes:
    form = await request.form()
    parts: list[list[str | int | None]] = []
    for field, value in form.multi_items():
        if isinstance(value, str):
            parts.append([field, value])
            continue
        digest = hashlib.sha256()
        await value.seek(0)
        while chunk := await value.read(1 << 16):
            digest.update(chunk)
        await value.seek(0)  # the endpoint reads it from the start
        parts.append([field, value.filename, value.content_type, digest.hexdigest()])
    return json.dumps(parts).encode()
