"""``sim``: simulated GEMM kernels for the simulated GPU, with honest roofline physics.

A call's time at SM clock ``f`` is ``compute_s * f_max / f + memory_s``: the compute
part scales with the clock, the HBM part does not (memory clock is fixed), and the two
do not overlap. Running a kernel loads the simulated GPU with its own dynamic power,
so back-to-back runs hit the power cap and the clock falls: a kernel that spends more
of its time on memory and draws less power loses less to the cap.

The ``sim-gemm`` candidates mirror the H200 measurement in docs/design.md: a Triton-like
compute-bound tile config wins by ~1.6% at full clock, a cuBLAS-like kernel (more
efficient MMA, but it re-reads operands from HBM without overlapping them) wins by ~4%
under the power cap; three more configs lose in both regimes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpuwatchd.tuning.dtypes import DTYPES, ELEMENT_BYTES, canonical
from gpuwatchd.tuning.families import specs_for
from gpuwatchd.tuning.types import Workload
from gpuwatchd.tuning.worker.candidate import Candidate, CandidateError, DeviceSession

#: bytes per element of the dtypes a simulated GEMM accepts
#: H200 dense bf16 tensor-core peak at max clock, and HBM3e bandwidth
DEFAULT_PEAK_TFLOPS = 989.0
DEFAULT_HBM_TBPS = 4.8


#: The family this module implements (gpuwatchd/tuning/families/sim.py).
(FAMILY,) = specs_for(__name__)


@dataclass(frozen=True, slots=True)
class KernelSpec:
    """A simulated kernel config.

    ``efficiency``: achieved fraction of peak FLOP/s at max clock during its compute
    part; ``traffic``: HBM bytes moved as a multiple of the minimum (A, B, C once);
    ``dynamic_power_w``: power above idle at max clock and full utilisation.
    """

    name: str
    efficiency: float
    traffic: float
    dynamic_power_w: float
    about: str


#: Compute-bound at full clock, winner there; draws the matmul power of the trace.
TRITON_LIKE = KernelSpec("sim.tile-256x128-s4", 0.80, 1.0, 1329.0, "Triton-like, compute bound")
#: Efficient MMA but exposed HBM traffic and less power: the winner under the cap.
CUBLAS_LIKE = KernelSpec("sim.cublas-like", 0.928, 3.6, 1250.0, "cuBLAS-like, memory heavy")
SPECS: tuple[KernelSpec, ...] = (
    TRITON_LIKE,
    CUBLAS_LIKE,
    KernelSpec("sim.tile-64x64-s2", 0.70, 5.0, 1150.0, "small tiles: low reuse, slow"),
    KernelSpec("sim.split-k4", 0.74, 2.5, 1300.0, "split-k: extra reduction traffic"),
    KernelSpec("sim.simt-naive", 0.30, 8.0, 600.0, "no tensor cores"),
)


class SimKernel:
    """A simulated kernel: only a :class:`~gpuwatchd.tuning.worker.devices.SimSession` runs it."""

    family = "sim"

    def __init__(self, spec: KernelSpec, flops: float, min_bytes: float, peak: float, bw: float):
        self.name = spec.name
        self.spec = spec
        self.flops = flops
        self.compute_s = flops / (peak * spec.efficiency)  # at max clock
        self.memory_s = min_bytes * spec.traffic / bw
        self.dynamic_power_w = spec.dynamic_power_w

    def seconds_per_call(self, sm_clock_mhz: float, max_sm_clock_mhz: float) -> float:
        """Time of one call when the SMs run at ``sm_clock_mhz``."""
        if sm_clock_mhz <= 0:
            raise CandidateError(f"{self.name}: SM clock {sm_clock_mhz} MHz, cannot run")
        return self.compute_s * max_sm_clock_mhz / sm_clock_mhz + self.memory_s

    def setup(self) -> None:
        """Nothing to allocate; the spec itself is the only thing that can be wrong."""
        if not 0 < self.spec.efficiency <= 1 or self.spec.traffic < 1:
            raise CandidateError(f"{self.name}: efficiency must be in (0, 1], traffic >= 1")

    def run(self, calls: int) -> None:
        raise CandidateError(f"{self.name}: a simulated kernel runs only on a sim session")

    def meta(self) -> dict[str, Any]:
        return {
            "config": self.spec.name,
            "about": self.spec.about,
            "flops": self.flops,
            "compute_s_at_max_clock": self.compute_s,
            "memory_s": self.memory_s,
            "dynamic_power_w": self.dynamic_power_w,
        }

    def teardown(self) -> None:
        return None


def _positive(w: Workload, where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"workload {w.name}: {where} must be a positive number, got {value!r}")
    return float(value)


def sim_family(w: Workload, session: DeviceSession) -> list[Candidate]:
    """The simulated GEMM candidates for ``shape`` m, n, k.

    ``params`` may set ``peak_tflops`` and ``hbm_tbps`` of the simulated GPU at max
    clock (defaults: H200 bf16 dense, HBM3e).
    """
    FAMILY.require_op(w.name, w.op)
    m, n, k = (_positive(w, f"shape.{key}", w.shape.get(key)) for key in ("m", "n", "k"))
    esize = ELEMENT_BYTES.get(canonical(w.dtype) or "")
    if esize is None:
        known = ", ".join(sorted(DTYPES))
        raise ValueError(f"workload {w.name}: dtype {w.dtype!r} not supported (known: {known})")
    peak = _positive(w, "params.peak_tflops", w.params.get("peak_tflops", DEFAULT_PEAK_TFLOPS))
    bw = _positive(w, "params.hbm_tbps", w.params.get("hbm_tbps", DEFAULT_HBM_TBPS))
    flops = 2.0 * m * n * k
    min_bytes = float(esize) * (m * k + k * n + m * n)
    return [SimKernel(s, flops, min_bytes, peak * 1e12, bw * 1e12) for s in SPECS]
