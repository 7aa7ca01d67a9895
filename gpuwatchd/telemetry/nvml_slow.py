"""What the slow NVML fields are, and how their raw values become a :class:`SlowReading`.

:mod:`gpuwatchd.telemetry.nvml` makes the calls; this module holds the field table and
the arithmetic, so both stay small. Choices, and why:

- The slow fields of the field table (memory temperature), ECC totals, the PCIe replay
  counter and the NVLink byte counters come from one ``nvmlDeviceGetFieldValues`` call:
  one driver round trip for all of them, and NVML reports success or failure per field,
  so one field failing drops only that field.
- PCIe bytes are estimated: ``nvmlDeviceGetPcieThroughput`` samples KB/s over a short window (and
  blocks for it), and :class:`PcieCounter` integrates those samples
  over time (trapezoids), so ``rate()`` gives their average. The true counters,
  ``NVML_FI_DEV_PCIE_COUNT_{TX,RX}_BYTES``, were measured on an H100 to wrap at 2**32
  bytes: under 0.2 s of traffic at PCIe 5.0 rates, so no poll period could unwrap them.
- NVLink bytes are ``NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_{TX,RX}`` (KiB) with scope
  ``UINT_MAX``: NVML's own sum over all links. A GPU without NVLink reports them
  unsupported, so they are absent.
- ECC counts are NVML's totals over all memory locations (single-bit errors are
  corrected, double-bit ones are not), volatile and aggregate.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from gpuwatchd.telemetry.fields import field_values
from gpuwatchd.telemetry.nvml_mig import MIG
from gpuwatchd.telemetry.types import ProcessMemory, RemappedRows, SlowReading

# Field keys: the unit of "NVML does not support this on this GPU".
ECC_VOLATILE_CORRECTED = "ecc_volatile_corrected"
ECC_VOLATILE_UNCORRECTED = "ecc_volatile_uncorrected"
ECC_AGGREGATE_CORRECTED = "ecc_aggregate_corrected"
ECC_AGGREGATE_UNCORRECTED = "ecc_aggregate_uncorrected"
PCIE_REPLAY = "pcie_replay"
PCIE_TX = "pcie_tx"  # nvmlDeviceGetPcieThroughput, KB/s
PCIE_RX = "pcie_rx"
NVLINK_TX = "nvlink_tx"
NVLINK_RX = "nvlink_rx"
MEMORY = "memory"
REMAPPED_ROWS = "remapped_rows"
FAN = "fan"
PROCESS_MEMORY = "process_memory"

#: How many compute processes a reading lists (the ones holding the most memory).
TOP_PROCESSES = 8

_ALL_LINKS = 0xFFFFFFFF  # scopeId that asks NVML for the sum over every NVLink
_KIB = 1024.0  # NVML's KB and KiB (throughput, NVLink counters) are 1024 bytes
#: NVML's "value not available" sentinels for 32- and 64-bit unsigned values.
_NOT_AVAILABLE = frozenset({0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF})
#: nvmlValue_t union member per NVML_VALUE_TYPE_* (double, uint, ulong, ull, sll, sint, ushort).
_VALUE_MEMBER = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")

_ECC_PAIRS: tuple[tuple[str, tuple[str, str]], ...] = (
    (ECC_VOLATILE_CORRECTED, ("volatile", "corrected")),
    (ECC_VOLATILE_UNCORRECTED, ("volatile", "uncorrected")),
    (ECC_AGGREGATE_CORRECTED, ("aggregate", "corrected")),
    (ECC_AGGREGATE_UNCORRECTED, ("aggregate", "uncorrected")),
)


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """One entry of the field-values request: its key, NVML field id and scope."""

    key: str
    field_id: int
    scope: int | None = None

    @property
    def request(self) -> int | tuple[int, int]:
        """What pynvml's ``nvmlDeviceGetFieldValues`` takes for this field."""
        return self.field_id if self.scope is None else (self.field_id, self.scope)


def field_specs(nv: Any) -> tuple[FieldSpec, ...]:
    """The field-values request, with ids from the bindings (NVML ABI values as fallback):
    the field table's slow fields, then the health fields."""

    def fid(name: str, default: int) -> int:
        return int(getattr(nv, name, default))

    return (
        *(FieldSpec(spec.key, fid(spec.field_id, spec.default_id)) for spec, _ in field_values()),
        FieldSpec(ECC_VOLATILE_CORRECTED, fid("NVML_FI_DEV_ECC_SBE_VOL_TOTAL", 3)),
        FieldSpec(ECC_VOLATILE_UNCORRECTED, fid("NVML_FI_DEV_ECC_DBE_VOL_TOTAL", 4)),
        FieldSpec(ECC_AGGREGATE_CORRECTED, fid("NVML_FI_DEV_ECC_SBE_AGG_TOTAL", 5)),
        FieldSpec(ECC_AGGREGATE_UNCORRECTED, fid("NVML_FI_DEV_ECC_DBE_AGG_TOTAL", 6)),
        FieldSpec(PCIE_REPLAY, fid("NVML_FI_DEV_PCIE_REPLAY_COUNTER", 94)),
        FieldSpec(NVLINK_TX, fid("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", 138), _ALL_LINKS),
        FieldSpec(NVLINK_RX, fid("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX", 139), _ALL_LINKS),
    )


