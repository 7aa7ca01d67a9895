"""The metric names and labels gpuwatchd exposes, and a scanner for the names a query uses.

The dashboard and alert tests check every query against this catalogue, so a renamed
metric or a misspelt label fails a test instead of leaving a blank panel or an alert
that can never fire. It is checked both ways against every family the exporter can emit
(tests/test_docs_reference.py, through scripts/docs_gen.py's enumeration): a family
without an entry, or an entry no collector emits, fails. ``SOURCE`` says where each
name comes from (``exporter``: the GPU collectors; ``tuning``, ``drift``, ``fleet``,
``mig``, ``pods``, ``periodic``, ``control``, ``tls``; ``prometheus``: Prometheus' own).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

#: Labels Prometheus attaches to every scraped series.
TARGET_LABELS: frozenset[str] = frozenset({"instance", "job"})

_GPU = frozenset({"gpu", "uuid"})


def _m(*labels: str, base: frozenset[str] = _GPU) -> frozenset[str]:
    return base | frozenset(labels)


_NONE: frozenset[str] = frozenset()
_MIG = ("gpu_instance_id", "compute_instance_id", "profile")

#: Exposed metric name -> its labels (target labels excluded).
KNOWN_METRICS: dict[str, frozenset[str]] = {
    # exporter: daemon facts, per-GPU telemetry, gate, poll and scrape health
    "gpuwatchd_build_info": _m("version", "backend", "python_version", base=_NONE),
    "gpuwatchd_gpu_info": _m("name", "driver_version", "pci_bus_id"),
    "gpuwatchd_gpu_temperature_celsius": _GPU,
    "gpuwatchd_gpu_memory_temperature_celsius": _GPU,
    "gpuwatchd_gpu_slowdown_temperature_celsius": _GPU,
    "gpuwatchd_gpu_shutdown_temperature_celsius": _GPU,
    "gpuwatchd_gpu_power_watts": _GPU,
    "gpuwatchd_gpu_power_limit_watts": _GPU,
    "gpuwatchd_gpu_energy_joules_total": _GPU,
    "gpuwatchd_gpu_sm_clock_hertz": _GPU,
    "gpuwatchd_gpu_max_sm_clock_hertz": _GPU,
    "gpuwatchd_gpu_memory_clock_hertz": _GPU,
    "gpuwatchd_gpu_max_memory_clock_hertz": _GPU,
    "gpuwatchd_gpu_utilization_ratio": _GPU,
    "gpuwatchd_gpu_memory_utilization_ratio": _GPU,
    "gpuwatchd_gpu_compute_processes": _GPU,
    "gpuwatchd_gpu_performance_state": _GPU,
    "gpuwatchd_gpu_encoder_utilization_ratio": _GPU,
    "gpuwatchd_gpu_throttle_active": _m("reason"),
    # GPU health, read on the slow path
    "gpuwatchd_gpu_memory_used_bytes": _GPU,
    "gpuwatchd_gpu_memory_free_bytes": _GPU,
    "gpuwatchd_gpu_memory_total_bytes": _GPU,
    "gpuwatchd_gpu_xid_errors_total": _m("xid"),
    "gpuwatchd_gpu_xid_events_total": _GPU,
    "gpuwatchd_gpu_ecc_errors_total": _m("scope", "type"),
    "gpuwatchd_gpu_remapped_rows": _m("cause"),
    "gpuwatchd_gpu_row_remap_pending": _GPU,
    "gpuwatchd_gpu_row_remap_failed": _GPU,
    "gpuwatchd_gpu_pcie_tx_bytes_total": _GPU,
    "gpuwatchd_gpu_pcie_rx_bytes_total": _GPU,
    "gpuwatchd_gpu_pcie_replay_errors_total": _GPU,
    "gpuwatchd_gpu_nvlink_tx_bytes_total": _GPU,
    "gpuwatchd_gpu_nvlink_rx_bytes_total": _GPU,
    "gpuwatchd_gpu_fan_speed_ratio": _GPU,
    "gpuwatchd_gpu_process_memory_bytes": _m("pid", "namespace", "pod", "container"),
    "gpuwatchd_gpu_field_errors_total": _m("field"),
    # MIG devices, while a GPU is in MIG mode
    "gpuwatchd_mig_device_info": _m(*_MIG, "mig_uuid"),
    "gpuwatchd_mig_memory_used_bytes": _m(*_MIG),
    "gpuwatchd_mig_memory_total_bytes": _m(*_MIG),
    "gpuwatchd_mig_utilization_ratio": _m(*_MIG),
    "gpuwatchd_pod_resources_up": _NONE,
    "gpuwatchd_gpu_throttle_seconds_total": _m("reason"),
    "gpuwatchd_gate_state": _m("state"),
    "gpuwatchd_gate_open": _GPU,
    "gpuwatchd_gate_state_duration_seconds": _GPU,
    "gpuwatchd_poll_success": _GPU,
    "gpuwatchd_poll_duration_seconds": _GPU,
    "gpuwatchd_poll_stalled": _GPU,
    "gpuwatchd_gpu_lost": _GPU,
    "gpuwatchd_last_poll_timestamp_seconds": _GPU,
    "gpuwatchd_scrape_collector_success": _m("collector", base=_NONE),
    "gpuwatchd_scrape_collector_duration_seconds": _m("collector", base=_NONE),
    # tuning
    "gpuwatchd_tune_sessions_total": _m("status", base=_NONE),
    "gpuwatchd_tune_deferred_total": _m("reason", base=_NONE),
    "gpuwatchd_tuning_ready": _m("reason", base=_NONE),
    "gpuwatchd_winner_info": _m("gpu_model", "workload", "regime", "candidate", "tie", base=_NONE),
    "gpuwatchd_winner_seconds": _m("gpu_model", "workload", "regime", base=_NONE),
    "gpuwatchd_regime_winners_differ": _m("gpu_model", "workload", base=_NONE),
    "gpuwatchd_tune_pending_workloads": _GPU,
    "gpuwatchd_last_tune_timestamp_seconds": _GPU,
    # drift and tuning state per GPU
    "gpuwatchd_clock_drift_ratio": _GPU,
    "gpuwatchd_retune_pending": _m("reason"),
    "gpuwatchd_tune_running": _GPU,
    "gpuwatchd_user_kernel_keys": _m("kernel", "state", base=_NONE),
    "gpuwatchd_user_kernel_regime_winners_differ_keys": _m("kernel", base=_NONE),
    "gpuwatchd_added_workloads": _m("state", base=_NONE),
    # fleet views over a shared store
    "gpuwatchd_fleet_sustained_clock_hertz": _m("gpu_model", "power_limit_watts"),
    "gpuwatchd_fleet_median_sustained_clock_hertz": _m("gpu_model", "power_limit_watts"),
    "gpuwatchd_fleet_peers": _m("gpu_model", "power_limit_watts", base=_NONE),
    "gpuwatchd_fleet_disagreements": _m("gpu_model", "workload", "regime", base=_NONE),
    "gpuwatchd_fleet_recent_disagreements": _m("gpu_model", "workload", "regime", base=_NONE),
    "gpuwatchd_fleet_coverage_workloads": _m("gpu_model", "versions", base=_NONE),
    "gpuwatchd_fleet_work_skipped_total": _m("reason", base=_NONE),
    "gpuwatchd_fleet_verified_total": _NONE,
    "gpuwatchd_fleet_claimed_elsewhere_total": _NONE,
    "gpuwatchd_fleet_sync_age_seconds": _NONE,
    "gpuwatchd_fleet_sync_success": _NONE,
    "gpuwatchd_store_up": _NONE,
    "gpuwatchd_store_writable": _NONE,
    "gpuwatchd_store_schema_skew": _NONE,
    "gpuwatchd_periodic_overdue_total": _m("task", base=_NONE),
    "gpuwatchd_control_turned_away_total": _NONE,
    # over TLS only
    "gpuwatchd_tls_certificate_expiry_timestamp_seconds": _m(
        "cert", "subject_cn", "serial_number", base=_NONE
    ),
    "gpuwatchd_store_pending_results": _NONE,
    "gpuwatchd_store_late_results_total": _m("outcome", base=_NONE),
    # Prometheus' own per-target series
    "up": _NONE,
}

SOURCE: dict[str, str] = {
    name: (
        "prometheus"
        if name == "up"
        else "fleet"
        if name.startswith("gpuwatchd_fleet_")
        else "tls"
        if name.startswith("gpuwatchd_tls_")
        else "drift"
        if name
        in {"gpuwatchd_clock_drift_ratio", "gpuwatchd_retune_pending", "gpuwatchd_tune_running"}
        else "tuning"
        if name.startswith(
            ("gpuwatchd_tune_", "gpuwatchd_winner_", "gpuwatchd_regime_", "gpuwatchd_user_")
        )
        or name
        in {
            "gpuwatchd_last_tune_timestamp_seconds",
            "gpuwatchd_tuning_ready",
            "gpuwatchd_added_workloads",
            "gpuwatchd_store_up",
            "gpuwatchd_store_writable",
            "gpuwatchd_store_schema_skew",
            "gpuwatchd_periodic_overdue_total",
            "gpuwatchd_control_turned_away_total",
            "gpuwatchd_store_pending_results",
            "gpuwatchd_store_late_results_total",
        }
        else "mig"
        if name.startswith("gpuwatchd_mig_")
        else "pods"
        if name == "gpuwatchd_pod_resources_up"
        else "exporter"
    )
    for name in KNOWN_METRICS
}

#: Values the enumerated labels take (the exporter emits every one of them).
THROTTLE_REASONS: tuple[str, ...] = (
    "gpu_idle",
    "applications_clocks_setting",
    "sw_power_cap",
    "hw_slowdown",
    "sync_boost",
    "sw_thermal_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
    "display_clock_setting",
)
GATE_STATES: tuple[str, ...] = ("cool_stable", "warming", "throttled", "busy", "unavailable")
ECC_SCOPES: tuple[str, ...] = ("volatile", "aggregate")
ECC_TYPES: tuple[str, ...] = ("corrected", "uncorrected")
REMAP_CAUSES: tuple[str, ...] = ("correctable", "uncorrectable")

_KEYWORDS = frozenset(
    {"and", "or", "unless", "bool", "offset", "inf", "nan", "start", "end", "atan2"}
)
_GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
_TOKEN = re.compile(
    r"""
    (?P<ws>\s+|\#[^\n]*)
  | (?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<num>\d+(?:\.\d*)?(?:[eE][+-]?\d+)?[a-zA-Z0-9_]*)
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=(){}\[\],:@])
    """,
    re.VERBOSE,
)


@dataclass(frozen=True, slots=True)
class Selector:
    """One vector selector: its metric name (None for ``{__name__=...}``) and matched labels."""

    name: str | None
    matchers: dict[str, str] = field(default_factory=dict)  # label -> literal value


@dataclass(frozen=True, slots=True)
class QueryNames:
    """The names a PromQL expression refers to."""

    selectors: list[Selector]
    grouping_labels: set[str]  # in by/without/on/ignoring/group_left/group_right lists

    @property
    def metrics(self) -> set[str]:
        return {s.name for s in self.selectors if s.name is not None}


def _tokens(expr: str) -> list[tuple[str, str]]:
    tokens: list[tuple[str, str]] = []
    pos = 0
    while pos < len(expr):
        match = _TOKEN.match(expr, pos)
        if match is None:
            raise ValueError(f"cannot tokenize query at {expr[pos : pos + 20]!r}: {expr!r}")
        kind = match.lastgroup or ""
        if kind != "ws":
            tokens.append((kind, match.group()))
        pos = match.end()
    return tokens


def scan(expr: str) -> QueryNames:
    """Metric names, label matchers and grouping labels of ``expr``.

    A scanner, not a parser: promtool checks the syntax; this only has to tell metric
    names from function names, keywords, label names and string arguments.
    """
    tokens = _tokens(expr)
    selectors: list[Selector] = []
    grouping: set[str] = set()
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        following = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if text == "[":  # a range or subquery duration: [5m], [1h:1m]
            while i < len(tokens) and tokens[i][1] != "]":
                i += 1
        elif kind == "ident" and text in _GROUPING and following == "(":
            i += 2
            while i < len(tokens) and tokens[i][1] != ")":
                if tokens[i][0] == "ident":
                    grouping.add(tokens[i][1])
                i += 1
        elif kind == "ident" and (
            following == "(" or following in _GROUPING or text in _KEYWORDS | _GROUPING
        ):
            pass  # a function, an aggregation (sum by ...) or a keyword
        elif kind == "ident" or text == "{":
            name = text if kind == "ident" else None
            if kind == "ident" and following == "{":
                i += 1
            matchers: dict[str, str] = {}
            if tokens[i][1] == "{":
                i += 1
                while i < len(tokens) and tokens[i][1] != "}":
                    if tokens[i][0] == "ident" and i + 2 < len(tokens):
                        matchers[tokens[i][1]] = tokens[i + 2][1].strip("\"'`")
                        i += 3
                    else:
                        i += 1
            if name is None:
                name = matchers.pop("__name__", None)
            selectors.append(Selector(name, matchers))
        i += 1
    return QueryNames(selectors, grouping)


def unknown_names(expr: str) -> list[str]:
    """Every metric or label in ``expr`` that gpuwatchd does not expose, as messages."""
    names = scan(expr)
    problems: list[str] = []
    in_scope: set[str] = set(TARGET_LABELS)
    for selector in names.selectors:
        if selector.name is None:
            problems.append(f"selector without a metric name: {selector.matchers}")
            continue
        labels = KNOWN_METRICS.get(selector.name)
        if labels is None:
            problems.append(f"unknown metric {selector.name}")
            continue
        in_scope |= labels
        for label in sorted(set(selector.matchers) - labels - TARGET_LABELS):
            problems.append(f"{selector.name} has no label {label!r}")
    for label in sorted(names.grouping_labels - in_scope):
        problems.append(f"grouping label {label!r} is on none of the metrics used")
    return problems
