"""``gpuwatchd status``: fetch the daemon's JSON state and print a per-GPU table.

Without ``--url`` the daemon is found where the config says it listens: on this host,
over https when the config's web config turns TLS on. The document is fetched by
:mod:`gpuwatchd.api.fetch` and read by :func:`gpuwatchd.api.state.parse_state`, as the
job-side client reads it; those modules are imported when the command runs, so building
the ``gpuwatchd`` parser does not pay for them.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import TYPE_CHECKING, Any

from gpuwatchd.cli.common import (
    EXIT_CONFIG,
    CliError,
    Subparsers,
    add_command,
    load_with_overrides,
)
from gpuwatchd.cli.state_text import gpu_health, tuning_line

if TYPE_CHECKING:
    from gpuwatchd.api.gpu_state import GpuState

PASSWORD_ENV = "GPUWATCHD_PASSWORD"
#: How often ``--watch`` refetches the state, and the least it may be asked to.
DEFAULT_INTERVAL_S = 2.0
MIN_INTERVAL_S = 0.1
#: The longest ``--wait``; a daemon that does not serve within it is not starting.
MAX_WAIT_S = 600.0
#: Between tries while ``--wait`` runs: a started daemon serves within a second or two.
WAIT_RETRY_S = 0.2


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    p = add_command(
        subparsers,
        "status",
        "per-GPU table from a running daemon",
        "Fetch the running daemon's /api/v1/state and print one row per GPU: temperature,\n"
        "power and SM clock against their limits, throttle reasons, and the gate with WHY\n"
        "it is shut (each threshold is the configured value; while the gate is shut, less\n"
        "its hysteresis, said in the reason). With --watch, a live view within 100 columns\n"
        "redrawn every --interval seconds, adding each GPU's utilisation and its compute\n"
        "processes (PID, user, device memory, Kubernetes pod); q or Ctrl-C quits.",
        (
            "gpuwatchd status",
            "gpuwatchd status --watch --interval 2",
            "gpuwatchd run --backend sim & gpuwatchd status --wait 30",
            "gpuwatchd status --url https://gpu-host:9844 --cacert ca.pem --user admin",
            "gpuwatchd status --json | jq '.gpus[0].gate'",
        ),
    )
    p.add_argument("--config", metavar="FILE", help="read the daemon's listen address from here")
    p.add_argument("--url", help="daemon base URL (default from the config's listen address)")
    p.add_argument("--json", action="store_true", help="print the raw JSON state")
    p.add_argument("--watch", action="store_true", help="a live view until q or Ctrl-C")
    p.add_argument(
        "--interval",
        type=float,
        default=DEFAULT_INTERVAL_S,
        metavar="S",
        help=f"seconds between --watch refreshes (default {DEFAULT_INTERVAL_S:g})",
    )
    p.add_argument(
        "--timeout", type=float, default=3.0, metavar="S", help="seconds to wait for the daemon"
    )
    p.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="S",
        help="keep trying up to S seconds while nothing listens yet (a daemon just started)",
    )
    p.add_argument("--cacert", metavar="FILE", help="CA certificate of an https daemon")
    p.add_argument("--user", help="basic-auth user (password in $GPUWATCHD_PASSWORD)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    if args.watch and not (args.interval >= MIN_INTERVAL_S):  # NaN fails too
        raise CliError(f"--interval {args.interval}: must be >= {MIN_INTERVAL_S:g}", EXIT_CONFIG)
    if args.watch and args.json:
        raise CliError("--watch and --json: choose one", EXIT_CONFIG)
    if not (0 <= args.wait <= MAX_WAIT_S):  # NaN fails too
        raise CliError(f"--wait {args.wait}: must be 0 to {MAX_WAIT_S:g} seconds", EXIT_CONFIG)
    url = args.url
    if url is None:
        from gpuwatchd.config import ConfigError
        from gpuwatchd.daemon.process import read_web_config

        cfg, _ = load_with_overrides(args)
        try:
            web = read_web_config(cfg)
        except ConfigError as exc:
            raise CliError(str(exc), EXIT_CONFIG) from None
        url = local_url(cfg.daemon.listen, https=web is not None and web.tls is not None)
    if args.watch:
        from gpuwatchd.cli.status_watch import watch

        return watch(
            lambda: fetch_state(url, timeout=args.timeout, cacert=args.cacert, user=args.user),
            args.interval,
        )
    state = fetch_state(
        url, timeout=args.timeout, cacert=args.cacert, user=args.user, wait=args.wait
    )
    if args.json:
        print(json.dumps(state, indent=2, sort_keys=True))
    else:
        print(format_status(state))
    return 0


def local_url(listen: str, https: bool = False) -> str:
    """The base URL of a daemon on this host listening on ``listen`` (any address: loopback)."""
    from gpuwatchd.config.listen import parse_listen

    host, port = parse_listen(listen)
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"{'https' if https else 'http'}://{host}:{port}"


def fetch_state(
    base_url: str,
    timeout: float = 3.0,
    *,
    cacert: str | None = None,
    user: str | None = None,
    wait: float = 0.0,
) -> dict[str, Any]:
    """GET the state document; one-line CliError when the daemon can't be reached.

    For a daemon behind a web config: an https URL, ``cacert`` (the CA that signed its
    certificate) and ``user`` for basic auth (password from $GPUWATCHD_PASSWORD). With
    ``wait`` > 0, an unreachable daemon is tried again until ``wait`` seconds have passed
    (scripts that start one and read it; any other error fails at once).
    """
    import time

    from gpuwatchd.api.errors import GpuwatchdError
    from gpuwatchd.api.fetch import CaFileError, FetchError, UnreachableError, get_json, is_base_url
    from gpuwatchd.api.state import STATE_PATH, parse_state

    if not is_base_url(base_url):
        raise CliError(
            f"--url {base_url}: expected http://HOST:PORT or https://HOST:PORT", EXIT_CONFIG
        )
    url = base_url.rstrip("/") + STATE_PATH
    auth = None
    if user:
        password = os.environ.get(PASSWORD_ENV)
        if password is None:
            raise CliError(f"--user {user}: set the password in ${PASSWORD_ENV}")
        auth = (user, password)
    deadline = time.monotonic() + wait
    try:
        while True:
            try:
                doc: dict[str, Any] = get_json(url, timeout=timeout, cafile=cacert, auth=auth)
                break
            except UnreachableError as exc:
                if time.monotonic() + WAIT_RETRY_S > deadline:
                    waited = f" after {wait:g} s" if wait > 0 else ""
                    raise CliError(
                        f"cannot reach gpuwatchd at {url}{waited}: {exc.detail}"
                        " (is the daemon running?)"
                    ) from None
                time.sleep(WAIT_RETRY_S)
    except CaFileError as exc:
        raise CliError(f"--cacert {exc}") from None
    except FetchError as exc:
        raise CliError(str(exc)) from None
    try:
        parse_state(doc, url)
    except GpuwatchdError as exc:
        raise CliError(str(exc)) from None
    return doc


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:{spec}}{unit}"


def _pair(cur: float | None, limit: float | None, spec: str, unit: str) -> str:
    if cur is None and limit is None:
        return "-"
    return f"{_fmt(cur, spec)}/{_fmt(limit, spec)}{unit}"


def _row(gpu: GpuState) -> list[str]:
    health = gpu_health(gpu)
    reasons = gpu.throttle_reasons
    reason_text = ",".join(reasons) if reasons else ("-" if reasons is None else "none")
    state = f"{gpu.state} ({health})" if health else gpu.state
    return [
        str(gpu.gpu),
        gpu.name or "-",
        _pair(gpu.temp_c, gpu.slowdown_temp_c, ".0f", "C"),
        _pair(gpu.power_w, gpu.power_limit_w, ".0f", "W"),
        _pair(gpu.sm_clock_mhz, gpu.max_sm_clock_mhz, ".0f", "MHz"),
        reason_text,
        state,
    ]


#: The table's columns; each GPU's row is followed by why its gate is shut (or open).
#: TEMP is the reading / the slowdown temperature, POWER / the limit, SM CLOCK / the max.
HEADER = ("GPU", "NAME", "TEMP", "POWER", "SM CLOCK", "THROTTLE", "GATE")
#: Where a GPU's WHY lines start, under its NAME.
WHY_INDENT = " " * 5


def format_status(doc: dict[str, Any], width: int | None = None) -> str:
    """A table with a row per GPU, each followed by why its gate is shut; every line is
    broken between words to fit ``width`` columns (default: the terminal's, else 80)."""
    import shutil
    import textwrap

    from gpuwatchd.api.state import parse_state

    width = width or shutil.get_terminal_size((80, 24)).columns
    state = parse_state(doc)
    rows = [list(HEADER)] + [_row(g) for g in state.gpus]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    whys = [None, *("; ".join(g.reasons) or "-" for g in state.gpus)]
    wrap = textwrap.TextWrapper(
        width, subsequent_indent=WHY_INDENT, break_long_words=False, break_on_hyphens=False
    )
    lines = []
    for r, why in zip(rows, whys, strict=True):
        row = "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        lines.extend(wrap.wrap(row))
        if why is not None:
            lines.extend(
                textwrap.wrap(
                    f"why: {why}",
                    width,
                    initial_indent=WHY_INDENT,
                    subsequent_indent=WHY_INDENT + "     ",
                    break_long_words=False,
                    break_on_hyphens=False,
                )
            )
    if state.daemon is not None:
        version, backend = state.daemon.version or "?", state.daemon.backend or "?"
        lines.insert(0, f"gpuwatchd {version} · backend {backend}")
    if not state.gpus:
        lines.append("(no GPUs)")
    if state.tuning is not None:
        lines.append(tuning_line(state.tuning))
    return "\n".join(lines)
