"""Where a job finds the daemon, its store, its control socket and its spool when not told.

``$GPUWATCHD_URL``, else the daemon config's listen address, else
``http://127.0.0.1:9844``; ``$GPUWATCHD_STORE``, else the config's ``[store] url`` (a
PostgreSQL URL, read with its ``password_file``, or a SQLite file), else ``gpuwatchd.db``
in the daemon's state directory (config ``state_dir``, ``$STATE_DIRECTORY``,
``/var/lib/gpuwatchd``, ``~/.local/state/gpuwatchd``: the first that holds a store);
``$GPUWATCHD_CONTROL_SOCKET``, else the config's ``control_socket``, else this user's
daemon socket if it exists, else the system daemon's; ``$GPUWATCHD_SPOOL``, else the
config's ``[tuning] spool_dir``, else ``spool/`` beside the store. The daemon resolves
the same settings with the same rules (:mod:`gpuwatchd.config`). The config is read only
when asked, so importing the client stays cheap.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpuwatchd.config import Config

DEFAULT_URL = "http://127.0.0.1:9844"
URL_ENV = "GPUWATCHD_URL"
STORE_ENV = "GPUWATCHD_STORE"
#: Overrides the control socket a job talks to.
SOCKET_ENV = "GPUWATCHD_CONTROL_SOCKET"
#: Overrides where jobs spool tuning requests (and where a daemon started with it reads).
SPOOL_ENV = "GPUWATCHD_SPOOL"
_SYSTEM_STATE_DIR = Path("/var/lib/gpuwatchd")


def _daemon_config() -> Config | None:
    """The daemon's config file, or None when there is none (or it is unreadable)."""
    from gpuwatchd.config import DEFAULT_CONFIG_PATH, ConfigError, load_config

    if not DEFAULT_CONFIG_PATH.is_file():
        return None
    try:
        return load_config(DEFAULT_CONFIG_PATH)
    except (ConfigError, ValueError, OSError):
        return None  # the daemon would refuse it too; fall back to the built-in defaults


def _chosen(env_name: str, configured: Callable[[Config], str]) -> Path | None:
    """The path ``$env_name`` names, else the one the daemon config sets, else None."""
    if env := os.environ.get(env_name):
        return Path(env)
    cfg = _daemon_config()
    value = configured(cfg) if cfg is not None else ""
    return Path(value) if value else None


def default_url() -> str:
    """``$GPUWATCHD_URL``, else the daemon config's listen address, else the default."""
    env = os.environ.get(URL_ENV)
    if env:
        return env
    cfg = _daemon_config()
    if cfg is None:
        return DEFAULT_URL
    host, _, port = cfg.daemon.listen.rpartition(":")
    host = host.strip("[]")
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def default_store_paths(cfg: Config | None = None) -> list[Path]:
    """Where the daemon keeps its store file, most likely first (the client and ``gpuwatchd
    report`` read the first that exists): the config's SQLite ``[store] url``, the
    state-dir rule of :func:`gpuwatchd.config.resolve_state_dir` for the configured
    ``state_dir``, then the system daemon's ``/var/lib/gpuwatchd``. ``cfg``: the daemon
    config to read them from (default: the system's, when there is one)."""
    from gpuwatchd.config import STORE_NAME, store_path

    cfg = cfg if cfg is not None else _daemon_config()
    paths = [store_path(cfg.daemon.state_dir if cfg else ""), _SYSTEM_STATE_DIR / STORE_NAME]
    if cfg is not None and cfg.store.url and not cfg.store.is_postgres:
        paths.insert(0, Path(cfg.store.url))
    return list(dict.fromkeys(paths))


def default_store_url() -> tuple[str, Path | None] | None:
    """The daemon config's PostgreSQL ``[store] url`` and its password file, or None when
    the daemon keeps a SQLite file. The URL is never shown unredacted."""
    from gpuwatchd.config import store_password_file

    cfg = _daemon_config()
    if cfg is None or not cfg.store.is_postgres:
        return None
    return cfg.store.url, store_password_file(cfg)


def default_socket_path() -> Path:
    """``$GPUWATCHD_CONTROL_SOCKET``, else the daemon config's ``control_socket``, else this
    user's daemon socket if it exists, else the system daemon's (the daemon's own rule,
    :func:`gpuwatchd.config.resolve_control_socket`, as seen from each user)."""
    from gpuwatchd.config import CONTROL_SOCKET_NAME, SYSTEM_RUNTIME_DIR, resolve_control_socket

    if (chosen := _chosen(SOCKET_ENV, lambda cfg: cfg.daemon.control_socket)) is not None:
        return chosen
    own = resolve_control_socket("")
    if own.exists() or not SYSTEM_RUNTIME_DIR.is_dir():
        return own
    return SYSTEM_RUNTIME_DIR / CONTROL_SOCKET_NAME


def default_spool_dir() -> Path:
    """``$GPUWATCHD_SPOOL``, else the daemon config's ``[tuning] spool_dir``, else ``spool/``
    in the daemon's state directory: the first state directory (store discovery order)
    that already holds a store or a spool, else the first of them."""
    from gpuwatchd.config import SPOOL_NAME

    if (chosen := _chosen(SPOOL_ENV, lambda cfg: cfg.tuning.spool_dir)) is not None:
        return chosen
    stores = default_store_paths()
    for store in stores:
        if store.is_file() or (store.parent / SPOOL_NAME).is_dir():
            return store.parent / SPOOL_NAME
    return stores[0].parent / SPOOL_NAME
