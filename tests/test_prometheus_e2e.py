"""A real Prometheus scraping gpuwatchd on the simulated GPU: dashboard panels and alerts.

promtool's unit tests (test_alert_rules.py, test_dashboard.py) evaluate the rules and
queries on synthetic series; here Debian's Prometheus scrapes the real daemon, so a
label the exporter spells differently, a join that never matches or an alert template
that cannot render shows up as an empty panel or a silent alert.

Two stacks (daemon + Prometheus, own ports and directories) run side by side for the
whole module, one per scenario, so their warm-up overlaps: ``heat-soak`` (an L4 that
reaches thermal slowdown after ~4 simulated minutes) and ``idle`` (an H200 doing
nothing). At ``SPEED`` 30 a simulated minute takes 2 s.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from builders import free_port
from daemon_helpers import http_get
from dashboard_queries import iter_panels, load_dashboard, panel_queries, substitute
from metric_catalog import scan
from prom_helpers import (
    ALERT_RULES,
    JOB,
    REPO,
    PromApi,
    find_prometheus,
    grafana_regex_value,
    has_data,
    log_tail,
    seed_winners,
    shorten_for_durations,
    start_prometheus,
    start_sim_daemon,
    stop_process,
    wait_until,
    write_prometheus_config,
    write_test_rules,
)

#: Slow end to end: the README's test command runs these in its second step.
pytestmark = pytest.mark.slow

DASHBOARD = REPO / "grafana" / "gpuwatchd.json"
PROMETHEUS = find_prometheus()
GPUS = 2
SPEED = 30.0
# alerts.yml waits 1 min to 6 h before an alert fires. The test's copy of the rules is
# made programmatically (prom_helpers.write_test_rules: yaml load, set every `for:`,
# dump) with only the `for:` durations shortened to this; exprs, labels and
# annotations are the production ones. 3 s is still three evaluations, so an alert
# must go through pending before it fires.
TEST_FOR_S = 3
TEST_FOR = f"{TEST_FOR_S}s"
THERMAL_ALERT = "GpuwatchdThermalSlowdown"
SCENARIOS = ("heat-soak", "idle")
#: The GPUs the `gpu` dashboard variable selects per scenario: one GPU in heat-soak (so
#: a panel that ignores $gpu shows GPU 0 and fails), both (Grafana's "(0|1)") in idle.
GPU_SELECTION: dict[str, tuple[str, ...]] = {"heat-soak": ("1",), "idle": ("0", "1")}
#: Simulated seconds idle must run before "no alert" means anything: heat-soak's
#: L4 is in thermal slowdown from ~240 s, plus margin.
IDLE_SIM_S = 360.0
#: How long the dashboard test waits for slow-to-appear series (the tuning counters
#: appear at the tuner's first 5 s check) before failing on empty panels.
PANEL_DEADLINE_S = 30.0
#: The daemon evaluates drift 2 s after it starts and then every 30 s (real time); the
#: learned clock needs drift.settle_s + min_load_s (180 simulated s, 6 s at SPEED), so
#: the ratio appears at the second evaluation.
DRIFT_DEADLINE_S = 50.0
#: Config files per scenario. At SPEED a 0.1 s poll is one sample every 3 simulated
#: seconds, too few for the gate's default 5 s window (min_samples 5): idle's gate would
#: never open and the first tuning, which the tuning panels must show, never run.
DAEMON_CONFIG: dict[str, str] = {"idle": "[gate]\nwindow_s = 20.0\n"}

#: Metrics allowed to have no series at all for a target, and why; a panel query may come
#: back empty only while one of its metrics is absent for one of these reasons. If every
#: metric of an empty query exists, the query is wrong and the test fails.
ALLOWED_ABSENT: dict[str, str] = {
    "gpuwatchd_last_tune_timestamp_seconds": (
        "exported per GPU once a session completed on it: heat-soak's GPUs are busy and "
        "never tune. In idle the first sessions run within seconds, and "
        "test_tuning_panels_show_the_short_sim_sessions requires the panel there"
    ),
    "gpuwatchd_clock_drift_ratio": (
        "absent while the learned sustained clock is unknown: idle has no load. Heat-soak "
        "has load and seeded winners, and test_drift_panel_shows_the_learned_clock waits "
        "for it there"
    ),
    # Health fields a GPU may not have are absent, never 0.
    "gpuwatchd_gpu_memory_temperature_celsius": "the L4 (GDDR6) reports no memory temperature",
    "gpuwatchd_gpu_xid_errors_total": (
        "a counter per XID code appears with the first XID; neither scenario injects one"
    ),
    "gpuwatchd_gpu_ecc_errors_total": "absent where ECC is off",
    "gpuwatchd_gpu_remapped_rows": "absent where rows cannot be remapped (no HBM)",
    "gpuwatchd_gpu_row_remap_pending": "as above",
    "gpuwatchd_gpu_row_remap_failed": "as above",
    "gpuwatchd_gpu_pcie_replay_errors_total": "absent where NVML has no counter",
    "gpuwatchd_gpu_nvlink_tx_bytes_total": "absent without NVLink (the L4)",
    "gpuwatchd_gpu_nvlink_rx_bytes_total": "as above",
    "gpuwatchd_gpu_fan_speed_ratio": "absent on passively cooled boards",
    "gpuwatchd_gpu_process_memory_bytes": "absent while no compute process runs (idle has none)",
    "gpuwatchd_gpu_field_errors_total": "a series appears with a field's first failed read",
}

#: Winners recorded in a stack's store before its daemon starts: workload ->
#: (unthrottled, sustained) winner. One pair differs and one does not, so the winners
#: table's two branches (winners_differ yes/no) both have rows to show.
SEEDED_WINNERS: dict[str, dict[str, tuple[str, str]]] = {
    "idle": {"e2e-flip": ("tile-128", "tile-64"), "e2e-same": ("cublas", "cublas")},
    # Winners for heat-soak's L4 give the drift detector its reference clock.
    "heat-soak": {"e2e-same": ("cublas", "cublas")},
}
SEEDED_MODEL = {"idle": "NVIDIA H200 (simulated)", "heat-soak": "NVIDIA L4 (simulated)"}

#: Alerts other than the thermal one that may be pending or firing per scenario.
OTHER_ALERTS_ALLOWED: dict[str, dict[str, str]] = {
    "heat-soak": {
        # The L4 runs at its 72 W cap for the first ~4 simulated minutes, so with the
        # shortened `for:` the 15-minute average crosses 80 %: a true positive.
        "GpuwatchdPowerCapped": "the load is power-capped until the die reaches 87 °C",
        # The GPUs were never tuned, so the daemon queues their first tuning at start,
        # and the busy gate never lets it run: with `for:` cut to 3 s that is "pending
        # too long" (with the real 6 h it would need six hours of a busy GPU).
        "GpuwatchdRetunePending": "first tuning queued at start, the gate stays busy",
        # The seeded winners' 1.5 GHz reference is not the clock the soaked L4 holds.
        "GpuwatchdClockDrift": "the learned sustained clock is far from the seeded reference",
    },
    "idle": {
        # The re-tune test_tuning_panels_show_the_short_sim_sessions asks for waits for
        # the gate's 10 s settle time, longer than the 3 s `for:`.
        "GpuwatchdRetunePending": "a requested re-tune runs once the gate has settled",
    },
}


@dataclass
class Stack:
    """One scenario's daemon and Prometheus, and when they came up."""

    scenario: str
    instance: str  # the daemon's host:port, as Prometheus labels its series
    api: PromApi
    daemon: subprocess.Popen[bytes]
    prometheus: subprocess.Popen[bytes]
    daemon_log: Path
    prometheus_log: Path
    daemon_up: float = 0.0  # time.monotonic() when the daemon first answered
    scraping_since: float = 0.0  # unix time Prometheus was ready

    def sim_seconds(self) -> float:
        """Simulated time the daemon has run, at least (it started before it answered)."""
        return (time.monotonic() - self.daemon_up) * SPEED

    def check_alive(self) -> None:
        for name, proc, log in (
            ("gpuwatchd", self.daemon, self.daemon_log),
            ("prometheus", self.prometheus, self.prometheus_log),
        ):
            if proc.poll() is not None:
                raise AssertionError(
                    f"{self.scenario}: {name} exited with {proc.returncode}:\n{log_tail(log)}"
                )

    def daemon_answers(self) -> bool:
        self.check_alive()
        try:
            http_get(f"http://{self.instance}/healthz", timeout=1.0)
        except OSError:
            return False
        return True

    def scraped(self, scrapes: int) -> bool:
        """The target is up and Prometheus has at least ``scrapes`` samples of it."""
        self.check_alive()
        sel = f'up{{job="{JOB}", instance="{self.instance}"}}'
        now = self.api.vector(f"{sel} == 1")
        seen = self.api.vector(f"count_over_time({sel}[5m]) >= {scrapes}")
        return bool(now and seen)


