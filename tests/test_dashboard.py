"""grafana/gpuwatchd.json: generated, import-ready, laid out, every query valid and meaningful.

The JSON is what grafana/build_dashboard.py writes (a test compares them). Syntax is
checked by promtool (the panel queries become recording rules); metric and label names
against tests/metric_catalog.py, itself checked against the real exporter, and every
exported metric must be on the dashboard or say why not; the trickier queries are
evaluated by promtool's rule unit tests on synthetic series.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from builders import DAEMON_INFO, board_of, full_h200
from dashboard_queries import (
    BUILTIN_DS,
    DEFAULT_VARIABLES,
    DS_VAR,
    GRAFANA,
    GRID_WIDTH,
    builtin_variables,
    check_mode_round_trip,
    data_panels,
    datasource_refs,
    expr_test,
    filled,
    iter_panels,
    load_dashboard,
    load_generator,
    needs_promtool,
    overlap,
    panel,
    panel_queries,
    promtool_check,
    substitute,
)
from metric_catalog import (
    GATE_STATES,
    KNOWN_METRICS,
    SOURCE,
    TARGET_LABELS,
    THROTTLE_REASONS,
    scan,
    unknown_names,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpuwatchd.exporter import build_registry

DASHBOARD = GRAFANA / "gpuwatchd.json"


@pytest.fixture(scope="module")
def dash() -> dict[str, Any]:
    return load_dashboard(DASHBOARD)


def exprs_of(p: Mapping[str, Any]) -> list[str]:
    return [t["expr"] for t in p.get("targets", []) if t.get("expr")]


def annotation_exprs(dash: Mapping[str, Any]) -> list[str]:
    return [a["expr"] for a in dash["annotations"]["list"] if a.get("expr")]


def query_variables(dash: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The variables filled by a Prometheus query (all but the data source picker)."""
    return [v for v in dash["templating"]["list"] if v["type"] == "query"]


