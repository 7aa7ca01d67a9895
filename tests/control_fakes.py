"""A stand-in for the daemon's control socket, for tests of what jobs and the CLI send."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path
from typing import Any


class ControlServer:
    """A control socket answering each request line with ``answer``, recording requests.

    ``answer`` may be replaced between requests.
    """

    def __init__(self, path: Path, answer: dict[str, Any]) -> None:
        self.requests: list[dict[str, Any]] = []
        self.answer = answer
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(path))
        self._sock.listen(4)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                self.requests.append(json.loads(read_line(conn)))
                conn.sendall(json.dumps(self.answer).encode() + b"\n")

    def close(self) -> None:
        self._sock.close()


def ask_line(path: Path, line: str, timeout: float = 10.0) -> dict[str, Any]:
    """Send one raw request line to the control socket at ``path``; its JSON answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        s.sendall(line.encode() + b"\n")
        answer: dict[str, Any] = json.loads(read_line(s))
    return answer


def read_line(conn: socket.socket) -> bytes:
    """Bytes up to and including the first newline (or to EOF)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    return data
