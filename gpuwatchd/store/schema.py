"""The store's schema as one ordered list of migrations, for every back end.

Statements are written in SQLite's spelling; each engine turns column types into its
own (:meth:`Conn.ddl`). The version is tracked by the engine (SQLite's ``PRAGMA
user_version``, a one-row table on PostgreSQL). Migration N takes a database at version
N-1 to N inside one transaction, so a crash mid-migration leaves it at N-1, and the
engine makes the step exclusive, so two daemons migrating at once apply it once. To
change the schema, append a migration; never edit one that has shipped.

Rolling upgrades and rollbacks run daemons of two versions on one database, so a
migration is additive (new tables, nullable columns, indexes): a daemon that knows an
older schema keeps reading and writing it (:class:`SchemaState`). A step that is not
additive says so with ``min_writer``, recorded in the database (:data:`COMPAT_TABLE`):
daemons older than that keep monitoring and reading, but write nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpuwatchd.store.conn import Conn
from gpuwatchd.store.errors import StoreError


@dataclass(frozen=True, slots=True)
class Migration:
    """One schema step: ``apply`` runs inside the transaction that sets ``version``.

    ``min_writer``: the oldest schema version whose daemons may still write once this
    step is applied (None: the step is additive, every daemon that knows
    :data:`COMPAT_VERSION` keeps writing).
    """

    version: int
    name: str
    apply: Callable[[Conn], None]
    min_writer: int | None = None


def sql_migration(
    version: int, name: str, *statements: str, min_writer: int | None = None
) -> Migration:
    """A migration made of SQL statements, run one at a time in the engine's types."""

    def apply(conn: Conn) -> None:
        for stmt in statements:
            conn.execute(conn.ddl(stmt))

    return Migration(version, name, apply, min_writer)


#: The columns ``winners`` and ``host_winners`` share.
_WINNER_COLUMNS = """
        gpu_model TEXT NOT NULL,
        versions_key TEXT NOT NULL,
        driver_version TEXT,
        cuda_version TEXT,
        torch_version TEXT,
        triton_version TEXT,
        cudnn_version TEXT,
        workload TEXT NOT NULL,
        regime TEXT NOT NULL,
        candidate TEXT NOT NULL,
        family TEXT NOT NULL,
        median_s REAL,
        sm_clock_hz REAL,
        margin REAL,
        tie INTEGER NOT NULL,
        session_id INTEGER NOT NULL REFERENCES sessions (id),
        result_id INTEGER NOT NULL REFERENCES results (id),
        gpu_uuid TEXT NOT NULL,
        measured_at REAL NOT NULL,"""

_INITIAL = sql_migration(
    1,
    "initial schema",
    """
    CREATE TABLE sessions (
        id INTEGER PRIMARY KEY,
        gpu_uuid TEXT NOT NULL,
        gpu_index INTEGER NOT NULL,
        gpu_model TEXT NOT NULL,
        host TEXT NOT NULL,
        backend TEXT NOT NULL,
        versions_json TEXT NOT NULL,
        driver_version TEXT,
        cuda_version TEXT,
        torch_version TEXT,
        triton_version TEXT,
        cudnn_version TEXT,
        workloads_json TEXT NOT NULL,
        regimes_json TEXT NOT NULL,
        started_at REAL NOT NULL,
        ended_at REAL,
        status TEXT NOT NULL,
        why TEXT,
        max_sm_clock_hz REAL,
        power_limit_w REAL,
        sm_clock_at_start_hz REAL,
        temp_at_start_c REAL,
        power_at_start_w REAL,
        extra_json TEXT NOT NULL DEFAULT '{}'
    )
    """,
    "CREATE INDEX sessions_by_status ON sessions (status, ended_at)",
    "CREATE INDEX sessions_by_start ON sessions (started_at)",
    """
    CREATE TABLE results (
        id INTEGER PRIMARY KEY,
        session_id INTEGER NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
        workload TEXT NOT NULL,
        regime TEXT NOT NULL,
        winner TEXT,
        tie INTEGER NOT NULL,
        margin REAL,
        noise REAL,
        recorded_at REAL NOT NULL,
        UNIQUE (session_id, workload, regime)
    )
    """,
    "CREATE INDEX results_by_key ON results (workload, regime, recorded_at)",
    """
    CREATE TABLE candidate_stats (
        id INTEGER PRIMARY KEY,
        result_id INTEGER NOT NULL REFERENCES results (id) ON DELETE CASCADE,
        candidate TEXT NOT NULL,
        family TEXT NOT NULL,
        median_s REAL,
        spread REAL,
        samples INTEGER NOT NULL,
        rejected INTEGER NOT NULL,
        sm_clock_hz REAL,
        power_w REAL,
        temp_c REAL,
        energy_j_per_call REAL,
        reasons INTEGER NOT NULL,
        meta_json TEXT NOT NULL,
        UNIQUE (result_id, candidate)
    )
    """,
    # No ON DELETE CASCADE from sessions: deleting a session a winner points at fails,
    # a second guard behind prune()'s own exclusion.
    f"""
    CREATE TABLE winners ({_WINNER_COLUMNS}
        PRIMARY KEY (gpu_model, versions_key, workload, regime)
    )
    """,
    "CREATE INDEX winners_by_session ON winners (session_id)",
    "CREATE INDEX winners_by_result ON winners (result_id)",
    # Finished sessions per status, bumped in the transaction that finishes one, so
    # gpuwatchd_tune_sessions_total survives restarts and prune().
    """
    CREATE TABLE session_totals (
        status TEXT PRIMARY KEY,
        n INTEGER NOT NULL
    )
    """,
)

