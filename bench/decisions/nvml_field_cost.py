"""What each NVML health field costs per call on a real GPU, and whether the GPU has it.

Times every call gpuwatchd's slow path makes (memory, row remapping, fan, processes,
the batched field values, the energy counter), each field value on its own, the
alternatives it chose against (``nvmlDeviceGetPcieThroughput``, per-call ECC and replay
getters), and the XID event calls; then runs the NVML backend once and prints the new
Prometheus series it exports. Reads only: it changes no GPU setting.

    python3 bench/decisions/nvml_field_cost.py [--gpu 0] [--calls 200] [--json FILE] [--traffic]

Each cost is the median of ``--calls`` calls (20 for calls over 1 ms), in microseconds.
``--traffic`` (needs torch) copies 2 GiB host-to-device and back and reads NVML's PCIe
byte counter fields around the copies (they wrap at 2**32 bytes, which is why gpuwatchd
integrates the throughput samples instead).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pynvml  # type: ignore[import-untyped]

from gpuwatchd.telemetry.nvml_slow import field_specs

SLOW_CALLS = 20  # calls timed for anything slower than 1 ms


def _median_us(call: Callable[[], Any], calls: int) -> tuple[float, int]:
    """Median per-call cost in µs, and how many calls it took."""
    for _ in range(3):
        call()
    t0 = time.perf_counter_ns()
    call()
    n = calls if time.perf_counter_ns() - t0 < 1_000_000 else SLOW_CALLS
    costs = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        call()
        costs.append(time.perf_counter_ns() - t0)
    return statistics.median(costs) / 1000.0, n


def _measure(name: str, call: Callable[[], Any], calls: int) -> dict[str, Any]:
    """One row: the value (or the NVML error) and, when it works, its cost."""
    try:
        value = call()
    except pynvml.NVMLError as exc:
        return {"call": name, "supported": False, "error": str(exc)}
    us, n = _median_us(call, calls)
    return {"call": name, "supported": True, "us": round(us, 2), "calls": n, "value": _show(value)}


def _field(handle: Any, request: int | tuple[int, int]) -> Callable[[], Any]:
    """One field value; raises the field's own NVML error, as the backend sees it."""

    def read() -> Any:
        value = pynvml.nvmlDeviceGetFieldValues(handle, [request])[0]
        if value.nvmlReturn != pynvml.NVML_SUCCESS:
            raise pynvml.NVMLError(value.nvmlReturn)
        member = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")[value.valueType]
        return getattr(value.value, member)

    return read


def _show(value: Any) -> Any:
    if isinstance(value, int | float | str | bool) or value is None:
        return value
    if isinstance(value, tuple | list):
        return [_show(v) for v in value][:8]
    if hasattr(value, "_fields_"):
        return {f[0]: _show(getattr(value, f[0])) for f in value._fields_ if f[0] != "version"}
    return repr(value)[:80]


def _rows(gpu: int, calls: int) -> list[dict[str, Any]]:
    h = pynvml.nvmlDeviceGetHandleByIndex(gpu)
    specs = field_specs(pynvml)
    batch = [spec.request for spec in specs]
    procs = getattr(pynvml, "nvmlDeviceGetComputeRunningProcesses_v3", None) or (
        pynvml.nvmlDeviceGetComputeRunningProcesses
    )
    plain: list[tuple[str, Callable[[], Any]]] = [
        ("nvmlDeviceGetTemperature (fast path, for scale)",
         lambda: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)),
        ("nvmlDeviceGetMemoryInfo", lambda: pynvml.nvmlDeviceGetMemoryInfo(h)),
        ("nvmlDeviceGetRemappedRows", lambda: pynvml.nvmlDeviceGetRemappedRows(h)),
        ("nvmlDeviceGetFanSpeed", lambda: pynvml.nvmlDeviceGetFanSpeed(h)),
        ("nvmlDeviceGetComputeRunningProcesses_v3", lambda: procs(h)),
        ("nvmlDeviceGetTotalEnergyConsumption",
         lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(h)),
        (f"nvmlDeviceGetFieldValues, the backend's batch of {len(batch)}",
         lambda: [v.nvmlReturn for v in pynvml.nvmlDeviceGetFieldValues(h, batch)]),
        ("nvmlDeviceGetPcieThroughput TX (a 20 ms sample, integrated)",
         lambda: pynvml.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_TX_BYTES)),
        ("nvmlDeviceGetPcieReplayCounter (not used: in the batch)",
         lambda: pynvml.nvmlDeviceGetPcieReplayCounter(h)),
        ("nvmlDeviceGetTotalEccErrors DBE volatile (not used: in the batch)",
         lambda: pynvml.nvmlDeviceGetTotalEccErrors(
             h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)),
        ("nvmlDeviceGetSupportedEventTypes", lambda: pynvml.nvmlDeviceGetSupportedEventTypes(h)),
    ]  # fmt: skip
    rows = [_measure(name, call, calls) for name, call in plain]
    for spec in specs:
        rows.append(_measure(f"field {spec.key} ({spec.request})", _field(h, spec.request), calls))
    for name in ("NVML_FI_DEV_PCIE_COUNT_TX_BYTES", "NVML_FI_DEV_PCIE_COUNT_RX_BYTES"):
        fid = getattr(pynvml, name)
        rows.append(_measure(f"field {name} (not used: wraps)", _field(h, fid), calls))
    link_count = _field(h, pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT)
    rows.append(_measure("field nvlink_link_count", link_count, calls))
    tx0 = (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 0)
    rows.append(_measure(f"field nvlink_tx link 0 {tx0}", _field(h, tx0), calls))
    rows.extend(_event_rows(h, calls))
    return rows


