"""Run a real Prometheus next to a gpuwatchd process in the tests, and talk to its HTTP API.

Everything here starts processes in their own session (process group) so that
:func:`stop_process` can end a process together with whatever it spawned (the daemon's
tuning workers) by that group's id, never by name.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import builders
import yaml
from builders import candidate, seed_session, session_meta

from gpuwatchd.config import STORE_NAME
from gpuwatchd.store import sqlite_store
from gpuwatchd.tuning.types import Regime, RegimeResult, Versions, Workload

REPO = Path(__file__).resolve().parent.parent
ALERT_RULES = REPO / "prometheus" / "alerts.yml"
DEBIAN_PROMETHEUS = Path("/usr/bin/prometheus")
#: The scrape job name prometheus/alerts.yml assumes (see GpuwatchdDown).
JOB = "gpuwatchd"


def find_prometheus() -> str | None:
    """The Prometheus server binary: on PATH, else Debian's; None when neither exists."""
    found = shutil.which("prometheus")
    if found:
        return found
    return str(DEBIAN_PROMETHEUS) if DEBIAN_PROMETHEUS.is_file() else None


# -- configuration ------------------------------------------------------------------


def shorten_for_durations(rules: Mapping[str, Any], for_duration: str) -> dict[str, Any]:
    """A copy of a rules document with every alert's ``for:`` set to ``for_duration``.

    The production rules wait minutes to hours before firing; a test that wants to see
    the pending -> firing transition in seconds shortens only that field.
    """
    doc = copy.deepcopy(dict(rules))
    for group in doc.get("groups", []):
        for rule in group.get("rules", []):
            if "alert" in rule and "for" in rule:
                rule["for"] = for_duration
    return doc


def write_test_rules(dest: Path, for_duration: str, source: Path = ALERT_RULES) -> Path:
    """Write ``source`` to ``dest`` with shortened ``for:`` durations (nothing else changed)."""
    rules = yaml.safe_load(source.read_text(encoding="utf-8"))
    dest.write_text(
        yaml.safe_dump(
            shorten_for_durations(rules, for_duration),
            sort_keys=False,
            allow_unicode=True,
            width=1000,
        ),
        encoding="utf-8",
    )
    return dest


def write_prometheus_config(dest: Path, target: str, rule_file: Path) -> Path:
    """A config scraping ``target`` every second as job ``gpuwatchd``, rules every second."""
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rule_file)],
        "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": [target]}]}],
    }
    dest.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return dest


# -- a tuning store with winners ------------------------------------------------------


def seed_winners(state_dir: Path, gpu_model: str, winners: Mapping[str, tuple[str, str]]) -> Path:
    """Record one completed session in the daemon's store before it starts.

    ``winners`` maps a workload name to its (unthrottled, sustained) winning candidate,
    so the test knows which rows the winners table must show and which "differ".
    Workload names the daemon does not configure keep it tuning (and deferring) its own.
    """
    # A mid clock (1.5 GHz): the drift reference the daemon seeds from this store.
    measured: dict[str, Any] = {
        "family": "torch.matmul",
        "spread": 0.01,
        "samples": 10,
        "sm_clock_hz": 1.5e9,
        "power_w": 300.0,
        "temp_c": 60.0,
        "energy_j_per_call": 0.3,
        "meta": {},
    }
    regimes = (Regime.UNTHROTTLED, Regime.SUSTAINED)
    workloads = tuple(
        Workload(name, "matmul", {"m": 1024, "n": 1024, "k": 1024}, "bf16", ("torch.matmul",))
        for name in winners
    )
    meta = session_meta(
        gpu_uuid="GPU-e2e-seed",
        gpu_model=gpu_model,
        backend="sim",
        workloads=workloads,
        regimes=regimes,
        versions=Versions(),
    )
    results = []
    for workload, picks in winners.items():
        names = sorted({*picks, "runner-up"})
        for regime, winner in zip(regimes, picks, strict=True):
            candidates = tuple(
                candidate(name, regime, 1e-3 if name == winner else 2e-3, **measured)
                for name in names
            )
            results.append(RegimeResult(workload, regime, candidates, winner, False, 1.0, 0.01))
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / STORE_NAME
    with sqlite_store(path) as store:
        seed_session(store, meta, results)
    return path


# -- processes ----------------------------------------------------------------------


