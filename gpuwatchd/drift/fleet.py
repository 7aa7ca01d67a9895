"""The fleet's sustained clocks compared: per GPU model and power limit, the median over
every host's GPUs, and which GPUs fall more than 5% behind it.

A host with bad cooling or a lower power limit learns a lower sustained clock than its
identical peers; compared with the fleet's median it stands out. The daemon (through
:class:`FleetSnapshot`, which the exporter reads) and ``gpuwatchd report --fleet`` both
use this module, so the metric, the alert's inputs and the report agree. Pure: rows in,
numbers out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields

from gpuwatchd.drift.config import DriftConfig
from gpuwatchd.sessions.fleet_settings import FleetConfig
from gpuwatchd.store.rows import ClockMedian, HostClock, WinnerRow, whole_watts
from gpuwatchd.tuning.types import Versions

#: A GPU whose sustained clock is more than this fraction under its group's median is an
#: outlier (prometheus/alerts.yml's GpuwatchdHostSlowerThanFleet uses the same 5%).
OUTLIER_SHORTFALL = 0.05
#: GPUs a group needs before an outlier is named: with two, "the median" is their mean
#: and either could be the slow one.
MIN_PEERS = 3
#: The ``versions`` label of a stack whose versions are all unknown (a simulated GPU).
UNKNOWN_VERSIONS = "unknown"
#: A host's sustained clock in the store older than this many drift windows (or fleet
#: syncs, if longer) is left out of the fleet's medians: that host is gone, or has not
#: seen sustained load for that long.
CLOCK_MAX_AGE_WINDOWS = 3.0


def clock_max_age_s(drift: DriftConfig, fleet: FleetConfig) -> float:
    """How old (seconds) a host's stored sustained clock may be and still count, for the
    daemon's metrics and ``report --fleet`` alike."""
    return CLOCK_MAX_AGE_WINDOWS * max(drift.window_s, fleet.sync_interval_s)


def power_limit_label(watts: float | None) -> str:
    """The power limit in whole watts as a label value ("" when unknown).

    NVML reports milliwatts: 699.999 W and 700 W are the same limit, grouped together.
    """
    whole = whole_watts(watts)
    return "" if whole is None else str(whole)


@dataclass(frozen=True, slots=True, order=True)
class ClockGroup:
    """GPUs whose sustained clocks are comparable: the same model at the same power limit."""

    gpu_model: str
    power_limit: str  # whole watts, see power_limit_label

    @classmethod
    def of(cls, gpu_model: str, power_limit_w: float | None) -> ClockGroup:
        return cls(gpu_model, power_limit_label(power_limit_w))


def is_outlier(clock_hz: float, median_hz: float, peers: int) -> bool:
    """More than :data:`OUTLIER_SHORTFALL` under the median, in a group of MIN_PEERS or more."""
    return peers >= MIN_PEERS and clock_hz < (1.0 - OUTLIER_SHORTFALL) * median_hz


@dataclass(frozen=True, slots=True)
class GroupClocks:
    """One group's GPUs (by host, then GPU UUID) and the median of their sustained clocks."""

    group: ClockGroup
    clocks: tuple[HostClock, ...]
    median_hz: float
    #: How many GPUs the median is over, when ``clocks`` was not read (the store computed
    #: the median: :func:`groups_from_medians`).
    counted: int | None = None

    @property
    def peers(self) -> int:
        """GPUs in the median, this host's included."""
        return self.counted if self.counted is not None else len(self.clocks)

    def ratio(self, clock_hz: float) -> float:
        """A clock as a fraction of the group's median (0.94: 6% under)."""
        return clock_hz / self.median_hz

    def is_outlier(self, clock_hz: float) -> bool:
        return is_outlier(clock_hz, self.median_hz, self.peers)

    def outliers(self) -> tuple[HostClock, ...]:
        return tuple(c for c in self.clocks if self.is_outlier(c.sustained_clock_hz))


def groups_from_medians(medians: Iterable[ClockMedian]) -> dict[ClockGroup, GroupClocks]:
    """Every group's median as the store computed it (no GPU's clock read), sorted."""
    out = {}
    for m in medians:
        group = ClockGroup.of(m.gpu_model, m.power_limit_w)
        out[group] = GroupClocks(group, (), m.median_hz, m.peers)
    return dict(sorted(out.items()))


def group_clocks(rows: Iterable[HostClock]) -> dict[ClockGroup, GroupClocks]:
    """Every group of the given (fresh) rows with its median, groups in sorted order."""
    by_group: dict[ClockGroup, list[HostClock]] = {}
    for row in rows:
        by_group.setdefault(ClockGroup.of(row.gpu_model, row.power_limit_w), []).append(row)
    if not by_group:
        return {}
    import statistics  # loaded once a fleet shows clocks (a lone host never pays its memory)

    return {
        group: GroupClocks(
            group,
            tuple(sorted(members, key=lambda c: (c.host, c.gpu_uuid))),
            statistics.median(c.sustained_clock_hz for c in members),
        )
        for group, members in sorted(by_group.items())
    }


def versions_label(versions: Versions) -> str:
    """A stack as a short label value: ``driver=580.159.04,cuda=12.8,torch=2.11.0``."""
    known = [(f.name, getattr(versions, f.name)) for f in fields(versions)]
    text = ",".join(f"{name}={value}" for name, value in known if value is not None)
    return text or UNKNOWN_VERSIONS


def coverage(winners: Iterable[WinnerRow]) -> dict[tuple[str, str], int]:
    """Workloads with a winner per (GPU model, versions label), keys in sorted order."""
    workloads: dict[tuple[str, str], set[str]] = {}
    for w in winners:
        workloads.setdefault((w.gpu_model, versions_label(w.versions)), set()).add(w.workload)
    return {key: len(names) for key, names in sorted(workloads.items())}


@dataclass(frozen=True, slots=True)
class OwnClock:
    """This host's learned sustained clock of one GPU, as it was written to the store."""

    gpu: int
    uuid: str
    group: ClockGroup
    clock_hz: float


#: The window of :attr:`FleetSnapshot.recent_disagreements`: a new disagreement alerts
#: for a day, then the alert resolves by itself.
RECENT_DISAGREEMENTS_S = 86400.0


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    """What the exporter shows about the fleet; replaced whole, read without locks or I/O.

    ``synced_at`` is the unix time of the last successful sync (None: never); ``stale``
    says the latest attempt failed, so every other field is from ``synced_at``.
    """

    own: tuple[OwnClock, ...] = ()
    groups: Mapping[ClockGroup, GroupClocks] = field(default_factory=dict)
    disagreements: Mapping[tuple[str, str, str], int] = field(default_factory=dict)
    coverage: Mapping[tuple[str, str], int] = field(default_factory=dict)
    synced_at: float | None = None
    stale: bool = False
    #: Disagreements recorded in the last :data:`RECENT_DISAGREEMENTS_S` (the alert's).
    recent_disagreements: Mapping[tuple[str, str, str], int] = field(default_factory=dict)
