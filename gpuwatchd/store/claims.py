"""Leases on work in a shared store, so hosts free at the same time don't tune the same thing.

A claim is one row per key. Taking it is one conditional upsert: it succeeds when the
key is free, its lease has expired (the holder died or gave up) or the same (host, GPU)
already holds it, which renews it. The store runs it in a write transaction, and
writers are serialised on both engines, so of two hosts racing exactly one wins.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpuwatchd.store.columns import CLAIM_COLUMNS, insert
from gpuwatchd.store.conn import Conn

#: The claim on a host name (held by one machine id at a time) is keyed by this and the
#: name; its ``gpu_uuid`` column holds the machine id. Work claims never start so.
HOST_CLAIM_PREFIX = "host:"


def take_sql(columns: Sequence[str] = CLAIM_COLUMNS, also_same_holder: str = "") -> str:
    """The upsert that takes or renews a claim row, returning its key when it did.

    It takes the row when free or lapsed, or when the same (host, GPU) holds it, and
    ``also_same_holder`` (SQL, ``AND ...``) narrows that; the ``columns`` past
    :data:`CLAIM_COLUMNS` are overwritten with the rest.
    """
    more = "".join(f",\n        {c} = excluded.{c}" for c in columns[len(CLAIM_COLUMNS) :])
    return insert(
        "claims",
        columns,
        f"""ON CONFLICT (claim_key) DO UPDATE SET
        claimed_at = CASE
            WHEN claims.host = excluded.host AND claims.gpu_uuid = excluded.gpu_uuid
                 AND claims.expires_at > excluded.claimed_at
            THEN claims.claimed_at ELSE excluded.claimed_at END,
        host = excluded.host,
        gpu_uuid = excluded.gpu_uuid,
        owner_pid = excluded.owner_pid,
        expires_at = excluded.expires_at{more}
    WHERE claims.expires_at <= excluded.claimed_at
       OR (claims.host = excluded.host AND claims.gpu_uuid = excluded.gpu_uuid{also_same_holder})
    RETURNING claim_key""",
    )


_TAKE = take_sql()


def take(
    conn: Conn, key: str, host: str, gpu_uuid: str, pid: int, now: float, ttl_s: float
) -> bool:
    """Take or renew the lease on ``key`` until ``now + ttl_s``; False when another holds it.

    A renewal keeps the original ``claimed_at``: how long this holder has had it.
    """
    row = conn.execute(_TAKE, (key, host, gpu_uuid, pid, now, now + ttl_s)).fetchone()
    return row is not None


def release(conn: Conn, key: str, host: str, gpu_uuid: str) -> None:
    """Give the lease back; a claim another (host, GPU) holds is left alone."""
    conn.execute(
        "DELETE FROM claims WHERE claim_key = ? AND host = ? AND gpu_uuid = ?",
        (key, host, gpu_uuid),
    )


def drop_expired(conn: Conn, now: float) -> int:
    """Delete leases that ran out: their holders are gone. Returns how many."""
    return int(conn.execute("DELETE FROM claims WHERE expires_at <= ?", (now,)).rowcount)


def live(conn: Conn, now: float, key: str | None = None) -> list[Any]:
    """The rows of the leases not expired at ``now`` (only ``key``'s when given), by key."""
    where, args = ("AND claim_key = ?", (now, key)) if key is not None else ("", (now,))
    sql = f"SELECT * FROM claims WHERE expires_at > ? {where} ORDER BY claim_key"
    return list(conn.execute(sql, args).fetchall())
