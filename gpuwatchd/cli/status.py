"""``gpuwatchd status``: fetch the daemon's JSON state and print a per-GPU table."""

from __future__ import annotations

import base64
import json
import os
import ssl
import urllib.error
import urllib.request
from typing import Any

from gpuwatchd.cli.main import CliError

STATE_PATH = "/api/v1/state"
PASSWORD_ENV = "GPUWATCHD_PASSWORD"


def _request(url: str, user: str | None) -> urllib.request.Request:
    req = urllib.request.Request(url)
    if user:
        password = os.environ.get(PASSWORD_ENV)
        if password is None:
            raise CliError(f"--user {user}: set the password in ${PASSWORD_ENV}")
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        req.add_header("Authorization", f"Basic {token}")
    return req


def fetch_state(
    base_url: str,
    timeout: float = 3.0,
    *,
    cacert: str | None = None,
    user: str | None = None,
) -> dict[str, Any]:
    """GET the state document; one-line CliError when the daemon can't be reached.

    For a daemon behind a web config: an https URL, ``cacert`` (the CA that signed its
    certificate) and ``user`` for basic auth (password from $GPUWATCHD_PASSWORD).
    """
    url = base_url.rstrip("/") + STATE_PATH
    if not url.startswith(("http://", "https://")):
        raise CliError(f"--url {base_url}: expected http://HOST:PORT or https://HOST:PORT", 2)
    context = None
    if cacert:
        try:
            context = ssl.create_default_context(cafile=cacert)
        except (OSError, ssl.SSLError) as exc:
            raise CliError(f"--cacert {cacert}: {exc}") from None
    try:
        with urllib.request.urlopen(_request(url, user), timeout=timeout, context=context) as resp:
            body = resp.read()
    except urllib.error.HTTPError as exc:
        raise CliError(f"{url}: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise CliError(
            f"cannot reach gpuwatchd at {url}: {reason} (is the daemon running?)"
        ) from None
    try:
        doc = json.loads(body)
    except ValueError:
        raise CliError(f"{url}: response is not JSON") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("gpus"), list):
        raise CliError(f"{url}: not a gpuwatchd state document")
    return doc


def _fmt(value: Any, spec: str, unit: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:{spec}}{unit}"


def _pair(cur: Any, limit: Any, spec: str, unit: str) -> str:
    if cur is None and limit is None:
        return "-"
    return f"{_fmt(cur, spec)}/{_fmt(limit, spec)}{unit}"


def _row(gpu: dict[str, Any]) -> list[str]:
    info = gpu.get("info") or {}
    sample = gpu.get("sample") or {}
    gate = gpu.get("gate") or {}
    poll = gpu.get("poll") or {}
    if poll.get("lost"):
        health = "LOST"
    elif poll.get("stalled"):
        health = "STALLED"
    elif not poll.get("success"):
        health = "FAILING"
    else:
        health = ""
    reasons = sample.get("throttle_reasons")
    reason_text = ",".join(reasons) if reasons else ("-" if reasons is None else "none")
    why = "; ".join(gate.get("reasons") or [])
    state = gate.get("state", "-")
    if health:
        state = f"{state} ({health})"
    return [
        str(gpu.get("gpu", "?")),
        str(info.get("name") or "-"),
        _pair(sample.get("temp_c"), info.get("slowdown_temp_c"), ".0f", "C"),
        _pair(sample.get("power_w"), info.get("power_limit_w"), ".0f", "W"),
        _pair(sample.get("sm_clock_mhz"), info.get("max_sm_clock_mhz"), ".0f", "MHz"),
        reason_text,
        state,
        why or "-",
    ]


def format_status(doc: dict[str, Any]) -> str:
    """A fixed-width table, one GPU per row; the last column says why the gate is shut."""
    header = [
        "GPU",
        "NAME",
        "TEMP/SLOWDOWN",
        "POWER/LIMIT",
        "SM CLOCK/MAX",
        "REASONS",
        "GATE",
        "WHY",
    ]
    rows = [header] + [_row(g) for g in doc["gpus"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    lines = []
    for r in rows:
        cells = [c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)]
        lines.append("  ".join([*cells, r[-1]]).rstrip())
    daemon = doc.get("daemon") or {}
    if daemon:
        lines.insert(
            0, f"gpuwatchd {daemon.get('version', '?')} · backend {daemon.get('backend', '?')}"
        )
    if not doc["gpus"]:
        lines.append("(no GPUs)")
    tuning = doc.get("tuning")
    if isinstance(tuning, dict):
        lines.append(_tuning_line(tuning))
    return "\n".join(lines)


def _tuning_line(tuning: dict[str, Any]) -> str:
    if not tuning.get("enabled", True):
        return "tuning: disabled"
    running = tuning.get("running_gpus") or []
    pending = tuning.get("pending") or {}
    parts = []
    if running:
        parts.append("running on GPU " + ", ".join(str(g) for g in running))
    for gpu, names in sorted(pending.items()):
        parts.append(f"GPU {gpu} waiting: {', '.join(names)}")
    return "tuning: " + ("; ".join(parts) if parts else "idle, nothing pending")
