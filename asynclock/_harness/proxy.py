"""A TCP proxy on loopback that the drill puts between one worker and one lock server.

Each :class:`Proxy` listens on a free 127.0.0.1 port and forwards every connection to its
upstream. Its :attr:`Proxy.mode` is switched while it runs: ``"pass"`` forwards at once,
``"latency"`` holds every chunk :attr:`Proxy.delay` seconds first, ``"blackhole"`` forwards
nothing in either direction (connections stay open, like a partition that drops packets;
what was sent arrives after :meth:`Proxy.heal`, like TCP retransmits after the partition).
It never connects anywhere but its upstream.
"""

from __future__ import annotations

import contextlib

import anyio
import anyio.abc

from .servers import free_port

MODES = ("pass", "latency", "blackhole")
CHUNK = 65536


class Proxy:
    """Forward 127.0.0.1:``port`` to ``upstream`` (host, port), switchably."""

    def __init__(self, upstream: tuple[str, int], port: int | None = None) -> None:
        self.upstream = upstream
        self.port = port or free_port()
        self.mode = "pass"
        self.delay = 0.0
        self._changed = anyio.Event()
        self._tg: anyio.abc.TaskGroup | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set_mode(self, mode: str, delay: float = 0.0) -> None:
        if mode not in MODES:
            raise ValueError(f"proxy mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode, self.delay = mode, delay
        self._changed.set()
        self._changed = anyio.Event()

    def heal(self) -> None:
        self.set_mode("pass")

    async def _pump(self, src: anyio.abc.ByteStream, dst: anyio.abc.ByteStream) -> None:
        with contextlib.suppress(
            anyio.EndOfStream, anyio.BrokenResourceError, OSError, anyio.ClosedResourceError
        ):
            while True:
                chunk = await src.receive(CHUNK)
                while self.mode == "blackhole":
                    await self._changed.wait()
                if self.mode == "latency" and self.delay > 0:
                    await anyio.sleep(self.delay)
                await dst.send(chunk)
        with contextlib.suppress(Exception):
            await dst.aclose()

    async def _handle(self, client: anyio.abc.SocketStream) -> None:
        async with client:
            try:
                upstream = await anyio.connect_tcp(*self.upstream)
            except OSError:
                return  # the server is down: the client sees its connection close
            async with upstream, anyio.create_task_group() as tg:
                tg.start_soon(self._pump, client, upstream)
                tg.start_soon(self._pump, upstream, client)

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Accept and forward until cancelled (start with ``tg.start(proxy.serve)``)."""
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=self.port)
        async with listener:
            task_status.started()
            await listener.serve(self._handle)
