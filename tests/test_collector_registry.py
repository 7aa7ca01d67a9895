"""Collectors are declared once (exporter/registry.py's ``COLLECTORS``), each declares its
families, and ``[exporter] fields`` chooses among the per-GPU ones.

What fails here when a collector is added but not declared: a sub-collector class under
exporter/collectors/ that no ``COLLECTORS`` entry makes; a family a per-GPU collector
yields but does not list in ``families`` (or lists but never yields); a declared family
missing from tests/metric_catalog.py or docs/metrics.md.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import signal
from pathlib import Path
from types import MappingProxyType

import pytest
from builders import DAEMON_INFO, free_port, mig_h200_board, wait_until
from daemon_helpers import http_get, start_daemon, wait_http
from metric_catalog import KNOWN_METRICS
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpuwatchd.config.loader import ConfigError, parse_config
from gpuwatchd.drift.fleet import FleetSnapshot
from gpuwatchd.exporter.collectors.base import Versioned
from gpuwatchd.exporter.collectors.gpu import exposed_name
from gpuwatchd.exporter.registry import (
    COLLECTORS,
    SELECTABLE,
    Sources,
    build_registry,
    selectable_fields,
)
from gpuwatchd.monitor.board import StateBoard
from gpuwatchd.sessions.tuning_view import TuningSnapshot
from gpuwatchd.telemetry.types import PodRef

ROOT = Path(__file__).resolve().parent.parent
COLLECTORS_DIR = ROOT / "gpuwatchd" / "exporter" / "collectors"


class _Pods:
    up = True
    pods = MappingProxyType({"00000000-aaaa": PodRef("ml", "trainer-0", "pytorch")})

    def lookup(self, uuid: str) -> PodRef | None:
        return self.pods.get(uuid.lower().removeprefix("gpu-").removeprefix("mig-"))


def _all_sources(board: StateBoard, fields: tuple[str, ...] = ()) -> Sources:
    snapshot = TuningSnapshot({}, {}, frozenset(), {}, None)
    return Sources(
        board,
        pods=_Pods(),
        fields=fields,
        tuning=lambda: snapshot,
        drift=dict,
        store=_Store(),
        fleet=FleetSnapshot,
        periodic=dict,
        control=lambda: 0,
    )


class _Store:
    """A store that answers, may write, and is at this gpuwatchd's schema."""

    up = True
    writable = True
    schema = None


def test_every_sub_collector_is_declared_once_under_its_name() -> None:
    made = {}
    for name, make in COLLECTORS:
        sub = make(_all_sources(mig_h200_board()))
        assert sub is not None and sub.name == name
        made[name] = type(sub._sub if isinstance(sub, Versioned) else sub)
    assert len(made) == len(COLLECTORS)
    defined = set()
    for path in sorted(COLLECTORS_DIR.glob("*.py")):
        module = importlib.import_module(f"gpuwatchd.exporter.collectors.{path.stem}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__ and isinstance(cls.__dict__.get("name"), str):
                defined.add(cls)
    missing = sorted(c.__name__ for c in defined - set(made.values()))
    assert not missing, f"sub-collectors not in exporter/registry.py COLLECTORS: {missing}"


def test_the_daemon_makes_no_collector_of_its_own() -> None:
    source = (ROOT / "gpuwatchd" / "daemon" / "process.py").read_text()
    calls = {
        node.func.id
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }
    assert not {c for c in calls if c.endswith("Collector")}, "declare it in COLLECTORS"


def _exposed_by(board: StateBoard, fields: tuple[str, ...] = ()) -> dict[str, set[str]]:
    """Sub-collector -> the families it exposed (by exposed name)."""
    out: dict[str, set[str]] = {}
    for name, make in COLLECTORS:
        sub = make(_all_sources(board, fields))
        assert sub is not None
        out[name] = {exposed_name(f) for f in sub.collect()}
    return out


def test_per_gpu_collectors_declare_exactly_the_families_they_yield() -> None:
    exposed = _exposed_by(mig_h200_board())
    for cls in SELECTABLE:
        assert exposed[cls.name] == set(cls.families), cls.name
        assert len(set(cls.families)) == len(cls.families), cls.name


def test_declared_families_are_catalogued_and_documented() -> None:
    documented = set(
        re.findall(r"^\| `(gpuwatchd_\w+)`", (ROOT / "docs" / "metrics.md").read_text(), re.M)
    )
    for name in selectable_fields():
        assert name in KNOWN_METRICS, f"{name}: add it to tests/metric_catalog.py"
        assert name in documented, f"{name}: add its row to docs/metrics.md"


def test_fields_choose_the_per_gpu_families_exported() -> None:
    chosen = ("gpuwatchd_gpu_power_watts", "gpuwatchd_gpu_energy_joules_total")
    cfg = parse_config({"exporter": {"fields": list(chosen)}})
    assert cfg.exporter.fields == chosen
    exposed = _exposed_by(mig_h200_board(), cfg.exporter.fields)
    assert exposed["gpu"] == set(chosen)
    assert exposed["gpu_health"] == exposed["gpu_mig"] == set()
    assert exposed["pods"] == {"gpuwatchd_pod_resources_up"}  # the daemon's own: always
    text = generate_latest(build_registry(mig_h200_board(), DAEMON_INFO, fields=chosen)).decode()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"gpuwatchd_gpu_power_watts", "gpuwatchd_gpu_energy_joules"} <= names
    assert "gpuwatchd_gpu_temperature_celsius" not in names
    assert "gpuwatchd_scrape_collector_success" in names and "gpuwatchd_build_info" in names


