"""The arguments of the store's queries: filters, IN lists and enums, checked first.

Every value is bound as a parameter (``?``); only column names the store itself wrote
are put into the SQL text.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpuwatchd.store import codec
from gpuwatchd.store.errors import StoreError
from gpuwatchd.tuning.types import Regime, SessionStatus


def checked_models(gpu_models: Sequence[str]) -> Sequence[str]:
    """``gpu_models`` when it is a list of GPU model names; StoreError naming a bad one."""
    if isinstance(gpu_models, str):
        raise StoreError("gpu_models must be a list of GPU model names, not one string")
    for i, model in enumerate(gpu_models):
        codec.check_text(model, f"gpu_models[{i}]")
    return gpu_models


def models_clause(gpu_models: Sequence[str] | None) -> tuple[str, tuple[str, ...]]:
    """``AND gpu_model IN (?, ...)`` for ``gpu_models`` (nothing when None)."""
    if gpu_models is None:
        return "", ()
    return in_list("gpu_model", sorted(set(checked_models(gpu_models))))


def in_list(column: str, values: Sequence[str]) -> tuple[str, tuple[str, ...]]:
    """``AND column IN (?, ...)`` for ``values`` (``AND 1 = 0`` when there are none)."""
    if not values:
        return "AND 1 = 0", ()
    return f"AND {column} IN ({', '.join('?' for _ in values)})", tuple(values)


def checked_pairs(pairs: Sequence[tuple[str, Regime]]) -> set[tuple[str, Regime]]:
    """(workload, regime) pairs, checked; StoreError naming the first bad one."""
    out = set()
    for i, pair in enumerate(pairs):
        ok = (
            isinstance(pair, tuple)
            and len(pair) == 2
            and isinstance(pair[0], str)
            and bool(pair[0])
            and isinstance(pair[1], Regime)
        )
        if not ok:
            raise StoreError(f"pairs[{i}]: expected a (workload, Regime) tuple, got {pair!r}")
        out.add(pair)
    return out


def enum_value(v: Regime | SessionStatus | None) -> str | None:
    """An enum filter's stored text; anything but the enum is refused with a clear error."""
    if v is None:
        return None
    if not isinstance(v, Regime | SessionStatus):
        raise StoreError(f"expected a Regime or SessionStatus, got {v!r}")
    return v.value


def filters(**where: object) -> tuple[str, tuple[object, ...]]:
    """``WHERE a = ? AND b = ?`` for the columns whose value is not None."""
    used = {k: v for k, v in where.items() if v is not None}
    if not used:
        return "", ()
    return "WHERE " + " AND ".join(f"{k} = ?" for k in used), tuple(used.values())
