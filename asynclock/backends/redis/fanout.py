"""Redlock's fan-out: one command to every node at once, each reply read under one shared
deadline (a node without an idle connection connects in a task meanwhile), and what the
replies say: who failed, why, and how many answered."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio
import redis.exceptions

from ..._core.exceptions import BackendUnavailable
from .deadlines import Deadlines
from .scripts import SCRIPTS
from .wire import Node, Spawned, Wire, drop_connection, pack

T = TypeVar("T")


class Fanout:
    """The nodes of one Redlock, asked all at once."""

    def __init__(self, nodes: Sequence[Node]) -> None:
        self.nodes = nodes
        self.deadlines = Deadlines()

    async def each(
        self,
        call: Callable[[Node], Awaitable[T]],
        timeout: float,
        nodes: Sequence[int] | None = None,
    ) -> dict[int, T | BaseException]:
        """Run ``call`` on every node in parallel tasks (rare paths: open)."""
        indexes = range(len(self.nodes)) if nodes is None else nodes
        results: dict[int, T | BaseException] = {}

        async def one(i: int) -> None:
            node = self.nodes[i]
            with anyio.move_on_after(timeout):
                try:
                    results[i] = await call(node)
                except Exception as exc:
                    results[i] = exc
                return
            results[i] = BackendUnavailable(f"no answer within {timeout:g}s")

        async with anyio.create_task_group() as tg:
            for i in indexes:
                tg.start_soon(one, i)
        return results

    async def send(
        self,
        script: str,
        packed: bytes,
        timeout: float,
        nodes: Sequence[int] | None = None,
        *,
        queue_deadline: bool = True,
    ) -> dict[int, Any]:
        """Send one command to every node at once; each node's reply, or its exception
        (:class:`BackendUnavailable`) when it failed or gave no answer within ``timeout``.
        ``queue_deadline`` False: a command that waits behind this process's own calls to a
        node (past MAX_CALLS on the wire) is not timed out while it waits (releases).

        Returns only when every node has answered or timed out. The command is written to
        each node's idle connection in turn (a write does not wait), then the replies are
        read under one shared deadline; replies that arrive meanwhile wait in their socket
        buffers. A node without an idle connection connects in a task of its own.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        indexes = range(len(self.nodes)) if nodes is None else nodes
        sent: list[tuple[int, Wire]] = []
        spawned = Spawned()
        results: dict[int, Any] = {}
        done = 0  # sent[:done] are answered, or being answered now
        reading: Wire | None = None  # a reply is being read from it: drop it if interrupted
        try:
            for i in indexes:
                wire = self.nodes[i].send(packed)
                if wire is None:
                    one = self._one(i, None, script, packed, deadline, timeout, queue_deadline)
                    spawned.start(i, one)
                else:
                    sent.append((i, wire))
            try:
                # One timer for all of them (every node's timeout ends at the same moment).
                with self.deadlines.at(deadline):
                    for i, wire in sent:
                        done += 1
                        reading = wire
                        try:
                            reply = await wire.read()
                        except Exception:
                            reading = None
                            await drop_connection(wire.conn)
                            # Stale connection, NOSCRIPT, an error reply: the careful path.
                            results[i] = await self._one(i, None, script, packed, None, timeout)
                            continue
                        reading = None
                        results[i] = reply
                        if not self.nodes[i].keep(wire):
                            await drop_connection(wire.conn)
            except TimeoutError:
                # The node we were waiting for (its reply, or its careful path) is too late.
                results[sent[done - 1][0]] = BackendUnavailable(f"no answer within {timeout:g}s")
                if reading is not None:
                    await drop_connection(reading.conn)  # cut off mid-reply
                    reading = None
                for i, wire in sent[done:]:  # past the deadline: only replies already here
                    done += 1
                    results[i] = await self._one(i, wire, script, packed, deadline, timeout)
            await spawned.collect(results)
        finally:
            spawned.cancel()
            if reading is not None:
                await drop_connection(reading.conn)
            for _, wire in sent[done:]:
                await drop_connection(wire.conn)  # a reply we will never read
        return results

    async def _one(
        self,
        i: int,
        wire: Wire | None,
        script: str,
        packed: bytes,
        deadline: float | None,
        timeout: float,
        queue_deadline: bool = True,
    ) -> Any:
        """One node's reply (``deadline`` None: the caller's timer bounds the wait)."""
        node = self.nodes[i]
        try:
            try:
                if wire is None and deadline is not None:
                    # Not sent yet (no idle connection): through the node's call, so a
                    # burst of fan-outs queues for its pipeline instead of connecting once
                    # per call (hundreds of connects at once time every fan-out out).
                    return await node.call(packed, deadline, queue_deadline=queue_deadline)
                return await node.receive(wire, packed, deadline)
            except redis.exceptions.NoScriptError:
                text = SCRIPTS[script].encode()
                until = (
                    asyncio.get_running_loop().time() + timeout if deadline is None else deadline
                )
                await node.call(pack(b"SCRIPT", b"LOAD", text), until)
                return await node.call(packed, until)
        except TimeoutError:
            return BackendUnavailable(f"no answer within {timeout:g}s")
        except Exception as exc:
            return node.error(script, exc)

    def failures(self, results: dict[int, Any]) -> dict[str, str]:
        return {
            self.nodes[i].display: self.nodes[i].reason(r)
            for i, r in results.items()
            if isinstance(r, BaseException)
        }


def tally(results: dict[int, Any]) -> tuple[int, int]:
    """How many nodes answered, and how many of them answered 1 (removed a key)."""
    answered = [r for r in results.values() if not isinstance(r, BaseException)]
    return len(answered), sum(r == 1 for r in answered)
