"""The store's reads of results across sessions, in SQL: the newest per key.

Each builder takes a ``WHERE`` clause made by :func:`gpuwatchd.store.sql_args.filters`
over ``results r`` joined with ``sessions s``; its values are bound by the caller.
Writing and parsing result rows is :mod:`gpuwatchd.store.result_rows`.
"""

from __future__ import annotations


def latest(where: str) -> str:
    """Per (GPU model, workload, regime) the newest result matching ``where``, with its
    session's GPU and versions; ordered by GPU model, workload, regime."""
    return f"""SELECT * FROM (
            SELECT r.*, s.gpu_model, s.gpu_uuid, s.versions_json,
                ROW_NUMBER() OVER (
                    PARTITION BY s.gpu_model, r.workload, r.regime
                    ORDER BY r.recorded_at DESC, r.id DESC) AS rn
            FROM results r JOIN sessions s ON s.id = r.session_id {where}) AS latest
        WHERE rn = 1 ORDER BY gpu_model, workload, regime"""


def resumable(where: str, workloads: int) -> str:
    """Per (workload, regime) the newest result matching ``where`` (which must not be
    empty), recorded at or after the first argument after its own, of one of the
    ``workloads`` workloads named by the arguments after that."""
    marks = ", ".join("?" for _ in range(workloads))
    return f"""SELECT * FROM (
            SELECT r.*, s.gpu_model, s.gpu_uuid, s.versions_json,
                ROW_NUMBER() OVER (
                    PARTITION BY r.workload, r.regime
                    ORDER BY r.recorded_at DESC, r.id DESC) AS rn
            FROM results r JOIN sessions s ON s.id = r.session_id {where}
                AND r.recorded_at >= ? AND r.workload IN ({marks})) AS newest
        WHERE rn = 1"""
