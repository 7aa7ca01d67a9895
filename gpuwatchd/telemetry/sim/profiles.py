"""Physical presets of simulated GPUs: static facts plus the constants of the model.

The thermal model is a two-stage RC (Foster) network: a fast die stage and a slower
heatsink stage, each ``dT_i/dt = (R_i * P - T_i) / tau_i`` above the inlet air. The
H200 numbers are fitted to ``traces/h200-matmul-burn.jsonl`` (see ``H200``); the L4
numbers are chosen to behave like a passively cooled 72 W card in a warm server.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

_MAY_BE_ZERO_OR_NEGATIVE = frozenset({"leakage_w_per_c", "ambient_c", "nvlink_links"})


@dataclass(frozen=True, slots=True)
class GpuPreset:
    """One GPU model: what NVML reports statically, and how it heats and throttles.

    ``idle_power_w`` is the board power with no kernel running at ``ref_temp_c``;
    static power then grows by ``leakage_w_per_c`` per degree (leakage current).
    A load's dynamic power scales with ``(f / f_max) ** power_exponent`` (dynamic
    power is ~f·V² and the voltage follows the clock on the DVFS curve).
    ``thermal_target_c`` is where the software thermal controller holds the die
    (NVML's "max operating temperature"); ``thermal_horizon_s`` is how far ahead that
    controller aims, which keeps it stable at any integration step.
    ``reserved_memory_bytes`` is device memory the driver holds with no process on the
    GPU; ``nvlink_links`` is 0 for a GPU without NVLink.
    """

    name: str
    cuda_capability: str
    memory_total_bytes: int
    max_sm_clock_mhz: float
    min_sm_clock_mhz: float
    mem_clock_mhz: float
    power_limit_w: float
    idle_power_w: float
    ref_temp_c: float
    leakage_w_per_c: float
    power_exponent: float
    heavy_load_dynamic_w: float
    ambient_c: float
    die_r_c_per_w: float
    die_tau_s: float
    sink_r_c_per_w: float
    sink_tau_s: float
    thermal_target_c: float
    slowdown_temp_c: float
    shutdown_temp_c: float
    thermal_horizon_s: float
    clock_bin_mhz: float = 15.0
    power_window_s: float = 1.0
    reserved_memory_bytes: int = 512 * 2**20
    nvlink_links: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _MAY_BE_ZERO_OR_NEGATIVE or not isinstance(value, int | float):
                continue
            if not value > 0:
                raise ValueError(f"{f.name} must be > 0, got {value}")
        if self.nvlink_links < 0:
            raise ValueError(f"nvlink_links must be >= 0, got {self.nvlink_links}")
        if self.leakage_w_per_c < 0:
            raise ValueError(f"leakage_w_per_c must be >= 0, got {self.leakage_w_per_c}")
        if not self.min_sm_clock_mhz < self.max_sm_clock_mhz:
            raise ValueError(
                f"min_sm_clock_mhz must be < max_sm_clock_mhz, got {self.min_sm_clock_mhz}"
            )
        for name in ("max_sm_clock_mhz", "min_sm_clock_mhz"):
            if getattr(self, name) % self.clock_bin_mhz:
                raise ValueError(f"{name} must be a multiple of clock_bin_mhz")
        if not self.ambient_c < self.thermal_target_c < self.slowdown_temp_c:
            raise ValueError(
                "thermal_target_c must lie between ambient_c and slowdown_temp_c, "
                f"got {self.thermal_target_c}"
            )
        if not self.slowdown_temp_c < self.shutdown_temp_c:
            raise ValueError(
                f"shutdown_temp_c must be > slowdown_temp_c, got {self.shutdown_temp_c}"
            )
        if self.idle_power_w >= self.power_limit_w:
            raise ValueError(f"idle_power_w must be < power_limit_w, got {self.idle_power_w}")


#: NVIDIA H200 SXM (141 GB HBM3e). Static facts from the header of
#: tests/data/h200-matmul-burn.jsonl.
#: Fit to the recorded bf16 matmul burn: total R = (60.4-40 °C)/(692-125 W) = 0.0359 °C/W,
#: 80 % of it in a 0.3 s die stage and 20 % in a 2.5 s cold-plate stage (least squares on
#: the rise and the fall); inlet 35.5 °C puts idle at 40 °C and 125 W; leakage 1.1 W/°C
#: is the idle-power excess seen while the die cools from 43 to 40 °C after the burn.
#: A matmul's dynamic power at 1980 MHz (1325 W, unreachable under the 700 W cap)
#: puts the capped clock at ~1442 MHz with the board at 693 W, as measured.
H200 = GpuPreset(
    name="NVIDIA H200",
    cuda_capability="9.0",
    memory_total_bytes=143_771 * 2**20,
    max_sm_clock_mhz=1980.0,
    min_sm_clock_mhz=345.0,
    mem_clock_mhz=3201.0,
    power_limit_w=700.0,
    idle_power_w=125.0,
    ref_temp_c=40.0,
    leakage_w_per_c=1.1,
    power_exponent=2.8,
    heavy_load_dynamic_w=1325.0,
    ambient_c=35.5,
    die_r_c_per_w=0.0287,
    die_tau_s=0.3,
    sink_r_c_per_w=0.0072,
    sink_tau_s=2.5,
    thermal_target_c=87.0,
    slowdown_temp_c=89.0,
    shutdown_temp_c=95.0,
    thermal_horizon_s=0.5,
    reserved_memory_bytes=589 * 2**20,
    nvlink_links=18,
)

#: NVIDIA L4 (24 GB GDDR6, 72 W, passively cooled). Not fitted to a recording: the
#: values are picked so that it behaves like an L4 in a warm server: idle ~50 °C at
#: ~18 W, a heavy kernel at full clock would draw ~93 W, so it is power-capped at
#: first, then the heatsink (R 0.75 °C/W, tau 4 min) soaks and the software thermal
#: controller holds 87 °C at ~55 W, pulling the clock down by ~15-20 % over minutes.
L4 = GpuPreset(
    name="NVIDIA L4",
    cuda_capability="8.9",
    memory_total_bytes=23_034 * 2**20,
    max_sm_clock_mhz=2040.0,
    min_sm_clock_mhz=210.0,
    mem_clock_mhz=6251.0,
    power_limit_w=72.0,
    idle_power_w=18.0,
    ref_temp_c=50.0,
    leakage_w_per_c=0.15,
    power_exponent=2.8,
    heavy_load_dynamic_w=75.0,
    ambient_c=32.0,
    die_r_c_per_w=0.25,
    die_tau_s=5.0,
    sink_r_c_per_w=0.75,
    sink_tau_s=240.0,
    thermal_target_c=87.0,
    slowdown_temp_c=92.0,
    shutdown_temp_c=95.0,
    thermal_horizon_s=5.0,
    reserved_memory_bytes=316 * 2**20,
)

PRESETS: dict[str, GpuPreset] = {"h200": H200, "l4": L4}
