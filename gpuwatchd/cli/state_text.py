"""A GPU's read health and the tuner's state in words: shared by ``gpuwatchd status``'s
one-shot table and its ``--watch`` view."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the parser is built without importing the API modules
    from gpuwatchd.api.gpu_state import GpuState
    from gpuwatchd.api.state import TuningSection


def gpu_health(gpu: GpuState) -> str:
    """``LOST``, ``STALLED`` or ``FAILING`` when the daemon's reads of the GPU are not
    fine, else ``""``: shown beside the gate state."""
    if gpu.lost:
        return "LOST"
    if gpu.stalled:
        return "STALLED"
    if not gpu.poll_ok:
        return "FAILING"
    return ""


def tuning_line(tuning: TuningSection) -> str:
    """One line: tuning off, idle, or where it runs and what waits."""
    if not tuning.enabled:
        return "tuning: disabled"
    parts = []
    if not tuning.ready:
        parts.append(f"worker not ready ({tuning.ready_reason or '?'})")
    if tuning.running_gpus:
        parts.append("running on GPU " + ", ".join(str(g) for g in tuning.running_gpus))
    for gpu, names in sorted(tuning.pending.items()):
        parts.append(f"GPU {gpu} waiting: {', '.join(names)}")
    return "tuning: " + ("; ".join(parts) if parts else "idle, nothing pending")