# The process that started a session, so a later start can tell a session whose process
# is gone (killed, crashed) from one another live process is still running.
_OWNER = sql_migration(
    2,
    "sessions record their owner process",
    "ALTER TABLE sessions ADD COLUMN owner_pid INTEGER",
)

# A fleet shares one store: each host keeps its own winners beside the fleet's, two hosts
# that disagree beyond noise are recorded instead of overwriting each other, hosts lease
# work so they do not all tune the same thing, and report their sustained clocks.
_FLEET = sql_migration(
    3,
    "fleet: host winners, disagreements, claims, host clocks",
    f"""
    CREATE TABLE host_winners (
        host TEXT NOT NULL,{_WINNER_COLUMNS}
        PRIMARY KEY (host, gpu_model, versions_key, workload, regime)
    )
    """,
    # One index, for the foreign-key check when prune() deletes sessions. Not one per
    # column as winners has: every index is another page written each time a session
    # completes, and a results row a host winner points at is never deleted (its session
    # is kept), so that check scans a table of (hosts x keys) rows only when pruning.
    "CREATE INDEX host_winners_by_session ON host_winners (session_id)",
    # Every winner so far was measured by its session's host: that host's own pick too.
    """
    INSERT INTO host_winners (host, gpu_model, versions_key, driver_version, cuda_version,
        torch_version, triton_version, cudnn_version, workload, regime, candidate, family,
        median_s, sm_clock_hz, margin, tie, session_id, result_id, gpu_uuid, measured_at)
    SELECT s.host, w.gpu_model, w.versions_key, w.driver_version, w.cuda_version,
        w.torch_version, w.triton_version, w.cudnn_version, w.workload, w.regime,
        w.candidate, w.family, w.median_s, w.sm_clock_hz, w.margin, w.tie, w.session_id,
        w.result_id, w.gpu_uuid, w.measured_at
    FROM winners w JOIN sessions s ON s.id = w.session_id
    """,
    # History, not references: a disagreement outlives the sessions it compared.
    """
    CREATE TABLE disagreements (
        id INTEGER PRIMARY KEY,
        gpu_model TEXT NOT NULL,
        versions_key TEXT NOT NULL,
        workload TEXT NOT NULL,
        regime TEXT NOT NULL,
        kept_candidate TEXT NOT NULL,
        kept_host TEXT NOT NULL,
        kept_gpu_uuid TEXT NOT NULL,
        kept_median_s REAL,
        new_candidate TEXT NOT NULL,
        new_host TEXT NOT NULL,
        new_gpu_uuid TEXT NOT NULL,
        new_median_s REAL,
        gap REAL NOT NULL,
        noise REAL,
        recorded_at REAL NOT NULL
    )
    """,
    "CREATE INDEX disagreements_by_time ON disagreements (recorded_at)",
    """
    CREATE TABLE claims (
        claim_key TEXT PRIMARY KEY,
        host TEXT NOT NULL,
        gpu_uuid TEXT NOT NULL,
        owner_pid INTEGER,
        claimed_at REAL NOT NULL,
        expires_at REAL NOT NULL
    )
    """,
    """
    CREATE TABLE host_clocks (
        host TEXT NOT NULL,
        gpu_uuid TEXT NOT NULL,
        gpu_model TEXT NOT NULL,
        power_limit_w REAL,
        sustained_clock_hz REAL NOT NULL,
        updated_at REAL NOT NULL,
        PRIMARY KEY (host, gpu_uuid)
    )
    """,
)

