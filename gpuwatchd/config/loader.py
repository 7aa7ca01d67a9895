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
from gpuwatchd.gate import GateConfig

DEFAULT_CONFIG_PATH = Path("/etc/gpuwatchd/config.toml")
BACKENDS = ("nvml", "sim", "replay")
LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(Exception):
    """A one-line, user-facing description of what is wrong with the configuration."""


def _positive(v: float) -> bool:
    return v > 0


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
    state_dir: str = "/var/lib/gpuwatchd"
    log_level: str = field(
        default="info", metadata=check(lambda v: v in LOG_LEVELS, f"must be one of {LOG_LEVELS}")
    )


@dataclass(frozen=True, slots=True)
class SimConfig:
    """The simulated GPU (``--backend sim``)."""

    gpus: int = field(default=1, metadata=check(lambda v: 1 <= v <= 1024, "must be in [1, 1024]"))
    scenario: str = "idle"
    seed: int = 0
    #: Simulated seconds per real second.
    speed: float = field(default=1.0, metadata=check(_positive, "must be > 0"))


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """A recorded ``gpuwatchd-trace/1`` file (``--backend replay``)."""

    trace: str = ""
    speed: float = field(default=1.0, metadata=check(_positive, "must be > 0"))
    loop: bool = True


@dataclass(frozen=True, slots=True)
class Config:
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    source: str | None = None  # the file it came from, for logs

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


_SECTIONS = {
    "daemon": lambda t: from_table(DaemonConfig, t, "daemon"),
    "sim": lambda t: from_table(SimConfig, t, "sim"),
    "replay": lambda t: from_table(ReplayConfig, t, "replay"),
    "gate": _gate,
}


def parse_config(data: Mapping[str, Any], source: str | None = None) -> Config:
    """Validate a parsed TOML document. Raises :class:`ConfigError` with one line."""
    where = f"{source}: " if source else ""
    sections: dict[str, Any] = {}
    for name, table in data.items():
        if name not in _SECTIONS:
            known = ", ".join(f"[{s}]" for s in _SECTIONS)
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
