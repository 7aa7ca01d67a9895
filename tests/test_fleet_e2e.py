"""A fleet on one machine: four daemons share a real PostgreSQL store, a real Prometheus
scrapes them all: the fleet, end to end.

The hosts are identical (the same simulated H200, same versions) and run the same
production job: three with working fans (``periodic-job``) and one whose fans are failing
(``fan-failure``, started 3.5 simulated hours into its decline with ``sim.start_s``, so
its first burst is already >5% slower). Every host wants to tune the default sim
workloads; the fleet must tune each once (claims, then fresh fleet winners) and hand the
winners to the others, and the slow host must stand out in the fleet metric and in
GpuwatchdHostSlowerThanFleet, in a real Prometheus.

At ``SPEED`` 60 a simulated minute takes a second: the production job's first burst
starts 1 s after a daemon starts, its learned clock is there 1.5 s later (the drift
settings below are shortened for it), and the first tuning window (after the burst,
once the gate has settled) opens ~7 s after start.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from builders import free_port
from fleet_helpers import (
    FleetHost,
    HostSpec,
    config_text,
    start_fleet_daemon,
    write_fleet_prometheus_config,
)
from pg_server import PASSWORD, PostgresServer
from prom_helpers import (
    JOB,
    PromApi,
    find_prometheus,
    log_tail,
    start_prometheus,
    stop_process,
    wait_until,
    write_test_rules,
)

from gpuwatchd.client import Client
from gpuwatchd.sessions.plan import runnable_workloads
from gpuwatchd.store import open_store
from gpuwatchd.store.rows import SessionStatus
from gpuwatchd.tuning.settings import TuningSetup

#: Slow end to end: the README's test command runs these in its second step.
pytestmark = pytest.mark.slow

PROMETHEUS = find_prometheus()
SPEED = 60.0
#: 3.5 h into fan-failure's decline: its next burst is >5% under a healthy host's.
FAN_FAILURE_START_S = 3.5 * 3600
HOSTS = (
    HostSpec("host-a", "periodic-job", seed=1),
    HostSpec("host-b", "periodic-job", seed=2),
    HostSpec("host-c", "periodic-job", seed=3),
    HostSpec("host-d", "fan-failure", seed=4, start_s=FAN_FAILURE_START_S),
)
SLOW_HOST = "host-d"
ALERT = "GpuwatchdHostSlowerThanFleet"
#: alerts.yml waits 15 minutes; the test's copy (prom_helpers.write_test_rules) only
#: shortens `for:`, to three rule evaluations, so the alert still goes through pending.
TEST_FOR = "3s"
#: What the sim backend tunes by default: the workloads the fleet must tune once each.
WORKLOADS = tuple(w.name for w in runnable_workloads(TuningSetup(), "sim"))
REGIMES = ("unthrottled", "sustained")
#: Real seconds to wait for each outcome (the whole module stays well under 2 minutes).
START_TIMEOUT_S = 30.0
TUNED_TIMEOUT_S = 45.0
ALERT_TIMEOUT_S = 45.0


def _config(host: FleetHost, store_url: str, password_file: Path) -> dict[str, dict[str, Any]]:
    spec = host.spec
    return {
        "daemon": {
            "backend": "sim",
            "listen": host.instance,
            "poll_interval_s": 0.1,
            "state_dir": str(host.work / "state"),
            "control_socket": str(host.work / "control.sock"),
        },
        "sim": {
            "scenario": spec.scenario,
            "seed": spec.seed,
            "speed": SPEED,
            "start_s": spec.start_s,
        },
        # One sample every 6 simulated seconds: the gate's window must hold 5 of them.
        "gate": {"window_s": 40.0},
        "tuning": {"check_interval_s": 0.5},
        # The learned clock 90 simulated seconds into a burst (not 180), kept between
        # bursts (the window spans two 15-minute job cycles) so the fleet series never gap.
        "drift": {
            "settle_s": 30.0,
            "min_load_s": 60.0,
            "min_samples": 8,
            "window_s": 1800.0,
            "check_interval_s": 1.0,
        },
        "store": {"url": store_url, "password_file": str(password_file)},
        # verify_fraction 0: no host measures the fleet's answer again (the default 5%
        # would, for a hash-chosen share of the work); a short lease so work claimed
        # elsewhere is looked at again within seconds.
        "fleet": {"sync_interval_s": 1.0, "verify_fraction": 0.0, "claim_ttl_s": 15.0},
    }


@dataclass
class Fleet:
    hosts: dict[str, FleetHost]
    api: PromApi
    prometheus: subprocess.Popen[bytes]
    prometheus_log: Path
    store_url: str
    password_file: Path
    scraping_since: float = 0.0

    def check_alive(self) -> None:
        for host in self.hosts.values():
            host.check_alive()
        if self.prometheus.poll() is not None:
            raise AssertionError(f"prometheus exited:\n{log_tail(self.prometheus_log)}")

    def prometheus_ready(self) -> bool:
        self.check_alive()
        return self.api.ready()

    def by_instance(self) -> dict[str, str]:
        return {h.instance: name for name, h in self.hosts.items()}

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{log_tail(h.log, 15)}" for n, h in self.hosts.items())


@pytest.fixture(scope="module")
def fleet(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Fleet]:
    if PROMETHEUS is None:
        pytest.skip("Prometheus is not installed (/usr/bin/prometheus: apt install prometheus)")
    postgres: PostgresServer = request.getfixturevalue("postgres_server")
    root = tmp_path_factory.mktemp("fleet-e2e")
    db = postgres.new_database()
    password_file = root / "store-password"
    password_file.write_text(PASSWORD + "\n")
    store_url = postgres.tcp_url(db)
    hosts = {}
    for spec in HOSTS:
        work = root / spec.name
        work.mkdir()
        hosts[spec.name] = FleetHost(spec, f"127.0.0.1:{free_port()}", work)
    rules = write_test_rules(root / "alerts.yml", TEST_FOR)
    prom_config = write_fleet_prometheus_config(
        root / "prometheus.yml", [h.instance for h in hosts.values()], rules
    )
    prom_log, prom_listen = root / "prometheus.log", f"127.0.0.1:{free_port()}"
    prometheus = start_prometheus(PROMETHEUS, prom_config, root / "tsdb", prom_listen, prom_log)
    running = Fleet(
        hosts,
        PromApi(f"http://{prom_listen}"),
        prometheus,
        prom_log,
        store_url,
        password_file,
    )
    try:
        for host in hosts.values():
            config = host.work / "config.toml"
            config.write_text(config_text(_config(host, store_url, password_file)))
            start_fleet_daemon(host, config)
        for host in hosts.values():
            wait_until(host.answers, START_TIMEOUT_S, f"{host.spec.name} to answer")
        wait_until(running.prometheus_ready, 20, "Prometheus ready")
        running.scraping_since = time.time()
        yield running
    finally:
        for host in hosts.values():
            if host.proc is not None:
                stop_process(host.proc)
        stop_process(prometheus)


# -- (a) each workload tuned once, by one host; the others use its winners --------------


def _completed_hosts(fleet: Fleet) -> dict[str, set[str]]:
    """Workload -> the hosts whose completed sessions recorded results for it."""
    store = open_store(fleet.store_url, readonly=True, password_file=fleet.password_file)
    try:
        done: dict[str, set[str]] = {}
        for s in store.sessions(limit=500, status=SessionStatus.COMPLETED):
            for r in store.results(s.id):
                done.setdefault(r.result.workload, set()).add(s.meta.host)
        return done
    finally:
        store.close()


def _fleet_counters(host: FleetHost) -> tuple[float, float]:
    """(work skipped for a fresh fleet winner, work found claimed elsewhere) so far."""
    metrics = host.metrics()
    skipped = metrics["gpuwatchd_fleet_work_skipped_total"][(("reason", "fresh_fleet_winner"),)]
    claimed = metrics["gpuwatchd_fleet_claimed_elsewhere_total"][()]
    return skipped, claimed


def _tuner(done: dict[str, set[str]], workload: str) -> str:
    hosts = done.get(workload, set())
    assert len(hosts) == 1, f"{workload}: completed sessions on {sorted(hosts)}, not on one host"
    return next(iter(hosts))


def test_each_workload_is_tuned_by_one_host_and_served_to_all(fleet: Fleet) -> None:
    assert WORKLOADS, "the sim backend tunes no workload by default"

    def all_tuned() -> dict[str, set[str]]:
        fleet.check_alive()
        done = _completed_hosts(fleet)
        return done if set(WORKLOADS) <= set(done) else {}

    def others_declined(others: set[str]) -> bool:
        """Each other host asked and was told no (the counters count every workload):
        claimed by the tuner while it ran, or skipped for its fresh winner afterwards."""
        fleet.check_alive()
        return all(any(_fleet_counters(fleet.hosts[name])) for name in others)

    try:
        done = wait_until(all_tuned, TUNED_TIMEOUT_S, f"completed sessions tuning {WORKLOADS}")
        tuners = {w: _tuner(done, w) for w in WORKLOADS}
        others = {n for w in WORKLOADS for n in fleet.hosts if n != tuners[w]}
        wait_until(lambda: others_declined(others), 20, f"{sorted(others)} declining the work")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{fleet.logs()}") from None
    done = _completed_hosts(fleet)  # nobody tuned it again meanwhile
    assert {w: _tuner(done, w) for w in WORKLOADS} == tuners
    for workload, tuner in tuners.items():
        for name, host in fleet.hosts.items():
            # As a job on that host reads them: the daemon's /api/v1/winners, which it
            # reads from the store once per fleet sync (1 s here).
            want = {(regime, tuner) for regime in REGIMES}

            def served(url: str = host.url, w: str = workload) -> set[tuple[str, str | None]]:
                winners = Client(url=url, control_socket=False).winners(workload=w)
                return {(x.regime.value, x.host) for x in winners}

            wait_until(lambda want=want: served() == want, 5, f"{name} serving {workload}")


# -- (b) the slow host stands out: metric and alert in a real Prometheus ----------------


def _values(fleet: Fleet, expr: str) -> dict[str, float]:
    return {
        fleet.by_instance()[s["metric"]["instance"]]: float(s["value"][1])
        for s in fleet.api.vector(expr)
    }


def test_the_slow_host_is_flagged_by_the_metric_and_the_alert(fleet: Fleet) -> None:
    def firing() -> list[dict[str, Any]]:
        fleet.check_alive()
        return [
            a
            for a in fleet.api.alerts()
            if a["labels"]["alertname"] == ALERT and a["state"] == "firing"
        ]

    try:
        alerts = wait_until(firing, ALERT_TIMEOUT_S, f"{ALERT} firing")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{fleet.logs()}") from None
    slow = fleet.hosts[SLOW_HOST]
    assert {a["labels"]["instance"] for a in alerts} == {slow.instance}
    (alert,) = alerts
    assert alert["labels"]["job"] == JOB and alert["labels"]["gpu"] == "0"
    assert alert["labels"]["gpu_model"] == "NVIDIA H200 (simulated)"
    own = _values(fleet, "gpuwatchd_fleet_sustained_clock_hertz")
    median = _values(fleet, "gpuwatchd_fleet_median_sustained_clock_hertz")
    peers = _values(fleet, "gpuwatchd_fleet_peers")
    assert set(own) == set(median) == set(fleet.hosts), (own, median)
    assert set(peers.values()) == {float(len(HOSTS))}
    assert own[SLOW_HOST] < 0.95 * median[SLOW_HOST], (own, median)
    for name in set(fleet.hosts) - {SLOW_HOST}:
        assert own[name] >= 0.95 * median[name], (name, own, median)
    # Never pending nor firing for any other host, at any time since scraping began.
    window = f"{int(time.time() - fleet.scraping_since) + 5}s"
    ever = fleet.api.vector(
        f'count by (instance) (count_over_time(ALERTS{{alertname="{ALERT}"}}[{window}]))'
    )
    assert {s["metric"]["instance"] for s in ever} == {slow.instance}
    # The alert names the slow host's GPU, as that host wrote its clock to the store.
    store = open_store(fleet.store_url, readonly=True, password_file=fleet.password_file)
    try:
        clocks = {c.host: c for c in store.host_clocks()}
    finally:
        store.close()
    assert set(clocks) == set(fleet.hosts)
    assert alert["labels"]["uuid"] == clocks[SLOW_HOST].gpu_uuid
    assert len({c.gpu_uuid for c in clocks.values()}) == len(HOSTS)