def start_logged(
    argv: Sequence[str], log: Path, env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a new session with stdout+stderr going to ``log`` (never a pipe
    nobody reads, which would block the process once it fills)."""
    with log.open("wb") as out:
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            cwd=REPO,
            start_new_session=True,
        )


def start_sim_daemon(
    scenario: str,
    listen: str,
    state_dir: Path,
    log: Path,
    *,
    gpus: int,
    speed: float,
    extra: Sequence[str] = (),
) -> subprocess.Popen[bytes]:
    """``gpuwatchd run`` on the simulated GPU, importing the package from this tree;
    ``extra`` arguments (``--config FILE``) go at the end."""
    argv = [
        sys.executable,
        "-m",
        "gpuwatchd",
        "run",
        "--backend",
        "sim",
        "--scenario",
        scenario,
        "--gpus",
        str(gpus),
        "--speed",
        str(speed),
        "--listen",
        listen,
        "--state-dir",
        str(state_dir),
        "--poll-interval",
        "0.1",
        *extra,
    ]
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    runtime_dir = state_dir.parent / "run"
    runtime_dir.mkdir(mode=0o700, exist_ok=True)
    env = {
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": pythonpath,
        # The control socket goes where systemd's RuntimeDirectory= would put it: one
        # per daemon, so daemons running side by side (or a real one) do not clash.
        "RUNTIME_DIRECTORY": str(runtime_dir),
    }
    return start_logged(argv, log, env)


def start_prometheus(
    binary: str, config: Path, data_dir: Path, listen: str, log: Path
) -> subprocess.Popen[bytes]:
    argv = [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={data_dir}",
        f"--web.listen-address={listen}",
        "--log.level=warn",
    ]
    return start_logged(argv, log)


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 5.0) -> None:
    """SIGTERM the process group ``proc`` leads, SIGKILL it if the leader outlives ``timeout``.

    The group is only signalled while its leader is unreaped, so its id is still ours.
    """
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout)


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(no log: {exc})"


#: Prometheus scrapes and evaluates once a second: probing it 4 times a second is enough.
wait_until = partial(builders.wait_until, interval=0.25)


# -- Grafana's variable formatting ---------------------------------------------------

_REGEX_SPECIAL = re.compile(r"[$^*{}\[\]'+?.()|]")


def grafana_regex_value(values: Sequence[str]) -> str:
    """What Grafana's Prometheus data source puts in place of a multi-value variable.

    As ``prometheusSpecialRegexEscape``: each value regex-escaped with the backslash
    doubled (it sits inside a PromQL string), several values joined as ``(a|b)``.
    """
    escaped = [_REGEX_SPECIAL.sub(r"\\\\\g<0>", v.replace("\\", "\\" * 4)) for v in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


# -- HTTP API -----------------------------------------------------------------------


class PromApiError(AssertionError):
    """Prometheus answered a query with an error (bad syntax, bad matcher...)."""


class PromApi:
    """The few /api/v1 endpoints the tests use; each returns the response's ``data``."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")

    def get(self, path: str, params: Sequence[tuple[str, str]] = ()) -> Any:
        url = f"{self.base_url}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(list(params))
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as exc:  # 400/422: the body says what was wrong
            body = json.load(exc)
        if body.get("status") != "success":
            raise PromApiError(
                f"{path} {dict(params)}: {body.get('errorType')}: {body.get('error')}"
            )
        return body["data"]

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/-/ready", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def query(self, expr: str, at: float | None = None) -> dict[str, Any]:
        params = [("query", expr)] + ([("time", f"{at:.3f}")] if at is not None else [])
        return self.get("/api/v1/query", params)

    def query_range(self, expr: str, start: float, end: float, step: float) -> dict[str, Any]:
        params = [
            ("query", expr),
            ("start", f"{start:.3f}"),
            ("end", f"{end:.3f}"),
            ("step", f"{step:g}"),
        ]
        return self.get("/api/v1/query_range", params)

    def vector(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's series (``[]`` when it has none)."""
        data = self.query(expr)
        if data["resultType"] != "vector":
            raise PromApiError(f"{expr!r} is a {data['resultType']}, not an instant vector")
        return list(data["result"])

    def alerts(self) -> list[dict[str, Any]]:
        return list(self.get("/api/v1/alerts")["alerts"])

    def alerting_rules(self) -> dict[str, dict[str, Any]]:
        groups = self.get("/api/v1/rules", [("type", "alert")])["groups"]
        return {rule["name"]: rule for group in groups for rule in group["rules"]}

    def label_values(self, label: str, match: str, start: float, end: float) -> list[str]:
        params = [("match[]", match), ("start", f"{start:.3f}"), ("end", f"{end:.3f}")]
        return list(self.get(f"/api/v1/label/{label}/values", params))


def has_data(data: Mapping[str, Any]) -> bool:
    """Whether a query result would draw anything: a series with at least one point."""
    kind, result = data["resultType"], data["result"]
    if kind == "matrix":
        return any(series["values"] for series in result)
    if kind == "vector":
        return bool(result)
    return True  # scalar or string: always one value