def _start_stack(root: Path, scenario: str, rules: Path, request: pytest.FixtureRequest) -> Stack:
    assert PROMETHEUS is not None
    work = root / scenario
    work.mkdir()
    instance = f"127.0.0.1:{free_port()}"
    prom_listen = f"127.0.0.1:{free_port()}"
    daemon_log, prom_log = work / "gpuwatchd.log", work / "prometheus.log"
    if scenario in SEEDED_WINNERS:
        seed_winners(work / "state", SEEDED_MODEL[scenario], SEEDED_WINNERS[scenario])
    extra: list[str] = []
    if scenario in DAEMON_CONFIG:
        (work / "config.toml").write_text(DAEMON_CONFIG[scenario], encoding="utf-8")
        extra = ["--config", str(work / "config.toml")]
    daemon = start_sim_daemon(
        scenario, instance, work / "state", daemon_log, gpus=GPUS, speed=SPEED, extra=extra
    )
    request.addfinalizer(lambda: stop_process(daemon))
    config = write_prometheus_config(work / "prometheus.yml", instance, rules)
    prom = start_prometheus(PROMETHEUS, config, work / "tsdb", prom_listen, prom_log)
    request.addfinalizer(lambda: stop_process(prom))
    return Stack(
        scenario, instance, PromApi(f"http://{prom_listen}"), daemon, prom, daemon_log, prom_log
    )


