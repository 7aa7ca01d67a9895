"""Hand captured workloads to the daemon: ``add_workloads`` on its control socket, else its spool.

Same rules as a user kernel's tuning request (:mod:`gpuwatchd.jobside.requests`, whose
socket and spool discovery this reuses): the daemon's ``ok`` means stored; "unknown
operation" means a daemon without this operation, so the request is spooled for a newer
one; any other refusal is final and reported; no daemon at all means spooled. The job
never fails because of it: the answer is a :class:`Submission`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gpuwatchd.client.control import Unreachable, ask
from gpuwatchd.jobside.requests import (
    MAX_LINE,
    Submission,
    default_socket_path,
    default_spool_dir,
)
from gpuwatchd.tuning.types import Workload
from gpuwatchd.tuning.workload_requests import ADD_OP, add_request
from gpuwatchd.tuning.workload_spool import write_workload_request
from gpuwatchd.validate import one_line


def submit_workloads(
    workloads: Sequence[Workload],
    source: Mapping[str, Any] | None = None,
    *,
    socket_path: str | os.PathLike[str] | None = None,
    spool_dir: str | os.PathLike[str] | None = None,
    timeout: float = 2.0,
) -> Submission:
    """Queue ``workloads`` with the daemon, else spool them; never raises OSError.

    ValueError when the workloads themselves are invalid (a bug of the caller).
    """
    doc = add_request(workloads, {k: v for k, v in (source or {}).items() if v is not None})
    line = json.dumps(doc, separators=(",", ":"))
    sock = Path(socket_path) if socket_path is not None else default_socket_path()
    if len(line.encode()) >= MAX_LINE:
        why = f"request too long for the control socket ({len(line)} bytes)"
    else:
        try:
            answer = ask(sock, line, timeout)
        except Unreachable as e:
            why = str(e)
        else:
            if answer.get("ok") is True:
                added = answer.get("added")
                count = len(added) if isinstance(added, list) else len(workloads)
                return Submission("daemon", f"{count} workload(s) added by the daemon at {sock}")
            error = one_line(answer.get("error", "no reason given"))
            if "unknown operation" not in error:
                return Submission("rejected", f"the daemon at {sock} refused them: {error}")
            why = f"the daemon at {sock} does not take {ADD_OP} requests"
    folder = Path(spool_dir) if spool_dir is not None else default_spool_dir()
    try:
        path = write_workload_request(folder, doc)
    except OSError as e:
        return Submission("failed", f"{why}; cannot spool to {folder}: {one_line(e)}")
    return Submission("spool", f"{why}; spooled {len(workloads)} workload(s) to {path}")
