# No library: the systemd bindings need libsystemd and a compiler; sd_notify is one datagram.
"""A dependency-free sd_notify(3) client: readiness, watchdog, reload and status.

systemd's ``Type=notify`` hands the daemon a datagram socket in ``NOTIFY_SOCKET``; the
daemon reports state by sending newline-separated ``KEY=VALUE`` lines to it. Outside
systemd the variable is unset and every call is a cheap no-op, so the daemon calls
these methods unconditionally. A failed send is logged once and never raised: losing a
status line must not take the daemon down (a missed watchdog ping is systemd's to act on).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Mapping, MutableMapping

__all__ = ["Notifier", "watchdog_interval_s"]

log = logging.getLogger(__name__)

# Variables systemd sets for the main process only; children must not act on them.
_NOTIFY_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
# Never block the caller (the watchdog thread) on a full receive queue; no SIGPIPE.
_SEND_FLAGS = socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL


def _parse_address(value: str) -> str | bytes:
    """Turn a NOTIFY_SOCKET value into a sendto() address; '@' means abstract namespace."""
    if value.startswith("@") and len(value) > 1:
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    raise ValueError(f"NOTIFY_SOCKET: expected an absolute path or '@abstract' name, got {value!r}")


def _fold_lines(text: str) -> str:
    """STATUS= ends at the first newline; fold line breaks (only) so the whole text arrives.

    Not :func:`gpuwatchd.validate.one_line`: spacing within a line is the caller's to keep.
    """
    return " ".join(text.splitlines())


class Notifier:
    """Sends sd_notify messages to one socket address, or does nothing if it has none.

    Thread-safe: the watchdog pinger and the main loop may share one instance.
    """

    def __init__(
        self, address: str | bytes | None, watchdog_interval_s: float | None = None
    ) -> None:
        self._address = address
        self._watchdog_interval_s = watchdog_interval_s if address is not None else None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._failing = False

    @classmethod
    def from_env(
        cls,
        environ: MutableMapping[str, str] | None = None,
        *,
        unset_environment: bool = False,
    ) -> Notifier:
        """Build from ``NOTIFY_SOCKET`` and ``WATCHDOG_*``; disabled when the socket is unset.

        ``unset_environment`` removes NOTIFY_SOCKET/WATCHDOG_* afterwards so child
        processes (the tuning worker) neither notify nor ping. Raises ValueError naming
        the variable for a malformed value.
        """
        env = os.environ if environ is None else environ
        raw = env.get("NOTIFY_SOCKET", "")
        address = _parse_address(raw) if raw else None
        interval = watchdog_interval_s(env)
        if unset_environment:
            for name in _NOTIFY_VARS:
                env.pop(name, None)
        return cls(address, interval)

    @property
    def enabled(self) -> bool:
        """True when there is a socket to notify."""
        return self._address is not None

    def watchdog_interval_s(self) -> float | None:
        """Seconds between :meth:`watchdog` pings, or None when systemd expects none."""
        return self._watchdog_interval_s

    def send(self, message: str) -> bool:
        """Send one raw notification; True if it was handed to the socket."""
        if self._address is None:
            return False
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._sock.sendto(message.encode(), _SEND_FLAGS, self._address)
            except OSError as exc:
                level = logging.DEBUG if self._failing else logging.WARNING
                log.log(level, "sd_notify to %r failed: %s", self._address, exc)
                self._failing = True
                return False
            if self._failing:
                log.info("sd_notify to %r works again", self._address)
                self._failing = False
            return True

    def ready(self, status: str | None = None) -> bool:
        """Startup (or a reload) finished: systemd now considers the unit active."""
        lines = ["READY=1"]
        if status is not None:
            lines.append(f"STATUS={_fold_lines(status)}")
        return self.send("\n".join(lines))

    def reloading(self) -> bool:
        """A reload started; send :meth:`ready` when it is done.

        MONOTONIC_USEC lets systemd 253+ (Type=notify-reload) match this message to the
        reload it requested; older systemd and Type=notify ignore the extra field.
        """
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.send(f"RELOADING=1\nMONOTONIC_USEC={usec}")

    def stopping(self) -> bool:
        """Shutdown started: systemd stops expecting watchdog pings."""
        return self.send("STOPPING=1")

    def watchdog(self) -> bool:
        """Keep-alive ping; call every :meth:`watchdog_interval_s` seconds."""
        return self.send("WATCHDOG=1")

    def status(self, text: str) -> bool:
        """Free-form one-line status shown by ``systemctl status``."""
        return self.send(f"STATUS={_fold_lines(text)}")

    def close(self) -> None:
        """Release the socket; later calls reopen it."""
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


def _positive_int(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}: expected a positive integer, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{name}: expected a positive integer, got {raw!r}")
    return value


def watchdog_interval_s(
    environ: Mapping[str, str] | None = None, pid: int | None = None
) -> float | None:
    """Seconds between watchdog pings (half of WatchdogSec=), or None if not asked for.

    None when WATCHDOG_USEC is unset or WATCHDOG_PID names another process (we are a
    child that inherited the variables). Half the timeout, as sd_watchdog_enabled(3)
    advises, leaves room for one late ping. Raises ValueError for malformed values.
    """
    env = os.environ if environ is None else environ
    if not env.get("WATCHDOG_USEC"):
        return None
    usec = _positive_int(env, "WATCHDOG_USEC")
    if env.get("WATCHDOG_PID"):
        own_pid = os.getpid() if pid is None else pid
        if _positive_int(env, "WATCHDOG_PID") != own_pid:
            return None
    return usec / 2_000_000
