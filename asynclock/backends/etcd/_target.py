"""The endpoints as one grpc channel: its target (host names resolved), options, credentials."""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING, Any

import anyio
import grpc
import grpc.aio

from ..._core.exceptions import BackendUnavailable

if TYPE_CHECKING:
    from .client import TLS, Endpoints


async def resolve(
    endpoints: Endpoints, timeout: float, display: str
) -> tuple[list[str], list[tuple[str, Any]]]:
    """The addresses of every endpoint (one family: IPv4 if any) and the channel options;
    each name is resolved within ``timeout``."""
    hosts = endpoints.hosts
    options: list[tuple[str, Any]] = [
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.initial_reconnect_backoff_ms", 50),
        ("grpc.max_reconnect_backoff_ms", 1_000),
        ("grpc.enable_retries", 0),  # never resend a call behind our back
    ]
    tls = endpoints.tls
    names = [h for h, _ in hosts if not _is_ip(h)]
    server_name = (tls.server_name if tls else None) or (names[0] if names else None)
    if tls is not None and server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
        options.append(("grpc.default_authority", server_name))
    # One channel over every endpoint (pick_first fails over when one goes away):
    # grpc's ipv4:/ipv6: targets take a list, so names are resolved here.
    v4: list[str] = []
    v6: list[str] = []
    for host, port in hosts:
        if _is_ip(host):
            addrs = [host]
        else:
            try:
                with anyio.fail_after(timeout):
                    infos = await anyio.getaddrinfo(host, port, type=0)
            except (OSError, TimeoutError) as exc:
                raise BackendUnavailable(f"{display}: cannot resolve {host!r}: {exc}") from exc
            addrs = list(dict.fromkeys(str(info[4][0]) for info in infos))
        for addr in addrs:
            if ipaddress.ip_address(addr).version == 4:
                v4.append(f"{addr}:{port}")
            else:
                v6.append(f"[{addr}]:{port}")
    return list(dict.fromkeys(v4 or v6)), options


def new_channel(
    addresses: list[str], options: list[tuple[str, Any]], tls: TLS | None
) -> grpc.aio.Channel:
    """A channel over ``addresses``, the first one tried first."""
    # pick_first over the list: grpc moves on when the member in use goes away.
    scheme = "ipv6:" if addresses[0].startswith("[") else "ipv4:"
    target = scheme + ",".join(addresses)
    if tls is None:
        return grpc.aio.insecure_channel(target, options=options)
    creds = grpc.ssl_channel_credentials(tls.ca, tls.key, tls.cert)
    return grpc.aio.secure_channel(target, creds, options=options)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True
