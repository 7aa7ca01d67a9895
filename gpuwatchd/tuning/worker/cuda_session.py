"""The worker's handle on one CUDA GPU, and the CUDA plumbing the GPU families share.

Runs in the tuning worker only: torch is imported inside functions, so importing this
module stays cheap and torch-free (the daemon may import it to read names).

Device identity. The daemon names GPUs by their telemetry (NVML) index. CUDA numbers the
same GPUs differently whenever ``CUDA_VISIBLE_DEVICES`` is set or ``CUDA_DEVICE_ORDER``
is not ``PCI_BUS_ID`` (CUDA's default order is "fastest first"), so the NVML index is
never used as a CUDA ordinal: :class:`CudaSession` finds the CUDA device whose UUID
(else PCI address) matches the telemetry's :class:`DeviceInfo`.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpuwatchd.telemetry.types import DeviceInfo, Sample, normalize_uuid
from gpuwatchd.tuning.dtypes import canonical
from gpuwatchd.tuning.worker.candidate import Candidate

if TYPE_CHECKING:
    import torch

    from gpuwatchd.telemetry.backend import Backend

#: Used only when torch cannot tell the L2 size: larger than any current GPU's L2.
_FALLBACK_L2_BYTES = 256 * 2**20
#: Used only when neither telemetry nor torch gives the SM clock.
_FALLBACK_SM_CLOCK_HZ = 2.0e9


@dataclass(frozen=True, slots=True)
class CudaIdentity:
    """What CUDA says about one visible device: enough to match it to an NVML device."""

    ordinal: int
    uuid: str | None
    pci: tuple[int, int, int] | None  # (domain, bus, device)


_PCI_RE = re.compile(
    r"^(?:(?P<domain>[0-9a-fA-F]+):)?(?P<bus>[0-9a-fA-F]+):(?P<dev>[0-9a-fA-F]+)(?:\.[0-7])?$"
)


def parse_pci_bus_id(bus_id: str) -> tuple[int, int, int]:
    """``00000000:1B:00.0`` -> (0, 0x1B, 0). Raise ValueError on anything else."""
    m = _PCI_RE.match(bus_id.strip())
    if m is None:
        raise ValueError(f"pci_bus_id: not a PCI address like 00000000:1B:00.0, got {bus_id!r}")
    return (int(m["domain"] or "0", 16), int(m["bus"], 16), int(m["dev"], 16))


def match_cuda_device(target: DeviceInfo, visible: Sequence[CudaIdentity]) -> int:
    """The CUDA ordinal of the GPU that telemetry calls ``target``.

    UUID first (unique per GPU and per MIG instance); the PCI address only when no UUID
    is known on one side, and only if exactly one visible device has it.
    """
    want = normalize_uuid(target.uuid) if target.uuid else None
    if want:
        for ident in visible:
            if ident.uuid and normalize_uuid(ident.uuid) == want:
                return ident.ordinal
    if target.pci_bus_id:
        pci = parse_pci_bus_id(target.pci_bus_id)
        hits = [i.ordinal for i in visible if i.pci == pci]
        if len(hits) == 1 and not (want and all(i.uuid for i in visible)):
            return hits[0]
    seen = ", ".join(f"cuda:{i.ordinal}={i.uuid or '?'}" for i in visible) or "none"
    raise RuntimeError(
        f"GPU {target.index} (uuid {target.uuid}, pci {target.pci_bus_id}) is not visible to "
        f"CUDA in this process (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}; "
        f"visible: {seen})"
    )


def _torch() -> Any:
    import torch

    return torch


def cuda_identities() -> list[CudaIdentity]:
    """UUID and PCI address of every CUDA device this process can see."""
    torch = _torch()
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        uuid = getattr(p, "uuid", None)
        bus = getattr(p, "pci_bus_id", None)
        pci = None
        if bus is not None:
            pci = (int(getattr(p, "pci_domain_id", 0)), int(bus), int(p.pci_device_id))
        out.append(CudaIdentity(i, str(uuid) if uuid is not None else None, pci))
    return out


class CudaSession:
    """:class:`DeviceSession` on one CUDA GPU: CUDA-event timing, L2 flush, NVML samples.

    ``gpu_index`` is the telemetry backend's index for the GPU (the daemon's name for it);
    the CUDA ordinal is found by UUID/PCI address, or given as ``cuda_device``. With no
    telemetry, ``gpu_index`` is the CUDA ordinal and samples carry only a timestamp.

    ``launch_cover_s``: before each timed batch a GPU sleep kernel of about this long is
    queued, so the start event fires after the CPU has already queued the first calls and
    the batch time holds no launch latency (nvbench's blocking-kernel idea). 0 disables.
    """

    def __init__(
        self,
        gpu_index: int,
        telemetry: Backend | None,
        *,
        cuda_device: int | None = None,
        launch_cover_s: float = 2e-4,
    ) -> None:
        torch = _torch()
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"CUDA is not available in this process (torch {torch.__version__}, "
                f"CUDA build {torch.version.cuda})"
            )
        if not launch_cover_s >= 0:
            raise ValueError(f"launch_cover_s must be >= 0, got {launch_cover_s!r}")
        self.gpu_index = gpu_index
        self._telemetry = telemetry
        if telemetry is not None:
            self.info: DeviceInfo = telemetry.device_info(gpu_index)
            ordinal = cuda_device if cuda_device is not None else None
            if ordinal is None:
                ordinal = match_cuda_device(self.info, cuda_identities())
        else:
            ordinal = gpu_index if cuda_device is None else cuda_device
            self.info = info_from_torch(ordinal)
        count = torch.cuda.device_count()
        if not 0 <= ordinal < count:
            raise ValueError(f"cuda_device: {ordinal} is not a CUDA device here (count {count})")
        torch.cuda.set_device(ordinal)
        self.cuda_device: int = ordinal
        self.device: Any = torch.device("cuda", ordinal)  # torch is imported lazily
        props = torch.cuda.get_device_properties(ordinal)
        self.l2_bytes: int = int(getattr(props, "L2_cache_size", 0) or _FALLBACK_L2_BYTES)
        self._scratch: Any = None  # a torch.Tensor once flush_l2 first runs
        self._start = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)
        clock_hz = _FALLBACK_SM_CLOCK_HZ
        if self.info.max_sm_clock_mhz:
            clock_hz = self.info.max_sm_clock_mhz * 1e6
        elif getattr(props, "clock_rate", 0):
            clock_hz = props.clock_rate * 1e3  # kHz
        has_sleep = hasattr(torch.cuda, "_sleep")
        self._cover_cycles = int(launch_cover_s * clock_hz) if has_sleep else 0

    # -- DeviceSession ----------------------------------------------------------------

    def sample(self) -> Sample:
        if self._telemetry is None:
            return Sample(gpu=self.gpu_index, t=self.now())
        return self._telemetry.read(self.gpu_index)

    def time_batch(self, candidate: Candidate, calls: int) -> float:
        """Device seconds for ``calls`` back-to-back calls, between two CUDA events.

        Synchronizes first (earlier work, an L2 flush, must not bleed in) and after; a
        CUDA error raised by the batch propagates: the context may be poisoned, so the
        worker must not go on timing.
        """
        if calls < 1:
            raise ValueError(f"calls must be >= 1, got {calls}")
        torch = _torch()
        torch.cuda.synchronize(self.device)
        stream = torch.cuda.current_stream(self.device)
        if self._cover_cycles:
            torch.cuda._sleep(self._cover_cycles)
        self._start.record(stream)
        candidate.run(calls)
        self._end.record(stream)
        self._end.synchronize()
        torch.cuda.synchronize(self.device)  # surfaces asynchronous errors of the batch
        ms = self._start.elapsed_time(self._end)
        if not (math.isfinite(ms) and ms > 0):
            raise RuntimeError(f"CUDA events gave a bad time for {candidate.name}: {ms!r} ms")
        return ms / 1e3

    def flush_l2(self) -> None:
        """Write a buffer twice the L2 size so the next call starts with a cold cache."""
        torch = _torch()
        if self._scratch is None:
            self._scratch = torch.empty(
                2 * self.l2_bytes // 4, dtype=torch.int32, device=self.device
            )
        self._scratch.zero_()

    def pause(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)

    def now(self) -> float:
        return time.monotonic()

    # -- extras -----------------------------------------------------------------------

    def software(self) -> dict[str, str | None]:
        """Versions a stored result depends on: torch, CUDA, cuDNN, Triton."""
        torch = _torch()
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        try:
            import triton

            triton_version: str | None = triton.__version__
        except ImportError:
            triton_version = None
        return {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cudnn": str(cudnn) if cudnn is not None else None,
            "triton": triton_version,
        }

    def close(self) -> None:
        self._scratch = None


def info_from_torch(ordinal: int) -> DeviceInfo:
    """Static facts from CUDA alone, for a session without telemetry."""
    torch = _torch()
    p = torch.cuda.get_device_properties(ordinal)
    uuid = getattr(p, "uuid", None)
    return DeviceInfo(
        index=ordinal,
        uuid=f"GPU-{uuid}" if uuid is not None else f"cuda:{ordinal}",
        name=p.name,
        memory_total_bytes=int(p.total_memory),
        cuda_capability=f"{p.major}.{p.minor}",
    )


# -- helpers shared by the GPU candidate families --------------------------------------


def canonical_dtype(name: str, allowed: Sequence[str], where: str) -> str:
    """``bf16`` -> ``bfloat16``; ValueError naming ``where`` for anything not allowed."""
    canon = canonical(name)
    if canon is None or canon not in allowed:
        raise ValueError(f"{where}: dtype must be one of {', '.join(allowed)}, got {name!r}")
    return canon


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ||out - ref|| / ||ref||, computed in float64."""
    o = out.double()
    r = ref.double()
    den = float(r.norm())
    num = float((o - r).norm())
    if not math.isfinite(num):
        return math.inf
    return num / den if den > 0 else num


@contextmanager
def fp32_precision(op: str, tf32: bool) -> Iterator[str]:
    """Hold the fp32 math mode of ``op`` ("conv" for cuDNN conv, "matmul" for cuBLAS).

    Uses torch's per-op ``fp32_precision`` API where it exists (torch >= 2.9, where mixing
    it with the legacy ``allow_tf32`` flags is an error), else the legacy flag. Restores
    the previous value. Yields the mode in force: "tf32" or "ieee".
    """
    torch = _torch()
    if op not in ("conv", "matmul"):
        raise ValueError(f"op must be 'conv' or 'matmul', got {op!r}")
    if op == "conv":
        node = getattr(torch.backends.cudnn, "conv", None)
    else:
        node = torch.backends.cuda.matmul
    mode = "tf32" if tf32 else "ieee"
    if node is not None and hasattr(node, "fp32_precision"):
        prev = node.fp32_precision
        node.fp32_precision = mode
        try:
            yield mode
        finally:
            node.fp32_precision = prev
        return
    legacy = torch.backends.cudnn if op == "conv" else torch.backends.cuda.matmul
    prev_flag = legacy.allow_tf32
    legacy.allow_tf32 = tf32
    try:
        yield mode
    finally:
        legacy.allow_tf32 = prev_flag


@dataclass(frozen=True, slots=True)
class KernelLaunch:
    """One distinct GPU kernel launch as the profiler saw it: the name and its launch shape.

    Two calls that launch the same names with the same grid and block ran the same code
    the same way; names alone can hide a different split or tiling of one kernel.
    """

    name: str
    grid: tuple[int, ...]
    block: tuple[int, ...]

    def describe(self) -> str:
        grid = "x".join(map(str, self.grid)) or "?"
        block = "x".join(map(str, self.block)) or "?"
        return f"{self.name} <<<{grid}, {block}>>>"


def launched_kernels(fn: Callable[[], None]) -> list[str]:
    """Names of the GPU kernels ``fn`` launches, in first-launch order, read with torch.profiler.

    Copies and memsets are left out. ``fn`` should run one call after warm-up so that
    what is seen is the steady-state choice (not a one-time autotuning sweep).
    """
    names: list[str] = []
    for k in kernel_launches(fn):
        if k.name not in names:
            names.append(k.name)
    return names


def kernel_launches(fn: Callable[[], None], distinct: bool = True) -> list[KernelLaunch]:
    """The kernel launches (name, grid, block) of ``fn`` by start time, each distinct one
    once (``distinct``) or every launch. Copies and memsets are left out."""
    torch = _torch()
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():
        # torch 2.11 warns on every profile() that events are cleared per cycle: expected.
        warnings.filterwarnings("ignore", ".*Profiler clears events", UserWarning)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory(prefix="gpuwatchd-prof-") as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as f:
            trace = json.load(f)
    return kernel_launches_in(trace, distinct)


def kernel_launches_in(trace: Any, distinct: bool = True) -> list[KernelLaunch]:
    """The kernel launches of a chrome trace (``export_chrome_trace``) by start time, each
    distinct one once (``distinct``) or every launch."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    if not isinstance(events, list):
        return []
    kernels = [e for e in events if isinstance(e, dict) and e.get("cat") == "kernel"]
    kernels.sort(key=lambda e: float(e.get("ts", 0)))
    out: list[KernelLaunch] = []
    for e in kernels:
        name = str(e.get("name", ""))
        args = e.get("args")
        args = args if isinstance(args, dict) else {}
        launch = KernelLaunch(name, _dims(args.get("grid")), _dims(args.get("block")))
        if name and not (distinct and launch in out):
            out.append(launch)
    return out


def _dims(value: Any) -> tuple[int, ...]:
    """A trace's ``[x, y, z]`` launch dimension; () when absent or malformed."""
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return tuple(value)
    return ()


def first_line(e: BaseException) -> str:
    """An exception as one line: CUDA and Triton errors run to pages."""
    text = str(e).strip()
    return text.splitlines()[0].strip() if text else type(e).__name__


def require_cuda_device(session: object, family: str) -> torch.device:
    """The torch CUDA device of ``session``, or CandidateError when it has none."""
    from gpuwatchd.tuning.worker.candidate import CandidateError

    device = getattr(session, "device", None)
    if getattr(device, "type", None) != "cuda":
        raise CandidateError(f"{family} needs a CUDA device session, got {type(session).__name__}")
    return device  # type: ignore[return-value]
