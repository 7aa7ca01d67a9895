"""Load and validate ``config.toml``.

Sections: ``[daemon]``, ``[sim]``, ``[replay]``, ``[gate]``. Anything unknown is an error:
a typo in a threshold must not silently fall back to a default on a production host.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuwatchd.config.fields import check, from_table
from gpuwatchd.config.windows import parse_windows
from gpuwatchd.drift.config import DriftConfig
from gpuwatchd.gate import GateConfig
from gpuwatchd.tuning.settings import ProtocolConfig
from gpuwatchd.tuning.types import Regime, Workload
from gpuwatchd.tuning.workloads import DEFAULT_WORKLOADS, merge_workloads, parse_workloads

DEFAULT_CONFIG_PATH = Path("/etc/gpuwatchd/config.toml")
BACKENDS = ("nvml", "sim", "replay")
LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(Exception):
    """A one-line, user-facing description of what is wrong with the configuration."""


def _positive(v: float) -> bool:
    return v > 0


def _valid_scenario(name: str) -> bool:
    from gpuwatchd.telemetry.sim.scenarios import SCENARIOS

    if name not in SCENARIOS:
        raise ValueError(f"sim.scenario: unknown {name!r} (known: {', '.join(SCENARIOS)})")
    return True


def _valid_windows(windows: tuple[str, ...]) -> bool:
    parse_windows(windows)  # raises ValueError naming the bad window
    return True


def _valid_listen(text: str) -> bool:
    from gpuwatchd.exporter.http import parse_listen

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
    #: Fast-field poll period. 10 Hz is cheap (about 11 µs of NVML per GPU per poll).
    poll_interval_s: float = field(
        default=0.5, metadata=check(lambda v: 0.01 <= v <= 1.0, "must be in [0.01, 1.0]")
    )
    #: The energy counter costs ~4 ms a call on an H200: read it at a lower rate.
    energy_interval_s: float = field(default=5.0, metadata=check(_positive, "must be > 0"))
    #: Static facts (power limit, max clocks, thresholds) are re-read this often.
    info_refresh_s: float = field(default=300.0, metadata=check(_positive, "must be > 0"))
    #: A GPU read in flight this many poll periods is reported as stalled.
    stall_periods: float = field(default=2.0, metadata=check(lambda v: v >= 1, "must be >= 1"))
    #: systemd watchdog pings stop once a GPU read has been stuck this long.
    watchdog_stall_s: float = field(default=60.0, metadata=check(_positive, "must be > 0"))
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
    control_group: str = ""
    #: TLS and basic auth for the HTTP endpoints, in the Prometheus exporter-toolkit
    #: web-config.yml format. Empty: plain HTTP without authentication.
    web_config: str = ""


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


@dataclass(frozen=True, slots=True)
class SimConfig:
    """The simulated GPU (``--backend sim``)."""

    gpus: int = field(default=1, metadata=check(lambda v: 1 <= v <= 1024, "must be in [1, 1024]"))
    scenario: str = field(default="idle", metadata=check(lambda v: _valid_scenario(v), ""))
    seed: int = 0
    #: Simulated seconds per real second.
    speed: float = field(default=1.0, metadata=check(_positive, "must be > 0"))


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """A recorded ``gpuwatchd-trace/1`` file (``--backend replay``)."""

    trace: str = ""
    speed: float = field(default=1.0, metadata=check(_positive, "must be > 0"))
    loop: bool = True


_REGIMES = tuple(r.value for r in Regime)


@dataclass(frozen=True, slots=True)
class TuningConfig:
    """When and how the daemon tunes (``[tuning]``; ``[tuning.protocol]`` holds the protocol)."""

    #: Tune automatically whenever a GPU's gate opens and work is pending.
    enabled: bool = True
    #: How often the scheduler looks for pending work and open gates.
    check_interval_s: float = field(default=5.0, metadata=check(_positive, "must be > 0"))
    #: A worker running longer than this is killed and the session marked failed.
    session_timeout_s: float = field(default=1800.0, metadata=check(_positive, "must be > 0"))
    regimes: tuple[str, ...] = field(
        default=_REGIMES,
        metadata=check(lambda v: v and set(v) <= set(_REGIMES), f"must be a subset of {_REGIMES}"),
    )
    #: Workloads the daemon tunes on its own (empty: every one whose device fits the backend).
    workloads: tuple[str, ...] = ()
    #: Local-time windows in which tuning may start, e.g. ["22:00-06:00"]; empty: any time.
    windows: tuple[str, ...] = field(default=(), metadata=check(_valid_windows, "bad window"))
    #: How many GPUs may be tuned at the same time.
    max_concurrent: int = field(default=1, metadata=check(lambda v: v >= 1, "must be >= 1"))
    #: After a failed session, wait this long before trying that GPU again.
    retry_failed_after_s: float = field(default=3600.0, metadata=check(_positive, "must be > 0"))
    protocol: ProtocolConfig = field(default_factory=ProtocolConfig)


@dataclass(frozen=True, slots=True)
class Config:
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    tuning: TuningConfig = field(default_factory=TuningConfig)
    drift: DriftConfig = field(default_factory=DriftConfig)
    workloads: tuple[Workload, ...] = DEFAULT_WORKLOADS
    source: str | None = None  # the file it came from, for logs

    def workload(self, name: str) -> Workload:
        """The workload called ``name``; ValueError listing the known ones otherwise."""
        for w in self.workloads:
            if w.name == name:
                return w
        known = ", ".join(w.name for w in self.workloads)
        raise ValueError(f"unknown workload {name!r} (known: {known})")

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
    return dataclasses.replace(from_table(TuningConfig, table, "tuning"), protocol=proto)


_SECTIONS = {
    "daemon": lambda t: from_table(DaemonConfig, t, "daemon"),
    "sim": lambda t: from_table(SimConfig, t, "sim"),
    "replay": lambda t: from_table(ReplayConfig, t, "replay"),
    "gate": _gate,
    "tuning": _tuning,
    "drift": DriftConfig.from_mapping,
}


def parse_config(data: Mapping[str, Any], source: str | None = None) -> Config:
    """Validate a parsed TOML document. Raises :class:`ConfigError` with one line."""
    where = f"{source}: " if source else ""
    sections: dict[str, Any] = {}
    data = dict(data)
    if "workload" in data:
        try:
            configured = parse_workloads(data.pop("workload"))
        except ValueError as exc:
            raise ConfigError(f"{where}{exc}") from None
        sections["workloads"] = merge_workloads(DEFAULT_WORKLOADS, configured)
    for name, table in data.items():
        if name not in _SECTIONS:
            known = ", ".join([*(f"[{s}]" for s in _SECTIONS), "[[workload]]"])
            raise ConfigError(f"{where}[{name}]: unknown section (known sections: {known})")
        if not isinstance(table, Mapping):
            raise ConfigError(f"{where}{name}: expected a [{name}] table")
        try:
            sections[name] = _SECTIONS[name](table)
        except ValueError as exc:
            msg = str(exc)
            if not msg.startswith(f"{name}.") and not msg.startswith("["):
                msg = f"{name}.{msg}"
            raise ConfigError(f"{where}{msg}") from None
    return Config(**sections, source=source)


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
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: config file is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: invalid TOML: {exc}") from None
    return parse_config(data, source=str(p))
