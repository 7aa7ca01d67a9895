"""``gpuwatchd run``: the daemon in the foreground, until SIGTERM or SIGINT.

The daemon's modules are imported only here, when the command runs, so the other
commands start without them.
"""

from __future__ import annotations

import argparse
import errno
import logging

from gpuwatchd.cli.common import (
    EXIT_CONFIG,
    CliError,
    Subparsers,
    add_backend_args,
    add_command,
    load_with_overrides,
    with_sim_paths,
)


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    p = add_command(
        subparsers,
        "run",
        "run the daemon in the foreground",
        "Poll every GPU, judge its gate, tune behind it (when [tuning] is enabled), watch\n"
        "for clock drift and serve /metrics and /api/v1 until SIGTERM; SIGHUP reloads the\n"
        "config. systemd runs it as Type=notify.",
        (
            "gpuwatchd run",
            "gpuwatchd run --backend sim --scenario power-cap --gpus 2 --speed 10"
            " --poll-interval 0.1",
            "gpuwatchd run --backend replay --trace tests/data/h200-matmul-burn.jsonl",
        ),
    )
    add_backend_args(p)
    p.add_argument(
        "--listen", metavar="HOST:PORT", help="HTTP address for /metrics (default :9844)"
    )
    p.add_argument("--poll-interval", type=float, metavar="S", help="poll period in seconds")
    p.add_argument(
        "--state-dir",
        metavar="DIR",
        help="where the tuning store lives (default: /var/lib/gpuwatchd for root, else "
        "~/.local/state/gpuwatchd; with --backend sim or replay a throwaway "
        "$XDG_RUNTIME_DIR/gpuwatchd-sim, the control socket too)",
    )
    p.add_argument("--control-socket", metavar="PATH", help="Unix socket for `gpuwatchd retune`")
    p.add_argument(
        "--web-config",
        metavar="FILE",
        help="TLS/basic auth, in the Prometheus exporter-toolkit web-config.yml format",
    )
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Start the daemon; a config, backend, store or socket problem is one line."""
    from gpuwatchd.config import ConfigError, check_store_access
    from gpuwatchd.daemon.privileges import PrivilegeError, drop_root, warn_if_root
    from gpuwatchd.daemon.process import Daemon, read_web_config, setup_logging
    from gpuwatchd.serve.control import ControlError
    from gpuwatchd.store import StoreError
    from gpuwatchd.telemetry.backend import BackendUnavailable, TraceError

    cfg, overrides = load_with_overrides(args, sim_paths=False)
    setup_logging(cfg.daemon.log_level)
    try:  # before anything from outside is read: the daemon never runs as root
        user = drop_root(cfg)
    except PrivilegeError as exc:
        raise CliError(str(exc), EXIT_CONFIG) from None
    except OSError as exc:
        raise CliError(_os_error_line(exc, cfg.daemon.listen)) from None
    cfg, overrides = with_sim_paths(cfg, overrides)  # made as the user the daemon runs as
    if user is not None:
        logging.getLogger("gpuwatchd").warning(
            "started as root: running as %s (uid %d) from here on", user.pw_name, user.pw_uid
        )
    try:
        read_web_config(cfg)  # as check-config does: refused before anything is created
        check_store_access(cfg)
        daemon = Daemon(cfg, config_path=args.config, overrides=overrides)
    except (ConfigError, TraceError) as exc:  # a bad --trace is a bad argument
        raise CliError(str(exc), EXIT_CONFIG) from None
    except (BackendUnavailable, StoreError, ControlError) as exc:
        raise CliError(str(exc)) from None
    except OSError as exc:
        raise CliError(_os_error_line(exc, cfg.daemon.listen)) from None
    daemon.install_signal_handlers()
    warn_if_root()
    try:
        daemon.run()
    except (ControlError, StoreError) as exc:  # a twin took the host name, say
        raise CliError(str(exc)) from None
    except OSError as exc:
        raise CliError(_os_error_line(exc, cfg.daemon.listen)) from None
    return 0


def _os_error_line(exc: OSError, listen: str) -> str:
    """One line for a file or socket the daemon could not use, its name said once; a
    port in use (of ``listen``, the HTTP address) says how to find who holds it."""
    from gpuwatchd.serve.http import ListenError

    if isinstance(exc, ListenError):  # its message names the address
        line = exc.strerror or str(exc)
        if exc.errno == errno.EADDRINUSE:
            from gpuwatchd.config.listen import parse_listen

            port = parse_listen(listen)[1]
            line += (
                f" (another process listens there: `ss -ltnp 'sport = :{port}'` names it;"
                " stop it, or pick another address with --listen HOST:PORT)"
            )
        return line
    return f"{exc.filename}: {exc.strerror or exc}" if exc.filename else str(exc)