@pytest.fixture(scope="module")
def stacks(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> dict[str, Stack]:
    """Both scenarios' stacks, started together, each up and scraped a few times."""
    if PROMETHEUS is None:
        pytest.skip("Prometheus is not installed (/usr/bin/prometheus: apt install prometheus)")
    root = tmp_path_factory.mktemp("prometheus-e2e")
    rules = write_test_rules(root / "alerts.yml", TEST_FOR)
    started = {s: _start_stack(root, s, rules, request) for s in SCENARIOS}
    for stack in started.values():
        wait_until(stack.daemon_answers, 20, f"gpuwatchd ({stack.scenario}) to answer")
        stack.daemon_up = time.monotonic()
    for stack in started.values():
        wait_until(
            lambda s=stack: s.check_alive() or s.api.ready(),
            20,
            f"Prometheus ({stack.scenario}) ready",
        )
        stack.scraping_since = time.time()
    for stack in started.values():
        wait_until(lambda s=stack: s.scraped(3), 20, f"3 scrapes of {stack.scenario}")
    return started


# -- the rules copy -----------------------------------------------------------------


def test_test_rules_differ_from_alerts_yml_only_in_for_durations(tmp_path: Path) -> None:
    original = yaml.safe_load(ALERT_RULES.read_text(encoding="utf-8"))
    copy = yaml.safe_load(write_test_rules(tmp_path / "r.yml", TEST_FOR).read_text("utf-8"))
    rules = [r for g in original["groups"] for r in g["rules"]]
    copied = [r for g in copy["groups"] for r in g["rules"]]
    assert len(copied) == len(rules) > 0
    for before, after in zip(rules, copied, strict=True):
        assert "for" in before, f"{before['alert']} has no for: (nothing to shorten)"
        assert after["for"] == TEST_FOR
        assert {k: v for k, v in after.items() if k != "for"} == {
            k: v for k, v in before.items() if k != "for"
        }
    assert shorten_for_durations(original, TEST_FOR) != original  # the input is untouched
    assert original == yaml.safe_load(ALERT_RULES.read_text(encoding="utf-8"))


# -- alerts -------------------------------------------------------------------------


def _gpu_alerts(stack: Stack, states: tuple[str, ...] = ("pending", "firing")) -> list[dict]:
    return [a for a in stack.api.alerts() if a["state"] in states]


def _alert_history(stack: Stack) -> dict[str, set[str]]:
    """Every alert that was pending or firing at any time so far -> its states.

    Prometheus keeps an ``ALERTS`` series for each pending/firing alert, so this sees
    an alert that fired and resolved between two looks at /api/v1/alerts.
    """
    window = f"{int(time.time() - stack.scraping_since) + 5}s"
    series = stack.api.vector(
        f"count by (alertname, alertstate) (count_over_time(ALERTS[{window}]))"
    )
    history: dict[str, set[str]] = {}
    for s in series:
        history.setdefault(s["metric"]["alertname"], set()).add(s["metric"]["alertstate"])
    return history


def _thermal_rule_is_healthy(stack: Stack) -> None:
    rule = stack.api.alerting_rules()[THERMAL_ALERT]
    assert rule["health"] == "ok", rule.get("lastError")
    assert rule["duration"] == TEST_FOR_S  # the shortened for:


def test_thermal_alert_fires_in_heat_soak(stacks: dict[str, Stack]) -> None:
    stack = stacks["heat-soak"]

    def thermal_firing() -> list[dict[str, Any]]:
        stack.check_alive()
        firing = [
            a for a in _gpu_alerts(stack, ("firing",)) if a["labels"]["alertname"] == THERMAL_ALERT
        ]
        return firing if {a["labels"]["gpu"] for a in firing} == {"0", "1"} else []

    firing = wait_until(thermal_firing, 45, f"{THERMAL_ALERT} firing on both GPUs")
    _thermal_rule_is_healthy(stack)
    # Not before the heatsink can have soaked (the die reaches 87 °C at ~240 s).
    assert stack.sim_seconds() > 200, "fired before the die could have soaked"
    for alert in firing:
        labels, notes = alert["labels"], alert["annotations"]
        assert labels["instance"] == stack.instance and labels["job"] == JOB
        assert labels["severity"] == "warning" and labels["uuid"].startswith("GPU-")
        assert "reason" not in labels  # one alert per GPU, whichever reason is active
        assert notes["summary"] == (
            f"GPU {labels['gpu']} on {stack.instance} is in thermal slowdown"
        )
        # Both temperatures rendered from live queries (not the "unknown" fallback).
        temps = re.findall(r"(\d+)°C", notes["description"])
        assert "unknown" not in notes["description"] and len(temps) == 2, notes["description"]
        assert int(temps[1]) == 92  # the L4's slowdown threshold
        assert 80 <= int(temps[0]) <= 92  # held near the 87 °C thermal target
    history = _alert_history(stack)
    assert history[THERMAL_ALERT] == {"pending", "firing"}
    unexpected = set(history) - {THERMAL_ALERT} - set(OTHER_ALERTS_ALLOWED["heat-soak"])
    assert unexpected == set(), {a: history[a] for a in unexpected}


def test_no_gpu_alert_in_idle(stacks: dict[str, Stack]) -> None:
    stack = stacks["idle"]
    wait_until(
        lambda: stack.check_alive() or stack.sim_seconds() >= IDLE_SIM_S,
        IDLE_SIM_S / SPEED + 10,
        f"{IDLE_SIM_S:.0f} simulated seconds of idle",
    )
    evaluated_after = time.time()
    # Wait for a rule evaluation that started after the threshold was reached.
    wait_until(lambda: _rule_evaluated_after(stack, evaluated_after), 10, "a rule evaluation")
    _thermal_rule_is_healthy(stack)
    # The thermal expression had its inputs (so "not firing" is not "no data") ...
    inputs = stack.api.vector(
        f'gpuwatchd_gpu_throttle_active{{instance="{stack.instance}", '
        f'reason=~"sw_thermal_slowdown|hw_thermal_slowdown|hw_slowdown"}}'
    )
    assert len(inputs) == 3 * GPUS
    assert {s["value"][1] for s in inputs} == {"0"}
    # ... and no GPU alert has been pending or firing at any point.
    allowed = set(OTHER_ALERTS_ALLOWED["idle"])
    assert {a: s for a, s in _alert_history(stack).items() if a not in allowed} == {}
    assert [a for a in _gpu_alerts(stack) if a["labels"]["alertname"] not in allowed] == []


def _rule_evaluated_after(stack: Stack, unix: float) -> bool:
    groups = stack.api.get("/api/v1/rules", [("type", "alert")])["groups"]
    return all(_rfc3339_to_unix(g["lastEvaluation"]) > unix for g in groups) and bool(groups)


def _rfc3339_to_unix(text: str) -> float:
    """Prometheus' nanosecond RFC 3339 times; fromisoformat takes at most microseconds."""
    match = re.fullmatch(r"(.+T\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)", text)
    assert match, f"not an RFC 3339 time: {text!r}"
    base, frac, zone = match.groups()
    stamp = datetime.fromisoformat(base + ("+00:00" if zone == "Z" else zone))
    return stamp.timestamp() + float(frac or 0)


# -- dashboard ----------------------------------------------------------------------


@dataclass(frozen=True)
class PanelQuery:
    title: str
    ref_id: str
    expr: str
    instant: bool  # Grafana's "instant" query type
    range: bool  # Grafana's "range" query type (the default when neither is set)


def _variables(stack: Stack) -> dict[str, str]:
    """The dashboard variables as Grafana fills them with this stack's instance and GPUs."""
    return {
        "instance": grafana_regex_value([stack.instance]),
        "gpu": grafana_regex_value(GPU_SELECTION[stack.scenario]),
    }


def _dashboard_queries(stack: Stack) -> list[PanelQuery]:
    kw = {"interval_s": 1.0, "rate_interval_s": 4.0, "range_s": 300.0}
    exprs = panel_queries(DASHBOARD, _variables(stack), **kw)
    targets = [
        (p["title"], t)
        for p in iter_panels(load_dashboard(DASHBOARD))
        for t in p.get("targets", [])
        if t.get("expr")
    ]
    out = []
    for (title, expr), (title2, target) in zip(exprs, targets, strict=True):
        assert title == title2
        instant = bool(target.get("instant"))
        out.append(
            PanelQuery(title, target["refId"], expr, instant, target.get("range", not instant))
        )
    return out


def _selection_problems(q: PanelQuery, stack: Stack, data: Mapping[str, Any]) -> list[str]:
    """Series the variables should have filtered out (another instance or GPU)."""
    problems = []
    for series in data["result"] if data["resultType"] in ("vector", "matrix") else []:
        labels = series["metric"]
        if "instance" in labels and labels["instance"] != stack.instance:
            problems.append(f"{q.title} [{q.ref_id}]: series of instance {labels['instance']}")
        if "gpu" in labels and labels["gpu"] not in GPU_SELECTION[stack.scenario]:
            problems.append(f"{q.title} [{q.ref_id}]: series of unselected GPU {labels['gpu']}")
    return problems


def _absent_metrics(stack: Stack, expr: str) -> list[str]:
    return [
        m
        for m in sorted(scan(expr).metrics)
        if not stack.api.vector(f'count({m}{{instance="{stack.instance}"}})')
    ]


def _panel_problems(stack: Stack, queries: list[PanelQuery]) -> list[str]:
    """What is wrong with the panels right now (empty is a problem unless allowed)."""
    problems: list[str] = []
    end = time.time()
    for q in queries:
        results = []
        if q.instant:
            results.append(stack.api.query(q.expr, at=end))  # an error raises: always a bug
        if q.range:
            results.append(stack.api.query_range(q.expr, stack.scraping_since, end, 1))
        for data in results:
            problems += _selection_problems(q, stack, data)
        if all(has_data(d) for d in results):
            continue
        absent = _absent_metrics(stack, q.expr)
        if set(absent) & set(ALLOWED_ABSENT):
            continue
        why = f"absent metrics {absent}" if absent else "all its metrics have data: query bug"
        problems.append(f"{q.title} [{q.ref_id}] is empty ({why}): {q.expr}")
    return problems


def test_allowed_absent_metrics_are_on_the_dashboard() -> None:
    used = set().union(*(scan(e).metrics for _, e in panel_queries(DASHBOARD)))
    assert set(ALLOWED_ABSENT) <= used


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_dashboard_panel_returns_data(stacks: dict[str, Stack], scenario: str) -> None:
    stack = stacks[scenario]
    queries = _dashboard_queries(stack)
    assert len({q.title for q in queries}) >= 15
    deadline = stack.scraping_since + PANEL_DEADLINE_S
    while True:
        stack.check_alive()
        problems = _panel_problems(stack, queries)
        if not problems or time.time() >= deadline:
            break
        time.sleep(1.0)
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_dashboard_variables_list_the_real_instance_and_gpus(
    stacks: dict[str, Stack], scenario: str
) -> None:
    stack = stacks[scenario]
    variables = {
        v["name"]: v
        for v in load_dashboard(DASHBOARD)["templating"]["list"]
        if v["type"] == "query"
    }
    found: dict[str, list[str]] = {}
    for name, var in variables.items():
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query.strip())
        assert match, f"{name}: {query!r}"
        selector = substitute(match.group(1), {"instance": _variables(stack)["instance"]})
        found[name] = stack.api.label_values(
            match.group(2), selector, stack.scraping_since, time.time()
        )
    assert found == {"instance": [stack.instance], "gpu": [str(i) for i in range(GPUS)]}


