"""Load and validate ``config.toml`` into one :class:`Config` of section dataclasses.

Tables: ``[daemon]``, ``[sim]``, ``[replay]``, ``[gate]``, ``[tuning]`` (with
``[tuning.protocol]``), ``[drift]``, ``[store]``, ``[fleet]``, ``[exporter]`` and
``[[workload]]``. Anything
unknown is an error: a typo in a threshold must not silently fall back to a default on a
production host.
Each component defines its own section type (telemetry the sim and replay ones, the gate
its thresholds, tuning its own, drift its own) and never imports this package; the
loader only assembles them, and hands each component its part (:meth:`Config.backend_spec`,
:meth:`Config.tuning_setup`, ``cfg.gate``, ``cfg.drift``, ``cfg.fleet``).
"""

from __future__ import annotations

import dataclasses
import grp
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuwatchd.config.store import StoreConfig, parse_store
from gpuwatchd.drift.config import DriftConfig
from gpuwatchd.exporter.settings import ExporterConfig
from gpuwatchd.gate import GateConfig
from gpuwatchd.sessions.fleet_settings import FleetConfig
from gpuwatchd.telemetry.pod_resources import DEFAULT_SOCKET as DEFAULT_POD_RESOURCES_SOCKET
from gpuwatchd.telemetry.settings import BACKENDS, BackendSpec, ReplayConfig
from gpuwatchd.telemetry.sim.settings import SimConfig
from gpuwatchd.tuning.settings import ProtocolConfig, TuningConfig, TuningSetup
from gpuwatchd.tuning.submitted.trust import TrustError, check_workload
from gpuwatchd.tuning.types import Workload
from gpuwatchd.tuning.workloads import (
    DEFAULT_WORKLOADS,
    find_workload,
    merge_workloads,
    parse_workloads,
)
from gpuwatchd.validate import check, check_durations, from_table, load_toml, show

DEFAULT_CONFIG_PATH = Path("/etc/gpuwatchd/config.toml")
LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(Exception):
    """A one-line, user-facing description of what is wrong with the configuration."""


def _known_group(name: str) -> bool:
    """An empty name, or a group this host knows: the daemon resolves it at start."""
    if not name:
        return True
    try:
        grp.getgrnam(name)
    except (KeyError, ValueError):  # ValueError: a NUL in the name
        raise ValueError(f"daemon.control_group: no group named {name!r} on this host") from None
    return True


