"""One tuning worker subprocess, watched from the daemon: its own process group, its
pipes drained by threads, its stdout parsed into messages, every wait bounded.

:class:`WorkerProcess` is what :class:`~gpuwatchd.sessions.runner.TuneRunner` starts for
each session; a kill reaches the worker's children too (Triton's compilers).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import IO

from gpuwatchd.tuning.session_spec import (
    MAX_LINE_BYTES,
    Message,
    SessionSpecError,
    decode_message,
)
from gpuwatchd.tuning.worker_isolation import WORKER_CWD, WorkerUser

log = logging.getLogger("gpuwatchd.sessions.runner")


@dataclass(frozen=True, slots=True)
class Invalid:
    """A line from the worker that is not a valid message."""

    why: str


class Eof:
    """The worker's stdout closed."""


Event = Message | Invalid | Eof


def exit_text(rc: int) -> str:
    """``-11`` -> ``exit 139 (SIGSEGV)``, ``3`` -> ``exit 3``: what a shell would say."""
    signum = -rc if rc < 0 else rc - 128 if rc > 128 else 0
    code = 128 - rc if rc < 0 else rc
    try:
        name = signal.Signals(signum).name if signum else ""
    except ValueError:
        name = ""
    return f"exit {code} ({name})" if name else f"exit {code}"


class WorkerProcess:
    """One worker subprocess in its own process group, with its pipes drained by threads.

    Messages parsed from stdout arrive on :attr:`events`; stderr is logged at debug
    level and its last lines kept for the failure message.
    """

    def __init__(
        self,
        cmd: Sequence[str],
        env: dict[str, str],
        stdin_data: bytes,
        cwd: str = WORKER_CWD,
        user: WorkerUser | None = None,
    ) -> None:
        self.proc = subprocess.Popen(
            list(cmd),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=cwd,
            start_new_session=True,  # own process group: killpg reaches grandchildren
            close_fds=True,
            user=None if user is None else user.uid,
            group=None if user is None else user.gid,
            extra_groups=None if user is None else list(user.groups),
        )
        self.pid = self.proc.pid
        self.events: queue.Queue[Event] = queue.Queue()
        self.stderr_tail: deque[str] = deque(maxlen=50)
        assert self.proc.stdin and self.proc.stdout and self.proc.stderr
        self._threads = [
            _thread(f"gpuwatchd-worker-{self.pid}-stdin", _feed, self.proc.stdin, stdin_data),
            _thread(f"gpuwatchd-worker-{self.pid}-stdout", self._read_stdout, self.proc.stdout),
            _thread(f"gpuwatchd-worker-{self.pid}-stderr", self._read_stderr, self.proc.stderr),
        ]

    def _read_stdout(self, stream: IO[bytes]) -> None:
        try:
            while line := stream.readline(MAX_LINE_BYTES + 1):
                if len(line) > MAX_LINE_BYTES:
                    self.events.put(Invalid(f"a line longer than {MAX_LINE_BYTES} bytes"))
                    return
                if not line.strip():
                    continue
                try:
                    self.events.put(decode_message(line))
                except SessionSpecError as e:
                    self.events.put(Invalid(str(e)))
                    return
        except (OSError, ValueError) as e:
            self.events.put(Invalid(f"cannot read its stdout: {e}"))
        finally:
            self.events.put(Eof())

    def _read_stderr(self, stream: IO[bytes]) -> None:
        with suppress(OSError, ValueError):
            for raw in stream:
                line = raw.decode("utf-8", "replace").rstrip()
                if line.strip():
                    self.stderr_tail.append(line)
                    log.debug("worker %d: %s", self.pid, line)

    def last_stderr_line(self) -> str | None:
        """The line that best says why it died: a fatal-error banner, else the last line."""
        for line in reversed(self.stderr_tail):
            if line.startswith("Fatal Python error"):
                return line.strip()
        return self.stderr_tail[-1].strip() if self.stderr_tail else None

    def exited(self) -> bool:
        """True once the worker has exited, without reaping it: while it is a zombie its
        PID, and so its process group ID, cannot be reused by another process."""
        if self.proc.returncode is not None:
            return True
        try:
            return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True

    def signal_group(self, sig: signal.Signals) -> None:
        if self.proc.returncode is not None:
            return  # reaped: its group ID may belong to someone else now
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def wait_exit(self, timeout_s: float) -> bool:
        """Poll until the worker exits or ``timeout_s`` passes; True if it exited."""
        deadline = time.monotonic() + timeout_s
        while not self.exited():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def stop(self, grace_s: float) -> None:
        """SIGTERM the group, SIGKILL it after ``grace_s`` if the worker is still there."""
        if not self.exited():
            self.signal_group(signal.SIGTERM)
            if grace_s > 0:
                self.wait_exit(grace_s)
        self.signal_group(signal.SIGKILL)

    def reap(self, timeout_s: float) -> int | None:
        """Kill whatever is left of the group, reap the worker and join the pipe threads.

        Returns the exit status, or None if the worker would not die in time (stuck in
        the kernel): a background thread then reaps it whenever it does.
        """
        self.signal_group(signal.SIGKILL)  # leftover grandchildren, the worker if alive
        try:
            rc: int | None = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.error("worker %d did not die within %.1f s of SIGKILL", self.pid, timeout_s)
            _thread(f"gpuwatchd-reap-{self.pid}", self.proc.wait)
            rc = None
        for t in self._threads:
            t.join(timeout=0.5)
        # A pipe still held open by an escaped grandchild is left to its reader thread:
        # closing a stream another thread is blocked reading would block here too.
        for t, stream in zip(self._threads[1:], (self.proc.stdout, self.proc.stderr), strict=True):
            if stream is not None and not t.is_alive():
                with suppress(OSError):
                    stream.close()
        return rc


def _thread(name: str, target: Callable[..., object], *args: object) -> threading.Thread:
    t = threading.Thread(target=target, args=args, name=name, daemon=True)
    t.start()
    return t


def _feed(stream: IO[bytes], data: bytes) -> None:
    """Write the spec and close stdin; a worker that died early just breaks the pipe."""
    with suppress(OSError, ValueError):
        stream.write(data)
    with suppress(OSError, ValueError):
        stream.close()
