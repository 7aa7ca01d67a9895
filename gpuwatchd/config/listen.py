"""The HTTP listen address, ``HOST:PORT``: parsed once for the config check, the server
and the command line that finds a local daemon."""

from __future__ import annotations

import ipaddress
import re

#: Default TCP port of the HTTP server. Not 9400 (dcgm-exporter) nor 9835
#: (nvidia_gpu_exporter), so gpuwatchd can run beside either.
DEFAULT_PORT = 9844
_HOSTNAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?")


def parse_listen(text: str) -> tuple[str, int]:
    """``"HOST:PORT"`` -> ``(host, port)``; ``":9844"`` is every interface, IPv6 in brackets.

    Raises ValueError with a one-line message naming the bad part.
    """
    value = text.strip()
    where = f"listen address {text!r}"
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            raise ValueError(f"{where}: missing ']' after the IPv6 address")
        host, rest = value[1:end], value[end + 1 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{where}: {host!r} is not an IPv6 address") from None
        if not rest.startswith(":"):
            raise ValueError(f"{where}: expected ':PORT' after ']', e.g. [::1]:9844")
        port_text = rest[1:]
    else:
        host, sep, port_text = value.rpartition(":")
        if not sep:
            raise ValueError(f"{where}: expected HOST:PORT, e.g. 127.0.0.1:9844 or :9844")
        if ":" in host:
            raise ValueError(f"{where}: put an IPv6 address in brackets, e.g. [::1]:9844")
        if host and not _HOSTNAME.fullmatch(host):
            raise ValueError(f"{where}: host {host!r} is not a valid hostname or IP address")
    if not port_text:
        raise ValueError(f"{where}: missing port")
    if not (port_text.isascii() and port_text.isdigit()):
        raise ValueError(f"{where}: port {port_text!r} is not a number")
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"{where}: port {port} is out of range 0-65535")
    return host, port


def format_listen(host: str, port: int) -> str:
    """Inverse of :func:`parse_listen` (brackets IPv6 hosts)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
