"""The sentinels of one service: where its primary is, and word the moment it moves.

Every sentinel reachable is asked at once. :meth:`Sentinels.resolve` asks each for the
service (``SENTINEL MASTER``) and takes the address with the highest ``config-epoch`` (a
failover raises it; a sentinel that has not heard of the latest failover answers with an
older one). :meth:`Sentinels.poll` asks ``SENTINEL get-master-addr-by-name`` (the driver
does it on every renewal round) and says whether any sentinel names another primary. One
pub/sub connection per sentinel carries ``+switch-master``: the announcement, about a
second after the promotion, while the old primary can stay a writable master for about ten
more (until Sentinel's next INFO round demotes it).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import anyio

from ..._core.exceptions import BackendUnavailable
from .deployments import Deployment
from .fanout import Fanout
from .pubsub import Listener
from .wire import Node, pack

logger = logging.getLogger("asynclock.redis")

SWITCH = "+switch-master"


def _pairs(reply: Any) -> dict[str, str]:
    """A flat ``[field, value, …]`` reply as a dict of text."""
    items = [x.decode(errors="replace") if isinstance(x, bytes) else str(x) for x in reply]
    return dict(zip(items[::2], items[1::2], strict=False))


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class Sentinels:
    """The sentinels of ``dep`` (see the module docstring). ``on_switch(address)`` runs for
    each ``+switch-master`` of the service; ``on_missed()`` when a sentinel's pub/sub
    connection came back (an announcement may have been missed)."""

    def __init__(
        self,
        dep: Deployment,
        on_switch: Callable[[str], None],
        on_missed: Callable[[], None],
    ) -> None:
        self.dep = dep
        self.service = dep.service
        self.timeout: float = dep.options["socket_timeout"]
        self.nodes = [
            Node(
                url,
                socket_timeout=self.timeout,
                connect_timeout=dep.options["connect_timeout"],
                options={},
            )
            for url in dep.seeds
        ]
        self.fan = Fanout(self.nodes)
        self.on_switch = on_switch
        self.on_missed = on_missed
        self.listeners = [
            Listener(n, self._on_message, _nothing, self._on_resumed) for n in self.nodes
        ]
        for listener in self.listeners:
            listener.wanted.add(SWITCH)

    async def run(self) -> None:
        """Listen for ``+switch-master`` on every sentinel until cancelled."""
        async with anyio.create_task_group() as tg:
            for listener in self.listeners:
                listener.keep_connected()
                tg.start_soon(listener.run)

    def _on_message(self, channel: str, payload: bytes) -> None:
        words = payload.decode(errors="replace").split()
        if channel == SWITCH and len(words) == 5 and words[0] == self.service:
            self.on_switch(
                f"{words[3]}:{words[4]}" if ":" not in words[3] else f"[{words[3]}]:{words[4]}"
            )

    def _on_resumed(self) -> None:
        self.on_missed()

    async def resolve(self) -> str:
        """The primary's ``host:port`` by the sentinels' latest config epoch; ValueError if
        the sentinels answer but none monitors the service, BackendUnavailable if none
        answers (each one's reason, without a password)."""
        packed = pack(b"SENTINEL", b"MASTER", self.service.encode())
        results = await self.fan.send("sentinel", packed, self.timeout)
        answers: list[tuple[int, str]] = []
        unknown = 0
        failures: dict[str, str] = {}
        for i, reply in results.items():
            node = self.nodes[i]
            if isinstance(reply, BaseException):
                reason = node.reason(reply)
                if "No such master" in reason:
                    unknown += 1
                    continue
                failures[node.display] = _advice(reason)
                continue
            fields = _pairs(reply)
            host, port = fields.get("ip", ""), fields.get("port", "")
            if not host or not port.isdigit():
                failures[node.display] = f"no address in its answer: {fields!r}"
                continue
            address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            answers.append((int(fields.get("config-epoch", "0") or 0), address))
        if answers:
            top = max(epoch for epoch, _ in answers)
            votes = Counter(address for epoch, address in answers if epoch == top)
            return votes.most_common(1)[0][0]
        if unknown:
            known = await self._known_services()
            listed = f"; they monitor {', '.join(map(repr, known))}" if known else ""
            raise ValueError(
                f"{self.dep.display}: no sentinel monitors a service named {self.service!r}"
                f"{listed}; the URL's path is the service (master) name: "
                "redis+sentinel://s1:26379,s2:26379/<service_name>"
            )
        detail = "; ".join(f"{where}: {why}" for where, why in failures.items())
        raise BackendUnavailable(
            f"{self.dep.display}: no sentinel answered where the primary of "
            f"{self.service!r} is ({detail})"
        )

    async def _known_services(self) -> list[str]:
        results = await self.fan.send("sentinel", pack(b"SENTINEL", b"MASTERS"), self.timeout)
        names: set[str] = set()
        for reply in results.values():
            if isinstance(reply, list):
                names |= {_pairs(entry).get("name", "") for entry in reply}
        return sorted(n for n in names if n)

    async def poll(self, current: str) -> bool:
        """True if a sentinel names a primary other than ``current`` (``host:port``)."""
        packed = pack(b"SENTINEL", b"GET-MASTER-ADDR-BY-NAME", self.service.encode())
        results = await self.fan.send("sentinel", packed, self.timeout)
        for reply in results.values():
            if isinstance(reply, list) and len(reply) == 2:
                host, port = _text(reply[0]), _text(reply[1])
                address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
                if address != current:
                    return True
        return False

    async def aclose(self) -> None:
        for node in self.nodes:
            await node.aclose()


def _advice(reason: str) -> str:
    if "authentication" in reason or "NOAUTH" in reason or "WRONGPASS" in reason:
        return (
            f"{reason} (the sentinels' own user and password are the options "
            "sentinel_username and sentinel_password, not the URL's, which are the primary's)"
        )
    return reason


def _nothing() -> None:
    pass
