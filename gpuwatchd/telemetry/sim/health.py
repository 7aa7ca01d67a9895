"""What a simulated GPU reports on the slow path: memory use, ECC and row remapping, PCIe
and NVLink byte counters, per-process memory and XIDs.

The physics model knows how busy the GPU has been (``busy_s``, the integral of
utilisation) and which processes hold memory; faults come as XID events, from the
scenario or injected. An XID leaves the traces a real one does: 48 (a double-bit,
uncorrectable ECC error) counts in the ECC totals, 63 marks a row for remapping
(pending until a GPU reset), 64 records a remap that failed. The simulated presets are
passively cooled, so fan speed is absent, as NVML reports it on an SXM board.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from types import MappingProxyType

from gpuwatchd.telemetry.sim.model import ModelState
from gpuwatchd.telemetry.sim.profiles import GpuPreset
from gpuwatchd.telemetry.types import ProcessMemory, RemappedRows, SlowReading

#: Host traffic of an idle GPU (driver polling), bytes per second each way.
PCIE_IDLE_BPS = 2.0e5
#: Extra PCIe traffic at full utilisation: input batches in, results and logs out.
PCIE_BUSY_RX_BPS = 1.5e9
PCIE_BUSY_TX_BPS = 3.0e8
#: NVLink traffic at full utilisation (a data-parallel job's all-reduce), each way.
NVLINK_BUSY_BPS = 6.0e10
#: How many processes a reading lists, as for a real GPU.
TOP_PROCESSES = 8

XID_DBE_ECC = 48
XID_ROW_REMAP_PENDING = 63
XID_ROW_REMAP_FAILED = 64


@dataclass(frozen=True, slots=True)
class XidEvent:
    """GPU ``gpu`` reports XID ``code`` at ``at_s`` simulated seconds."""

    at_s: float
    code: int
    gpu: int = 0

    def __post_init__(self) -> None:
        if not self.at_s >= 0:
            raise ValueError(f"at_s must be >= 0, got {self.at_s}")
        if self.code <= 0:
            raise ValueError(f"code must be > 0, got {self.code}")
        if self.gpu < 0:
            raise ValueError(f"gpu must be >= 0, got {self.gpu}")


def slow_reading(
    t: float, state: ModelState, preset: GpuPreset, xids: Iterable[XidEvent]
) -> SlowReading:
    """The slow fields of a GPU in ``state`` (at backend time ``t``), given its XIDs so far."""
    codes = Counter(x.code for x in xids if x.at_s <= state.t)
    used = preset.reserved_memory_bytes + sum(b for _, b in state.proc_memory)
    total = preset.memory_total_bytes
    uncorrected = codes[XID_DBE_ECC]
    ecc = {
        ("volatile", "corrected"): 0,
        ("volatile", "uncorrected"): uncorrected,
        ("aggregate", "corrected"): 0,
        ("aggregate", "uncorrected"): uncorrected,
    }
    procs = sorted(
        (ProcessMemory(pid, b) for pid, b in state.proc_memory if b > 0),
        key=lambda p: (-p.used_bytes, p.pid),
    )
    nvlink = state.busy_s * NVLINK_BUSY_BPS if preset.nvlink_links else None
    return SlowReading(
        t=t,
        memory_used_bytes=min(used, total),
        memory_free_bytes=max(0, total - used),
        memory_total_bytes=total,
        ecc_errors=MappingProxyType(ecc),
        remapped_rows=RemappedRows(
            correctable=0,
            uncorrectable=codes[XID_ROW_REMAP_PENDING],
            pending=codes[XID_ROW_REMAP_PENDING] > 0,
            failed=codes[XID_ROW_REMAP_FAILED] > 0,
        ),
        pcie_tx_bytes=PCIE_IDLE_BPS * state.t + PCIE_BUSY_TX_BPS * state.busy_s,
        pcie_rx_bytes=PCIE_IDLE_BPS * state.t + PCIE_BUSY_RX_BPS * state.busy_s,
        pcie_replay_errors=0,
        nvlink_tx_bytes=nvlink,
        nvlink_rx_bytes=nvlink,
        fan_speed_ratio=None,
        processes=tuple(procs[:TOP_PROCESSES]),
        xid_errors=MappingProxyType(dict(codes)),
    )
