"""The reference documents list exactly what the code has.

docs/configuration.md: one table per section with exactly the keys the loader accepts;
examples/config.toml: every one of those keys. docs/metrics.md: every family of the
daemon's registry (every sub-collector populated) and of a live simulated daemon's
/metrics, with its type and labels, and nothing the exporter does not have.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

import pytest
from builders import free_port, wait_until
from daemon_helpers import http_get, start_daemon
from daemon_registry import daemon_registry
from metric_catalog import KNOWN_METRICS
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpuwatchd.config.loader import Config
from gpuwatchd.tuning import workloads
from gpuwatchd.tuning.settings import ProtocolConfig

ROOT = Path(__file__).resolve().parent.parent
CONFIG_DOC = ROOT / "docs" / "configuration.md"
METRICS_DOC = ROOT / "docs" / "metrics.md"
EXAMPLE = ROOT / "examples" / "config.toml"
SECTIONS = ("daemon", "sim", "replay", "gate", "tuning", "drift", "store", "fleet", "exporter")


def _loader_keys() -> dict[str, set[str]]:
    """Section -> the keys the loader accepts (``[tuning]``'s protocol is its own table)."""
    defaults = Config()
    keys = {s: {f.name for f in dataclasses.fields(getattr(defaults, s))} for s in SECTIONS}
    keys["tuning"].discard("protocol")
    keys["tuning.protocol"] = {f.name for f in dataclasses.fields(ProtocolConfig)}
    keys["[workload]"] = set(workloads._KEYS)
    return keys


def _tables_by_heading(doc: Path) -> dict[str, list[list[str]]]:
    """``## heading`` -> the rows (cells) of the tables under it, header rows left out."""
    tables: dict[str, list[list[str]]] = {}
    heading = ""
    for line in doc.read_text().splitlines():
        if line.startswith("## "):
            heading = line[3:].strip()
        elif line.startswith("|") and not re.match(r"^\|\s*-", line):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            tables.setdefault(heading, []).append(cells)
    return {h: rows[1:] if rows else rows for h, rows in tables.items()}


def _code(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_configuration_doc_lists_exactly_the_loaders_keys() -> None:
    tables = _tables_by_heading(CONFIG_DOC)
    for section, keys in _loader_keys().items():
        rows = tables.get(f"[{section}]")
        assert rows, f"configuration.md has no table under '## [{section}]'"
        documented = [_code(r[0])[0] for r in rows]
        assert len(documented) == len(set(documented)), section
        assert set(documented) == keys, section


def test_configuration_doc_defaults_are_the_examples() -> None:
    example = tomllib.loads(EXAMPLE.read_text())
    tables = _tables_by_heading(CONFIG_DOC)
    for section in (*SECTIONS, "tuning.protocol"):
        table = example
        for part in section.split("."):
            table = table[part]
        for row in tables[f"[{section}]"]:
            key, default = _code(row[0])[0], _code(row[1])[0]
            assert tomllib.loads(f"v = {default}")["v"] == table[key], f"{section}.{key}"


def test_the_example_config_lists_every_key() -> None:
    example = tomllib.loads(EXAMPLE.read_text())
    for section, keys in _loader_keys().items():
        if section == "[workload]":
            assert all(set(w) <= keys for w in example["workload"])
            continue
        table = example
        for part in section.split("."):
            table = table[part]
        assert set(table) - {"protocol"} == keys, section


@dataclasses.dataclass(frozen=True)
class Documented:
    type: str
    labels: frozenset[str]


def _documented_metrics() -> dict[str, Documented]:
    out: dict[str, Documented] = {}
    for rows in _tables_by_heading(METRICS_DOC).values():
        for row in rows:
            if len(row) != 5 or not row[0].startswith("`gpuwatchd_"):
                continue  # the dcgm-exporter mapping and prose tables
            (name,) = _code(row[0])
            assert name not in out, f"{name} is listed twice"
            out[name] = Documented(row[1], frozenset(_code(row[3])))
    return out


def _families(text: str) -> dict[str, Documented]:
    """Exposed name (counters with ``_total``) -> type and label names."""
    out: dict[str, Documented] = {}
    for fam in text_string_to_metric_families(text):
        name = f"{fam.name}_total" if fam.type == "counter" else fam.name
        labels = frozenset(k for s in fam.samples for k in s.labels)
        out[name] = Documented(fam.type, labels)
    return out


def _assert_documented(exposed: dict[str, Documented], where: str) -> None:
    documented = _documented_metrics()
    for name, fam in exposed.items():
        assert name in documented, f"{name} ({where}) is not in docs/metrics.md"
        doc = documented[name]
        assert doc.type == fam.type, f"{name}: documented {doc.type}, {where} {fam.type}"
        if fam.labels:  # a family without samples shows no labels
            assert doc.labels == fam.labels, f"{name}: labels {sorted(doc.labels)}"


def test_metrics_doc_covers_the_daemons_registry() -> None:
    text = generate_latest(daemon_registry(2).registry).decode()
    _assert_documented(_families(text), "the daemon's registry")


def test_metrics_doc_lists_only_what_the_exporter_has() -> None:
    """Each documented name is exposed by the registry, catalogued for the dashboards'
    and alerts' checks, or named by an exporter collector's source."""
    registry = set(_families(generate_latest(daemon_registry(2).registry).decode()))
    source = "".join(p.read_text() for p in (ROOT / "gpuwatchd" / "exporter").rglob("*.py"))
    for name in _documented_metrics():
        base = name.removesuffix("_total")
        known = name in registry or name in KNOWN_METRICS or f'"{base}"' in source
        assert known, f"docs/metrics.md lists {name}, which the exporter does not have"


@pytest.fixture(scope="module")
def live_metrics() -> str:
    """/metrics of a simulated daemon that has polled, read the slow fields and tuned."""
    port = free_port()
    proc = start_daemon(
        [
            "--backend",
            "sim",
            "--scenario",
            "ecc-error",
            "--speed",
            "10",
            "--poll-interval",
            "0.1",
            "--listen",
            f"127.0.0.1:{port}",
        ]
    )
    url = f"http://127.0.0.1:{port}/metrics"

    def scrape() -> str:
        try:
            text = http_get(url)
        except OSError:
            return ""
        return text if "gpuwatchd_gpu_memory_used_bytes" in text else ""

    try:
        return wait_until(scrape, 30, what="a scrape with the slow fields", interval=0.2)
    finally:
        proc.terminate()
        proc.communicate(timeout=10)


def test_metrics_doc_covers_a_live_daemons_metrics(live_metrics: str) -> None:
    _assert_documented(_families(live_metrics), "a live simulated daemon")
