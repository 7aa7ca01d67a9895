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
                data = b""
                while not data.endswith(b"\n"):
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                self.requests.append(json.loads(data))
                conn.sendall(json.dumps(self.answer).encode() + b"\n")

    def close(self) -> None:
        self._sock.close()
