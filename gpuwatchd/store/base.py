"""The store as its users see it, whichever database holds it.

The daemon, the CLI, the client API, drift and report type against :class:`TuningStore`;
:func:`gpuwatchd.store.open_store` picks the back end from the configured location.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from gpuwatchd.store.owner import Alive
from gpuwatchd.store.rows import (
    Claim,
    ClockMedian,
    Disagreement,
    HostClock,
    SessionMeta,
    SessionRow,
    StoredResult,
    WinnerRow,
)
from gpuwatchd.tuning.types import Regime, RegimeResult, SessionStatus, Versions


@runtime_checkable
class TuningStore(Protocol):
    """Sessions, their results and the winners, in one transactional store."""

    readonly: bool

    @property
    def where(self) -> str:
        """The store in messages: a file's path or a URL without its password."""
        ...

    @property
    def shared(self) -> bool:
        """Several hosts use this store (PostgreSQL): the fleet's winners and claims."""
        ...

    @property
    def up(self) -> bool:
        """The store is open and its last call reached it (see :meth:`probe`)."""
        ...

    def probe(self) -> None:
        """Reach the store now, opening it if it never was; StoreError if it cannot."""
        ...

    def close(self) -> None: ...

    def schema_version(self) -> int: ...

    def start_session(self, meta: SessionMeta) -> int: ...

    def set_session_versions(self, session_id: int, versions: Versions) -> None: ...

    def finish_session(
        self,
        session_id: int,
        status: SessionStatus,
        why: str | None = None,
        *,
        ended_at: float | None = None,
    ) -> None: ...

    def abandon_running(self, why: str = ..., *, alive: Alive = ...) -> int: ...

    def session(self, session_id: int) -> SessionRow | None: ...

    def sessions(
        self,
        limit: int = 50,
        status: SessionStatus | None = None,
        gpu_uuid: str | None = None,
    ) -> list[SessionRow]: ...

    def session_totals(self) -> dict[SessionStatus, int]: ...

    def running_count(self) -> int: ...

    def last_completed_at(self, gpu_uuid: str | None = None) -> float | None: ...

    def record_result(self, session_id: int, result: RegimeResult) -> None: ...

    def results(self, session_id: int) -> list[StoredResult]: ...

    def session_results(self, session_ids: Sequence[int]) -> dict[int, list[StoredResult]]: ...

    def latest_results(
        self,
        gpu_model: str | None = None,
        workload: str | None = None,
        regime: Regime | None = None,
        statuses: Sequence[SessionStatus] = ...,
    ) -> list[StoredResult]: ...

    def winners(
        self,
        gpu_model: str | None = None,
        workload: str | None = None,
        regime: Regime | None = None,
        versions: Versions | None = None,
        *,
        latest: bool = False,
        prefer_host: str | None = None,
    ) -> list[WinnerRow]: ...

    def winners_differ(self, workload: str, gpu_model: str | None = None) -> bool | None: ...

    def prune(self, older_than_s: float) -> int: ...

    def prune_clocks(self, older_than_s: float) -> int: ...

    # -- the fleet (hosts sharing one store) ----------------------------------------------

    def fleet_winners(
        self,
        gpu_model: str,
        max_age_s: float,
        *,
        versions: Versions | None = None,
        exclude_host: str | None = None,
    ) -> list[WinnerRow]: ...

    def claim(self, key: str, host: str, gpu_uuid: str, ttl_s: float) -> bool: ...

    def release(self, key: str, host: str, gpu_uuid: str) -> None: ...

    def claim_host(self, host: str, machine: str, ttl_s: float) -> str | None: ...

    def release_host(self, host: str, machine: str) -> None: ...

    def claims(self) -> list[Claim]: ...

    def disagreements(self, limit: int = 100) -> list[Disagreement]: ...

    def disagreement_counts(
        self, since: float | None = None
    ) -> dict[tuple[str, str, str], int]: ...

    def report_host_clock(self, clock: HostClock) -> None: ...

    def host_clocks(self, max_age_s: float | None = None) -> list[HostClock]: ...

    def clock_medians(self, max_age_s: float) -> list[ClockMedian]: ...

    # -- resuming a preempted session ---------------------------------------------------------

    def resumable_results(
        self,
        gpu_uuid: str,
        pairs: Sequence[tuple[str, Regime]],
        *,
        since: float,
        versions: Versions | None = None,
    ) -> dict[tuple[str, Regime], StoredResult]: ...

    def carry_results(self, to_session_id: int, results: Sequence[StoredResult]) -> int: ...