def test_no_fields_exports_every_family() -> None:
    assert parse_config({}).exporter.fields == ()
    exposed = _exposed_by(mig_h200_board())
    assert exposed["gpu"] == set(SELECTABLE[0].families)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (["gpuwatchd_gpu_powr_watts"], "exporter.fields[0]: unknown metric "
         "'gpuwatchd_gpu_powr_watts' (did you mean 'gpuwatchd_gpu_power_watts'?"),
        (["gpuwatchd_gpu_power_watts", "gpuwatchd_tune_sessions_total"],
         "exporter.fields[1]: unknown metric 'gpuwatchd_tune_sessions_total'"),
        ("gpuwatchd_gpu_power_watts", "exporter.fields: expected a list"),
    ],
)  # fmt: skip
def test_an_unknown_field_is_one_line_naming_it(fields: object, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"exporter": {"fields": fields}}, source="c.toml")
    text = str(err.value)
    assert "\n" not in text and text.startswith("c.toml: ") and message in text, text


def test_without_fields_the_config_loads_no_collector() -> None:
    import subprocess
    import sys

    code = (
        "import sys; from gpuwatchd.config.loader import parse_config; parse_config({})\n"
        "print('prometheus_client' in sys.modules, 'gpuwatchd.exporter.registry' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_a_daemon_exports_only_the_chosen_fields_and_says_a_change_needs_a_restart(
    tmp_path: Path,
) -> None:
    port = free_port()
    cfg = tmp_path / "config.toml"
    head = (
        f'[daemon]\nbackend = "sim"\nlisten = "127.0.0.1:{port}"\npoll_interval_s = 0.1\n'
        f'state_dir = "{tmp_path / "state"}"\n[tuning]\nenabled = false\n'
    )
    cfg.write_text(head + '[exporter]\nfields = ["gpuwatchd_gpu_power_watts"]\n')
    proc = start_daemon(["--config", str(cfg)])
    url = f"http://127.0.0.1:{port}/metrics"

    def polled() -> str:
        text = http_get(url)
        return text if "gpuwatchd_gpu_power_watts{" in text else ""

    try:
        wait_http(url)
        text = wait_until(polled, 30, what="a scrape after a poll")
        cfg.write_text(head)
        proc.send_signal(signal.SIGHUP)
        assert proc.stdout is not None
        log = []
        for line in proc.stdout:  # the daemon logs the reload's outcome
            log.append(line)
            if "config reload" in line:
                break
    finally:
        proc.terminate()
        proc.communicate(timeout=10)
    names = {f.name for f in text_string_to_metric_families(text)}
    assert "gpuwatchd_gpu_power_watts" in names
    assert not {"gpuwatchd_gpu_temperature_celsius", "gpuwatchd_gate_open"} & names
    assert {"gpuwatchd_build_info", "gpuwatchd_tuning_ready"} <= names  # the daemon's own
    assert "[exporter] change only on restart" in log[-1], log
