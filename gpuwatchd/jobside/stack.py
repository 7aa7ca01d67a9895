"""The GPU and software stack a job runs on: what a recorded winner must match.

Read the same way the tuning worker reads them (device name, ``torch.version.cuda``,
``triton.__version__``, the NVML driver version), so a winner's recorded
:class:`~gpuwatchd.tuning.types.Versions` compare equal on the same host.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from gpuwatchd.tuning.types import Versions


@dataclass(frozen=True, slots=True)
class Stack:
    """One CUDA device of this job: its model name and UUID, and the versions in use."""

    gpu_model: str
    gpu_uuid: str | None
    versions: Versions


@functools.cache
def _driver_version() -> str | None:
    """The NVIDIA driver version via the NVML module; None without NVML (then it is not
    compared)."""
    from gpuwatchd.telemetry.nvml import driver_version

    return driver_version()


@functools.cache
def _device_stack(index: int) -> Stack:
    import torch

    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    return Stack(
        gpu_model=str(props.name),
        gpu_uuid=f"GPU-{uuid}" if uuid is not None else None,
        versions=Versions(
            driver=_driver_version(),
            cuda=torch.version.cuda,
            torch=torch.__version__,
            triton=triton_version,
        ),
    )


def current_stack(device: Any = None) -> Stack:
    """The stack of ``device`` (a torch device, or None for the current CUDA device)."""
    import torch

    index = getattr(device, "index", None)
    if index is None:
        index = torch.cuda.current_device()
    return _device_stack(int(index))
