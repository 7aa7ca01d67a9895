"""Which telemetry backend to open, with the sections it reads (``[sim]``, ``[replay]``).

The config loader builds a :class:`BackendSpec`; :func:`~gpuwatchd.telemetry.factory.open_backend`
takes it, so telemetry never sees the rest of the configuration.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuwatchd.telemetry.sim.settings import SimConfig
from gpuwatchd.validate import check

#: Every backend :func:`~gpuwatchd.telemetry.factory.open_backend` knows.
BACKENDS = ("nvml", "sim", "replay")


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """A recorded ``gpuwatchd-trace/1`` file (``--backend replay``)."""

    trace: str = ""
    speed: float = field(default=1.0, metadata=check(lambda v: v > 0, "must be > 0"))
    loop: bool = True


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """The backend to open (one of :data:`BACKENDS`) and the settings of each kind."""

    kind: str = "nvml"
    sim: SimConfig = field(default_factory=SimConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