def test_winners_table_shows_the_seeded_winners(stacks: dict[str, Stack]) -> None:
    stack = stacks["idle"]
    by_title = {q.title: q for q in _dashboard_queries(stack)}
    rows = wait_until(
        lambda: stack.api.vector(by_title["Winners per regime"].expr),
        10,
        "the winners table's rows",
    )
    keys = ("workload", "regime", "candidate", "winners_differ")
    got = {(*(r["metric"][k] for k in keys), float(r["value"][1])) for r in rows}
    want = {
        (workload, regime, winner, "yes" if picks[0] != picks[1] else "no", 1e-3)
        for workload, picks in SEEDED_WINNERS["idle"].items()
        for regime, winner in zip(("unthrottled", "sustained"), picks, strict=True)
    }
    # The idle daemon may also have tuned its own workload by now: its rows are extra.
    assert want <= got
    seeded = set(SEEDED_WINNERS["idle"])
    assert {row for row in got if row[0] in seeded} == want


def _max_per_gpu(stack: Stack, expr: str) -> dict[str, float]:
    """The largest value each GPU's series took since Prometheus started scraping."""
    data = stack.api.query_range(expr, stack.scraping_since, time.time(), 1)
    return {
        s["metric"]["gpu"]: max(float(v) for _, v in s["values"])
        for s in data["result"]
        if s["values"]
    }


