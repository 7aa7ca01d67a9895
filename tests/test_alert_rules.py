"""prometheus/alerts.yml: valid rules, every alert unit-tested firing and not firing.

Beyond running promtool, two mutation checks prove the unit tests have teeth: with an
alert's rule deleted its firing case must fail, and with its ``for`` set to 0s its
"still pending" case must fail.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml
from metric_catalog import KNOWN_METRICS, scan, unknown_names

RULES_DIR = Path(__file__).resolve().parent.parent / "prometheus"
RULES = RULES_DIR / "alerts.yml"
TESTS = RULES_DIR / "alerts_test.yml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed")
SEVERITIES = {"critical", "warning", "info"}
#: Alerts whose value is a measurement worth quoting, not a 0/1 flag.
VALUE_ALERTS = {
    "GpuwatchdPowerCapped",
    "GpuwatchdClockDrift",
    "GpuwatchdPollStale",
    "GpuwatchdHostSlowerThanFleet",
    "GpuwatchdFleetDisagreement",
}
#: Alerts about the fleet as a whole: aggregated over the daemons that all export the same
#: store-wide count, so one fires per fact, with no instance to name.
FLEET_WIDE_ALERTS = {"GpuwatchdFleetDisagreement"}


def _load(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(data, dict), f"{path}: not a YAML mapping"
    return data


@pytest.fixture(scope="module")
def rules() -> list[dict[str, Any]]:
    return [rule for group in _load(RULES)["groups"] for rule in group["rules"]]


@pytest.fixture(scope="module")
def unit_tests() -> dict[str, Any]:
    return _load(TESTS)


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)


@needs_promtool
def test_promtool_check_rules(rules: list[dict[str, Any]]) -> None:
    result = _promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


@needs_promtool
def test_promtool_unit_tests_pass() -> None:
    result = _promtool("test", "rules", str(TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_expected_alerts_exist(rules: list[dict[str, Any]]) -> None:
    names = [rule.get("alert") for rule in rules]
    assert None not in names, "alerts.yml holds alerting rules only"
    assert len(names) == len(set(names))
    assert set(names) == {
        "GpuwatchdThermalSlowdown",
        "GpuwatchdPowerCapped",
        "GpuwatchdClockDrift",
        "GpuwatchdRetunePending",
        "GpuwatchdPollFailing",
        "GpuwatchdPollStale",
        "GpuwatchdPollStalled",
        "GpuwatchdGpuLost",
        "GpuwatchdXidError",
        "GpuwatchdTuningNotReady",
        "GpuwatchdDown",
        "GpuwatchdCollectorFailing",
        "GpuwatchdStoreDown",
        "GpuwatchdStoreWritesRefused",
        "GpuwatchdStoreSchemaSkew",
        "GpuwatchdHostSlowerThanFleet",
        "GpuwatchdFleetDisagreement",
    }


def test_every_alert_is_labelled_and_explained(rules: list[dict[str, Any]]) -> None:
    for rule in rules:
        name = rule["alert"]
        assert rule["labels"]["severity"] in SEVERITIES, name
        assert re.fullmatch(r"\d+[smh]", rule["for"]), f"{name}: needs a `for` duration"
        notes = rule["annotations"]
        assert set(notes) >= {"summary", "description"}, name
        if name not in FLEET_WIDE_ALERTS:
            assert "$labels.instance" in notes["summary"], name
        metrics = scan(rule["expr"]).metrics
        if any("gpu" in KNOWN_METRICS[m] for m in metrics):
            for key in ("summary", "description"):
                assert "$labels.gpu" in notes[key], f"{name}: {key} does not name the GPU"
            assert "$labels.uuid" in notes["description"], name
        if name in VALUE_ALERTS:
            assert "$value" in notes["description"], f"{name}: description lacks the value"


def test_alert_exprs_use_only_exported_names(rules: list[dict[str, Any]]) -> None:
    for rule in rules:
        assert unknown_names(rule["expr"]) == [], rule["alert"]


def test_daemon_down_alert_selects_the_gpuwatchd_job(rules: list[dict[str, Any]]) -> None:
    (down,) = [r for r in rules if r["alert"] == "GpuwatchdDown"]
    (selector,) = scan(down["expr"]).selectors
    assert selector.name == "up" and selector.matchers == {"job": "gpuwatchd"}


def _cases(unit_tests: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """alert -> (evaluations expecting it to fire, evaluations expecting silence)."""
    cases: dict[str, tuple[int, int]] = {}
    for group in unit_tests["tests"]:
        for case in group.get("alert_rule_test", []):
            firing, silent = cases.get(case["alertname"], (0, 0))
            if case.get("exp_alerts"):
                firing += 1
            else:
                silent += 1
            cases[case["alertname"]] = (firing, silent)
    return cases


def test_every_alert_has_a_firing_and_a_silent_case(
    rules: list[dict[str, Any]], unit_tests: dict[str, Any]
) -> None:
    cases = _cases(unit_tests)
    assert set(cases) == {rule["alert"] for rule in rules}
    for name, (firing, silent) in cases.items():
        assert firing >= 1, f"{name}: no case where it fires"
        assert silent >= 1, f"{name}: no case where it stays silent"


def _run_mutant(
    tmp_path: Path, rules_doc: dict[str, Any], unit_tests: dict[str, Any], alert: str
) -> subprocess.CompletedProcess[str]:
    """Run the unit-test groups that test ``alert`` against a modified rules file."""
    workdir = tmp_path / alert
    workdir.mkdir()
    (workdir / "alerts.yml").write_text(yaml.safe_dump(rules_doc, allow_unicode=True))
    tests = copy.deepcopy(unit_tests)
    tests["rule_files"] = ["alerts.yml"]
    tests["tests"] = [
        g
        for g in tests["tests"]
        if any(c["alertname"] == alert for c in g.get("alert_rule_test", []))
    ]
    (workdir / "alerts_test.yml").write_text(yaml.safe_dump(tests, allow_unicode=True))
    return _promtool("test", "rules", str(workdir / "alerts_test.yml"))


def _mutate(alert: str, change: str) -> dict[str, Any]:
    doc = _load(RULES)
    for group in doc["groups"]:
        for rule in list(group["rules"]):
            if rule["alert"] == alert:
                if change == "delete":
                    group["rules"].remove(rule)
                else:
                    rule["for"] = "0s"
    return doc


@needs_promtool
@pytest.mark.parametrize("change", ["delete", "no_for"])
def test_unit_tests_fail_when_an_alert_is_broken(
    tmp_path: Path, rules: list[dict[str, Any]], unit_tests: dict[str, Any], change: str
) -> None:
    """Deleting a rule breaks its firing case; dropping its `for`, its pending case."""
    names = [rule["alert"] for rule in rules]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(
            pool.map(
                lambda name: _run_mutant(tmp_path, _mutate(name, change), unit_tests, name),
                names,
            )
        )
    survivors = [
        name for name, result in zip(names, results, strict=True) if result.returncode == 0
    ]
    assert survivors == [], f"unit tests still pass with these alerts broken ({change})"


def test_fleet_wide_alerts_aggregate_away_the_instance(rules: list[dict[str, Any]]) -> None:
    """One alert per disagreement however many daemons report it, naming what it is about."""
    for rule in rules:
        if rule["alert"] in FLEET_WIDE_ALERTS:
            expr = " ".join(rule["expr"].split())
            assert expr.startswith("max by (gpu_model, workload, regime) ("), rule["alert"]
            for label in ("gpu_model", "workload", "regime"):
                assert f"$labels.{label}" in rule["annotations"]["summary"], rule["alert"]


def _fleet_case(unit_tests: dict[str, Any], name: str) -> dict[str, Any]:
    (group,) = [g for g in unit_tests["tests"] if g["name"] == name]
    return group


def test_slower_than_fleet_cases_cover_the_threshold_and_the_peer_minimum(
    unit_tests: dict[str, Any],
) -> None:
    """The promtool case holds a GPU 6% under (fires), 4% under and one with 2 peers (not)."""
    group = _fleet_case(unit_tests, "host slower than its fleet")
    first: dict[tuple[str, str], float] = {}
    for series in group["input_series"]:
        name, _, labels = series["series"].partition("{")
        instance = re.search(r'instance="([^"]+)"', labels)
        assert instance is not None
        first[(name, instance.group(1))] = float(series["values"].split("x")[0])
    ratio = {
        inst: first[("gpuwatchd_fleet_sustained_clock_hertz", inst)]
        / first[("gpuwatchd_fleet_median_sustained_clock_hertz", inst)]
        for _, inst in first
    }
    peers = {inst: first[("gpuwatchd_fleet_peers", inst)] for _, inst in first}
    assert ratio["h1:9844"] == pytest.approx(0.94) and peers["h1:9844"] == 3
    assert ratio["h2:9844"] == pytest.approx(0.96) and peers["h2:9844"] == 3
    assert ratio["h3:9844"] < 0.95 and peers["h3:9844"] == 2
    fired = [
        a["exp_labels"]["instance"]
        for case in group["alert_rule_test"]
        for a in case.get("exp_alerts") or []
    ]
    assert fired == ["h1:9844"]


@needs_promtool
def test_unmodified_rules_pass_the_same_harness(tmp_path: Path, unit_tests: dict[str, Any]) -> None:
    """The mutation harness itself passes on the real rules, so its failures mean something."""
    result = _run_mutant(tmp_path, _load(RULES), unit_tests, "GpuwatchdThermalSlowdown")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_readme_lists_every_alert_in_order_with_its_severity() -> None:
    """prometheus/README.md's table is the rules file's alerts, none missing or extra."""
    root = Path(__file__).resolve().parent.parent
    rules = yaml.safe_load((root / "prometheus" / "alerts.yml").read_text())
    declared = [
        (r["alert"], r["labels"]["severity"])
        for group in rules["groups"]
        for r in group["rules"]
        if "alert" in r
    ]
    rows = re.findall(
        r"^\| (Gpuwatchd\w+) \|.*\| (\w+) \|$",
        (root / "prometheus" / "README.md").read_text(),
        re.MULTILINE,
    )
    assert rows == declared
