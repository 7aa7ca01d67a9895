"""The reference documents list exactly what the code has.

docs/configuration.md: one table per section with exactly the keys the loader accepts;
examples/config.toml: every one of those keys. docs/metrics.md (generated, see
test_generated_docs.py): every family of a live simulated daemon's /metrics, with its
type and labels. tests/metric_catalog.py: exactly the families the exporter can emit.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from builders import free_port, wait_until
from daemon_helpers import http_get, start_daemon
from metric_catalog import KNOWN_METRICS, SOURCE
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


def _emittable() -> dict[str, Documented]:
    """Every family some collector can emit (scripts/docs_gen.py's enumeration, the one
    docs/metrics.md is rendered from)."""
    spec = importlib.util.spec_from_file_location("docs_gen", ROOT / "scripts" / "docs_gen.py")
    assert spec is not None and spec.loader is not None
    gen: Any = importlib.util.module_from_spec(spec)
    sys.modules["docs_gen"] = gen
    spec.loader.exec_module(gen)
    return {
        f.name: Documented(f.type, frozenset(f.labels))
        for fams in gen.metric_sections().values()
        for f in fams
    }


def test_metric_catalogue_is_every_family_the_exporter_can_emit() -> None:
    """Both ways: a family without a catalogue entry (dashboards and alerts could not
    use it) and an entry no collector emits (a query on it would stay empty)."""
    emitted = _emittable()
    catalogued = {n for n, src in SOURCE.items() if src != "prometheus"}
    for name, fam in emitted.items():
        assert name in KNOWN_METRICS, f"{name} is emitted but not in tests/metric_catalog.py"
        assert KNOWN_METRICS[name] == fam.labels, f"{name}: catalogued labels differ"
    for name in sorted(catalogued - set(emitted)):
        raise AssertionError(f"tests/metric_catalog.py lists {name}, which no collector emits")


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
