"""File a tuning request: to the daemon over its control socket, else into the spool.

The daemon's answer decides: ``ok`` means queued; "unknown operation" means a daemon
without user-kernel support, so the request is spooled for a newer one to read at
start; ``busy`` is asked again with backoff, and spooled when it stays busy; any other
refusal (a module not allowed, a bad request) is final and reported. No socket, no
permission, a timeout or a request too long for one socket line: spooled.
The job never fails because of any of this; it gets a :class:`Submission` saying what
happened.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuwatchd.client.control import Unreachable, ask
from gpuwatchd.client.discovery import default_socket_path, default_spool_dir
from gpuwatchd.control import wire
from gpuwatchd.tuning.intake.spool import write_request
from gpuwatchd.tuning.submitted.kernels import KernelRequest
from gpuwatchd.validate import one_line


@dataclass(frozen=True, slots=True)
class Submission:
    """What became of a request: ``how`` is ``daemon`` (queued), ``spool`` (written for the
    daemon's next start), ``rejected`` (the daemon refused it) or ``failed`` (neither
    reachable nor writable). ``detail`` is one line."""

    how: str
    detail: str

    @property
    def filed(self) -> bool:
        return self.how in ("daemon", "spool")


class Submitter:
    """Sends requests to the daemon (``socket_path``) or spools them (``spool_dir``).

    None picks the defaults (:func:`default_socket_path`, :func:`default_spool_dir`),
    resolved at each submission so a daemon started later is found.
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str] | None = None,
        spool_dir: str | os.PathLike[str] | None = None,
        timeout: float = 2.0,
    ) -> None:
        self.socket_path = Path(socket_path) if socket_path is not None else None
        self.spool_dir = Path(spool_dir) if spool_dir is not None else None
        self.timeout = timeout

    def submit(self, request: KernelRequest) -> Submission:
        """Queue ``request`` with the daemon, else spool it; never raises OSError."""
        sock = self.socket_path or default_socket_path()
        return deliver(
            wire.request(wire.TUNE_KERNEL, request=request.to_json()),
            socket_path=sock,
            timeout=self.timeout,
            accepted=lambda _answer: f"queued with the daemon at {sock}",
            refused="it",
            spool=lambda folder: write_request(folder, request),
            spool_dir=self.spool_dir,
        )


def deliver(
    doc: dict[str, Any],
    *,
    socket_path: Path,
    timeout: float,
    accepted: Callable[[dict[str, Any]], str],
    refused: str,
    spool: Callable[[Path], Path],
    spool_dir: Path | None = None,
    spooled: str = "",
) -> Submission:
    """Send ``doc`` (one control-socket request) to the daemon, else spool it.

    The one rule for every job-side request: ``ok`` is ``daemon`` (``accepted`` words
    the answer), "unknown operation", ``busy`` for longer than the client's patience or
    no daemon at all is ``spool`` (``spool(folder)``
    writes the file; ``spool_dir`` None: the default, looked up only then), any other
    refusal is ``rejected`` (``refused`` names the thing: "it", "them"). Never raises
    OSError.
    """
    line = json.dumps(doc, separators=(",", ":"))
    why: str
    if len(line.encode()) >= wire.MAX_LINE:
        why = f"request too long for the control socket ({len(line)} bytes)"
    else:
        try:
            answer = ask(socket_path, line, timeout)
        except Unreachable as e:
            why = str(e)
        else:
            if answer.get("ok") is True:
                return Submission("daemon", accepted(answer))
            error = one_line(answer.get("error", "no reason given"))
            if wire.is_busy(answer):
                why = f"the daemon at {socket_path} stayed busy ({error})"
            elif wire.is_unknown_op(answer):
                why = f"the daemon at {socket_path} does not take {doc['op']} requests"
            else:
                return Submission(
                    "rejected", f"the daemon at {socket_path} refused {refused}: {error}"
                )
    folder = spool_dir or default_spool_dir()
    try:
        path = spool(folder)
    except OSError as e:
        return Submission("failed", f"{why}; cannot spool to {folder}: {one_line(e)}")
    return Submission("spool", f"{why}; spooled {spooled}to {path}")
