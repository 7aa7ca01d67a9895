"""Recorded winners for the capture and Inductor tests: a real store holding one completed
session, read back through :class:`gpuwatchd.client.Client` as a job would."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gpuwatchd.client import Client
from gpuwatchd.store import SessionMeta, sqlite_store
from gpuwatchd.tuning.types import (
    CandidateStats,
    Regime,
    RegimeResult,
    SessionStatus,
    Versions,
    Workload,
)

GPU_MODEL = "NVIDIA H100 80GB HBM3"
#: A URL nobody listens on: the client then reads the store file it was given.
NO_DAEMON = "http://127.0.0.1:9"


def stats(
    name: str, family: str, median_s: float | None, meta: Mapping[str, Any] | None = None
) -> CandidateStats:
    return CandidateStats(
        name=name,
        family=family,
        regime=Regime.SUSTAINED,
        median_s=median_s,
        spread=0.01 if median_s else None,
        samples=5 if median_s else 0,
        rejected=0,
        sm_clock_hz=1.5e9,
        power_w=690.0,
        temp_c=60.0,
        energy_j_per_call=None,
        reasons=0,
        meta=dict(meta or {}),
    )


def result(workload: str, cands: Sequence[CandidateStats], tie: bool = False) -> RegimeResult:
    ranked = sorted(cands, key=lambda c: (c.median_s is None, c.median_s or 0.0))
    return RegimeResult(
        workload=workload,
        regime=Regime.SUSTAINED,
        candidates=tuple(ranked),
        winner=None if tie else ranked[0].name,
        tie=tie,
        margin=0.1,
        noise=0.01,
    )


def client_with(
    tmp_path: Path, results: Sequence[RegimeResult], torch_version: str = "2.11.0+cu130"
) -> Client:
    """A client reading a store where one completed session recorded ``results``."""
    path = tmp_path / "gpuwatchd.db"
    workloads = tuple(
        Workload(r.workload, "matmul", {"m": 1, "n": 1, "k": 1}, "bf16", (r.candidates[0].family,))
        for r in results
    )
    with sqlite_store(path) as store:
        sid = store.start_session(
            SessionMeta(
                gpu_uuid="GPU-0000",
                gpu_index=0,
                gpu_model=GPU_MODEL,
                backend="nvml",
                workloads=workloads,
                regimes=(Regime.SUSTAINED,),
                versions=Versions(torch=torch_version, driver="580.159.04"),
            )
        )
        for r in results:
            store.record_result(sid, r)
        store.finish_session(sid, SessionStatus.COMPLETED)
    return Client(url=NO_DAEMON, store=path)
