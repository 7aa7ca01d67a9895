"""Command line: ``gpuwatchd run | status | record | check-config``.

Errors the user can fix are one line on stderr: exit 2 for bad configuration or
arguments, 1 for a runtime failure (no NVML, daemon unreachable).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from gpuwatchd import __version__
from gpuwatchd.config import Config, ConfigError, load_config

EXIT_RUNTIME = 1
EXIT_CONFIG = 2


class CliError(Exception):
    """A one-line error with an exit code."""

    def __init__(self, message: str, code: int = EXIT_RUNTIME) -> None:
        super().__init__(message)
        self.code = code


def _add_backend_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("telemetry backend")
    g.add_argument(
        "--config",
        metavar="FILE",
        help="TOML config (default /etc/gpuwatchd/config.toml if present)",
    )
    g.add_argument(
        "--backend", choices=("nvml", "sim", "replay"), help="telemetry source (default nvml)"
    )
    g.add_argument(
        "--scenario", help="sim scenario: idle, power-cap, heat-soak, fan-failure, busy, gpu-lost"
    )
    g.add_argument("--gpus", type=int, metavar="N", help="number of simulated GPUs")
    g.add_argument("--seed", type=int, help="sim random seed")
    g.add_argument("--trace", metavar="FILE", help="gpuwatchd-trace/1 file for --backend replay")
    g.add_argument(
        "--speed", type=float, metavar="X", help="sim/replay time runs X times real time"
    )
    g.add_argument("--no-loop", action="store_true", help="replay: stop at the end of the trace")


def load_with_overrides(args: argparse.Namespace) -> tuple[Config, dict[str, dict[str, Any]]]:
    """The config file plus command-line overrides; raises CliError(code 2) when invalid."""
    backend = getattr(args, "backend", None)
    overrides: dict[str, dict[str, Any]] = {
        "daemon": {
            "backend": backend,
            "listen": getattr(args, "listen", None),
            "poll_interval_s": getattr(args, "poll_interval", None),
            "log_level": getattr(args, "log_level", None),
            "state_dir": getattr(args, "state_dir", None),
            "control_socket": getattr(args, "control_socket", None),
            "web_config": getattr(args, "web_config", None),
        },
        "sim": {
            "gpus": getattr(args, "gpus", None),
            "scenario": getattr(args, "scenario", None),
            "seed": getattr(args, "seed", None),
        },
        "replay": {"trace": getattr(args, "trace", None)},
    }
    speed = getattr(args, "speed", None)
    if speed is not None:
        overrides["sim"]["speed"] = speed
        overrides["replay"]["speed"] = speed
    if getattr(args, "no_loop", False):
        overrides["replay"]["loop"] = False
    if getattr(args, "trace", None) and backend is None:
        overrides["daemon"]["backend"] = "replay"
    try:
        cfg = load_config(getattr(args, "config", None)).with_overrides(**overrides)
    except ConfigError as exc:
        raise CliError(str(exc), EXIT_CONFIG) from None
    except ValueError as exc:
        raise CliError(f"command line: {exc}", EXIT_CONFIG) from None
    return cfg, overrides


# -- commands ------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    from gpuwatchd.daemon.control import ControlError
    from gpuwatchd.daemon.process import Daemon, setup_logging
    from gpuwatchd.store import StoreError
    from gpuwatchd.telemetry.backend import BackendUnavailable

    cfg, overrides = load_with_overrides(args)
    setup_logging(cfg.daemon.log_level)
    try:
        daemon = Daemon(cfg, config_path=args.config, overrides=overrides)
    except ConfigError as exc:
        raise CliError(str(exc), EXIT_CONFIG) from None
    except (BackendUnavailable, StoreError, ControlError) as exc:
        raise CliError(str(exc)) from None
    except OSError as exc:
        where = exc.filename or cfg.daemon.listen
        raise CliError(f"{where}: {exc.strerror or exc}") from None
    daemon.install_signal_handlers()
    try:
        daemon.run()
    except ControlError as exc:
        raise CliError(str(exc)) from None
    except OSError as exc:
        raise CliError(f"cannot listen on {cfg.daemon.listen}: {exc.strerror or exc}") from None
    return 0


def cmd_check_config(args: argparse.Namespace) -> int:
    from gpuwatchd.daemon.process import read_web_config

    cfg, _ = load_with_overrides(args)
    try:
        read_web_config(cfg)
    except ConfigError as exc:
        raise CliError(str(exc), EXIT_CONFIG) from None
    print(f"{cfg.source or 'built-in defaults'}: OK")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from gpuwatchd.cli.status import fetch_state, format_status

    url = args.url
    if url is None:
        from gpuwatchd.daemon.process import read_web_config

        cfg, _ = load_with_overrides(args)
        try:
            web = read_web_config(cfg)
        except ConfigError as exc:
            raise CliError(str(exc), EXIT_CONFIG) from None
        url = _local_url(cfg.daemon.listen, https=web is not None and web.tls is not None)
    state = fetch_state(url, timeout=args.timeout, cacert=args.cacert, user=args.user)
    if args.json:
        import json

        print(json.dumps(state, indent=2, sort_keys=True))
    else:
        print(format_status(state))
    return 0


def cmd_record(args: argparse.Namespace) -> int:
    from gpuwatchd.telemetry.backend import BackendUnavailable
    from gpuwatchd.telemetry.factory import open_backend
    from gpuwatchd.telemetry.record import record_trace

    cfg, _ = load_with_overrides(args)
    for flag, value in (("--duration", args.duration), ("--interval", args.interval)):
        if not value > 0:
            raise CliError(f"{flag}: must be > 0, got {value}", EXIT_CONFIG)
    try:
        backend = open_backend(cfg)
    except BackendUnavailable as exc:
        raise CliError(str(exc)) from None
    try:
        n = record_trace(backend, args.out, duration_s=args.duration, period_s=args.interval)
    except OSError as exc:
        raise CliError(f"{args.out}: {exc.strerror or exc}") from None
    finally:
        backend.close()
    print(f"wrote {n} samples to {args.out}", file=sys.stderr)
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from gpuwatchd.cli.tune import run_tune

    return run_tune(args)


def cmd_plot_timeline(args: argparse.Namespace) -> int:
    from gpuwatchd.cli.tune import run_plot_timeline

    return run_plot_timeline(args)


def cmd_retune(args: argparse.Namespace) -> int:
    from gpuwatchd.cli.retune import run_retune

    return run_retune(args)


def cmd_report(args: argparse.Namespace) -> int:
    from gpuwatchd.cli.tune import run_report

    return run_report(args)


def _local_url(listen: str, https: bool = False) -> str:
    from gpuwatchd.exporter import parse_listen

    host, port = parse_listen(listen)
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"{'https' if https else 'http'}://{host}:{port}"


# -- parser ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpuwatchd",
        description="Thermal-aware GPU profiling daemon: telemetry, gate, gated autotuning.",
    )
    parser.add_argument("--version", action="version", version=f"gpuwatchd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="run the daemon in the foreground")
    _add_backend_args(p)
    p.add_argument(
        "--listen", metavar="HOST:PORT", help="HTTP address for /metrics (default :9844)"
    )
    p.add_argument("--poll-interval", type=float, metavar="S", help="poll period in seconds")
    p.add_argument("--state-dir", metavar="DIR", help="where the tuning store lives")
    p.add_argument("--control-socket", metavar="PATH", help="Unix socket for `gpuwatchd retune`")
    p.add_argument(
        "--web-config",
        metavar="FILE",
        help="TLS/basic auth, in the Prometheus exporter-toolkit web-config.yml format",
    )
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("status", help="per-GPU table from a running daemon")
    p.add_argument("--config", metavar="FILE", help="read the daemon's listen address from here")
    p.add_argument("--url", help="daemon base URL (default from the config's listen address)")
    p.add_argument("--json", action="store_true", help="print the raw JSON state")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the daemon")
    p.add_argument("--cacert", metavar="FILE", help="CA certificate of an https daemon")
    p.add_argument("--user", help="basic-auth user (password in $GPUWATCHD_PASSWORD)")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("record", help="record a gpuwatchd-trace/1 file from any backend")
    _add_backend_args(p)
    p.add_argument("--out", required=True, metavar="FILE", help="trace file to write")
    p.add_argument("--duration", type=float, required=True, metavar="S", help="seconds to record")
    p.add_argument("--interval", type=float, default=0.05, metavar="S", help="sample period")
    p.set_defaults(func=cmd_record)

    p = sub.add_parser("tune", help="wait for an open gate, tune, print the winners")
    _add_backend_args(p)
    p.add_argument("--gpu", type=int, default=0, metavar="N", help="GPU index (default 0)")
    p.add_argument("--workload", action="append", metavar="W", help="workload name (repeatable)")
    p.add_argument(
        "--regime", choices=("unthrottled", "sustained", "both"), default="both", help="regimes"
    )
    p.add_argument("--store", metavar="PATH", help="SQLite store (default STATE_DIR/gpuwatchd.db)")
    p.add_argument("--state-dir", metavar="DIR", help="state directory holding the store")
    p.add_argument("--poll-interval", type=float, metavar="S", help="gate poll period in seconds")
    p.add_argument("--no-wait", action="store_true", help="fail at once if the gate is shut")
    p.add_argument("--wait-timeout", type=float, metavar="S", help="give up waiting after S s")
    p.add_argument(
        "--budget", type=float, metavar="S", help="measuring time per workload and regime"
    )
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser("report", help="per workload and regime: winners, times, clocks")
    p.add_argument("--config", metavar="FILE")
    p.add_argument("--store", metavar="PATH", help="SQLite store (default STATE_DIR/gpuwatchd.db)")
    p.add_argument("--state-dir", metavar="DIR", help="state directory holding the store")
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.add_argument("--gpu-model", metavar="NAME", help="only this GPU model")
    p.add_argument("--plot", metavar="FILE.png", help="also draw the candidates' times per regime")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("plot-timeline", help="draw clock/temperature/power of a trace")
    p.add_argument("--config", metavar="FILE", help="gate thresholds for the gate strip")
    p.add_argument("--trace", required=True, metavar="FILE", help="a gpuwatchd-trace/1 file")
    p.add_argument("--out", required=True, metavar="FILE.png")
    p.add_argument("--store", metavar="PATH", help="shade this store's tuning sessions")
    p.add_argument("--gpu", type=int, default=0, metavar="N")
    p.add_argument("--t0-unix", type=float, metavar="S", help="unix time of the trace's t=0")
    p.add_argument("--no-gate", action="store_true", help="leave out the replayed gate strip")
    p.set_defaults(func=cmd_plot_timeline)

    from gpuwatchd.cli.retune import add_retune_args  # imports CliError from here

    p = sub.add_parser("retune", help="ask the running daemon to re-tune at the next open gate")
    add_retune_args(p)
    p.set_defaults(func=cmd_retune)

    p = sub.add_parser("check-config", help="validate a config file and exit")
    p.add_argument("--config", metavar="FILE")
    p.add_argument("--web-config", metavar="FILE", help="also validate this web-config.yml")
    p.set_defaults(func=cmd_check_config)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except CliError as exc:
        print(f"gpuwatchd: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130
