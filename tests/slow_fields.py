"""The slow health fields of a fully populated H200, for the exporter and catalogue tests."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from gpuwatchd.telemetry.types import ProcessMemory, RemappedRows, SlowReading

GIB = 2**30


def full_slow_reading(t: float = 158.0) -> SlowReading:
    """Every slow field set: 40 GiB used, one uncorrected ECC error, a pending row remap."""
    return SlowReading(
        t=t,
        memory_used_bytes=40 * GIB,
        memory_free_bytes=100 * GIB,
        memory_total_bytes=140 * GIB,
        ecc_errors=MappingProxyType(
            {
                ("volatile", "corrected"): 3,
                ("volatile", "uncorrected"): 1,
                ("aggregate", "corrected"): 17,
                ("aggregate", "uncorrected"): 1,
            }
        ),
        remapped_rows=RemappedRows(correctable=2, uncorrectable=1, pending=True, failed=False),
        pcie_tx_bytes=5.0e9,
        pcie_rx_bytes=7.5e9,
        pcie_replay_errors=4,
        nvlink_tx_bytes=3.0e12,
        nvlink_rx_bytes=2.5e12,
        fan_speed_ratio=0.55,
        processes=(ProcessMemory(4242, 30 * GIB), ProcessMemory(4243, 9 * GIB)),
        xid_errors=MappingProxyType({48: 1, 63: 1}),
    )


def slow_fields() -> dict[str, Any]:
    """Sample fields a fully populated H200 carries: its slow reading and field errors."""
    return {"slow": full_slow_reading(), "field_errors": MappingProxyType({"util": 2})}
