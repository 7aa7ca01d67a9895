"""Hand captured workloads to the daemon: ``add_workloads`` on its control socket, else its spool.

Same rules as a user kernel's tuning request (:mod:`gpuwatchd.jobside.requests`, whose
socket and spool discovery this reuses): the daemon's ``ok`` means stored; "unknown
operation" means a daemon without this operation, so the request is spooled for a newer
one; any other refusal is final and reported; no daemon at all means spooled. The job
never fails because of it: the answer is a :class:`Submission`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gpuwatchd.jobside.requests import Submission, default_socket_path, deliver
from gpuwatchd.tuning.intake.spool import write_workload_request
from gpuwatchd.tuning.intake.workload_requests import add_request
from gpuwatchd.tuning.types import Workload


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
    sock = Path(socket_path) if socket_path is not None else default_socket_path()

    def accepted(answer: dict[str, Any]) -> str:
        added = answer.get("added")
        count = len(added) if isinstance(added, list) else len(workloads)
        return f"{count} workload(s) added by the daemon at {sock}"

    return deliver(
        doc,
        socket_path=sock,
        timeout=timeout,
        accepted=accepted,
        refused="them",
        spool=lambda folder: write_workload_request(folder, doc),
        spool_dir=Path(spool_dir) if spool_dir is not None else None,
        spooled=f"{len(workloads)} workload(s) ",
    )