def _event_rows(h: Any, calls: int) -> list[dict[str, Any]]:
    """XID events: subscribe once, then time a wait that finds nothing (1 ms timeout)."""
    t0 = time.perf_counter_ns()
    try:
        event_set = pynvml.nvmlEventSetCreate()
        pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, event_set)
    except pynvml.NVMLError as exc:
        return [{"call": "XID event subscription", "supported": False, "error": str(exc)}]
    setup_us = (time.perf_counter_ns() - t0) / 1000.0
    rows: list[dict[str, Any]] = [
        {"call": "nvmlEventSetCreate + nvmlDeviceRegisterEvents (once)", "supported": True,
         "us": round(setup_us, 1), "calls": 1},
    ]  # fmt: skip

    def wait_1ms() -> None:
        with contextlib.suppress(pynvml.NVMLError_Timeout):
            pynvml.nvmlEventSetWait_v2(event_set, 1)

    rows.append(_measure("nvmlEventSetWait_v2, 1 ms timeout, no event", wait_1ms, min(calls, 50)))
    pynvml.nvmlEventSetFree(event_set)
    return rows


def _backend_rows(gpu: int, calls: int) -> tuple[list[dict[str, Any]], list[str]]:
    """The NVML backend's read and slow read, and the health series a scrape exports."""
    from prometheus_client.exposition import generate_latest

    from gpuwatchd.exporter.collectors.build_info import DaemonInfo
    from gpuwatchd.exporter.registry import build_registry
    from gpuwatchd.gate import GateConfig
    from gpuwatchd.monitor.board import StateBoard
    from gpuwatchd.monitor.poller import Poller
    from gpuwatchd.telemetry.nvml import NvmlBackend

    backend = NvmlBackend()
    try:
        rows = [
            _measure("NvmlBackend.read (all fast fields)", lambda: backend.read(gpu), calls),
            _measure("NvmlBackend.read_energy (the whole slow path)",
                     lambda: backend.read_energy(gpu), SLOW_CALLS),
        ]  # fmt: skip
        board = StateBoard()
        poller = Poller(backend, board, GateConfig())
        poller.poll(gpu)
        text = generate_latest(build_registry(board, DaemonInfo("bench", "nvml", "3"))).decode()
    finally:
        backend.close()
    health = (
        "gpuwatchd_gpu_memory_", "gpuwatchd_gpu_xid", "gpuwatchd_gpu_ecc", "gpuwatchd_gpu_remap",
        "gpuwatchd_gpu_row_remap", "gpuwatchd_gpu_pcie", "gpuwatchd_gpu_nvlink",
        "gpuwatchd_gpu_fan", "gpuwatchd_gpu_process", "gpuwatchd_gpu_field",
        'gpuwatchd_scrape_collector_success{collector="gpu_health"}',
    )  # fmt: skip
    lines = [line for line in text.splitlines() if line.startswith(health)]
    return rows, lines


def _traffic(gpu: int) -> dict[str, Any]:
    """NVML's PCIe byte counter fields around 2 GiB copied each way: bytes, and wrapping?"""
    import torch

    pynvml.nvmlInit()
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(gpu)
        tx_field = _field(h, pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES)
        rx_field = _field(h, pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES)

        def counters() -> tuple[float, float]:
            return float(tx_field()), float(rx_field())

        host = torch.empty(256 * 2**20, dtype=torch.uint8).pin_memory()
        dev = torch.empty_like(host, device=f"cuda:{gpu}")
        torch.cuda.synchronize()
        tx0, rx0 = counters()
        for _ in range(8):
            dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        tx1, rx1 = counters()
        for _ in range(8):
            host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        tx2, rx2 = counters()
    finally:
        pynvml.nvmlShutdown()

    def delta(a: float, b: float) -> float:
        return b - a

    return {
        "moved_bytes_each_way": 8 * 256 * 2**20,
        "host_to_device": {"rx": delta(rx0, rx1), "tx": delta(tx0, tx1)},
        "device_to_host": {"rx": delta(rx1, rx2), "tx": delta(tx1, tx2)},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--traffic", action="store_true", help="check PCIe counters (torch)")
    args = parser.parse_args()
    pynvml.nvmlInit()
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(args.gpu)
        device = {
            "name": pynvml.nvmlDeviceGetName(h),
            "driver": pynvml.nvmlSystemGetDriverVersion(),
            "nvml_bindings": getattr(pynvml, "__version__", "?"),
        }
        rows = _rows(args.gpu, args.calls)
    finally:
        pynvml.nvmlShutdown()
    backend_rows, series = _backend_rows(args.gpu, args.calls)
    rows.extend(backend_rows)
    print(f"{device['name']}, driver {device['driver']}")
    for row in rows:
        cost = f"{row['us']:>10.2f} us" if row["supported"] else f"{'-':>13}"
        what = row.get("value") if row["supported"] else row["error"]
        print(f"{cost}  {row['call']}: {json.dumps(what)[:100]}")
    print("\nhealth series from one poll after one slow read:")
    print("\n".join(series))
    traffic = _traffic(args.gpu) if args.traffic else None
    if traffic is not None:
        print("\nPCIe counters around copies:", json.dumps(traffic))
    if args.json:
        doc = {"device": device, "rows": rows, "series": series, "traffic": traffic}
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
