"""grafana/gpuwatchd-fleet.json: generated, import-ready, every query valid and meaningful.

As for the per-host dashboard (tests/test_dashboard.py): the JSON is what
grafana/build_fleet_dashboard.py writes, promtool parses every query, metric and label
names are checked against tests/metric_catalog.py, every fleet metric is on a panel, and
the queries that decide something (outliers, fleet-wide counts) are evaluated by
promtool on synthetic series from several daemons.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from dashboard_queries import (
    BUILTIN_DS,
    DS_VAR,
    GRAFANA,
    GRID_WIDTH,
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
)
from metric_catalog import KNOWN_METRICS, SOURCE, scan, unknown_names

DASHBOARD = GRAFANA / "gpuwatchd-fleet.json"


@pytest.fixture(scope="module")
def dash() -> dict[str, Any]:
    return load_dashboard(DASHBOARD)


def _query(dash: Mapping[str, Any], title: str, ref: str = "A") -> str:
    (t,) = [t for t in panel(dash, title)["targets"] if t["refId"] == ref]
    return filled(t["expr"])


# -- generated and import-ready ----------------------------------------------------------


def test_committed_json_is_what_the_generator_writes() -> None:
    assert (
        DASHBOARD.read_text(encoding="utf-8") == load_generator("build_fleet_dashboard.py").render()
    ), "grafana/gpuwatchd-fleet.json is stale: run python3 grafana/build_fleet_dashboard.py"


def test_generator_check_mode_reports_a_stale_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gen = load_generator("build_fleet_dashboard.py")
    gen.OUTPUT = tmp_path / "gpuwatchd-fleet.json"  # missing: stale
    assert check_mode_round_trip(gen, capsys)["uid"] == "gpuwatchd-fleet"


def test_dashboard_is_import_ready(dash: dict[str, Any]) -> None:
    assert "__inputs" not in dash and "${DS_" not in DASHBOARD.read_text(encoding="utf-8")
    assert dash["id"] is None and dash["uid"] == "gpuwatchd-fleet" and dash["title"]
    assert 36 <= dash["schemaVersion"] <= 41
    required = {(r["type"], r["id"]) for r in dash["__requires"]}
    assert {("grafana", "grafana"), ("datasource", "prometheus")} <= required
    assert {p["type"] for p in data_panels(dash)} <= {i for t, i in required if t == "panel"}
    per_host = load_dashboard(GRAFANA / "gpuwatchd.json")
    assert dash["uid"] != per_host["uid"]  # both can be provisioned side by side


def test_every_datasource_is_the_variable(dash: dict[str, Any]) -> None:
    refs = [ref for _, ref in datasource_refs(dash)]
    assert [r for r in refs if r not in (DS_VAR, BUILTIN_DS)] == []
    assert refs.count(BUILTIN_DS) == 1  # Grafana's built-in annotation only


def test_every_data_panel_queries_prometheus_and_explains_itself(dash: dict[str, Any]) -> None:
    for p in data_panels(dash):
        assert p["datasource"] == DS_VAR and p.get("description"), p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        assert all(t["expr"].strip() and t["datasource"] == DS_VAR for t in p["targets"])


def test_layout_ids_unique_and_no_overlap(dash: dict[str, Any]) -> None:
    top = dash["panels"]
    ids = [p["id"] for p in iter_panels(dash)]
    assert all(isinstance(i, int) and i > 0 for i in ids) and len(ids) == len(set(ids))
    for p in top:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] >= 1 and g["x"] + g["w"] <= GRID_WIDTH, p["title"]
    for a, b in itertools.combinations(top, 2):
        assert not overlap(a["gridPos"], b["gridPos"]), (a["title"], b["title"])


def test_variables_are_the_data_source_and_instances(dash: dict[str, Any]) -> None:
    names = [v["name"] for v in dash["templating"]["list"]]
    assert names == ["datasource", "instance"]
    (instance,) = [v for v in dash["templating"]["list"] if v["name"] == "instance"]
    assert instance["multi"] and instance["includeAll"] and instance["allValue"] == ".*"


def test_every_selector_is_filtered_by_instance(dash: dict[str, Any]) -> None:
    for p in data_panels(dash):
        for t in p["targets"]:
            for selector in scan(filled(t["expr"])).selectors:
                assert selector.matchers.get("instance") == ".*", (p["title"], selector.name)
            assert "$gpu" not in t["expr"], p["title"]  # no such variable here


# -- names and syntax ------------------------------------------------------------------


def test_every_query_uses_only_exported_names() -> None:
    for title, expr in panel_queries(DASHBOARD):
        assert scan(expr).metrics, f"{title}: no metric in {expr!r}"
        assert unknown_names(expr) == [], title


def test_every_fleet_metric_is_on_the_fleet_dashboard() -> None:
    used = {m for _, expr in panel_queries(DASHBOARD) for m in scan(expr).metrics}
    fleet = {name for name, source in SOURCE.items() if source == "fleet"}
    assert fleet and fleet <= used, sorted(fleet - used)
    assert used <= set(KNOWN_METRICS)


@pytest.mark.parametrize(
    "title",
    [
        "GPU models × driver versions",
        "Throttle time per host in range",
        "Outlier hosts",
        "Sustained clock vs fleet median",
        "Tuning coverage",
        "Disagreements",
        "Work the fleet saved in range",
    ],
)
def test_required_panel(dash: dict[str, Any], title: str) -> None:
    assert panel(dash, title)["targets"]


@needs_promtool
def test_every_query_parses(tmp_path: Path) -> None:
    exprs = [e for _, e in panel_queries(DASHBOARD)]
    result = promtool_check(exprs, tmp_path, "fleet_dashboard")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in result.stdout


# -- what the deciding queries compute (promtool evaluates them) -------------------------


def _gpu(host: str, model: str, peers: int, clock_mhz: float, median_mhz: float) -> list[dict]:
    gpu = f'instance="{host}",job="gpuwatchd",gpu="0",uuid="GPU-{host}"'
    group = f'gpu_model="{model}",power_limit_watts="700"'
    return [
        {
            "series": f"gpuwatchd_fleet_sustained_clock_hertz{{{gpu},{group}}}",
            "values": f"{clock_mhz * 1e6:.0f}x10",
        },
        {
            "series": f"gpuwatchd_fleet_median_sustained_clock_hertz{{{gpu},{group}}}",
            "values": f"{median_mhz * 1e6:.0f}x10",
        },
        {
            "series": f'gpuwatchd_fleet_peers{{instance="{host}",job="gpuwatchd",{group}}}',
            "values": f"{peers}x10",
        },
    ]


@needs_promtool
def test_outlier_table_lists_only_a_gpu_over_5_percent_under_in_a_group_of_three(
    dash: dict[str, Any], tmp_path: Path
) -> None:
    series = [
        *_gpu("h1:9844", "NVIDIA H200", 3, 1353.6, 1440.0),  # 6% under: listed
        *_gpu("h2:9844", "NVIDIA H200", 3, 1382.4, 1440.0),  # 4% under: fine
        *_gpu("h3:9844", "NVIDIA H100", 2, 1000.0, 1300.0),  # 2 GPUs: too few to judge
    ]
    labels = (
        '{instance="h1:9844",job="gpuwatchd",gpu="0",uuid="GPU-h1:9844",'
        'gpu_model="NVIDIA H200",power_limit_watts="700"}'
    )
    expr_test(tmp_path, _query(dash, "Outlier hosts"), series, [(labels, 0.94)])


@needs_promtool
def test_fleet_wide_counts_are_counted_once_however_many_daemons_report_them(
    dash: dict[str, Any], tmp_path: Path
) -> None:
    key = 'gpu_model="NVIDIA H200",workload="gemm",regime="sustained"'
    other = 'gpu_model="NVIDIA H200",workload="conv",regime="sustained"'
    series = [
        {
            "series": f'gpuwatchd_fleet_disagreements{{instance="{h}",job="gpuwatchd",{k}}}',
            "values": f"{n}x10",
        }
        for h in ("h1:9844", "h2:9844")
        for k, n in ((key, 2), (other, 0))
    ]
    expr_test(tmp_path, _query(dash, "Disagreements"), series, [(f"{{{key}}}", 2.0)])
    cov = 'gpu_model="NVIDIA H200",versions="driver=580.159.04"'
    series = [
        {
            "series": f'gpuwatchd_fleet_coverage_workloads{{instance="{h}",job="gpuwatchd",{cov}}}',
            "values": "12x10",
        }
        for h in ("h1:9844", "h2:9844")
    ]
    expr_test(tmp_path, _query(dash, "Tuning coverage"), series, [(f"{{{cov}}}", 12.0)])


@needs_promtool
def test_models_by_driver_counts_gpus_and_hosts(dash: dict[str, Any], tmp_path: Path) -> None:
    def info(host: str, gpu: int, driver: str) -> dict[str, str]:
        labels = (
            f'instance="{host}",job="gpuwatchd",gpu="{gpu}",uuid="GPU-{host}-{gpu}",'
            f'name="NVIDIA H200",driver_version="{driver}",pci_bus_id=""'
        )
        return {"series": f"gpuwatchd_gpu_info{{{labels}}}", "values": "1x10"}

    series = [
        info("h1", 0, "580"),
        info("h1", 1, "580"),
        info("h2", 0, "580"),
        info("h3", 0, "575"),
    ]
    title = "GPU models × driver versions"
    gpus = [('{name="NVIDIA H200",driver_version="580"}', 3.0)]
    gpus.append(('{name="NVIDIA H200",driver_version="575"}', 1.0))
    expr_test(tmp_path, _query(dash, title, "A"), series, gpus)
    hosts = [('{name="NVIDIA H200",driver_version="580"}', 2.0)]
    hosts.append(('{name="NVIDIA H200",driver_version="575"}', 1.0))
    expr_test(tmp_path, _query(dash, title, "B"), series, hosts)
