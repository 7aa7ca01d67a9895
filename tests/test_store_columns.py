"""Each table's column list (gpuwatchd/store/columns.py) is the table a migrated store has,
and every dataclass read from a row reads only columns its table lists."""

from __future__ import annotations

import sqlite3
from dataclasses import fields
from pathlib import Path

import pytest

from gpuwatchd.store import codec, columns, sqlite_store
from gpuwatchd.store.rows import Claim, Disagreement, HostClock, StoredResult, WinnerRow
from gpuwatchd.tuning.types import CandidateStats, RegimeResult

#: Each table, its list, and the columns the store fills itself (ids) or later (finishing).
TABLES = {
    "sessions": (columns.SESSION_COLUMNS, {"id", "ended_at", "why"}),
    "results": (columns.RESULT_COLUMNS, {"id"}),
    "candidate_stats": (columns.CANDIDATE_COLUMNS, {"id"}),
    "winners": (columns.WINNER_COLUMNS, set()),
    "host_winners": (("host", *columns.WINNER_COLUMNS), set()),
    "disagreements": (columns.DISAGREEMENT_COLUMNS, {"id"}),
    "claims": (columns.HOST_LEASE_COLUMNS, set()),
    "host_clocks": (columns.HOST_CLOCK_COLUMNS, set()),
}


@pytest.fixture(scope="module")
def table_columns(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    path = Path(tmp_path_factory.mktemp("columns")) / "tune.db"
    sqlite_store(path).close()
    con = sqlite3.connect(path)
    try:
        return {t: [r[1] for r in con.execute(f"PRAGMA table_info({t})")] for t in TABLES}
    finally:
        con.close()


@pytest.mark.parametrize("table", TABLES)
def test_a_tables_list_is_its_migrated_columns(
    table: str, table_columns: dict[str, list[str]]
) -> None:
    listed, own = TABLES[table]
    assert len(set(listed)) == len(listed)
    assert set(listed) | own == set(table_columns[table])


#: The columns of the table each row type is read from (a winner's adds its session's host).
READ_FROM = {
    WinnerRow: (*columns.WINNER_COLUMNS, "host"),
    Disagreement: columns.DISAGREEMENT_COLUMNS,
    Claim: columns.CLAIM_COLUMNS,
    HostClock: columns.HOST_CLOCK_COLUMNS,
    CandidateStats: columns.CANDIDATE_COLUMNS,
    RegimeResult: columns.RESULT_COLUMNS,
    StoredResult: (*columns.RESULT_COLUMNS, "gpu_model", "gpu_uuid", "versions_json"),
}
#: The fields the reader is given rather than reading them from the row's own columns.
GIVEN = {CandidateStats: {"regime", "meta"}, RegimeResult: {"candidates"}, StoredResult: {"result"}}


@pytest.mark.parametrize("cls", codec.RENAMED, ids=lambda c: c.__name__)
def test_a_row_type_reads_only_its_tables_columns(cls: type) -> None:
    renamed = codec.RENAMED[cls]
    read = {f.name for f in fields(cls)} - GIVEN.get(cls, set())
    assert {renamed.get(name, name) for name in read} <= set(READ_FROM[cls])
