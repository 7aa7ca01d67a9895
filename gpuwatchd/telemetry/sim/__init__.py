"""The simulated GPU backend: a physical model, GPU presets and scripted scenarios.

The names below are imported on first use (PEP 562 ``__getattr__``): the config reads
``[sim]`` through :mod:`gpuwatchd.telemetry.sim.settings`, so every daemon imports this
package, and one on real GPUs never loads the simulator itself. Hand-written because a
lazy-import library would be a dependency for one table.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the same names, for type checkers (``X as X``: re-exported)
    from gpuwatchd.telemetry.sim.backend import SimBackend as SimBackend
    from gpuwatchd.telemetry.sim.backend import SimGpuView as SimGpuView
    from gpuwatchd.telemetry.sim.model import GpuModel as GpuModel
    from gpuwatchd.telemetry.sim.model import Load as Load
    from gpuwatchd.telemetry.sim.model import ModelState as ModelState
    from gpuwatchd.telemetry.sim.profiles import H200 as H200
    from gpuwatchd.telemetry.sim.profiles import L4 as L4
    from gpuwatchd.telemetry.sim.profiles import PRESETS as PRESETS
    from gpuwatchd.telemetry.sim.profiles import GpuPreset as GpuPreset
    from gpuwatchd.telemetry.sim.scenarios import FOREIGN_PID as FOREIGN_PID
    from gpuwatchd.telemetry.sim.scenarios import SCENARIOS as SCENARIOS
    from gpuwatchd.telemetry.sim.scenarios import Scenario as Scenario

#: Each name this package exports -> the module that defines it.
_HOMES = {
    "SimBackend": "backend",
    "SimGpuView": "backend",
    "GpuModel": "model",
    "Load": "model",
    "ModelState": "model",
    "H200": "profiles",
    "L4": "profiles",
    "PRESETS": "profiles",
    "GpuPreset": "profiles",
    "FOREIGN_PID": "scenarios",
    "SCENARIOS": "scenarios",
    "Scenario": "scenarios",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # looked up once
    return value
