"""Helpers for tests that start gpuwatchd as a real process or in a thread."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from builders import wait_until


class NotifySocket:
    """A datagram socket standing in for systemd's NOTIFY_SOCKET."""

    def __init__(self, tmp: Path) -> None:
        self.path = str(tmp / "notify.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.1)
        self.messages: list[str] = []

    def drain(self, seconds: float = 0.0) -> list[str]:
        deadline = time.monotonic() + seconds
        while True:
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except TimeoutError:
                if time.monotonic() >= deadline:
                    return self.messages

    def wait_for(self, needle: str, timeout: float = 10.0) -> bool:
        """Whether a message containing ``needle`` arrives within ``timeout`` seconds."""
        return wait_until(lambda: any(needle in m for m in self.drain()), timeout, interval=0)

    def close(self) -> None:
        self.sock.close()


def http_get(url: str, timeout: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def wait_http(url: str, timeout: float = 15.0) -> str:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            return http_get(url)
        except OSError as exc:
            last = exc
            time.sleep(0.1)
    raise AssertionError(f"{url} never answered: {last}")


def start_daemon(args: list[str], env: dict[str, str] | None = None, **kw) -> subprocess.Popen[str]:
    """Start ``gpuwatchd run ARGS``; unless given, state and control socket go to a temp dir
    so that concurrent test daemons never share a store or a socket."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    scratch = tempfile.mkdtemp(prefix="gpuwatchd-test-")
    if "--control-socket" not in args:
        args = [*args, "--control-socket", os.path.join(scratch, "control.sock")]
    if "--state-dir" not in args and "--config" not in args:
        args = [*args, "--state-dir", scratch]
    return subprocess.Popen(
        [sys.executable, "-m", "gpuwatchd", "run", *args],
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


def quiet_config(state_dir: Path, **sections: object) -> Any:
    """A daemon Config on 127.0.0.1:0 that polls every 50 ms, keeps its state and control
    socket in ``state_dir`` and tunes nothing; ``sections`` replace whole sections
    (``store=StoreConfig(...)``, ``fleet=FleetConfig(...)``)."""
    from gpuwatchd.config import Config, DaemonConfig, TuningConfig

    daemon = DaemonConfig(
        listen="127.0.0.1:0",
        poll_interval_s=0.05,
        state_dir=str(state_dir),
        control_socket=str(state_dir / "control.sock"),
    )
    return Config(daemon=daemon, tuning=TuningConfig(enabled=False), **sections)  # type: ignore[arg-type]