# Every per-GPU and per-host query of a fleet's store is indexed: a GPU's sessions (its
# last tune, what it may resume, what pruning keeps), a host's running sessions (at
# start), clocks by group and age (the fleet's medians, pruning), leases by expiry.
_INDEXES = sql_migration(
    4,
    "fleet indexes",
    "CREATE INDEX sessions_by_gpu ON sessions (gpu_uuid, status, ended_at)",
    "CREATE INDEX sessions_by_host ON sessions (host, status)",
    "CREATE INDEX host_clocks_by_group ON host_clocks (gpu_model, power_limit_w, updated_at)",
    "CREATE INDEX host_clocks_by_time ON host_clocks (updated_at)",
    "CREATE INDEX claims_by_expiry ON claims (expires_at)",
)

#: The table holding the oldest schema version whose daemons may write the database.
COMPAT_TABLE = "schema_compat"

# From here on daemons of two schema versions share a database (a rolling upgrade, a
# rollback): the database says which of them may write it.
_COMPAT = sql_migration(
    5,
    "schema compatibility for rolling upgrades",
    f"CREATE TABLE {COMPAT_TABLE} (min_writer INTEGER NOT NULL)",
    f"INSERT INTO {COMPAT_TABLE} (min_writer) VALUES (1)",
)

# A host name's lease names the boot and the process holding it, so a second machine
# with the same name and machine id (a cloned image) is told from a restart.
_LEASE_HOLDER = sql_migration(
    6,
    "host leases name their boot and process",
    "ALTER TABLE claims ADD COLUMN boot_id TEXT",
    "ALTER TABLE claims ADD COLUMN nonce TEXT",
)

# A grown fleet store: pruning deletes in batches through indexed foreign-key checks
# (host_winners' result_id was scanned once per deleted result), the session totals are
# counted per GPU (one fleet-wide row per status made every finishing host queue behind
# a stalled one), and a host's sync reads only its own GPU models' disagreements. Only
# additions: a daemon one version older runs beside it on the same database.
_FLEET_SCALE = sql_migration(
    7,
    "fleet at scale: batch pruning, per-GPU session totals, per-model reads, kept medians",
    "CREATE INDEX host_winners_by_result ON host_winners (result_id)",
    """
    CREATE TABLE gpu_session_totals (
        gpu_uuid TEXT NOT NULL,
        status TEXT NOT NULL,
        n INTEGER NOT NULL,
        PRIMARY KEY (gpu_uuid, status)
    )
    """,
    "CREATE INDEX disagreements_by_model ON disagreements (gpu_model, recorded_at)",
    "CREATE INDEX sessions_running_since ON sessions (status, started_at)",
    # The fleet's clock medians per group, recomputed by one host per sync interval
    # instead of by every host at every sync over every host's clocks.
    """
    CREATE TABLE clock_medians (
        gpu_model TEXT NOT NULL,
        watts INTEGER,
        median_hz REAL NOT NULL,
        peers INTEGER NOT NULL,
        computed_at REAL NOT NULL
    )
    """,
    "CREATE INDEX clock_medians_by_model ON clock_medians (gpu_model)",
    # Disagreements counted per key as they are recorded (and pruned), so a sync reads a
    # row per key instead of counting a month of them.
    """
    CREATE TABLE disagreement_totals (
        gpu_model TEXT NOT NULL,
        workload TEXT NOT NULL,
        regime TEXT NOT NULL,
        n INTEGER NOT NULL,
        PRIMARY KEY (gpu_model, workload, regime)
    )
    """,
    """
    INSERT INTO disagreement_totals (gpu_model, workload, regime, n)
    SELECT gpu_model, workload, regime, COUNT(*) FROM disagreements
    GROUP BY gpu_model, workload, regime
    """,
)

