"""Read-only MIG devices of a GPU in MIG mode, through NVML's MIG handles.

:class:`~gpuwatchd.telemetry.nvml.NvmlBackend` reads them on the slow path, as one slow
field (``mig``): ``nvmlDeviceGetMigMode`` first; a GPU without MIG answers NotSupported
and is never asked again; MIG mode off reads as None. In MIG mode, every slot up to
``nvmlDeviceGetMaxMigDeviceCount`` is asked for its handle (an empty slot answers
NotFound and is skipped, never taken for a lost GPU), and each MIG device for its
GPU and compute instance ids, UUID, profile (from its name), memory and utilization;
a value NVML does not give for a MIG device (utilization, on most drivers) is None.
Nothing here changes MIG mode or any instance: only getters are bound.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpuwatchd.telemetry.types import MigDevice

#: The slow field's key (its unsupported/failed bookkeeping, like the other slow fields).
MIG = "mig"
#: ``nvmlDeviceGetMigMode``'s "enabled" value (NVML_DEVICE_MIG_ENABLE).
_MIG_ENABLE = 1


def profile_of(name: str) -> str:
    """``NVIDIA H200 MIG 1g.18gb`` -> ``1g.18gb`` (the whole name if it has no ``MIG``)."""
    head, sep, tail = name.rpartition(" MIG ")
    return tail.strip() if sep and head else name.strip()


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class MigReader:
    """``reader(handle)`` -> the GPU's MIG devices, or None while MIG mode is off.

    ``fn(name)`` returns the bound pynvml function (one that raises FunctionNotFound
    where the bindings lack it); ``errors`` are NVML's exception classes.
    """

    def __init__(
        self, fn: Callable[[str], Callable[..., Any]], errors: tuple[type[BaseException], ...]
    ) -> None:
        self._mode = fn("nvmlDeviceGetMigMode")
        self._count = fn("nvmlDeviceGetMaxMigDeviceCount")
        self._by_index = fn("nvmlDeviceGetMigDeviceHandleByIndex")
        self._gi = fn("nvmlDeviceGetGpuInstanceId")
        self._ci = fn("nvmlDeviceGetComputeInstanceId")
        self._uuid = fn("nvmlDeviceGetUUID")
        self._name = fn("nvmlDeviceGetName")
        self._memory = fn("nvmlDeviceGetMemoryInfo")
        self._util = fn("nvmlDeviceGetUtilizationRates")
        self._errors = errors

    def __call__(self, handle: Any) -> tuple[MigDevice, ...] | None:
        current, _pending = self._mode(handle)  # raises NotSupported on a GPU without MIG
        if current != _MIG_ENABLE:
            return None
        out = []
        for slot in range(int(self._count(handle))):
            try:
                mig = self._by_index(handle, slot)
            except self._errors:  # an empty slot: NotFound
                continue
            device = self._device(mig)
            if device is not None:
                out.append(device)
        return tuple(sorted(out, key=lambda d: (d.gpu_instance_id, d.compute_instance_id)))

    def _device(self, mig: Any) -> MigDevice | None:
        try:
            uuid = _text(self._uuid(mig))
            gi, ci = int(self._gi(mig)), int(self._ci(mig))
        except self._errors:  # destroyed between the two calls
            return None
        name = self._get(self._name, mig)
        memory = self._get(self._memory, mig)
        util = self._get(self._util, mig)
        return MigDevice(
            uuid=uuid,
            gpu_instance_id=gi,
            compute_instance_id=ci,
            profile=profile_of(_text(name)) if name is not None else "",
            memory_used_bytes=None if memory is None else int(memory.used),
            memory_total_bytes=None if memory is None else int(memory.total),
            util_gpu=None if util is None else float(util.gpu) / 100.0,
        )

    def _get(self, call: Callable[[Any], Any], mig: Any) -> Any:
        try:
            return call(mig)
        except self._errors:
            return None
