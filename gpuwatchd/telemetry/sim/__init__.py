"""The simulated GPU backend: a physical model, GPU presets and scripted scenarios."""

from gpuwatchd.telemetry.sim.backend import SimBackend, SimGpuView
from gpuwatchd.telemetry.sim.model import GpuModel, Load, ModelState
from gpuwatchd.telemetry.sim.profiles import H200, L4, PRESETS, GpuPreset
from gpuwatchd.telemetry.sim.scenarios import FOREIGN_PID, SCENARIOS, Scenario

__all__ = [
    "FOREIGN_PID",
    "H200",
    "L4",
    "PRESETS",
    "SCENARIOS",
    "GpuModel",
    "GpuPreset",
    "Load",
    "ModelState",
    "Scenario",
    "SimBackend",
    "SimGpuView",
]
