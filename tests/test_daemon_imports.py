"""What a monitoring daemon imports: nothing that only tuning, a fleet, TLS users or the
CLI's display need (each import is memory every host pays)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from builders import free_port, wait_until
from daemon_helpers import http_get, wait_http

#: Slow end to end: the README's test command runs these in its second step.
pytestmark = pytest.mark.slow

#: Loaded only when used: ``statistics`` (a reference or a fleet to take a median of), a
#: web config's YAML and password hashes, the CLI's tables, and torch (the worker's).
NOT_IMPORTED = ("statistics", "yaml", "bcrypt", "rich", "torch")

#: Single modules loaded only when used: the IDNA codec (a listen address that is not
#: ASCII), a captured-workload request's parser and Inductor sites' (a request, the worker),
#: the trace reader (``--backend replay``), a tuning session's runner and spec (a session).
NOT_IMPORTED_MODULES = (
    "encodings.idna",
    "gpuwatchd.sessions.resume",
    "gpuwatchd.sessions.runner",
    "gpuwatchd.telemetry.trace",
    "gpuwatchd.tuning.submitted.captured",
    "gpuwatchd.tuning.submitted.inductor_sites",
    "gpuwatchd.tuning.session_spec",
)

#: The web config's modules (TLS, basic auth): a daemon serving plain HTTP loads none.
WEB_CONFIG = "gpuwatchd.serve.web"

#: The CLI modules ``gpuwatchd run`` needs: no other command's module or parser.
RUN_CLI = ("gpuwatchd.cli", "gpuwatchd.cli.common", "gpuwatchd.cli.main", "gpuwatchd.cli.run")

#: The simulator's modules: a daemon on real GPUs reads ``[sim]`` (its settings) and no more.
SIMULATOR = "gpuwatchd.telemetry.sim."
SIM_SETTINGS = "gpuwatchd.telemetry.sim.settings"

#: Runs ``gpuwatchd run`` and writes the process's module names to a file on SIGUSR1;
#: with a tests directory as its second argument, ``import pynvml`` finds one fake GPU.
WRAPPER = """
import json, os, signal, sys
out, tests = sys.argv[1], sys.argv[2]
if tests:
    sys.path.append(tests)
    from fakes_nvml import FakeNvml
    sys.modules["pynvml"] = FakeNvml(1)
def dump(_signum, _frame):
    with open(out + ".tmp", "w") as f:
        json.dump(sorted(sys.modules), f)
    os.replace(out + ".tmp", out)
signal.signal(signal.SIGUSR1, dump)
from gpuwatchd.cli.main import main
sys.exit(main(sys.argv[3:]))
"""


def _scraped_daemon_modules(tmp_path: Path, backend: list[str], fake_nvml: bool) -> set[str]:
    """The modules of a monitoring daemon (tuning and drift off) scraped three times,
    after its first fleet sync."""
    config = tmp_path / "config.toml"
    config.write_text("[tuning]\nenabled = false\n\n[drift]\nenabled = false\n")
    port = free_port()
    modules = tmp_path / "modules.json"
    tests = str(Path(__file__).resolve().parent) if fake_nvml else ""
    argv = [
        sys.executable, "-c", WRAPPER, str(modules), tests,
        "run", "--config", str(config), *backend,
        "--poll-interval", "0.2", "--listen", f"127.0.0.1:{port}", "--log-level", "warning",
        "--state-dir", str(tmp_path), "--control-socket", str(tmp_path / "c.sock"),
    ]  # fmt: skip
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path
    )
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        wait_http(url)
        for _ in range(3):
            http_get(url)
        # the fleet sync's first run (3 s after start) is part of what a daemon does
        wait_until(
            lambda: "\ngpuwatchd_fleet_sync_success " in http_get(url) or proc.poll() is not None,
            20,
            "the first fleet sync",
        )
        os.kill(proc.pid, signal.SIGUSR1)
        wait_until(modules.exists, 10, "the module list")
        loaded = set(json.loads(modules.read_text()))
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
    assert "gpuwatchd.daemon.process" in loaded, out
    return loaded


def test_a_scraped_monitoring_daemon_imports_nothing_it_does_not_use(tmp_path: Path) -> None:
    loaded = _scraped_daemon_modules(tmp_path, ["--backend", "sim", "--gpus", "1"], False)
    heavy = sorted(m for m in loaded if m.split(".")[0] in NOT_IMPORTED)
    assert heavy == [], heavy
    assert sorted(loaded.intersection(NOT_IMPORTED_MODULES)) == []
    web = sorted(m for m in loaded if m.startswith(WEB_CONFIG))
    assert web == []
    cli = sorted(m for m in loaded if m.startswith("gpuwatchd.cli"))
    assert cli == sorted(RUN_CLI)


def test_a_daemon_on_real_gpus_does_not_load_the_simulator(tmp_path: Path) -> None:
    loaded = _scraped_daemon_modules(tmp_path, ["--backend", "nvml"], True)
    assert "gpuwatchd.telemetry.nvml" in loaded
    sim = sorted(m for m in loaded if m.startswith(SIMULATOR) and m != SIM_SETTINGS)
    assert sim == []