def variable_selectors(dash: Mapping[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(variable name, selector, label) of each ``label_values(selector, label)`` query."""
    for var in query_variables(dash):
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query.strip())
        assert match, f"variable {var['name']}: not a label_values() query: {query!r}"
        yield var["name"], match.group(1), match.group(2)


# -- generated ------------------------------------------------------------------------


def test_committed_json_is_what_the_generator_writes() -> None:
    expected = load_generator("build_dashboard.py").render()
    assert DASHBOARD.read_text(encoding="utf-8") == expected, (
        "grafana/gpuwatchd.json is stale: run python3 grafana/build_dashboard.py"
    )


def test_generator_check_mode_reports_a_stale_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gen = load_generator("build_dashboard.py")
    gen.OUTPUT = tmp_path / "gpuwatchd.json"
    gen.OUTPUT.write_text("{}\n", encoding="utf-8")
    assert check_mode_round_trip(gen, capsys)["uid"] == "gpuwatchd"


#: Exported metrics left off the dashboard, and why.
NOT_ON_DASHBOARD: dict[str, str] = {
    "gpuwatchd_gate_state_duration_seconds": "the gate timeline shows how long each state held",
    "gpuwatchd_gpu_performance_state": "the SM clock panel shows what the P-state implies",
    "gpuwatchd_gpu_encoder_utilization_ratio": "video encoding does not gate tuning",
    "gpuwatchd_gpu_shutdown_temperature_celsius": "slowdown comes first; it is the line drawn",
    "gpuwatchd_gpu_memory_clock_hertz": "memory clocks do not move with the power cap",
    "gpuwatchd_gpu_max_memory_clock_hertz": "as above",
    "gpuwatchd_gpu_memory_free_bytes": "total minus used, both drawn",
    "up": "Prometheus' own; the GpuwatchdDown alert watches it",
    "gpuwatchd_store_schema_skew": "the GpuwatchdStoreSchemaSkew alert watches it; the store"
    " panel shows whether writes go on",
    "gpuwatchd_mig_device_info": "a GPU in MIG mode is never tuned: the dashboard's subject",
    "gpuwatchd_mig_memory_used_bytes": "as above",
    "gpuwatchd_mig_memory_total_bytes": "as above",
    "gpuwatchd_mig_utilization_ratio": "as above",
    "gpuwatchd_periodic_overdue_total": "the log names the late task; a daemon whose work is stuck"
    " past watchdog_stall_s is restarted by systemd",
    "gpuwatchd_pod_resources_up": "explains empty pod labels; no panel uses pod labels",
    "gpuwatchd_control_turned_away_total": "clients ask again; a crowd shows in the log too",
    # catalogued once the catalogue was checked exporter -> catalogue (issue 30)
    "gpuwatchd_tls_certificate_expiry_timestamp_seconds": "only over TLS; no panel or shipped"
    " alert uses it yet",
    "gpuwatchd_user_kernel_keys": "users' own kernels: `gpuwatchd workloads list` shows them",
    "gpuwatchd_user_kernel_regime_winners_differ_keys": "as above",
    "gpuwatchd_added_workloads": "`gpuwatchd workloads list` shows them",
    "gpuwatchd_store_late_results_total": "the session ends waiting are drawn beside store up;"
    " this counts how they ended (recorded late, dropped)",
}


def test_every_exported_metric_is_on_the_dashboard_or_says_why(dash: dict[str, Any]) -> None:
    used: set[str] = set()
    for _, expr in panel_queries(DASHBOARD):
        used |= scan(expr).metrics
    for _, selector, _ in variable_selectors(dash):
        used |= scan(filled(selector)).metrics
    fleet = {name for name, source in SOURCE.items() if source == "fleet"}  # fleet dashboard
    missing = set(KNOWN_METRICS) - used - set(NOT_ON_DASHBOARD) - fleet
    assert missing == set(), f"exported but on no panel: {sorted(missing)}"
    assert set(NOT_ON_DASHBOARD) <= set(KNOWN_METRICS)  # no stale excuse
    assert used.isdisjoint(NOT_ON_DASHBOARD), "on the dashboard after all: drop its excuse"


# -- import-ready and provisionable ----------------------------------------------------


def test_dashboard_is_import_ready(dash: dict[str, Any]) -> None:
    # No __inputs: a file provisioned as is (or from a ConfigMap) has nobody to resolve an
    # input, so an exported dashboard shows ${DS_PROMETHEUS} unresolved. The data source
    # is a variable instead, which Grafana fills with the default Prometheus either way.
    assert "__inputs" not in dash
    assert "${DS_" not in DASHBOARD.read_text(encoding="utf-8")
    required = {(r["type"], r["id"]) for r in dash["__requires"]}
    assert ("grafana", "grafana") in required
    assert ("datasource", "prometheus") in required
    used = {p["type"] for p in data_panels(dash)}
    assert used <= {rid for rtype, rid in required if rtype == "panel"}
    assert 36 <= dash["schemaVersion"] <= 41  # Grafana 9.4 to 11.x
    assert dash["id"] is None  # an exported instance id would clash on import
    assert dash["uid"] == "gpuwatchd" and dash["title"]


def test_datasource_is_a_template_variable(dash: dict[str, Any]) -> None:
    (var,) = [v for v in dash["templating"]["list"] if v["type"] == "datasource"]
    assert var["name"] == "datasource" and var["query"] == "prometheus"
    assert var["current"] == {} and not var["multi"] and not var["includeAll"]
    assert dash["templating"]["list"][0] is var  # defined before the variables that use it


def test_every_datasource_is_the_variable(dash: dict[str, Any]) -> None:
    """No concrete uid: only the variable (or Grafana's built-in annotations) anywhere."""
    refs = list(datasource_refs(dash))
    bad = [(where, ref) for where, ref in refs if ref not in (DS_VAR, BUILTIN_DS)]
    assert bad == []
    assert sum(ref == BUILTIN_DS for _, ref in refs) == 1  # the built-in annotation only


def test_every_data_panel_queries_prometheus(dash: dict[str, Any]) -> None:
    for p in data_panels(dash):
        assert p.get("datasource") == DS_VAR, p["title"]
        targets = p.get("targets", [])
        assert targets, f"panel {p['title']!r} has no queries"
        refs = [t["refId"] for t in targets]
        assert len(refs) == len(set(refs)), f"panel {p['title']!r}: duplicate refIds {refs}"
        for t in targets:
            assert t.get("datasource") == DS_VAR, (p["title"], t["refId"])
            assert t.get("expr", "").strip(), (p["title"], t["refId"])
        assert p.get("description"), f"panel {p['title']!r} has no description"


# -- layout ---------------------------------------------------------------------------


def test_panel_ids_are_unique_positive_ints(dash: dict[str, Any]) -> None:
    ids = [p["id"] for p in iter_panels(dash)]
    assert all(isinstance(i, int) and i > 0 for i in ids)
    assert len(ids) == len(set(ids))


def test_grid_positions_fit_and_do_notoverlap(dash: dict[str, Any]) -> None:
    top = dash["panels"]  # panels inside collapsed rows are laid out when expanded
    for p in top:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["y"] >= 0 and g["w"] >= 1 and g["h"] >= 1, p["title"]
        assert g["x"] + g["w"] <= GRID_WIDTH, p["title"]
        if p["type"] == "row":
            assert (g["x"], g["w"], g["h"]) == (0, GRID_WIDTH, 1), p["title"]
    clashes = [
        (a["title"], b["title"])
        for a, b in itertools.combinations(top, 2)
        if overlap(a["gridPos"], b["gridPos"])
    ]
    assert clashes == []


def test_overlap_check_catches_a_clash() -> None:
    assert overlap({"x": 0, "y": 0, "w": 12, "h": 8}, {"x": 11, "y": 7, "w": 2, "h": 2})
    assert not overlap({"x": 0, "y": 0, "w": 12, "h": 8}, {"x": 12, "y": 0, "w": 12, "h": 8})
    assert not overlap({"x": 0, "y": 0, "w": 24, "h": 1}, {"x": 0, "y": 1, "w": 24, "h": 8})


# -- template variables ---------------------------------------------------------------


def test_instance_and_gpu_variables(dash: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in query_variables(dash)}
    assert set(variables) == {"instance", "gpu"}
    for name, var in variables.items():
        assert var["datasource"] == DS_VAR, name
        assert var["multi"] and var["includeAll"], name
        # panel_queries stands in for "All" with the same regex Grafana sends.
        assert var["allValue"] == DEFAULT_VARIABLES[name], name
    selectors = {name: (sel, label) for name, sel, label in variable_selectors(dash)}
    assert selectors["instance"][1] == "instance"
    assert selectors["gpu"][1] == "gpu"
    assert '$instance"' in selectors["gpu"][0]  # GPUs of the chosen daemons only
    for name, (selector, label) in selectors.items():
        assert unknown_names(filled(selector)) == [], name
        metric = scan(selector).selectors[0].name
        assert metric is not None and label in KNOWN_METRICS[metric] | TARGET_LABELS, name


def test_panels_use_the_variables_and_nothing_undefined(dash: dict[str, Any]) -> None:
    defined = {v["name"] for v in dash["templating"]["list"]} | set(builtin_variables())
    used: set[str] = set()
    texts = [e for p in data_panels(dash) for e in exprs_of(p)] + annotation_exprs(dash)
    for expr in texts:
        for m in re.finditer(r"\$\{(\w+)[^}]*\}|\[\[(\w+)[^\]]*\]\]|\$(\w+)", expr):
            name = m.group(1) or m.group(2) or m.group(3)
            if not name.isdigit():
                used.add(name)
    assert used <= defined
    assert {"instance", "gpu"} <= used
    # Every per-GPU query is filtered by both variables.
    for p in data_panels(dash):
        for expr in exprs_of(p):
            for sel in scan(filled(expr)).selectors:
                labels = KNOWN_METRICS[sel.name or ""]
                assert "instance" in sel.matchers, (p["title"], sel.name)
                if "gpu" in labels:
                    assert "gpu" in sel.matchers, (p["title"], sel.name)


# -- the queries ----------------------------------------------------------------------


@needs_promtool
def test_every_query_parses(dash: dict[str, Any], tmp_path: Path) -> None:
    exprs = [e for _, e in panel_queries(DASHBOARD)]
    exprs += [filled(e) for e in annotation_exprs(dash)]
    result = promtool_check(exprs, tmp_path, "dashboard")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in result.stdout


@needs_promtool
def test_promtool_check_rejects_a_broken_query(tmp_path: Path) -> None:
    result = promtool_check(['sum by (gpu (gpuwatchd_gpu_lost{gpu=~".*"})'], tmp_path, "dashboard")
    assert result.returncode != 0


def test_every_query_uses_only_exported_names(dash: dict[str, Any]) -> None:
    queries = panel_queries(DASHBOARD) + [("annotation", filled(e)) for e in annotation_exprs(dash)]
    for title, expr in queries:
        assert scan(expr).metrics, f"{title}: no metric in {expr!r}"
        assert unknown_names(expr) == [], title


def test_name_check_catches_mistakes() -> None:
    assert unknown_names('gpuwatchd_gpu_temperature_celsius{gpu="0"}') == []
    assert unknown_names("gpuwatchd_gpu_temp_celsius") == [
        "unknown metric gpuwatchd_gpu_temp_celsius"
    ]
    assert unknown_names('gpuwatchd_gate_open{state="busy"}') == [
        "gpuwatchd_gate_open has no label 'state'"
    ]
    assert unknown_names("sum by (reason) (gpuwatchd_gate_open)") == [
        "grouping label 'reason' is on none of the metrics used"
    ]
    names = scan(
        'sum without (state) (rate(x_total{a="1"}[5m])) * on (gpu) group_left y '
        'or label_replace(z, "d", "$1", "s", "(.*)") and max_over_time(w[1h:1m]) > bool 0.5'
    )
    assert names.metrics == {"x_total", "y", "z", "w"}
    assert names.grouping_labels == {"state", "gpu"}


def test_panel_queries_cover_every_target_and_fill_every_variable(dash: dict[str, Any]) -> None:
    queries = panel_queries(DASHBOARD)
    assert len(queries) == sum(len(exprs_of(p)) for p in data_panels(dash))
    assert all("$" not in expr and "[[" not in expr for _, expr in queries)
    titles = {t for t, _ in queries}
    assert titles == {p["title"] for p in data_panels(dash)}
    chosen = panel_queries(
        DASHBOARD, {"instance": "h1:9844", "gpu": "3"}, rate_interval_s=1.5, range_s=300
    )
    exprs = "\n".join(e for _, e in chosen)
    assert 'instance=~"h1:9844"' in exprs and 'gpu=~"3"' in exprs and ".*" not in exprs
    assert "[5m]" not in exprs and "[300s]" in exprs


def test_substitute_handles_every_variable_form() -> None:
    values = {"gpu": "1", **builtin_variables(interval_s=0.25, rate_interval_s=60, range_s=7200)}
    assert substitute("${gpu} [[gpu]] ${gpu:regex} $gpu", values) == "1 1 1 1"
    assert substitute("$__range_s $__range $__interval", values) == "7200 7200s 250ms"
    assert substitute('label_replace(x, "a", "$1", "b", "(.*)")', values).count("$1") == 1
    with pytest.raises(ValueError, match=r"unknown template variable \$gpuu"):
        substitute('x{gpu=~"$gpuu"}', values)
    with pytest.raises(ValueError, match="interval must be positive"):
        builtin_variables(interval_s=0)


# -- the panels the operator needs ----------------------------------------------------

REQUIRED_PANELS: dict[str, tuple[str, set[str]]] = {
    "Temperature vs slowdown threshold": (
        "timeseries",
        {"gpuwatchd_gpu_temperature_celsius", "gpuwatchd_gpu_slowdown_temperature_celsius"},
    ),
    "Power vs limit": (
        "timeseries",
        {"gpuwatchd_gpu_power_watts", "gpuwatchd_gpu_power_limit_watts"},
    ),
    "SM clock vs max": (
        "timeseries",
        {"gpuwatchd_gpu_sm_clock_hertz", "gpuwatchd_gpu_max_sm_clock_hertz"},
    ),
    "Throttle reasons": ("state-timeline", {"gpuwatchd_gpu_throttle_active"}),
    "Gate state": ("state-timeline", {"gpuwatchd_gate_state"}),
    "Time throttled in range": ("bargauge", {"gpuwatchd_gpu_throttle_seconds_total"}),
    "GPU memory used vs total": (
        "timeseries",
        {"gpuwatchd_gpu_memory_used_bytes", "gpuwatchd_gpu_memory_total_bytes"},
    ),
    "Memory per compute process": ("timeseries", {"gpuwatchd_gpu_process_memory_bytes"}),
    "Energy in range": ("bargauge", {"gpuwatchd_gpu_energy_joules_total"}),
    "XID errors in range": (
        "bargauge",
        {"gpuwatchd_gpu_xid_events_total", "gpuwatchd_gpu_xid_errors_total"},
    ),
    "ECC errors in range": ("bargauge", {"gpuwatchd_gpu_ecc_errors_total"}),
    "Remapped rows": (
        "timeseries",
        {
            "gpuwatchd_gpu_remapped_rows",
            "gpuwatchd_gpu_row_remap_pending",
            "gpuwatchd_gpu_row_remap_failed",
        },
    ),
    "PCIe replays": ("timeseries", {"gpuwatchd_gpu_pcie_replay_errors_total"}),
    "Field read errors": ("timeseries", {"gpuwatchd_gpu_field_errors_total"}),
    "PCIe throughput": (
        "timeseries",
        {"gpuwatchd_gpu_pcie_tx_bytes_total", "gpuwatchd_gpu_pcie_rx_bytes_total"},
    ),
    "NVLink throughput": (
        "timeseries",
        {"gpuwatchd_gpu_nvlink_tx_bytes_total", "gpuwatchd_gpu_nvlink_rx_bytes_total"},
    ),
    "Fan speed": ("timeseries", {"gpuwatchd_gpu_fan_speed_ratio"}),
    "Tuning running": (
        "state-timeline",
        {"gpuwatchd_tune_running", "gpuwatchd_last_tune_timestamp_seconds"},
    ),
    "Tune sessions in range": ("bargauge", {"gpuwatchd_tune_sessions_total"}),
    "Tune deferrals in range": ("bargauge", {"gpuwatchd_tune_deferred_total"}),
    "Winners per regime": (
        "table",
        {"gpuwatchd_winner_info", "gpuwatchd_winner_seconds", "gpuwatchd_regime_winners_differ"},
    ),
    "Clock drift vs winners' clock": ("timeseries", {"gpuwatchd_clock_drift_ratio"}),
    "Re-tune pending": ("state-timeline", {"gpuwatchd_retune_pending"}),
    "Poll state": (
        "state-timeline",
        {"gpuwatchd_poll_success", "gpuwatchd_poll_stalled", "gpuwatchd_gpu_lost"},
    ),
    "Age of last successful poll": ("timeseries", {"gpuwatchd_last_poll_timestamp_seconds"}),
    "Scrape collectors": ("state-timeline", {"gpuwatchd_scrape_collector_success"}),
    "Scrape collector duration": (
        "timeseries",
        {"gpuwatchd_scrape_collector_duration_seconds"},
    ),
}


@pytest.mark.parametrize("title", sorted(REQUIRED_PANELS))
def test_required_panel(dash: dict[str, Any], title: str) -> None:
    kind, metrics = REQUIRED_PANELS[title]
    p = panel(dash, title)
    assert p["type"] == kind
    used = set().union(*(scan(filled(e)).metrics for e in exprs_of(p)))
    assert metrics <= used


@pytest.mark.parametrize(
    "title",
    [
        "Temperature vs slowdown threshold",
        "Power vs limit",
        "SM clock vs max",
        "GPU memory used vs total",
    ],
)
def test_limit_series_are_drawn_as_dashed_lines(dash: dict[str, Any], title: str) -> None:
    p = panel(dash, title)
    limit_ref = p["targets"][1]["refId"]
    styled = [
        o
        for o in p["fieldConfig"]["overrides"]
        if o["matcher"] == {"id": "byFrameRefID", "options": limit_ref}
    ]
    assert styled, f"{title}: the limit query {limit_ref} has no override"
    props = {prop["id"]: prop["value"] for prop in styled[0]["properties"]}
    assert props["custom.lineStyle"]["fill"] == "dash"


def _value_mappings(p: Mapping[str, Any]) -> dict[str, str]:
    mappings = p["fieldConfig"]["defaults"]["mappings"]
    return {k: v["text"] for m in mappings for k, v in m["options"].items()}


def test_gate_timeline_codes_match_its_value_mappings(dash: dict[str, Any]) -> None:
    p = panel(dash, "Gate state")
    (expr,) = exprs_of(p)
    codes = dict(re.findall(r'state="(\w+)"\}\s*\*\s*(\d+)', expr))
    assert set(codes) == set(GATE_STATES)
    assert _value_mappings(p) == {code: state for state, code in codes.items()}


def test_binary_timelines_map_zero_and_one(dash: dict[str, Any]) -> None:
    assert _value_mappings(panel(dash, "Throttle reasons")) == {"0": "off", "1": "active"}
    assert _value_mappings(panel(dash, "Scrape collectors")) == {"0": "failing", "1": "ok"}
    assert _value_mappings(panel(dash, "Re-tune pending")) == {"0": "no", "1": "pending"}
    assert _value_mappings(panel(dash, "Tuning running")) == {"0": "idle", "1": "tuning"}
    assert set(_value_mappings(panel(dash, "Poll state")).values()) == {
        "ok",
        "failing",
        "stalled",
        "lost",
    }


def test_winners_table_shows_the_differ_flag(dash: dict[str, Any]) -> None:
    p = panel(dash, "Winners per regime")
    assert all(t["instant"] and t["format"] == "table" for t in p["targets"])
    (organize,) = [t for t in p["transformations"] if t["id"] == "organize"]
    assert organize["options"]["renameByName"]["winners_differ"] == "winners differ"
    (flag,) = [
        o for o in p["fieldConfig"]["overrides"] if o["matcher"]["options"] == "winners differ"
    ]
    mapping = {k: v["text"] for k, v in flag["properties"][0]["value"][0]["options"].items()}
    assert mapping == {"yes": "DIFFER", "no": "same"}


# -- what the trickier queries compute (promtool evaluates them) ------------------------

_LBL = 'instance="h1:9844",job="gpuwatchd"'


def _gpu(i: int) -> str:
    return f'{_LBL},gpu="{i}",uuid="GPU-{i}"'


def _series(metric: str, labels: str, value: float) -> dict[str, str]:
    return {"series": f"{metric}{{{labels}}}", "values": f"{value}x10"}


def _query(dash: Mapping[str, Any], title: str) -> str:
    (expr,) = exprs_of(panel(dash, title))
    return filled(expr)


@needs_promtool
def test_gate_timeline_query_yields_the_active_state_code(
    dash: dict[str, Any], tmp_path: Path
) -> None:
    active = {0: "cool_stable", 1: "busy", 2: "unavailable"}
    series = [
        _series("gpuwatchd_gate_state", f'{_gpu(g)},state="{s}"', float(s == on))
        for g, on in active.items()
        for s in GATE_STATES
    ]
    codes = {s: i for i, s in enumerate(GATE_STATES, 1)}
    expected = [(f"{{{_gpu(g)}}}", float(codes[s])) for g, s in active.items()]
    expr_test(tmp_path, _query(dash, "Gate state"), series, expected)


@needs_promtool
def test_poll_state_query_ranks_lost_over_stalled_over_failing(
    dash: dict[str, Any], tmp_path: Path
) -> None:
    # gpu: (success, stalled, lost) -> code shown
    cases = {0: ((1, 0, 0), 0), 1: ((0, 0, 0), 1), 2: ((1, 1, 0), 2), 3: ((0, 1, 1), 3)}
    series = [
        _series(metric, _gpu(g), value)
        for g, (values, _) in cases.items()
        for metric, value in zip(
            ("gpuwatchd_poll_success", "gpuwatchd_poll_stalled", "gpuwatchd_gpu_lost"),
            values,
            strict=True,
        )
    ]
    expected = [(f"{{{_gpu(g)}}}", float(code)) for g, (_, code) in cases.items()]
    expr_test(tmp_path, _query(dash, "Poll state"), series, expected)


@needs_promtool
def test_winners_query_joins_candidate_time_and_differ_flag(
    dash: dict[str, Any], tmp_path: Path
) -> None:
    winners = {  # (workload, regime): (candidate, seconds)
        ("gemm", "unthrottled"): ("triton_128x256", 0.0021),
        ("gemm", "sustained"): ("cublas", 0.0030),
        ("conv", "unthrottled"): ("cudnn_heuristic", 0.0004),
        ("conv", "sustained"): ("cudnn_heuristic", 0.0005),
    }
    series = [
        _series("gpuwatchd_winner_info", f'{_LBL},workload="{w}",regime="{r}",candidate="{c}"', 1)
        for (w, r), (c, _) in winners.items()
    ]
    series += [
        _series("gpuwatchd_winner_seconds", f'{_LBL},workload="{w}",regime="{r}"', s)
        for (w, r), (_, s) in winners.items()
    ]
    series += [
        _series("gpuwatchd_regime_winners_differ", f'{_LBL},workload="gemm"', 1),
        _series("gpuwatchd_regime_winners_differ", f'{_LBL},workload="conv"', 0),
    ]
    expected = [
        (
            f'{{{_LBL},workload="{w}",regime="{r}",candidate="{c}",'
            f'winners_differ="{"yes" if w == "gemm" else "no"}"}}',
            s,
        )
        for (w, r), (c, s) in winners.items()
    ]
    expr_test(tmp_path, _query(dash, "Winners per regime"), series, expected)


@needs_promtool
def test_tuning_timeline_shows_a_session_shorter_than_a_scrape(
    dash: dict[str, Any], tmp_path: Path
) -> None:
    """Samples every 15 s from unix 0, evaluated at 5m over the 1m rate interval."""
    n = 21  # 0s .. 5m

    def values(f: Any) -> str:
        return " ".join(str(f(i)) for i in range(n))

    series = [
        # GPU 0: its first session ever completed at 4m40s, between two scrapes that
        # both saw tune_running 0; the last-tune series appears with the next scrape.
        {"series": f"gpuwatchd_tune_running{{{_gpu(0)}}}", "values": values(lambda i: 0)},
        {
            "series": f"gpuwatchd_last_tune_timestamp_seconds{{{_gpu(0)}}}",
            "values": " ".join("_" if i < 19 else "280" for i in range(n)),
        },
        # GPU 1: scraped once while running (a session still going, or preempted).
        {
            "series": f"gpuwatchd_tune_running{{{_gpu(1)}}}",
            "values": values(lambda i: int(i == 18)),
        },
        # GPU 2: tuned long ago (at 100 s), idle now; GPU 3: never tuned.
        {"series": f"gpuwatchd_tune_running{{{_gpu(2)}}}", "values": values(lambda i: 0)},
        {
            "series": f"gpuwatchd_last_tune_timestamp_seconds{{{_gpu(2)}}}",
            "values": values(lambda i: 100),
        },
        {"series": f"gpuwatchd_tune_running{{{_gpu(3)}}}", "values": values(lambda i: 0)},
    ]
    expected = [
        (f'{{instance="h1:9844",gpu="{g}"}}', v) for g, v in ((0, 1), (1, 1), (2, 0), (3, 0))
    ]
    expr_test(tmp_path, _query(dash, "Tuning running"), series, expected, interval="15s")
    # The annotation marks the same sessions, and only them.
    (annotation,) = annotation_exprs(dash)
    expr_test(tmp_path, filled(annotation), series, expected[:2], interval="15s")


# -- the catalogue against the real exporter ------------------------------------------


def test_catalogue_matches_what_the_exporter_exposes() -> None:
    registry = build_registry(board_of(full_h200()), DAEMON_INFO)
    text = generate_latest(registry).decode()
    exposed: dict[str, set[str]] = {}
    values: dict[str, set[str]] = {"reason": set(), "state": set()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            exposed.setdefault(sample.name, set()).update(sample.labels)
            for label in values:
                if label in sample.labels:
                    values[label].add(sample.labels[label])
    for name, labels in KNOWN_METRICS.items():
        if SOURCE[name] == "exporter":
            assert name in exposed, f"{name} is in the catalogue but not exported"
            assert exposed[name] == set(labels), name
    assert values["reason"] == set(THROTTLE_REASONS)
    assert values["state"] == set(GATE_STATES)
