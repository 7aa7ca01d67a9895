"""The ``fleet`` sub-collector: this host's sustained clocks against the fleet's, and what
the shared store saved this host from doing.

Reads only the :class:`FleetSnapshot` the daemon's fleet sync publishes (replaced whole)
and the scheduler's :class:`TuningSnapshot`, so a scrape takes no lock and does no I/O.
Fleet-wide facts (disagreements, coverage) are the same on every host: dashboards and
alerts take ``max by`` over instances.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpuwatchd.drift.fleet import RECENT_DISAGREEMENTS_S, FleetSnapshot
from gpuwatchd.exporter.collectors.gpu import GPU_LABELS
from gpuwatchd.sessions.tuning_view import TuningSnapshot

#: The labels of a comparable group of GPUs: same model, same power limit (whole watts).
GROUP_LABELS: tuple[str, str] = ("gpu_model", "power_limit_watts")
CLOCK_LABELS: tuple[str, ...] = (*GPU_LABELS, *GROUP_LABELS)
#: Why the scheduler skips work thanks to the fleet; exported at 0 from the start, so
#: rate() and increase() see the first skip.
SKIP_REASONS: tuple[str, ...] = ("fresh_fleet_winner",)


class FleetCollector:
    """Per-GPU fleet clock comparison, fleet-wide disagreements and coverage, fleet work."""

    name = "fleet"

    def __init__(
        self,
        snapshot: Callable[[], FleetSnapshot],
        tuning: Callable[[], TuningSnapshot],
        now: Callable[[], float] = time.time,
    ) -> None:
        self._snapshot = snapshot
        self._tuning = tuning
        self._now = now

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        families = [*_clocks(snap), *_store_facts(snap), *_work(self._tuning())]
        families += _sync(snap, self._now())
        return (f for f in families if f.samples)


def _clocks(snap: FleetSnapshot) -> list[Metric]:
    own = GaugeMetricFamily(
        "gpuwatchd_fleet_sustained_clock_hertz",
        "This host's learned sustained-load SM clock of the GPU, as written to the shared store.",
        labels=CLOCK_LABELS,
        unit="hertz",
    )
    median = GaugeMetricFamily(
        "gpuwatchd_fleet_median_sustained_clock_hertz",
        "Median learned sustained-load SM clock over the fleet's GPUs of the same model and "
        "power limit (fresh rows of the shared store, this host's included).",
        labels=CLOCK_LABELS,
        unit="hertz",
    )
    peers = GaugeMetricFamily(
        "gpuwatchd_fleet_peers",
        "GPUs of this model and power limit, across the fleet, in the fleet median.",
        labels=GROUP_LABELS,
    )
    seen = set()
    for clock in snap.own:
        group = snap.groups.get(clock.group)
        group_labels = [clock.group.gpu_model, clock.group.power_limit]
        labels = [str(clock.gpu), clock.uuid, *group_labels]
        own.add_metric(labels, clock.clock_hz)
        if group is None:
            continue
        median.add_metric(labels, group.median_hz)
        if clock.group not in seen:
            seen.add(clock.group)
            peers.add_metric(group_labels, float(group.peers))
    return [own, median, peers]


def _store_facts(snap: FleetSnapshot) -> list[Metric]:
    return [
        _counts_gauge(
            "gpuwatchd_fleet_disagreements",
            "Winners on which two hosts of the fleet disagree beyond noise, as recorded in the "
            "shared store and not yet pruned (the same on every host).",
            ("gpu_model", "workload", "regime"),
            snap.disagreements.items(),
        ),
        _counts_gauge(
            "gpuwatchd_fleet_recent_disagreements",
            f"Disagreements recorded in the shared store in the last "
            f"{RECENT_DISAGREEMENTS_S / 3600:g} hours (the same on every host): the fleet alert "
            "fires on a new one and resolves once it is older.",
            ("gpu_model", "workload", "regime"),
            snap.recent_disagreements.items(),
        ),
        _counts_gauge(
            "gpuwatchd_fleet_coverage_workloads",
            "Workloads with a fresh winner in the shared store, per GPU model and software "
            "stack (the same on every host).",
            ("gpu_model", "versions"),
            snap.coverage.items(),
        ),
    ]


def _counts_gauge(
    name: str,
    documentation: str,
    labels: tuple[str, ...],
    counts: Iterable[tuple[tuple[str, ...], int]],
) -> GaugeMetricFamily:
    """One gauge series per (label values, count) of ``counts``, sorted by label values."""
    family = GaugeMetricFamily(name, documentation, labels=labels)
    for key, n in sorted(counts):
        family.add_metric(list(key), float(n))
    return family


def _work(tuning: TuningSnapshot) -> list[Metric]:
    skipped = CounterMetricFamily(
        "gpuwatchd_fleet_work_skipped",
        "Tuning work this daemon skipped since it started because the fleet had done it, "
        "by reason.",
        labels=("reason",),
    )
    counts = dict.fromkeys(SKIP_REASONS, 0) | tuning.fleet_skipped_total
    for reason, n in sorted(counts.items()):
        skipped.add_metric([reason], float(n))
    verified = CounterMetricFamily(
        "gpuwatchd_fleet_verified",
        "Fleet winners this daemon measured again to check them (tuning.verify_fraction), "
        "since it started.",
    )
    verified.add_metric([], float(tuning.fleet_verified_total))
    claimed = CounterMetricFamily(
        "gpuwatchd_fleet_claimed_elsewhere",
        "Workloads this daemon left alone since it started because another host held the "
        "claim on them.",
    )
    claimed.add_metric([], float(tuning.claimed_elsewhere_total))
    return [skipped, verified, claimed]


def _sync(snap: FleetSnapshot, now: float) -> list[Metric]:
    age = GaugeMetricFamily(
        "gpuwatchd_fleet_sync_age_seconds",
        "Seconds since this daemon last read the fleet's clocks, disagreements and coverage "
        "from the shared store; the fleet series are that old.",
        unit="seconds",
    )
    success = GaugeMetricFamily(
        "gpuwatchd_fleet_sync_success",
        "1 if the latest fleet sync with the shared store succeeded, else 0 (the fleet "
        "series are then from the last one that did).",
    )
    if snap.synced_at is not None:
        age.add_metric([], max(0.0, now - snap.synced_at))
    if snap.synced_at is not None or snap.stale:
        success.add_metric([], 0.0 if snap.stale else 1.0)
    return [age, success]
