"""The ``retune``, ``status`` and ``cancel_retune`` control operations: queue tuning work,
show what is queued, take waiting work off the queue.

On the wire (see :mod:`gpuwatchd.serve.control` for the framing)::

    {"op": "retune", "gpu": 0, "workloads": ["sim-gemm"]}
        -> {"ok": true, "queued": {"0": ["sim-gemm"]}}
    {"op": "status"}
        -> {"ok": true, "pending": {"0": ["sim-gemm"]}}
    {"op": "cancel_retune", "gpu": 0}
        -> {"ok": true, "cancelled": {"0": ["sim-gemm"]}}

A missing or null ``gpu`` means every GPU, missing or null ``workloads`` the daemon's
tuning set (for ``cancel_retune``: all of it that is waiting). A session already running
keeps its workloads; work the daemon queues by itself (a GPU never tuned, drift) is queued
again at its next check; a job's kernel request stays (``gpuwatchd workloads remove``
takes it back). ``gpuwatchd retune`` (:mod:`gpuwatchd.cli.retune`) is the client.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol

from gpuwatchd.config import Config
from gpuwatchd.control.wire import CANCEL_RETUNE, MAX_LINE, RETUNE, STATUS
from gpuwatchd.daemon.ops import Op, Request, Response
from gpuwatchd.serve.control import PeerCred, RequestError
from gpuwatchd.tuning.types import Workload

MANUAL_REASON = "manual request"


class RetuneTarget(Protocol):
    """What the ops need of :class:`~gpuwatchd.sessions.scheduler.TuneScheduler`."""

    def request(self, gpu: int, workloads: Sequence[Workload], reason: str) -> None: ...

    def pending(self) -> dict[int, tuple[str, ...]]: ...

    def in_session(self) -> dict[int, frozenset[str]]: ...

    def withdraw(self, names: Collection[str], gpus: Collection[int] | None = None) -> None: ...


def parse_retune(doc: Request) -> Request:
    """``{"op": "retune", "gpu": int | None, "workloads": [unique names] | None}``."""
    return {"op": RETUNE, **_gpu_and_workloads(doc)}


def parse_cancel(doc: Request) -> Request:
    """``{"op": "cancel_retune", "gpu": int | None, "workloads": [unique names] | None}``."""
    return {"op": CANCEL_RETUNE, **_gpu_and_workloads(doc)}


def _gpu_and_workloads(doc: Request) -> Request:
    """The ``gpu`` and ``workloads`` both ops take, checked; RequestError naming the key."""
    gpu = doc.get("gpu")
    if gpu is not None and (isinstance(gpu, bool) or not isinstance(gpu, int) or gpu < 0):
        raise RequestError(f"gpu: must be a GPU index >= 0 or null, got {gpu!r}")
    names = doc.get("workloads")
    if names is not None:
        if not isinstance(names, list) or not names:
            raise RequestError("workloads: must be a non-empty list of names or null")
        for n in names:
            if not isinstance(n, str) or not n:
                raise RequestError(f"workloads: every entry must be a non-empty string, got {n!r}")
        names = list(dict.fromkeys(names))  # drop repeats, keep the order
    return {"gpu": gpu, "workloads": names}


def retune_ops(
    scheduler: RetuneTarget,
    cfg: Config | Callable[[], Config],
    gpus: Callable[[], list[int]],
    runnable: Callable[[], tuple[Workload, ...]],
) -> tuple[Op, Op, Op]:
    """The ``retune``, ``status`` and ``cancel_retune`` ops, for the daemon's op table.

    ``retune`` queues the named workloads (default: ``runnable()``) on one GPU or all
    of ``gpus()``; names must be among ``runnable()``. ``cfg`` may be a callable so a
    reloaded config is seen (it tells unknown names from known but not tunable ones).
    """
    current: Callable[[], Config] = cfg if callable(cfg) else (lambda: cfg)

    def retune(request: Request, _peer: PeerCred) -> Response:
        config = current()
        if not config.tuning.enabled:
            raise RequestError(
                "tuning is disabled in the config ([tuning] enabled = false): nothing would run"
            )
        targets = _pick_gpus(request["gpu"], gpus())
        chosen = _pick_workloads(request["workloads"], config, runnable())
        for gpu in targets:
            scheduler.request(gpu, chosen, MANUAL_REASON)
        names = [w.name for w in chosen]
        return {"ok": True, "queued": {str(g): names for g in targets}}

    def status(_request: Request, _peer: PeerCred) -> Response:
        return {"ok": True, "pending": _by_gpu(scheduler.pending())}

    def cancel(request: Request, _peer: PeerCred) -> Response:
        pending, running = scheduler.pending(), scheduler.in_session()
        gpu = request["gpu"]
        targets = sorted(pending) if gpu is None else _pick_gpus(gpu, gpus())
        wanted = request["workloads"]
        ours = {w.name for w in runnable()}  # a job's kernel request is its job's to take back
        cancelled: dict[int, tuple[str, ...]] = {}
        for g in targets:
            busy = running.get(g, frozenset())  # a running session keeps its workloads
            names = tuple(
                n
                for n in pending.get(g, ())
                if n in ours and n not in busy and (wanted is None or n in wanted)
            )
            if names:
                scheduler.withdraw(names, (g,))
                cancelled[g] = names
        return {"ok": True, **_named_within_a_line(cancelled)}

    return (
        Op(RETUNE, retune, parse_retune),
        Op(STATUS, status),
        Op(CANCEL_RETUNE, cancel, parse_cancel),
    )


def _named_within_a_line(cancelled: dict[int, tuple[str, ...]]) -> dict[str, Any]:
    """``cancelled`` by GPU, naming workloads while the answer stays well within one wire
    line (``MAX_LINE``); what did not fit is counted in ``omitted`` by GPU."""
    named: dict[str, list[str]] = {}
    omitted: dict[str, int] = {}
    budget = MAX_LINE // 2
    for g, names in sorted(cancelled.items()):
        kept = named.setdefault(str(g), [])
        for n in names:
            cost = len(json.dumps(n)) + 2
            if cost <= budget:
                budget -= cost
                kept.append(n)
            else:
                omitted[str(g)] = omitted.get(str(g), 0) + 1
    return {"cancelled": named, **({"omitted": omitted} if omitted else {})}


def _by_gpu(pending: dict[int, tuple[str, ...]]) -> dict[str, list[str]]:
    return {str(g): list(w) for g, w in sorted(pending.items())}


def _pick_gpus(gpu: int | None, known: list[int]) -> list[int]:
    indices = sorted(set(known))
    if not indices:
        raise RequestError("the daemon knows no GPUs yet; try again once it has polled them")
    if gpu is None:
        return indices
    if gpu not in indices:
        listed = ", ".join(map(str, indices))
        raise RequestError(f"gpu: no GPU {gpu} on this host (GPUs: {listed})")
    return [gpu]


def _pick_workloads(
    names: list[str] | None, config: Config, runnable: tuple[Workload, ...]
) -> list[Workload]:
    here = ", ".join(w.name for w in runnable) or "none"
    if names is None:
        if not runnable:
            raise RequestError("workloads: no configured workload can be tuned by this daemon")
        return list(runnable)
    by_name = {w.name: w for w in runnable}
    out: list[Workload] = []
    for name in names:
        if name in by_name:
            out.append(by_name[name])
            continue
        try:
            config.workload(name)
        except ValueError:
            raise RequestError(f"workloads: unknown workload {name!r} (known: {here})") from None
        raise RequestError(f"workloads: {name!r} is not tuned by this daemon (known: {here})")
    return out
