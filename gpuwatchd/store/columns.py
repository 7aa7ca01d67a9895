"""Each table's columns as the store writes and reads them, declared once.

Every INSERT's column list and placeholders come from these tuples (:func:`insert`),
and so does reading a row into its dataclass where the two match field for field
(:func:`gpuwatchd.store.codec.from_row`). The tables themselves are created by the
migrations (:mod:`gpuwatchd.store.schema`), which never change once shipped; a test
holds these lists to the columns a freshly migrated database has.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import TYPE_CHECKING

from gpuwatchd.tuning.types import CandidateStats

if TYPE_CHECKING:
    from gpuwatchd.tuning.types import Versions

#: The versions a session ran with, one column each (``<name>_version``), in the order
#: of :class:`~gpuwatchd.tuning.types.Versions`' fields that the store keeps.
VERSION_NAMES = ("driver", "cuda", "torch", "triton", "cudnn")
VERSION_COLUMNS = tuple(f"{name}_version" for name in VERSION_NAMES)

#: ``sessions``, but its ``id`` and what finishing it sets (``ended_at``, ``why``).
SESSION_COLUMNS = (
    "gpu_uuid",
    "gpu_index",
    "gpu_model",
    "host",
    "backend",
    "versions_json",
    *VERSION_COLUMNS,
    "workloads_json",
    "regimes_json",
    "started_at",
    "status",
    "max_sm_clock_hz",
    "power_limit_w",
    "sm_clock_at_start_hz",
    "temp_at_start_c",
    "power_at_start_w",
    "extra_json",
    "owner_pid",
)

#: ``results``, but its ``id``.
RESULT_COLUMNS = (
    "session_id",
    "workload",
    "regime",
    "winner",
    "tie",
    "margin",
    "noise",
    "recorded_at",
)

#: ``candidate_stats``, but its ``id``: :class:`~gpuwatchd.tuning.types.CandidateStats`'
#: fields but ``regime`` (its result's), with these renamed.
_CANDIDATE_RENAMED = {"name": "candidate", "meta": "meta_json"}
CANDIDATE_COLUMNS = (
    "result_id",
    *(_CANDIDATE_RENAMED.get(f.name, f.name) for f in fields(CandidateStats) if f.name != "regime"),
)

#: ``winners``; ``host_winners`` is ``host`` and these.
WINNER_COLUMNS = (
    "gpu_model",
    "versions_key",
    *VERSION_COLUMNS,
    "workload",
    "regime",
    "candidate",
    "family",
    "median_s",
    "sm_clock_hz",
    "margin",
    "tie",
    "session_id",
    "result_id",
    "gpu_uuid",
    "measured_at",
)
#: What makes a winner one (GPU model, versions, workload, regime); a host's adds ``host``.
WINNER_KEY = ("gpu_model", "versions_key", "workload", "regime")

#: ``disagreements``, but its ``id``: the key of the winner disputed, then both sides.
DISAGREEMENT_COLUMNS = (
    *WINNER_KEY,
    "kept_candidate",
    "kept_host",
    "kept_gpu_uuid",
    "kept_median_s",
    "new_candidate",
    "new_host",
    "new_gpu_uuid",
    "new_median_s",
    "gap",
    "noise",
    "recorded_at",
)

#: ``claims``.
CLAIM_COLUMNS = ("claim_key", "host", "gpu_uuid", "owner_pid", "claimed_at", "expires_at")
#: ``claims`` as a host name's lease fills it: its holder's boot and process too.
HOST_LEASE_COLUMNS = (*CLAIM_COLUMNS, "boot_id", "nonce")

#: ``host_clocks``: :class:`~gpuwatchd.store.rows.HostClock`'s fields, in order.
HOST_CLOCK_COLUMNS = (
    "host",
    "gpu_uuid",
    "gpu_model",
    "power_limit_w",
    "sustained_clock_hz",
    "updated_at",
)


def insert(table: str, columns: Sequence[str], tail: str = "") -> str:
    """``INSERT INTO table (columns) VALUES (?, ...)``, then ``tail`` (``ON CONFLICT``,
    ``RETURNING``)."""
    marks = ", ".join("?" for _ in columns)
    sql = f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({marks})"
    return f"{sql} {tail}" if tail else sql


def version_values(versions: Versions) -> dict[str, str | None]:
    """The :data:`VERSION_COLUMNS` and the values ``versions`` gives them."""
    return {
        column: getattr(versions, name)
        for name, column in zip(VERSION_NAMES, VERSION_COLUMNS, strict=True)
    }