def field_value(value: Any) -> float | None:
    """A successful nvmlFieldValue_t's number; None for NVML's "not available" sentinel.

    Raises ``ValueError`` for a value type this module does not know.
    """
    kind = value.valueType
    if not isinstance(kind, int) or not 0 <= kind < len(_VALUE_MEMBER):
        raise ValueError(f"unknown field value type {kind!r}")
    number = getattr(value.value, _VALUE_MEMBER[kind])
    if kind in (1, 2, 3) and number in _NOT_AVAILABLE:
        return None
    return float(number)


def top_processes(procs: Any) -> tuple[ProcessMemory, ...]:
    """The :data:`TOP_PROCESSES` processes holding the most memory, largest first.

    A process whose memory NVML cannot see (``usedGpuMemory`` None: another PID
    namespace, or no permission) is left out.
    """
    known = [
        ProcessMemory(int(p.pid), int(p.usedGpuMemory))
        for p in procs
        if getattr(p, "usedGpuMemory", None) is not None
    ]
    known.sort(key=lambda p: (-p.used_bytes, p.pid))
    return tuple(known[:TOP_PROCESSES])


@dataclass(frozen=True, slots=True)
class PcieCounter:
    """PCIe bytes each way, integrated from throughput samples (bytes/s) over time.

    A direction whose latest sample is missing (unsupported, or failed this time) is
    ``None`` in :meth:`bytes` and adds nothing for that gap; its total is kept.
    """

    t: float | None = None
    tx_bps: float | None = None
    rx_bps: float | None = None
    tx_total: float = 0.0
    rx_total: float = 0.0

    def add(self, t: float, tx_bps: float | None, rx_bps: float | None) -> PcieCounter:
        """The counter after samples taken at ``t``."""
        dt = 0.0 if self.t is None else max(0.0, t - self.t)
        return PcieCounter(
            t=t,
            tx_bps=tx_bps,
            rx_bps=rx_bps,
            tx_total=self.tx_total + _trapezoid(self.tx_bps, tx_bps, dt),
            rx_total=self.rx_total + _trapezoid(self.rx_bps, rx_bps, dt),
        )

    def gap(self) -> PcieCounter:
        """Forget the last samples (the GPU was lost): the time since is not integrated."""
        return PcieCounter(tx_total=self.tx_total, rx_total=self.rx_total)

    def bytes(self) -> tuple[float | None, float | None]:
        """Bytes sent and received so far, per direction whose latest sample exists."""
        return (
            None if self.tx_bps is None else self.tx_total,
            None if self.rx_bps is None else self.rx_total,
        )


def _trapezoid(before: float | None, after: float | None, dt: float) -> float:
    return 0.0 if before is None or after is None else 0.5 * (before + after) * dt


def throughput_bps(kilobytes_per_s: Any) -> float:
    """``nvmlDeviceGetPcieThroughput``'s KB/s as bytes/s."""
    return float(kilobytes_per_s) * _KIB


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


def build_reading(
    t: float,
    fields: Mapping[str, float | None],
    calls: Mapping[str, Any],
    pcie: PcieCounter,
    xid_errors: Mapping[int, int] | None,
) -> SlowReading:
    """A :class:`SlowReading` from decoded field values, the getters' results, the PCIe
    counter and the XID counts.

    ``fields`` and ``calls`` hold only what was read this time; a key that is missing
    (unsupported, or failed this time) leaves its field ``None``.
    """
    ecc = {pair: int(v) for key, pair in _ECC_PAIRS if (v := fields.get(key)) is not None}
    memory = calls.get(MEMORY)
    rows = calls.get(REMAPPED_ROWS)
    fan = calls.get(FAN)
    nvlink_tx, nvlink_rx = fields.get(NVLINK_TX), fields.get(NVLINK_RX)
    pcie_tx, pcie_rx = pcie.bytes()
    return SlowReading(
        t=t,
        memory_used_bytes=None if memory is None else int(memory.used),
        memory_free_bytes=None if memory is None else int(memory.free),
        memory_total_bytes=None if memory is None else int(memory.total),
        ecc_errors=MappingProxyType(ecc) if ecc else None,
        remapped_rows=None
        if rows is None
        else RemappedRows(int(rows[0]), int(rows[1]), bool(rows[2]), bool(rows[3])),
        pcie_tx_bytes=pcie_tx,
        pcie_rx_bytes=pcie_rx,
        pcie_replay_errors=_int(fields.get(PCIE_REPLAY)),
        nvlink_tx_bytes=None if nvlink_tx is None else nvlink_tx * _KIB,
        nvlink_rx_bytes=None if nvlink_rx is None else nvlink_rx * _KIB,
        fan_speed_ratio=None if fan is None else fan / 100.0,
        processes=calls.get(PROCESS_MEMORY),
        xid_errors=xid_errors,
        mig=calls.get(MIG),
    )
