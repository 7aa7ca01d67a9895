"""Where winner rows are read from: the fleet's table, or a host's own picks before it.

Each source selects the winner columns plus the measuring ``host``, so every reader
wraps it the same way (``SELECT * FROM (source) AS src WHERE ...``) and parses rows
with :func:`gpuwatchd.store.codec.winner_from_row`.
"""

from __future__ import annotations

from gpuwatchd.store.columns import WINNER_COLUMNS


def _columns(alias: str) -> str:
    return ", ".join(f"{alias}.{c}" for c in WINNER_COLUMNS)


#: The fleet's winners, each with the host its session ran on.
FLEET = f"SELECT {_columns('w')}, s.host FROM winners w JOIN sessions s ON s.id = w.session_id"

#: Per key, the host's own winner where it has one, else the fleet's. Arguments: the
#: host, twice.
PREFERRING_HOST = f"""SELECT {_columns("h")}, h.host FROM host_winners h WHERE h.host = ?
    UNION ALL
    {FLEET} WHERE NOT EXISTS (
        SELECT 1 FROM host_winners mine
        WHERE mine.host = ? AND mine.gpu_model = w.gpu_model
          AND mine.versions_key = w.versions_key AND mine.workload = w.workload
          AND mine.regime = w.regime)"""


def newest_first(source: str, where: str, *, latest: bool) -> str:
    """The winner rows of ``source`` matching ``where``, by GPU model, workload, regime,
    newest first; ``latest`` keeps only the newest row of each (GPU model, workload,
    regime), whatever its versions."""
    return f"""SELECT * FROM (
            SELECT *, ROW_NUMBER() OVER (
                PARTITION BY gpu_model, workload, regime
                ORDER BY measured_at DESC, session_id DESC) AS rn
            FROM ({source}) AS src {where}) AS picks
        {"WHERE rn = 1" if latest else ""}
        ORDER BY gpu_model, workload, regime, measured_at DESC"""
