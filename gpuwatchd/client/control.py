"""The job's end of the daemon's control socket: one JSON line out, one JSON answer back.

The daemon authenticates the caller by its socket credentials (SO_PEERCRED), so a job
needs no secret; it only needs the path (:func:`gpuwatchd.client.discovery.default_socket_path`).
Anything that keeps an answer from arriving (no socket, no permission, a timeout, a
reply that is not a control answer) is :class:`Unreachable` with one line; a refusal
is an ordinary answer ``{"ok": false, "error": ...}`` for the caller to read. A ``busy``
answer (every slot taken) is asked again, waiting longer each time with random jitter,
for up to ``patience_s``; the caller sees a busy answer only once that ran out. A
connect that finds the daemon's listen backlog full is tried again within the timeout.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuwatchd.control.wire import (
    BUSY_FIRST_WAIT_S,
    BUSY_MAX_WAIT_S,
    BUSY_PATIENCE_S,
    MAX_LINE,
    WireError,
    check_answer,
    is_busy,
)
from gpuwatchd.validate import load_json, one_line

#: A connect() refused with EAGAIN (the daemon's listen backlog is full: a crowd connects
#: at once) is tried again after a random wait of up to twice this, doubling up to
#: ``_CONNECT_MAX_WAIT_S``, until the request's timeout.
_CONNECT_FIRST_WAIT_S = 0.002
_CONNECT_MAX_WAIT_S = 0.05


class Unreachable(Exception):
    """No daemon answered (one line)."""


def ask(
    path: str | os.PathLike[str],
    line: str,
    timeout: float,
    *,
    patience_s: float | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """Send one request line to the control socket at ``path``; its JSON answer.

    A busy answer is asked again after a wait that doubles from ``BUSY_FIRST_WAIT_S``
    up to ``BUSY_MAX_WAIT_S`` (each plus up to as much again at random), while the waits
    add up to at most ``patience_s`` (None: ``BUSY_PATIENCE_S``); then the busy answer
    is returned.
    """
    patience = BUSY_PATIENCE_S if patience_s is None else patience_s
    waited = 0.0
    wait = BUSY_FIRST_WAIT_S
    while True:
        answer = _ask_once(Path(path), line, timeout)
        if not is_busy(answer):
            return answer
        pause = min(wait * (1.0 + random.random()), patience - waited)
        if pause <= 0:
            return answer
        sleep(pause)
        waited += pause
        wait = min(wait * 2, BUSY_MAX_WAIT_S)


def _ask_once(where: Path, line: str, timeout: float) -> dict[str, Any]:
    try:
        sock = _connect(where, timeout)
    except OSError as e:
        raise Unreachable(_unreachable(where, e)) from None
    try:
        # Turned away (busy) before the request was read: the answer is waiting anyway.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(line.encode() + b"\n")
        data = _read_line(sock)
    except OSError as e:
        raise Unreachable(_unreachable(where, e)) from None
    finally:
        sock.close()
    try:
        doc = load_json(data, "answer")
    except ValueError:
        raise Unreachable(f"{where}: the daemon's response is not JSON") from None
    try:
        return dict(check_answer(doc))
    except WireError as e:
        raise Unreachable(f"{where}: {e}") from None


def _connect(where: Path, timeout: float) -> socket.socket:
    """A socket connected to ``where``, its timeout what is left of ``timeout``; a full
    listen backlog (EAGAIN) is waited out with jittered backoff, up to the timeout."""
    deadline = time.monotonic() + timeout
    wait = _CONNECT_FIRST_WAIT_S
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        left = deadline - time.monotonic()
        sock.settimeout(max(left, 0.001))
        try:
            sock.connect(os.fspath(where))
            return sock
        except BlockingIOError:
            sock.close()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(errno.ETIMEDOUT, "listen backlog stayed full") from None
            time.sleep(min(left, wait * (1.0 + random.random())))
            wait = min(wait * 2, _CONNECT_MAX_WAIT_S)
        except BaseException:
            sock.close()
            raise


def ask_doc(
    path: str | os.PathLike[str],
    doc: dict[str, Any],
    timeout: float,
    *,
    patience_s: float | None = None,
) -> dict[str, Any]:
    """:func:`ask` with the request given as a JSON object."""
    return ask(path, json.dumps(doc, separators=(",", ":")), timeout, patience_s=patience_s)


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
