"""What the host offers the SQLite backend: its boot id (rows from before a reboot are
expired) and an abstract Unix datagram socket for wake-ups across processes (Linux)."""

from __future__ import annotations

import os
import secrets
import socket
import sys
from pathlib import Path


def boot_id() -> str:
    """The kernel's boot id (Linux); monotonic time restarts with it."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "no-boot-id"


def wake_socket() -> tuple[socket.socket, str] | None:
    """A datagram socket in Linux's abstract namespace (no file to clean up), or None."""
    if not sys.platform.startswith("linux"):
        return None
    address = f"asynclock-{os.getpid()}-{secrets.token_hex(8)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind("\0" + address)
        sock.setblocking(False)
    except OSError:
        sock.close()
        return None
    return sock, address
