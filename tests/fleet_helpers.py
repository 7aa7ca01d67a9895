"""A fleet on one machine for the tests: several ``gpuwatchd run`` daemons on simulated
GPUs, each under its own host name, sharing one store, and a Prometheus scraping them all.

Every process starts in its own session (see prom_helpers.start_logged), so
prom_helpers.stop_process ends it with whatever it spawned, by process group id.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from prom_helpers import JOB, REPO, log_tail, start_logged
from prometheus_client.parser import text_string_to_metric_families

from gpuwatchd.store.rows import HOST_ENV

#: A metric sample as the tests compare it: its labels, sorted, as a tuple.
Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class HostSpec:
    """One host of the fleet: its name, what its simulated GPU lives through, and its
    seed (each host's GPU has its own UUID, as real GPUs do)."""

    name: str
    scenario: str
    seed: int
    start_s: float = 0.0


@dataclass
class FleetHost:
    """A started host: its daemon process, where it serves and where it logs."""

    spec: HostSpec
    instance: str  # host:port, as Prometheus labels its series
    work: Path
    proc: subprocess.Popen[bytes] | None = None
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log = self.work / "gpuwatchd.log"

    @property
    def url(self) -> str:
        return f"http://{self.instance}"

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(
                f"{self.spec.name}: gpuwatchd exited with {self.proc.returncode}:\n"
                f"{log_tail(self.log, 40)}"
            )

    def answers(self) -> bool:
        self.check_alive()
        try:
            with urllib.request.urlopen(f"{self.url}/healthz", timeout=1.0):
                return True
        except OSError:
            return False

    def metrics(self) -> dict[str, dict[Labels, float]]:
        """The daemon's /metrics now: sample name -> labels -> value."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=5.0) as resp:
            text = resp.read().decode()
        out: dict[str, dict[Labels, float]] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
        return out


def toml_text(value: object) -> str:
    """A TOML literal for the few value types the configs use."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_text(v) for v in value) + "]"
    raise TypeError(f"no TOML literal for {value!r}")


def config_text(tables: Mapping[str, Mapping[str, object]]) -> str:
    """A gpuwatchd config file made of ``tables`` (table name -> key -> value)."""
    lines: list[str] = []
    for name, table in tables.items():
        lines.append(f"[{name}]")
        lines += [f"{key} = {toml_text(value)}" for key, value in table.items()]
    return "\n".join(lines) + "\n"


def start_fleet_daemon(host: FleetHost, config: Path) -> subprocess.Popen[bytes]:
    """``gpuwatchd run --config FILE`` as ``host.spec.name`` (``GPUWATCHD_HOST``),
    importing the package from this tree."""
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {"PYTHONUNBUFFERED": "1", "PYTHONPATH": pythonpath, HOST_ENV: host.spec.name}
    argv = [sys.executable, "-m", "gpuwatchd", "run", "--config", str(config)]
    host.proc = start_logged(argv, host.log, env)
    return host.proc


def write_fleet_prometheus_config(dest: Path, targets: Sequence[str], rule_file: Path) -> Path:
    """A config scraping every target each second as job ``gpuwatchd``, rules each second."""
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rule_file)],
        "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": list(targets)}]}],
    }
    dest.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return dest
