"""Tune once per fleet: pending work another host has answered is skipped, the rest claimed.

Hosts with the same GPU model and software stack get the same winners, so on a shared
store (PostgreSQL) a host skips a workload whose every regime already has a fresh winner
measured by another host, except for a ``verify_fraction`` share it measures again to
check the fleet. Work it does measure is claimed first (a lease in the store that lapses
if the host dies), so hosts whose gates open at the same time do not all tune it.

The decisions are pure functions of what the store returned (:func:`fleet_answer`,
:func:`plan_fleet`); :class:`FleetPolicy` adds the store calls. Library versions are
compared by :func:`~gpuwatchd.tuning.versions.changed_versions` against the versions
installed now (an injected ``versions_now``: the drift package's ``current_versions``).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from gpuwatchd.sessions.fleet_settings import FleetConfig
from gpuwatchd.store.rows import WinnerRow, host_name
from gpuwatchd.telemetry.types import DeviceInfo
from gpuwatchd.tuning.types import Regime, Versions, Workload
from gpuwatchd.tuning.versions import VersionsNow, changed_versions

log = logging.getLogger(__name__)

#: The ``reason`` of work skipped because the fleet already answered it.
SKIP_REASON = "fresh_fleet_winner"
#: Work claimed by another host is looked at again after at most this long (its session
#: may be preempted and give the claim back within seconds).
MAX_RECHECK_S = 30.0


class FleetQueries(Protocol):
    """What the fleet policy needs of a shared store."""

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


@dataclass(frozen=True, slots=True)
class FleetAnswer:
    """Another host's fresh winners for every regime of one workload."""

    workload: str
    measured_at: float  # the newest of the regimes' winners
    hosts: tuple[str, ...]  # who measured them, sorted


@dataclass(frozen=True, slots=True)
class FleetPlan:
    """What to do with a GPU's pending workloads: measure ``run``, skip ``skipped``.

    ``verify`` names the workloads in ``run`` that the fleet has answered and that are
    measured again to check it.
    """

    run: tuple[Workload, ...]
    skipped: tuple[tuple[Workload, FleetAnswer], ...] = ()
    verify: frozenset[str] = frozenset()


def claim_key(gpu_model: str, versions: Versions, workload: str) -> str:
    """The key a workload is claimed under: the same on every identical host."""
    return f"{gpu_model}|{versions.key()}|{workload}"


def verify_key(key: str, host: str) -> str:
    """The claim on ``host``'s verification of the work claimed as ``key``: hosts verify
    an answer side by side, each its own share (one claim for all would let them verify
    one after another, and most would find the answer re-measured and draw again), while
    the host's own GPUs take turns on it."""
    return f"{key}|verify:{host}"


def verify_share(host: str, gpu_model: str, workload: str, measured_at: float) -> float:
    """A stable number in [0, 1) for one host and one fleet answer.

    The same answer gives the same number on every tick (no re-verifying on each), and
    different hosts get different numbers (they verify different workloads).
    """
    text = "\0".join((host, gpu_model, workload, repr(float(measured_at))))
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def fleet_answer(
    rows: Iterable[WinnerRow],
    workload: str,
    regimes: Collection[Regime],
    *,
    gpu_model: str,
    versions: Versions,
    now: float,
    max_age_s: float,
) -> FleetAnswer | None:
    """The fleet's answer for ``workload`` in every one of ``regimes``, or None.

    A winner counts when it is for this GPU model, measured by a named host (this one's
    other GPUs included: a host measures each key once too) at most ``max_age_s`` ago,
    on a stack whose compared versions match ``versions``.
    """
    newest: dict[Regime, WinnerRow] = {}
    for row in rows:
        if row.workload != workload or row.regime not in regimes:
            continue
        if row.gpu_model != gpu_model or row.host is None:
            continue
        if now - row.measured_at > max_age_s or changed_versions(row.versions, versions):
            continue
        best = newest.get(row.regime)
        if best is None or row.measured_at > best.measured_at:
            newest[row.regime] = row
    if not regimes or set(newest) != set(regimes):
        return None
    return FleetAnswer(
        workload,
        max(r.measured_at for r in newest.values()),
        tuple(sorted({r.host for r in newest.values() if r.host is not None})),
    )


def plan_fleet(
    workloads: Sequence[Workload],
    answers: Mapping[str, FleetAnswer],
    *,
    host: str,
    gpu_model: str,
    verify_fraction: float,
    must_measure: Collection[str] = (),
    draw_at: Mapping[str, float] | None = None,
) -> FleetPlan:
    """Split ``workloads`` into work to measure and work the fleet answered.

    A workload in ``must_measure`` is measured whatever the fleet says; one another host
    answered is measured again when its :func:`verify_share` falls under
    ``verify_fraction``; one only this host answered (on another of its GPUs) never is.
    The share is drawn on ``draw_at``'s measurement time for the workload where given,
    else on the answer's.
    """
    draw_at = draw_at or {}
    run: list[Workload] = []
    skipped: list[tuple[Workload, FleetAnswer]] = []
    verify: set[str] = set()
    for w in workloads:
        answer = answers.get(w.name)
        if answer is None or w.name in must_measure:
            run.append(w)
        elif answer.hosts != (host,) and (
            verify_share(host, gpu_model, w.name, draw_at.get(w.name, answer.measured_at))
            < verify_fraction
        ):
            run.append(w)
            verify.add(w.name)
        else:
            skipped.append((w, answer))
    return FleetPlan(tuple(run), tuple(skipped), frozenset(verify))


@dataclass(frozen=True, slots=True)
class Claimed:
    """The outcome of claiming a GPU's work: ``keys`` (workload -> key) held by this
    host, and the workloads another holder has."""

    keys: dict[str, str]
    elsewhere: tuple[str, ...]


