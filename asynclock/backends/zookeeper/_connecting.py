"""How the ZooKeeper client connects: kazoo's reconnect policy, and its logger read for what
kazoo does not expose (the negotiated session timeout, a handshake the server closed, a
handshake the server never answers). No kazoo import: the bridge (``_kazoo``) wires these
into its client."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

#: How kazoo words a connection the server closed (or reset) once it was open: during the
#: handshake, the server refused the session (the address was reachable).
_CLOSED_BY_SERVER = ("socket connection broken", "Connection reset by peer", "Broken pipe")


class Capture(logging.LoggerAdapter):  # type: ignore[type-arg]
    """kazoo's logger, reading out of its records the negotiated session timeout (ms) and
    the handshakes the server closed (``on_refused``, on kazoo's connection thread: the
    server took the connection and closed it before it answered the session request).

    It also bounds a handshake (``on_stuck``, called ``handshake_bound`` seconds after a
    connection attempt began if no session answer or drop came meanwhile). kazoo waits for
    the server's answer to its session request for the session timeout divided by the
    number of hosts (30 s for one server asked for 30 s); a server restarting took the
    connection during its start-up and never answered it, so a client whose session the
    server still kept came back only after that wait, past a lease's deadline (issue 39
    item 6: 1 run in 20 under load)."""

    def __init__(
        self,
        on_timeout: Callable[[int], None],
        on_refused: Callable[[], None],
        on_stuck: Callable[[], None] | None = None,
        handshake_bound: float = 0.0,
    ) -> None:
        super().__init__(logging.getLogger("kazoo.client"), {})
        self._on_timeout = on_timeout
        self._on_refused = on_refused
        self._on_stuck = on_stuck
        self._handshake = False
        #: The bound on the next handshake: doubled after each one cut short (a server
        #: merely slow to answer gets longer and longer), back to the first on a session.
        self._bound0 = self._bound = handshake_bound
        self._attempt = 0
        #: The handshake in progress was cut short by us (its drop is no refusal).
        self._cut = False
        self._lock = threading.Lock()

    def _arm(self) -> None:
        """A connection attempt begins (on kazoo's connection thread)."""
        if self._on_stuck is None or self._bound <= 0:
            return
        with self._lock:
            self._attempt += 1
            attempt = self._attempt
        timer = threading.Timer(self._bound, self._expire, (attempt,))
        timer.daemon = True
        timer.start()

    def _expire(self, attempt: int) -> None:
        with self._lock:
            if attempt != self._attempt or not self._handshake:
                return  # answered, dropped, or another attempt since
            self._bound *= 2
            self._cut = True
        assert self._on_stuck is not None
        self._on_stuck()

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        if isinstance(msg, str):
            if msg.startswith("Connecting to"):
                self._handshake = True
                self._arm()
            elif msg.startswith("Session created"):
                self._handshake = False
                self._bound = self._bound0
                if len(args) >= 3:
                    with contextlib.suppress(TypeError, ValueError):
                        self._on_timeout(int(args[2]))
            elif msg.startswith("Connection dropped") and self._handshake:
                with self._lock:
                    self._handshake = False
                    cut, self._cut = self._cut, False
                # A handshake we cut short is no refusal by the server.
                if not cut and args and any(w in str(args[0]) for w in _CLOSED_BY_SERVER):
                    self._on_refused()
            elif msg.startswith(("Connection time-out", "Session has expired")):
                self._handshake = False
        super().log(level, msg, *args, **kwargs)


def handshake_bound(session_timeout: float, hosts: int) -> float:
    """How long a session request may go unanswered before the attempt is cut short and
    made again: a twentieth of the session timeout, at least 1 s (doubled after each cut,
    so a server merely slow to answer is waited for longer each time), and 0 (kazoo's own
    wait) where kazoo's wait, the session timeout over the hosts, is shorter. A server that
    serves answers within milliseconds."""
    bound = max(1.0, session_timeout / 20)
    return bound if bound < session_timeout / hosts else 0.0


def reconnect_policy(session_timeout: float) -> dict[str, float]:
    """How kazoo retries the connection: forever, backing off from 0.1 s to at most a
    tenth of the session timeout (1 s at most). kazoo's own default doubles up to an hour:
    after a server outage of 8 s its next try came 4-5 s after the server was back, and a
    restart slower than about 13 s left the next try past the session's deadline, so a
    session the server still kept was given up (issue 39 item 6)."""
    return {
        "max_tries": -1,
        "delay": 0.1,
        "backoff": 2,
        "max_jitter": 0.4,
        "max_delay": min(1.0, session_timeout / 10),
    }
