"""The control socket's wire: every operation, the keys it takes, its answer, the limits.

One JSON object per line each way. The daemon (its op table and socket server), the
command line and the job side all import these names; none of them spells an op name,
a key list or a limit itself::

    {"op": "...", ...}  ->  {"ok": true, ...}
    (anything wrong)    ->  {"ok": false, "error": "one line"}
    (no free slot)      ->  {"ok": false, "error": "busy: ..."}   (try again later)

A request's values are checked by the operation that takes it (kernel requests by
:mod:`gpuwatchd.tuning.submitted.kernels`, workloads by
:mod:`gpuwatchd.tuning.intake.workload_requests`); this module checks the envelope: a JSON
object, a known ``op``, no key the op does not take.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict

#: Longest request or answer line, newline excluded.
MAX_LINE = 64 * 1024
#: A client must send its whole request line within this many seconds of connecting.
CLIENT_TIMEOUT_S = 2.0
#: Connections served at once, and at most this many from one user (so one user's idle
#: connections leave room for everybody else).
MAX_CLIENTS = 8
MAX_CLIENTS_PER_PEER = 4
#: The error of an answer that means "no free slot now, ask again".
BUSY = "busy"
#: What the error of a request for an operation the daemon lacks says (an older daemon).
UNKNOWN_OP = "unknown operation"
#: A client asks again after a busy answer, waiting twice as long each time (plus up to
#: as much again of random jitter, so a crowd spreads out), for at most this long in all.
BUSY_FIRST_WAIT_S = 0.02
BUSY_MAX_WAIT_S = 0.5
BUSY_PATIENCE_S = 10.0
#: Workloads in one ``list_workloads`` answer, at most; the answer says where to go on.
LIST_PAGE_MAX = 256

#: ``judged_by`` of a GPU state the daemon judged for a job (``job_gate``).
JUDGED_FOR_JOB = "daemon_for_job"

TUNE_KERNEL = "tune_kernel"
ADD_WORKLOADS = "add_workloads"
LIST_WORKLOADS = "list_workloads"
REMOVE_WORKLOADS = "remove_workloads"
RETUNE = "retune"
STATUS = "status"
CANCEL_RETUNE = "cancel_retune"
REGISTER_JOB = "register_job"
JOB_GATE = "job_gate"


# -- requests --------------------------------------------------------------------------


class TuneKernelRequest(TypedDict):
    op: str
    request: dict[str, Any]  # a gpuwatchd-kernel-request/1 document


class AddWorkloadsRequest(TypedDict):
    op: str
    workloads: list[dict[str, Any]]  # workload tables: name, op, shape, dtype, families
    source: NotRequired[dict[str, Any]]  # where they came from: host, pid, torch version


class ListWorkloadsRequest(TypedDict):
    op: str
    cursor: NotRequired[int]  # where the page starts: 0, or a previous answer's ``next``
    limit: NotRequired[int]  # at most this many workloads (at most LIST_PAGE_MAX)


class RemoveWorkloadsRequest(TypedDict):
    op: str
    names: list[str]


class StatusRequest(TypedDict):
    op: str


class RegisterJobRequest(TypedDict):
    op: str


class RetuneRequest(TypedDict):
    op: str
    gpu: NotRequired[int | None]  # None: every GPU
    workloads: NotRequired[list[str] | None]  # None: the daemon's tuning set


class CancelRetuneRequest(TypedDict):
    op: str
    gpu: NotRequired[int | None]  # None: every GPU
    workloads: NotRequired[list[str] | None]  # None: everything waiting


class JobGateRequest(TypedDict):
    op: str
    gpu: int | str  # index or UUID
    job: NotRequired[str | None]  # from register_job; None registers the caller


# -- answers ---------------------------------------------------------------------------


class Answer(TypedDict):
    ok: bool
    error: NotRequired[str]  # one line, when ok is false


class TuneKernelAnswer(Answer):
    workload: str
    queued: dict[str, list[str]]
    persisted: bool
    warning: NotRequired[str]


class AddWorkloadsAnswer(Answer):
    added: list[str]
    replaced: list[str]


class ListWorkloadsAnswer(Answer):
    workloads: list[dict[str, Any]]  # each with its "origin": config, added or kernel
    next: NotRequired[int | None]  # the next page's cursor; None or absent: the last page


class RemoveWorkloadsAnswer(Answer):
    removed: list[str]


class RetuneAnswer(Answer):
    queued: dict[str, list[str]]


class StatusAnswer(Answer):
    pending: dict[str, list[str]]


class CancelRetuneAnswer(Answer):
    cancelled: dict[str, list[str]]  # by GPU: what was waiting and is taken off the queue
    omitted: NotRequired[dict[str, int]]  # by GPU: how many more, left unnamed (line length)


class RegisterJobAnswer(Answer):
    job: str
    pid: int
    pids: list[int]


class JobGateAnswer(Answer):
    job: str
    excluded_pids: list[int]
    judged_by: str
    gpu: dict[str, Any]  # the GPU's /api/v1/state entry, its gate judged for the job


@dataclass(frozen=True, slots=True)
class OpSpec:
    """One operation on the wire: its name, its request and answer shapes."""

    name: str
    request: type
    answer: type

    @property
    def keys(self) -> frozenset[str]:
        """What a request may carry besides ``op``."""
        return frozenset(self.request.__annotations__) - {"op"}


#: Every operation, in the order ``op: unknown`` lists them.
OPS: dict[str, OpSpec] = {
    spec.name: spec
    for spec in (
        OpSpec(RETUNE, RetuneRequest, RetuneAnswer),
        OpSpec(STATUS, StatusRequest, StatusAnswer),
        OpSpec(CANCEL_RETUNE, CancelRetuneRequest, CancelRetuneAnswer),
        OpSpec(TUNE_KERNEL, TuneKernelRequest, TuneKernelAnswer),
        OpSpec(ADD_WORKLOADS, AddWorkloadsRequest, AddWorkloadsAnswer),
        OpSpec(LIST_WORKLOADS, ListWorkloadsRequest, ListWorkloadsAnswer),
        OpSpec(REMOVE_WORKLOADS, RemoveWorkloadsRequest, RemoveWorkloadsAnswer),
        OpSpec(REGISTER_JOB, RegisterJobRequest, RegisterJobAnswer),
        OpSpec(JOB_GATE, JobGateRequest, JobGateAnswer),
    )
}


class WireError(ValueError):
    """A request or answer that does not fit the wire (one line naming the key)."""


def op_keys(name: str) -> frozenset[str]:
    """The keys operation ``name`` takes besides ``op`` (none for an op not declared here)."""
    spec = OPS.get(name)
    return spec.keys if spec is not None else frozenset()


def check_keys(doc: Mapping[str, Any], name: str, keys: frozenset[str] | None = None) -> None:
    """WireError naming the first key of ``doc`` that operation ``name`` does not take."""
    allowed = (op_keys(name) if keys is None else keys) | {"op"}
    unknown = sorted(set(doc) - allowed)
    if unknown:
        listed = ", ".join(sorted(allowed))
        key = unknown[0] if unknown[0].isprintable() else repr(unknown[0])  # stays one line
        raise WireError(f"{key[:64]}: unknown key for op {name!r} (allowed: {listed})")


def request(name: str, **fields: Any) -> dict[str, Any]:
    """The request document of operation ``name``; fields that are None are left out."""
    doc = {"op": name, **{k: v for k, v in fields.items() if v is not None}}
    check_keys(doc, name)
    return doc


def check_answer(doc: Any) -> Answer:
    """``doc`` if it is a control answer (``ok`` a boolean, ``error`` text when refused)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("ok"), bool):
        raise WireError("not a gpuwatchd control response")
    if doc["ok"] is False and not isinstance(doc.get("error", ""), str):
        raise WireError("error: expected one line of text")
    answer: Answer = doc  # type: ignore[assignment]
    return answer