class FleetPolicy:
    """The fleet's rules on one shared store, for this host.

    ``measure_anyway`` lists request reasons whose work is measured even when the fleet
    has answered it (an operator's explicit re-tune, a change on this host's own GPU).
    ``cfg`` may be replaced on a config reload.
    """

    def __init__(
        self,
        store: FleetQueries,
        cfg: FleetConfig,
        *,
        host: str,
        versions_now: VersionsNow,
        measure_anyway: Collection[str] = (),
        now: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.cfg = cfg
        self.host = host
        self._versions_now = versions_now
        self.measure_anyway = frozenset(str(r) for r in measure_anyway)
        self._now = now
        self._lock = threading.Lock()  # sessions' threads plan at once
        self._drawn: dict[str, float] = {}  # per claim key: the answer its share is drawn on

    @property
    def active(self) -> bool:
        return self.cfg.enabled

    @property
    def recheck_s(self) -> float:
        """How long work claimed elsewhere waits before this host looks at it again."""
        return min(self.cfg.renew_every_s, MAX_RECHECK_S)

    def versions(self, info: DeviceInfo) -> Versions:
        """The stack installed now for the GPU ``info`` describes."""
        return self._versions_now(info)

    def plan(
        self,
        info: DeviceInfo,
        versions: Versions,
        workloads: Sequence[Workload],
        regimes: Collection[Regime],
        reasons: Mapping[str, Collection[str]],
    ) -> FleetPlan:
        """Read the fleet's fresh winners for this GPU model and split the work."""
        cfg = self.cfg
        rows = self.store.fleet_winners(info.name, cfg.max_winner_age_s)
        now = self._now()
        answers: dict[str, FleetAnswer] = {}
        for w in workloads:
            found = fleet_answer(
                rows, w.name, regimes, gpu_model=info.name, versions=versions,
                now=now, max_age_s=cfg.max_winner_age_s,
            )  # fmt: skip
            if found is not None:
                answers[w.name] = found
        must = {n for n, why in reasons.items() if self.measure_anyway.intersection(why)}
        return plan_fleet(
            workloads,
            answers,
            host=self.host,
            gpu_model=info.name,
            verify_fraction=cfg.verify_fraction,
            must_measure=must,
            draw_at=self._draw_at(info.name, versions, answers, now),
        )

    def _draw_at(
        self, gpu_model: str, versions: Versions, answers: Mapping[str, FleetAnswer], now: float
    ) -> dict[str, float]:
        """Per workload, the answer this host draws its verify share on: the first it saw
        while that one stays fresh. Verifications re-measure an answer within minutes of
        each other, and a GPU that looked after one landed would draw again: the host would
        verify more than its share, on several GPUs."""
        max_age_s = self.cfg.max_winner_age_s
        out: dict[str, float] = {}
        with self._lock:
            for key, seen in list(self._drawn.items()):
                if now - seen > max_age_s:
                    del self._drawn[key]
            for name, answer in answers.items():
                key = claim_key(gpu_model, versions, name)
                out[name] = self._drawn.setdefault(key, answer.measured_at)
        return out

    def claim(
        self,
        info: DeviceInfo,
        versions: Versions,
        workloads: Sequence[Workload],
        verify: Collection[str] = (),
    ) -> Claimed:
        """Claim each workload for this host and GPU (those in ``verify`` under this
        host's :func:`verify_key`); a store error gives back what was claimed before it
        and is raised."""
        keys: dict[str, str] = {}
        elsewhere: list[str] = []
        try:
            for w in workloads:
                key = claim_key(info.name, versions, w.name)
                if w.name in verify:
                    key = verify_key(key, self.host)
                if self.store.claim(key, self.host, info.uuid, self.cfg.claim_ttl_s):
                    keys[w.name] = key
                else:
                    elsewhere.append(w.name)
        except Exception:
            self.release(info.uuid, keys.values())
            raise
        return Claimed(keys, tuple(elsewhere))

    def renew(self, gpu_uuid: str, keys: Mapping[str, str]) -> tuple[str, ...]:
        """Extend this GPU's claims by a full lease; the workloads whose claim was lost."""
        lost = []
        for name, key in keys.items():
            if not self.store.claim(key, self.host, gpu_uuid, self.cfg.claim_ttl_s):
                lost.append(name)
        return tuple(lost)

    def release(self, gpu_uuid: str, keys: Iterable[str]) -> None:
        """Give the claims back; one that fails is logged and lapses with its lease."""
        for key in keys:
            try:
                self.store.release(key, self.host, gpu_uuid)
            except Exception as exc:
                log.warning("releasing the claim on %s failed (it lapses by itself): %s", key, exc)


def fleet_policy(
    store: object,
    cfg: FleetConfig,
    *,
    versions_now: VersionsNow,
    measure_anyway: Collection[str] = (),
    host: str | None = None,
) -> FleetPolicy | None:
    """The policy for ``store`` when it is shared by several hosts (its ``shared`` is
    true), else None. ``host`` defaults to :func:`~gpuwatchd.store.rows.host_name`.

    On an embedded store every winner is this host's own: nothing to skip or claim.
    ``cfg.enabled`` is read at each decision, so a reload can turn the fleet off and on.
    """
    if not getattr(store, "shared", False):
        return None
    fleet_store: FleetQueries = store  # type: ignore[assignment]  # shared: a SqlStore
    return FleetPolicy(
        fleet_store,
        cfg,
        host=host if host is not None else host_name(),
        versions_now=versions_now,
        measure_anyway=measure_anyway,
    )
