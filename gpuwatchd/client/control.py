"""The job's end of the daemon's control socket: one JSON line out, one JSON answer back.

The daemon authenticates the caller by its socket credentials (SO_PEERCRED), so a job
needs no secret; it only needs the path (:func:`gpuwatchd.client.discovery.default_socket_path`).
Anything that keeps an answer from arriving (no socket, no permission, a timeout, a
reply that is not a control answer) is :class:`Unreachable` with one line; a refusal
is an ordinary answer ``{"ok": false, "error": ...}`` for the caller to read.
"""

from __future__ import annotations

import errno
import json
import os
import socket
from pathlib import Path
from typing import Any

from gpuwatchd.validate import one_line

#: The daemon reads at most this many bytes per request line (its ``MAX_LINE``).
MAX_LINE = 64 * 1024


class Unreachable(Exception):
    """No daemon answered (one line)."""


def ask(path: str | os.PathLike[str], line: str, timeout: float) -> dict[str, Any]:
    """Send one request line to the control socket at ``path``; its JSON answer."""
    where = Path(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(os.fspath(where))
        sock.sendall(line.encode() + b"\n")
        data = _read_line(sock)
    except OSError as e:
        raise Unreachable(_unreachable(where, e)) from None
    finally:
        sock.close()
    try:
        doc = json.loads(data)
    except ValueError:
        raise Unreachable(f"{where}: the daemon's response is not JSON") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("ok"), bool):
        raise Unreachable(f"{where}: not a gpuwatchd control response")
    return doc


def ask_doc(path: str | os.PathLike[str], doc: dict[str, Any], timeout: float) -> dict[str, Any]:
    """:func:`ask` with the request given as a JSON object."""
    return ask(path, json.dumps(doc, separators=(",", ":")), timeout)


def _read_line(sock: socket.socket) -> bytes:
    buf = bytearray()
    while b"\n" not in buf:
        if len(buf) > MAX_LINE:
            raise OSError(errno.EMSGSIZE, "answer line too long")
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            chunk = b""  # the server closed after answering while we were still sending
        if not chunk:
            if buf:
                break
            raise OSError(errno.ECONNRESET, "connection closed without an answer")
        buf += chunk
    return bytes(buf.split(b"\n", 1)[0])


def _unreachable(where: Path, exc: OSError) -> str:
    reason = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or one_line(exc))
    if isinstance(exc, PermissionError):
        hint = "are you root, the daemon's user or in its control_group?"
    else:
        hint = "is the daemon running?"
    return f"cannot reach gpuwatchd at {where}: {reason or type(exc).__name__} ({hint})"