#: Every migration, in order. Append only (one line each).
MIGRATIONS: tuple[Migration, ...] = (
    _INITIAL,
    _OWNER,
    _FLEET,
    _INDEXES,
    _COMPAT,
    _LEASE_HOLDER,
    _FLEET_SCALE,
)
#: The first version that records which daemons may write (:data:`COMPAT_TABLE`).
COMPAT_VERSION = _COMPAT.version
#: The first version whose host leases name their holder's boot and process.
LEASE_HOLDER_VERSION = _LEASE_HOLDER.version


def latest_version(migrations: Sequence[Migration]) -> int:
    return migrations[-1].version if migrations else 0


def check_migrations(migrations: Sequence[Migration]) -> None:
    """Refuse a migration list that is not numbered 1, 2, 3, ... in order."""
    for i, m in enumerate(migrations, start=1):
        if m.version != i:
            raise StoreError(f"migration {m.name!r} has version {m.version}, expected {i}")


@dataclass(frozen=True, slots=True)
class SchemaState:
    """The database's schema against this daemon's: ``database`` is its version,
    ``own`` the latest this gpuwatchd knows, ``min_writer`` the oldest version that may
    write it (known only when the database is newer)."""

    database: int
    own: int
    min_writer: int = 0

    @property
    def skew(self) -> int:
        """The database's version minus this daemon's (> 0: a newer daemon migrated it)."""
        return self.database - self.own

    @property
    def writable(self) -> bool:
        """Whether this daemon may write: the database is at most as new as it, or newer
        by additive steps only (and this daemon knows the compatibility record)."""
        if self.database <= self.own:
            return True
        return self.own >= COMPAT_VERSION and self.min_writer <= self.own

    def describe(self, where: str) -> str:
        """One line for the log: the skew and what this daemon does about it."""
        if self.writable:
            return (
                f"store {where} has schema version {self.database}, newer than this"
                f" gpuwatchd's {self.own}; its changes are additive: monitoring, tuning and"
                " writes go on"
            )
        needs = max(self.min_writer, COMPAT_VERSION)
        return (
            f"store {where} has schema version {self.database}, newer than this gpuwatchd's"
            f" {self.own} and not compatible (it needs version {needs} or newer to write)"
            ": monitoring and reads go on, tuning and writes stop until"
            " gpuwatchd is upgraded"
        )


def read_state(conn: Conn, version: int, migrations: Sequence[Migration]) -> SchemaState:
    """The schema state of a database at ``version``, read on ``conn``."""
    own = latest_version(migrations)
    if version <= own:
        return SchemaState(version, own)
    if version < COMPAT_VERSION:  # no record: only an identical schema is safe
        return SchemaState(version, own, version)
    row = conn.execute(f"SELECT MAX(min_writer) AS min_writer FROM {COMPAT_TABLE}").fetchone()
    return SchemaState(version, own, int(row["min_writer"] or 0))


def record_min_writer(conn: Conn, m: Migration) -> None:
    """Inside ``m``'s transaction: record that daemons older than its ``min_writer``
    may no longer write (nothing for an additive step)."""
    if m.min_writer is not None and m.version >= COMPAT_VERSION:
        conn.execute(f"UPDATE {COMPAT_TABLE} SET min_writer = ?", (int(m.min_writer),))


class SchemaTooNew(StoreError):
    """The database's schema is newer than this gpuwatchd and not compatible with it."""


def refuse_newer(state: SchemaState, where: str) -> None:
    """Raise SchemaTooNew when this gpuwatchd may not use the database (read-only
    readers: ``gpuwatchd report``, the client API)."""
    if not state.writable:
        raise SchemaTooNew(
            f"store {where} has schema version {state.database}, newer than this gpuwatchd"
            f" knows ({state.own}); upgrade gpuwatchd or point --store elsewhere"
        )