def _valid_listen(text: str) -> bool:
    from gpuwatchd.config.listen import parse_listen

    try:
        parse_listen(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    """How the daemon polls and serves."""

    backend: str = field(
        default="nvml", metadata=check(lambda v: v in BACKENDS, f"must be one of {BACKENDS}")
    )
    listen: str = field(
        default=":9844", metadata=check(lambda v: _valid_listen(v), "must be HOST:PORT")
    )
    #: Fast-field poll period; its cost per GPU is in bench/RESULTS.md ("NVML call cost").
    poll_interval_s: float = field(
        default=0.5, metadata=check(lambda v: 0.01 <= v <= 1.0, "must be in [0.01, 1.0]")
    )
    #: The energy counter and the health fields are slow NVML calls (bench/RESULTS.md, "NVML
    #: health fields: cost and support"): every 30 s, as dcgm-exporter collects.
    energy_interval_s: float = field(
        default=30.0, metadata=check(lambda v: 0.1 <= v <= 3600, "must be in [0.1, 3600]")
    )
    #: Static facts (power limit, max clocks, thresholds) are re-read this often.
    info_refresh_s: float = field(
        default=300.0, metadata=check(lambda v: 1 <= v <= 86400, "must be in [1, 86400]")
    )
    #: A GPU read in flight this many poll periods is reported as stalled.
    stall_periods: float = field(
        default=2.0, metadata=check(lambda v: 1 <= v <= 100, "must be in [1, 100]")
    )
    #: systemd watchdog pings stop once a GPU read has been stuck this long.
    watchdog_stall_s: float = field(
        default=60.0, metadata=check(lambda v: 0 < v <= 3600, "must be in (0, 3600]")
    )
    #: Who the daemon becomes when started as root (it never runs as root; systemd and
    #: Kubernetes start it as its own user, so this is for a manual root start).
    user: str = "gpuwatchd"
    #: Where the tuning store lives. Empty: $STATE_DIRECTORY (systemd's StateDirectory=),
    #: else /var/lib/gpuwatchd for root, else ~/.local/state/gpuwatchd.
    state_dir: str = ""
    log_level: str = field(
        default="info", metadata=check(lambda v: v in LOG_LEVELS, f"must be one of {LOG_LEVELS}")
    )
    #: Unix socket for `gpuwatchd retune`. Empty: $RUNTIME_DIRECTORY/control.sock under
    #: systemd, /run/gpuwatchd/control.sock for root, else under $XDG_RUNTIME_DIR.
    control_socket: str = ""
    #: A group whose members may use the control socket (root and the daemon's user always may).
    control_group: str = field(default="", metadata=check(_known_group, ""))
    #: TLS and basic auth for the HTTP endpoints, in the Prometheus exporter-toolkit
    #: web-config.yml format. Empty: plain HTTP without authentication.
    web_config: str = ""
    #: The kubelet's pod-resources socket: where it exists, GPU processes are labelled
    #: with the pod holding their GPU (needs the [k8s] extra). Empty: never.
    pod_resources_socket: str = field(
        default=DEFAULT_POD_RESOURCES_SOCKET,
        metadata=check(
            lambda v: v == "" or (v.startswith("/") and "\0" not in v),
            "must be an absolute path or empty",
        ),
    )


def resolve_state_dir(configured: str) -> Path:
    """The state directory to use, following :attr:`DaemonConfig.state_dir`'s rule."""
    if configured:
        return Path(configured)
    systemd = os.environ.get("STATE_DIRECTORY")
    if systemd:
        return Path(systemd.split(":")[0])
    if os.geteuid() == 0:
        return Path("/var/lib/gpuwatchd")
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "gpuwatchd"


#: The tuning store's file name inside the state directory.
STORE_NAME = "gpuwatchd.db"


def store_path(configured_state_dir: str) -> Path:
    """Where the daemon keeps its tuning store, by the state-directory rule."""
    return resolve_state_dir(configured_state_dir) / STORE_NAME


def store_location(cfg: Config) -> str | Path:
    """The daemon's store for :func:`gpuwatchd.store.open_store`: ``[store] url`` (a
    PostgreSQL URL or a SQLite file) when set, else :func:`store_path`."""
    if cfg.store.is_postgres:
        return cfg.store.url
    if cfg.store.url:
        return Path(cfg.store.url)
    return store_path(cfg.daemon.state_dir)


def store_password_file(cfg: Config) -> Path | None:
    """``[store] password_file``, or None for libpq's environment."""
    return Path(cfg.store.password_file) if cfg.store.password_file else None


def check_store_access(cfg: Config) -> None:
    """ConfigError unless this host can reach the configured store: psycopg for a
    PostgreSQL URL, a readable password file. check-config and run ask before starting."""
    try:
        cfg.store.check_host()
    except ValueError as exc:
        where = f"{cfg.source}: " if cfg.source else ""
        raise ConfigError(f"{where}{exc}") from None


#: Where jobs leave tuning requests for the daemon, inside the state directory.
SPOOL_NAME = "spool"


def spool_path(configured_spool_dir: str, configured_state_dir: str) -> Path:
    """Where the daemon reads (and jobs leave) tuning requests: ``[tuning] spool_dir``,
    else ``spool`` in the state directory."""
    if configured_spool_dir:
        return Path(configured_spool_dir)
    return resolve_state_dir(configured_state_dir) / SPOOL_NAME


#: The control socket's file name, and the system daemon's runtime directory.
CONTROL_SOCKET_NAME = "control.sock"
SYSTEM_RUNTIME_DIR = Path("/run/gpuwatchd")


def resolve_control_socket(configured: str) -> Path:
    """The control socket the daemon listens on, following :attr:`DaemonConfig.control_socket`'s
    rule: the configured path, else ``$RUNTIME_DIRECTORY`` under systemd, else
    /run/gpuwatchd for root, else ``$XDG_RUNTIME_DIR/gpuwatchd`` (``/tmp/gpuwatchd-UID``
    without one). Shared by the daemon and the jobs that talk to it."""
    if configured:
        return Path(configured)
    systemd = os.environ.get("RUNTIME_DIRECTORY")
    if systemd:
        return Path(systemd.split(":")[0]) / CONTROL_SOCKET_NAME
    if os.geteuid() == 0:
        return SYSTEM_RUNTIME_DIR / CONTROL_SOCKET_NAME
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(xdg) / "gpuwatchd" if xdg else Path(f"/tmp/gpuwatchd-{os.geteuid()}")
    return base / CONTROL_SOCKET_NAME


@dataclass(frozen=True, slots=True)
class Config:
    """The whole validated configuration: one field per table."""

    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    tuning: TuningConfig = field(default_factory=TuningConfig)
    drift: DriftConfig = field(default_factory=DriftConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)
    exporter: ExporterConfig = field(default_factory=ExporterConfig)
    workloads: tuple[Workload, ...] = DEFAULT_WORKLOADS
    source: str | None = None  # the file it came from, for logs

    def workload(self, name: str) -> Workload:
        """The workload called ``name``; ValueError listing the known ones otherwise."""
        return find_workload(self.workloads, name)

    def backend_spec(self) -> BackendSpec:
        """What :func:`~gpuwatchd.telemetry.factory.open_backend` needs to open the backend."""
        return BackendSpec(kind=self.daemon.backend, sim=self.sim, replay=self.replay)

    def tuning_setup(self) -> TuningSetup:
        """What the tuning scheduler and planner (``gpuwatchd.sessions``) read."""
        return TuningSetup(tuning=self.tuning, workloads=self.workloads, sim=self.sim)

    def with_overrides(self, **sections: Mapping[str, Any]) -> Config:
        """Apply CLI overrides (already typed) section by section, re-validating them."""
        updates: dict[str, Any] = {}
        for name, values in sections.items():
            present = {k: v for k, v in values.items() if v is not None}
            if not present:
                continue
            current = dataclasses.asdict(getattr(self, name))
            current.update(present)
            updates[name] = _SECTIONS[name](current)
        return dataclasses.replace(self, **updates)


def _gate(table: Mapping[str, Any]) -> GateConfig:
    return GateConfig.from_mapping(table)


def _tuning(table: Mapping[str, Any]) -> TuningConfig:
    table = dict(table)
    protocol = table.pop("protocol", {})
    if isinstance(protocol, ProtocolConfig):  # from with_overrides
        proto = protocol
    elif isinstance(protocol, Mapping):
        proto = ProtocolConfig.from_mapping(protocol)
    else:
        raise ValueError("tuning.protocol: expected a [tuning.protocol] table")
    check_durations(proto, "protocol")
    return dataclasses.replace(from_table(TuningConfig, table, "tuning"), protocol=proto)


_SECTIONS = {
    "daemon": lambda t: from_table(DaemonConfig, t, "daemon"),
    "sim": lambda t: from_table(SimConfig, t, "sim"),
    "replay": lambda t: from_table(ReplayConfig, t, "replay"),
    "gate": _gate,
    "tuning": _tuning,
    "drift": DriftConfig.from_mapping,
    "store": parse_store,
    "fleet": FleetConfig.from_mapping,
    "exporter": lambda t: from_table(ExporterConfig, t, "exporter"),
}


def _check_claim_renewal(cfg: Config) -> None:
    """A running session renews its fleet claims from the scheduler's tick, every third
    of ``claim_ttl_s``: a tick slower than that would let them lapse mid-session."""
    need = 3 * cfg.tuning.check_interval_s
    if cfg.fleet.claim_ttl_s < need:
        raise ValueError(
            f"fleet.claim_ttl_s: must be at least 3 x tuning.check_interval_s ({need:g}) so"
            f" running sessions renew their claims in time, got {cfg.fleet.claim_ttl_s:g}"
        )


def parse_config(data: Mapping[str, Any], source: str | None = None) -> Config:
    """Validate a parsed TOML document. Raises :class:`ConfigError` with one line."""
    where = f"{source}: " if source else ""
    sections: dict[str, Any] = {}
    data = dict(data)
    configured: tuple[Workload, ...] = ()
    if "workload" in data:
        try:
            configured = parse_workloads(data.pop("workload"))
        except ValueError as exc:
            raise ConfigError(f"{where}{exc}") from None
        sections["workloads"] = merge_workloads(DEFAULT_WORKLOADS, configured)
    for name, table in data.items():
        if name not in _SECTIONS:
            known = ", ".join([*(f"[{s}]" for s in _SECTIONS), "[[workload]]"])
            shown = name if str(name).isprintable() else show(name)
            raise ConfigError(f"{where}[{shown}]: unknown section (known sections: {known})")
        if not isinstance(table, Mapping):
            raise ConfigError(f"{where}{name}: expected a [{name}] table")
        try:
            sections[name] = _SECTIONS[name](table)
        except ValueError as exc:
            msg = str(exc)
            if not msg.startswith(f"{name}.") and not msg.startswith("["):
                msg = f"{name}.{msg}"
            raise ConfigError(f"{where}{msg}") from None
    cfg = Config(**sections, source=source)
    try:
        _check_claim_renewal(cfg)
    except ValueError as exc:
        raise ConfigError(f"{where}{exc}") from None
    for i, w in enumerate(configured):  # the config's own list is the only allow-list
        try:
            check_workload(w, cfg.tuning.allowed_modules, f"workload[{i}]")
        except TrustError as exc:
            raise ConfigError(f"{where}{exc}") from None
    for i, name in enumerate(cfg.tuning.workloads):  # the planner looks each one up
        try:
            cfg.workload(name)
        except ValueError as exc:
            raise ConfigError(f"{where}tuning.workloads[{i}]: {exc}") from None
    return cfg


def load_config(path: str | os.PathLike[str] | None) -> Config:
    """Read ``path``; with ``None``, the default file if it exists, else built-in defaults."""
    if path is None:
        if not DEFAULT_CONFIG_PATH.exists():
            return Config()
        path = DEFAULT_CONFIG_PATH
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read config file: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: config file is not UTF-8 text") from None
    data = load_toml(text, str(p), error=ConfigError)
    return parse_config(data, source=str(p))
