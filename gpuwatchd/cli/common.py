"""What every command shares: the one-line error, exit codes, config loading, the store.

A command module exposes ``add_parser(subparsers)`` and ``run(args) -> int``; errors the
user can fix are raised as :class:`CliError` and printed by ``cli.main`` as one line on
stderr: exit 2 for bad configuration or arguments, 1 for a runtime failure (no NVML,
daemon unreachable). This module must not import ``cli.main`` (main imports the commands).

``cli.main`` imports every command module to build ``gpuwatchd --help``, so neither this
module nor a command imports the config, the store or the daemon's layers at module level:
they are imported when a command runs, and ``gpuwatchd --help`` starts without them.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

if TYPE_CHECKING:
    from gpuwatchd.config import Config
    from gpuwatchd.store import SqlStore

EXIT_RUNTIME = 1
EXIT_CONFIG = 2
#: Ctrl-C: the status a shell gives a process killed by SIGINT.
EXIT_INTERRUPTED = 130
#: stdout's reader went away (``| head``): the status a shell gives a process killed by SIGPIPE.
EXIT_BROKEN_PIPE = 141

#: What ``argparse.ArgumentParser.add_subparsers`` returns.
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


class CliError(Exception):
    """A one-line error with an exit code."""

    def __init__(self, message: str, code: int = EXIT_RUNTIME) -> None:
        super().__init__(message)
        self.code = code


class Command(Protocol):
    """The shape of a command module, as ``cli.main`` assembles and dispatches them."""

    def add_parser(self, subparsers: Subparsers) -> argparse.ArgumentParser:
        """Add the command's subparser, with ``func`` set to its ``run``."""
        ...

    def run(self, args: argparse.Namespace) -> int:
        """Carry out the command; the exit status, or :class:`CliError`."""
        ...


CONFIG_HELP = "TOML config (default /etc/gpuwatchd/config.toml if present)"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the line breaks of a command's description and examples, and adds an
    option's default to its help where the help does not mention one already."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        default = action.default
        if (
            not text
            or not action.option_strings
            or "default" in text
            or default is None
            or isinstance(default, bool)
            or default is argparse.SUPPRESS
        ):
            return text
        return f"{text} (default %(default)s)"


def add_command(
    subparsers: Subparsers,
    name: str,
    summary: str,
    description: str,
    examples: Sequence[str] = (),
) -> argparse.ArgumentParser:
    """A command's parser: ``summary`` is its line in ``gpuwatchd --help``; its own
    ``--help`` shows ``description``, every option with its default, and ``examples``."""
    epilog = "examples:\n" + "\n".join(f"  {e}" for e in examples) if examples else None
    return subparsers.add_parser(
        name,
        help=summary,
        description=description,
        epilog=epilog,
        formatter_class=HelpFormatter,
    )


def add_backend_args(p: argparse.ArgumentParser) -> None:
    """``--config`` and the telemetry-backend options shared by ``run``, ``record``, ``tune``."""
    p.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    g = p.add_argument_group("telemetry backend")
    g.add_argument(
        "--backend", choices=("nvml", "sim", "replay"), help="telemetry source (default nvml)"
    )
    g.add_argument(
        "--scenario",
        help="sim scenario: idle (default), power-cap, heat-soak, fan-failure, periodic-job, "
        "busy, gpu-lost, ecc-error",
    )
    g.add_argument("--gpus", type=int, metavar="N", help="number of simulated GPUs")
    g.add_argument("--seed", type=int, help="sim random seed")
    g.add_argument("--trace", metavar="FILE", help="gpuwatchd-trace/1 file for --backend replay")
    g.add_argument(
        "--speed", type=float, metavar="X", help="sim/replay time runs X times real time"
    )
    g.add_argument("--no-loop", action="store_true", help="replay: stop at the end of the trace")


def load_with_overrides(
    args: argparse.Namespace, sim_paths: bool = True
) -> tuple[Config, dict[str, dict[str, Any]]]:
    """The config file plus command-line overrides; raises CliError(code 2) when invalid.
    ``sim_paths``: give a simulated daemon its private directory (made now, as this user)."""
    from gpuwatchd.config import ConfigError, load_config
    from gpuwatchd.config.listen import parse_listen

    listen = getattr(args, "listen", None)
    if listen is not None:
        try:
            parse_listen(listen)
        except ValueError as exc:  # says which part is wrong: the port's range, say
            raise CliError(f"--listen: {exc}", EXIT_CONFIG) from None
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
    return with_sim_paths(cfg, overrides) if sim_paths else (cfg, overrides)


def with_sim_paths(
    cfg: Config, overrides: dict[str, dict[str, Any]]
) -> tuple[Config, dict[str, dict[str, Any]]]:
    """``cfg`` and ``overrides`` with a simulated daemon's private directory (made now,
    as this process's user) where nothing else chose its paths (:func:`_sim_paths`)."""
    private = _sim_paths(cfg)
    if not private:
        return cfg, overrides
    overrides["daemon"].update(private)
    return cfg.with_overrides(daemon=private), overrides