def test_tuning_panels_show_the_short_sim_sessions(stacks: dict[str, Stack]) -> None:
    """A simulated session lasts a fraction of a scrape interval; the panels show it."""
    stack = stacks["idle"]
    by_title = {q.title: q for q in _dashboard_queries(stack)}
    gpus = {str(i) for i in range(GPUS)}
    # As in the README's tour: ask the daemon to re-tune every GPU at its next open gate
    # (the seeded winners serve its GPUs, so it queues nothing by itself).
    sock = stack.daemon_log.parent / "run" / "control.sock"
    asked = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "retune", "--socket", str(sock),
         "--workload", "sim-gemm"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert asked.returncode == 0, asked.stdout + asked.stderr

    def tuned_everywhere() -> dict[str, float]:
        stack.check_alive()
        since = stack.api.vector(by_title["Time since last tune"].expr)
        return {s["metric"]["gpu"]: float(s["value"][1]) for s in since} if since else {}

    since = wait_until(
        lambda: (seen := tuned_everywhere()) and set(seen) == gpus and seen,
        PANEL_DEADLINE_S,
        "a completed session on every GPU",
    )
    assert all(0 <= v < 300 for v in since.values()), since
    wait_until(
        lambda: _max_per_gpu(stack, by_title["Tuning running"].expr) == dict.fromkeys(gpus, 1.0),
        10,
        "the tuning timeline marking every GPU",
    )
    sessions = stack.api.vector(by_title["Tune sessions in range"].expr)
    assert {s["metric"]["status"]: float(s["value"][1]) for s in sessions}["completed"] > 0


def test_drift_panel_shows_the_learned_clock(stacks: dict[str, Stack]) -> None:
    stack = stacks["heat-soak"]
    by_title = {q.title: q for q in _dashboard_queries(stack)}
    expr = by_title["Clock drift vs winners' clock"].expr
    deadline = DRIFT_DEADLINE_S - (time.monotonic() - stack.daemon_up)
    ratios = wait_until(
        lambda: stack.check_alive() or stack.api.vector(expr),
        max(deadline, 1.0),
        "the drift ratio of the soaked L4",
    )
    # GPU_SELECTION keeps GPU 1 only in heat-soak; its clock is far under max while soaked.
    assert {r["metric"]["gpu"] for r in ratios} == set(GPU_SELECTION["heat-soak"])
    assert all(-1.0 < float(r["value"][1]) < 1.0 for r in ratios)
