"""Every collector gpuwatchd exports, declared once (:data:`COLLECTORS`), and the registry
built from them.

A collector is listed here with the source it reads (a field of :class:`Sources`): the
daemon hands :func:`build_registry` its sources, and a collector whose source is absent
is left out (tests build a registry from a board alone). docs/contributing.md walks
through adding one.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.registry import Collector, CollectorRegistry

from gpuwatchd.drift.detector import GpuDriftView
from gpuwatchd.drift.fleet import FleetSnapshot
from gpuwatchd.exporter.collectors.base import GpuwatchdCollector, SubCollector, Versioned
from gpuwatchd.exporter.collectors.build_info import BuildInfoCollector, DaemonInfo
from gpuwatchd.exporter.collectors.control import ControlCollector
from gpuwatchd.exporter.collectors.drift import DriftCollector
from gpuwatchd.exporter.collectors.fleet import FleetCollector
from gpuwatchd.exporter.collectors.gpu import BoardCollector, GpuCollector
from gpuwatchd.exporter.collectors.health import HealthCollector
from gpuwatchd.exporter.collectors.mig import MigCollector
from gpuwatchd.exporter.collectors.periodic import PeriodicCollector
from gpuwatchd.exporter.collectors.pods import PodsCollector
from gpuwatchd.exporter.collectors.store import PendingCounts, StoreCollector, StoreView
from gpuwatchd.exporter.collectors.tls import ServedCertificate, TlsCertificateCollector
from gpuwatchd.exporter.collectors.tuning import TuningCollector
from gpuwatchd.monitor.board import StateBoard
from gpuwatchd.sessions.tuning_view import TuningSnapshot
from gpuwatchd.telemetry.pod_resources import PodSource


class ExporterRegistry(CollectorRegistry):
    """A registry that also lists its collectors in order, so a renderer can encode each
    on its own and reuse the text of those that did not change (prometheus_client keeps
    that list private)."""

    def __init__(self) -> None:
        super().__init__(auto_describe=False)
        self.parts: list[Collector] = []

    def register(self, collector: Collector) -> None:
        super().register(collector)
        self.parts.append(collector)

    def unregister(self, collector: Collector) -> None:
        super().unregister(collector)
        self.parts.remove(collector)


@dataclass(frozen=True, slots=True)
class Sources:
    """What the collectors read. ``None``: absent, and so is the collector reading it.

    ``fields`` is ``[exporter] fields`` (empty: every per-GPU family); ``pods`` the
    kubelet's pod map (a Kubernetes node); the callables return published snapshots.
    """

    board: StateBoard
    pods: PodSource | None = None
    fields: Collection[str] = ()
    tuning: Callable[[], TuningSnapshot] | None = None
    added: Callable[[], Collection[str]] = frozenset
    drift: Callable[[], dict[int, GpuDriftView]] | None = None
    store: StoreView | None = None
    pending: Callable[[], PendingCounts] = PendingCounts
    fleet: Callable[[], FleetSnapshot] | None = None
    periodic: Callable[[], Mapping[str, int]] | None = None
    control: Callable[[], int] | None = None


def _fleet(s: Sources) -> SubCollector | None:
    fleet, tuning = s.fleet, s.tuning
    if fleet is None or tuning is None:
        return None
    # Reads published snapshots only: its text is kept while they are unchanged.
    return Versioned(FleetCollector(fleet, tuning), lambda: (fleet(), tuning()), runs_inline=True)


#: Every sub-collector, in scrape order: its name (the ``collector`` label) and how it is
#: made from the sources (None where its source is absent).
COLLECTORS: tuple[tuple[str, Callable[[Sources], SubCollector | None]], ...] = (
    ("gpu", lambda s: GpuCollector(s.board, s.pods, s.fields)),
    ("gpu_health", lambda s: HealthCollector(s.board, s.pods, s.fields)),
    ("gpu_mig", lambda s: MigCollector(s.board, s.pods, s.fields)),
    ("pods", lambda s: None if s.pods is None else PodsCollector(s.pods)),
    (
        "tuning",
        lambda s: None if s.tuning is None else TuningCollector(s.board, s.tuning, s.added),
    ),
    ("drift", lambda s: None if s.drift is None else DriftCollector(s.drift)),
    ("store", lambda s: None if s.store is None else StoreCollector(s.store, s.pending)),
    ("fleet", _fleet),
    ("periodic", lambda s: None if s.periodic is None else PeriodicCollector(s.periodic)),
    ("control", lambda s: None if s.control is None else ControlCollector(s.control)),
)
#: The per-GPU collectors whose families ``[exporter] fields`` chooses from.
SELECTABLE: tuple[type[BoardCollector], ...] = (GpuCollector, HealthCollector, MigCollector)


def selectable_fields() -> tuple[str, ...]:
    """Every family name ``[exporter] fields`` may list, in scrape order."""
    return tuple(name for c in SELECTABLE for name in c.families)


def build_registry(
    board: StateBoard,
    info: DaemonInfo,
    extra: Sequence[SubCollector] = (),
    pods: PodSource | None = None,
    fields: Collection[str] = (),
    *,
    sources: Sources | None = None,
    certificates: Callable[[], Sequence[ServedCertificate]] | None = None,
) -> ExporterRegistry:
    """A private registry (never the global one): build info, every collector of
    :data:`COLLECTORS` whose source is given under the aggregator, then the served
    certificates' expiry.

    ``sources`` (the daemon's) replaces ``board``, ``pods`` and ``fields``; ``extra``
    sub-collectors (a test's own) are scraped after the declared ones.
    """
    given = sources if sources is not None else Sources(board, pods, fields)
    subs = [sub for _, make in COLLECTORS if (sub := make(given)) is not None]
    registry = ExporterRegistry()
    registry.register(BuildInfoCollector(info))
    registry.register(GpuwatchdCollector([*subs, *extra]))
    if certificates is not None:
        registry.register(TlsCertificateCollector(certificates))
    return registry