#: Backends whose GPUs are not this host's: their daemon stays out of the system's paths.
SIM_BACKENDS = ("sim", "replay")


def _sim_paths(cfg: Config) -> dict[str, str]:
    """For a simulated or replayed GPU, the state directory and control socket that were
    not chosen (by the config, the command line or systemd): in
    :func:`gpuwatchd.store.location.sim_state_dir`, so a demo run as root never writes
    /var/lib/gpuwatchd or /run/gpuwatchd, and its winners never reach real jobs."""
    from gpuwatchd.config import CONTROL_SOCKET_NAME
    from gpuwatchd.store import StoreError
    from gpuwatchd.store.location import make_private_dir, sim_state_dir

    if cfg.daemon.backend not in SIM_BACKENDS:
        return {}
    paths: dict[str, str] = {}
    if not (cfg.daemon.state_dir or cfg.store.url or os.environ.get("STATE_DIRECTORY")):
        paths["state_dir"] = str(sim_state_dir())
    if not (cfg.daemon.control_socket or os.environ.get("RUNTIME_DIRECTORY")):
        paths["control_socket"] = str(sim_state_dir() / CONTROL_SOCKET_NAME)
    if paths:
        try:
            make_private_dir(sim_state_dir())
        except StoreError as exc:
            raise CliError(str(exc)) from None
    return paths


def open_store(
    location: Path | str,
    readonly: bool = False,
    password_file: Path | None = None,
    call_timeout_s: float | None = None,
) -> SqlStore:
    """The tuning store at ``location`` (``--store`` or the config's ``[store] url``): a
    PostgreSQL connection string or a SQLite file, by :func:`gpuwatchd.store.urls.store_target`'s
    rule; any other URL scheme is one line. A writable SQLite one creates its missing
    directory. ``call_timeout_s`` (default: the store's) bounds each PostgreSQL call."""
    from gpuwatchd.store import StoreError
    from gpuwatchd.store import open_store as open_location

    bound = {"call_timeout_s": call_timeout_s} if call_timeout_s is not None else {}
    try:
        return open_location(location, readonly=readonly, password_file=password_file, **bound)
    except StoreError as exc:
        raise CliError(str(exc)) from None


def open_configured_store(cfg: Config, readonly: bool = False) -> SqlStore:
    """The daemon's store as ``cfg`` names it: ``[store] url``, else the state directory's."""
    from gpuwatchd.config import store_location, store_password_file

    return open_store(
        store_location(cfg), readonly, store_password_file(cfg), cfg.store.call_timeout_s
    )


def open_store_to_read(cfg: Config) -> SqlStore:
    """The store a reader without ``--store`` was pointed at (``$GPUWATCHD_STORE``, else
    the config's ``[store] url``), else the first store file of the job client's own list
    (:func:`gpuwatchd.client.discovery.default_store_paths`), else a simulated daemon's
    (:func:`gpuwatchd.store.location.sim_state_dir`, said on stderr), opened read-only;
    none: one line naming every place looked and the daemon's winners API."""
    from gpuwatchd.api.winners import WINNERS_PATH
    from gpuwatchd.client.discovery import STORE_ENV, default_store_paths, default_url
    from gpuwatchd.config import STORE_NAME
    from gpuwatchd.store import StoreError, find_store_file
    from gpuwatchd.store.location import sim_state_dirs

    given = os.environ.get(STORE_ENV)
    if given:
        return open_store(given, readonly=True)
    if cfg.store.url:
        return open_configured_store(cfg, readonly=True)
    daemons = default_store_paths(cfg)
    sims = [d / STORE_NAME for d in sim_state_dirs()]
    try:
        path = find_store_file([*daemons, *sims], default_url() + WINNERS_PATH)
    except StoreError as exc:
        raise CliError(str(exc)) from None
    if path in sims and path not in daemons:
        print(f"gpuwatchd: reading the simulated GPU's store {path}", file=sys.stderr)
    return open_store(path, readonly=True)


def control_socket(args: argparse.Namespace) -> Path:
    """``args.socket``, or the daemon's default control socket; where no daemon listens
    there, a simulated daemon's (:func:`_sim_paths`) when one does."""
    from gpuwatchd.client.discovery import default_socket_path
    from gpuwatchd.config import CONTROL_SOCKET_NAME
    from gpuwatchd.store.location import sim_state_dirs

    if args.socket:
        return Path(args.socket)
    path = default_socket_path()
    if path.exists():
        return path
    sims = [d / CONTROL_SOCKET_NAME for d in sim_state_dirs()]
    return next((sim for sim in sims if sim.exists()), path)


def ask_daemon(args: argparse.Namespace, request: dict[str, Any]) -> dict[str, Any]:
    """Send ``request`` to :func:`control_socket` within ``args.timeout`` seconds; its
    answer, or CliError (exit 1) when none comes."""
    from gpuwatchd.client.control import Unreachable, ask_doc

    path = control_socket(args)
    try:
        return ask_doc(path, request, timeout=args.timeout)
    except Unreachable as exc:
        raise CliError(str(exc), EXIT_RUNTIME) from None