def page(
    items: Sequence[Mapping[str, Any]], cursor: int, limit: int = LIST_PAGE_MAX
) -> tuple[list[Mapping[str, Any]], int | None]:
    """Up to ``limit`` of ``items`` from index ``cursor`` that fit one answer line, and
    the cursor of the next page (None after the last). A page holds at least one item."""
    budget = MAX_LINE - 1024  # the answer's other keys
    out: list[Mapping[str, Any]] = []
    end = cursor
    for item in items[cursor : cursor + limit]:
        size = len(json.dumps(item, separators=(",", ":"))) + 1
        if out and size > budget:
            break
        out.append(item)
        budget -= size
        end += 1
    return out, (end if end < len(items) else None)


def check_page(doc: Mapping[str, Any]) -> tuple[int, int]:
    """A ``list_workloads`` request's ``(cursor, limit)``; WireError naming a bad one."""
    cursor = doc.get("cursor", 0)
    limit = doc.get("limit", LIST_PAGE_MAX)
    cursor = 0 if cursor is None else cursor
    limit = LIST_PAGE_MAX if limit is None else limit
    if isinstance(cursor, bool) or not isinstance(cursor, int) or cursor < 0:
        raise WireError(f"cursor: expected an integer >= 0, got {cursor!r:.40}")
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= LIST_PAGE_MAX:
        raise WireError(f"limit: expected an integer from 1 to {LIST_PAGE_MAX}, got {limit!r:.40}")
    return cursor, limit


def error_answer(message: str) -> dict[str, Any]:
    """The one shape of every refusal."""
    return {"ok": False, "error": message}


def busy_answer(why: str) -> dict[str, Any]:
    """The answer that tells a client to ask again later."""
    return error_answer(f"{BUSY}: {why}, try again")


def is_busy(answer: Mapping[str, Any]) -> bool:
    """Whether ``answer`` says no slot was free (worth asking again)."""
    error = answer.get("error")
    return answer.get("ok") is False and isinstance(error, str) and error.startswith(BUSY + ":")


def is_unknown_op(answer: Mapping[str, Any]) -> bool:
    """Whether ``answer`` says the daemon does not have the operation (an older daemon)."""
    return answer.get("ok") is False and UNKNOWN_OP in str(answer.get("error", ""))
