"""Which power reading shows the protocol's own load, and after how long.

NVML's ``power_w`` is a 1 s average: after a load step it still holds the time before
the load for about a second, so it counts only after ``power_probe_s`` of back-to-back
load (before that, it reads low, or shows another job's load). Where the session also
reads instantaneous power (``POWER_INSTANT``, carried in ``Sample.extra``), that reading
follows the load within its refresh period and the limiter within about a tenth of a
second, so it is the reading used, and it counts after ``power_probe_instant_s``. A
sample without it (a GPU or driver that lacks the field) is judged as before.
"""

from __future__ import annotations

from gpuwatchd.telemetry.types import Sample, instant_power
from gpuwatchd.tuning.settings import ProtocolConfig


def probe_s(cfg: ProtocolConfig, s: Sample) -> float:
    """Back-to-back load after which ``s``'s power reading shows that load only."""
    return cfg.power_probe_s if instant_power(s) is None else cfg.power_probe_instant_s


def load_power(s: Sample) -> float | None:
    """The power reading that follows a load: instantaneous where read, else the average."""
    watts = instant_power(s)
    return s.power_w if watts is None else watts


def counts(cfg: ProtocolConfig, s: Sample, loaded_s: float) -> bool:
    """Whether ``s``'s power reading, after ``loaded_s`` of back-to-back load, shows it."""
    return loaded_s >= probe_s(cfg, s)
