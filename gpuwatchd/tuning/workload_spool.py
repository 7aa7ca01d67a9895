"""``add_workloads`` requests that jobs leave for a daemon that is not running.

They live in ``workloads/`` inside the spool directory of :mod:`gpuwatchd.tuning.spool`
(that module's reader takes only the ``*.json`` files at the top, so the two never
mix). Each file holds one ``add_workloads`` request document and is written atomically
(a hidden temporary file, fsync, ``os.replace``): a reader never sees half a file. The
file name hashes the workload names, so a job that captures the same model at every
start replaces its file instead of piling up copies. The daemon reads the folder at
start (:func:`read_workload_spool`), takes the good requests and moves bad files into
``rejected/`` beside a ``.reason`` file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuwatchd.tuning.regular_file import NotReadable, read_regular_file
from gpuwatchd.tuning.spool import REJECTED_DIR as REJECTED_DIR
from gpuwatchd.tuning.spool import (
    SUFFIX,
    Rejected,
    reject_file,
    request_files,
    write_atomically,
)
from gpuwatchd.tuning.workload_requests import MAX_FILE_BYTES, AddRequest, parse_add_request
from gpuwatchd.validate import load_json, one_line

#: The folder, inside the spool directory, that holds ``add_workloads`` requests.
SUBDIR = "workloads"


def spool_file_name(doc: dict[str, Any]) -> str:
    """``<hash of the sorted workload names>.json``: one file per set of workloads."""
    names = sorted(str(w.get("name")) for w in doc.get("workloads", []) if isinstance(w, dict))
    digest = hashlib.sha256("\n".join(names).encode("utf-8")).hexdigest()
    return f"{digest[:24]}{SUFFIX}"


def write_workload_request(spool_dir: str | os.PathLike[str], doc: dict[str, Any]) -> Path:
    """Validate ``doc`` (an ``add_workloads`` request) and write it atomically; its path.

    ValueError for a bad request, OSError when the folder cannot be written.
    """
    parse_add_request(doc)
    data = (json.dumps(doc, sort_keys=True) + "\n").encode("utf-8")
    return write_atomically(Path(spool_dir) / SUBDIR, spool_file_name(doc), data)


@dataclass(frozen=True, slots=True)
class SpooledRequest:
    """A good request read from the spool, and the file it came from."""

    path: Path
    request: AddRequest


@dataclass(slots=True)
class WorkloadSpoolScan:
    """Good requests (oldest first) and the bad files, set aside where they could be."""

    requests: list[SpooledRequest] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)


def read_workload_spool(spool_dir: str | os.PathLike[str]) -> WorkloadSpoolScan:
    """Every ``add_workloads`` request spooled; bad files moved into ``rejected/``.

    A missing folder is an empty spool. The daemon deletes a good file
    (:func:`remove_spooled`) once it has stored its workloads.
    """
    folder = Path(spool_dir) / SUBDIR
    scan = WorkloadSpoolScan()
    try:
        names = request_files(folder, time.time())
    except (NotReadable, OSError) as e:
        reason = e.reason if isinstance(e, NotReadable) else one_line(e)
        scan.rejected.append(Rejected(SUBDIR, reason, None))
        return scan
    for name in names:
        path = folder / name
        try:
            raw = read_regular_file(path, MAX_FILE_BYTES, follow_symlinks=False)
            request = parse_add_request(load_json(raw, "request"))
        except FileNotFoundError:
            continue
        except ValueError as e:
            reason = e.reason if isinstance(e, NotReadable) else one_line(e)
            scan.rejected.append(reject_file(folder, name, None, reason))
            continue
        scan.requests.append(SpooledRequest(path, request))
    return scan


def remove_spooled(entry: SpooledRequest) -> None:
    """Delete a spooled request the daemon has taken (gone already is fine)."""
    with contextlib.suppress(FileNotFoundError):
        entry.path.unlink()
