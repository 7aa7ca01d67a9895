"""``torch.matmul`` family: cuBLAS and cuBLASLt through torch.matmul.

torch routes a plain GEMM to cuBLAS (cublasGemmEx) or cuBLASLt (cublasLtMatmul) as
``torch.backends.cuda.preferred_blas_library`` says; each candidate pins its library
around its own calls and restores the previous choice. The GEMM workload parsing and
the shared inputs live here too: the Triton family measures the same GEMM.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from gpuwatchd.tuning.families import FamilySpec, specs_for
from gpuwatchd.tuning.types import Workload
from gpuwatchd.tuning.winners import JOB_DEFAULT
from gpuwatchd.tuning.worker.candidate import CandidateError, DeviceSession
from gpuwatchd.tuning.worker.cuda_session import (
    canonical_dtype,
    first_line,
    fp32_precision,
    launched_kernels,
    relative_error,
    require_cuda_device,
)
from gpuwatchd.tuning.worker.families.base import CandidateBase
from gpuwatchd.tuning.worker.families.common import (
    bool_param,
    choices_param,
    float_tolerance,
    fp32_precision_label,
    positive_dims,
    seed_param,
)

if TYPE_CHECKING:
    import torch

(SPEC,) = specs_for(__name__)
FAMILY = SPEC.name
BLAS_LIBRARIES = ("cublas", "cublaslt")
_ELEM_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
#: Rows of C checked against a float64 reference: spread over M so every tile-row and
#: the ragged edge are hit, few enough that the float64 product stays cheap.
_CHECK_ROWS = 256


@dataclass(frozen=True, slots=True)
class GemmSpec:
    """C[m, n] = A[m, k] @ B[k, n], all row-major, in ``dtype``."""

    m: int
    n: int
    k: int
    dtype: str  # torch attribute name: bfloat16, float16, float32
    tf32: bool  # fp32 only: allow TF32 tensor cores
    seed: int

    @property
    def elem_bytes(self) -> int:
        return _ELEM_BYTES[self.dtype]

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k

    @property
    def bytes(self) -> int:
        """Compulsory traffic: read A and B once, write C once."""
        return (self.m * self.k + self.k * self.n + self.m * self.n) * self.elem_bytes

    @property
    def tolerance(self) -> float:
        """Largest relative Frobenius error accepted against the float64 reference."""
        return float_tolerance(self.dtype, self.tf32)

    def describe(self) -> dict[str, Any]:
        return {"m": self.m, "n": self.n, "k": self.k, "dtype": self.dtype}


def parse_gemm(workload: Workload, dtypes: tuple[str, ...], family: FamilySpec = SPEC) -> GemmSpec:
    """Validate a matmul workload for ``family``; ValueError naming the bad field."""
    where = f"workload {workload.name!r}"
    family.require_op(repr(workload.name), workload.op)
    dims = positive_dims(workload, ("m", "n", "k"), where)
    dtype = canonical_dtype(workload.dtype, dtypes, where)
    tf32 = bool_param(workload, "tf32", where)
    seed = seed_param(workload, where)
    return GemmSpec(dims["m"], dims["n"], dims["k"], dtype, tf32, seed)


class _SampledSpec(Protocol):
    """What :class:`SharedGemmOperands` needs of a GEMM spec."""

    @property
    def m(self) -> int: ...

    @property
    def tolerance(self) -> float: ...

    def describe(self) -> dict[str, Any]: ...


S = TypeVar("S", bound=_SampledSpec)


class SharedGemmOperands(Generic[S]):
    """Inputs, output and reference rows shared by one family's candidates.

    Allocated at the first ``acquire`` and freed when the last holder releases, so a
    family of a dozen candidates holds one copy of an 8192^3 GEMM's operands.
    """

    def __init__(self, spec: S, device: torch.device) -> None:
        self.spec = spec
        self.device = device
        self._holders = 0
        self.a: Any = None
        self.b: Any = None
        self.c: Any = None
        self._rows: Any = None
        self._ref: Any = None

    def acquire(self) -> None:
        if self._holders == 0:
            self.a, self.b, self.c = self._allocate()
        self._holders += 1

    def release(self) -> None:
        self._holders = max(0, self._holders - 1)
        if self._holders == 0:
            self.a = self.b = self.c = self._rows = self._ref = None

    def check(self, name: str) -> float:
        """Relative error of the sampled rows of C; CandidateError when over tolerance."""
        import torch

        s = self.spec
        a, b, c = self._checked_matrices()
        if self._ref is None:
            rows = torch.linspace(0, s.m - 1, min(s.m, _CHECK_ROWS), device=self.device)
            self._rows = rows.round().long().unique()
            self._ref = a[self._rows].double() @ b.double()
        err = relative_error(c[self._rows], self._ref)
        if not err <= s.tolerance:
            raise CandidateError(
                f"{name}: wrong result, relative error {err:.3g} over {s.tolerance:g} "
                f"against a float64 reference"
            )
        return err

    def clear_output(self) -> None:
        """Poison C with NaN so a candidate that writes nothing cannot pass the check."""
        self.c.fill_(math.nan)

    def multiply(self) -> None:
        """One C = A @ B on the current stream."""
        raise NotImplementedError

    def _allocate(self) -> tuple[Any, Any, Any]:
        """A, B and C, made from ``spec.seed``."""
        raise NotImplementedError

    def _checked_matrices(self) -> tuple[Any, Any, Any]:
        """The 2-D A, B and C whose sampled rows :meth:`check` compares."""
        return self.a, self.b, self.c


class GemmData(SharedGemmOperands[GemmSpec]):
    """Row-major A and B, and C, for :class:`GemmSpec`."""

    def _allocate(self) -> tuple[Any, Any, Any]:
        import torch

        s = self.spec
        dt = getattr(torch, s.dtype)
        g = torch.Generator(device=self.device).manual_seed(s.seed)
        a = torch.randn(s.m, s.k, dtype=dt, device=self.device, generator=g)
        b = torch.randn(s.k, s.n, dtype=dt, device=self.device, generator=g)
        c = torch.empty(s.m, s.n, dtype=dt, device=self.device)
        return a, b, c

    def multiply(self) -> None:
        import torch

        torch.matmul(self.a, self.b, out=self.c)


class BlasGemm(CandidateBase):
    """The shared GEMM with one BLAS library pinned around its calls."""

    def __init__(self, library: str, data: SharedGemmOperands[Any]) -> None:
        super().__init__(library)
        self.library = library
        self._data = data
        self._held = False

    def _setup(self) -> None:
        """Take the shared inputs, warm up, check against float64, read the kernel."""
        import torch

        self._data.acquire()
        self._held = True
        try:
            self._data.clear_output()
            t0 = time.perf_counter()
            self.run(1)
            torch.cuda.synchronize(self._data.device)
            first_call_s = time.perf_counter() - t0
            err = self._data.check(self.name)
            kernels = launched_kernels(lambda: self.run(1))
        except CandidateError:
            raise
        except RuntimeError as e:
            raise CandidateError(f"{self.name}: {type(e).__name__}: {first_line(e)}") from e
        s = self._data.spec
        self._meta = {
            "library": self.library,
            "kernels": kernels,
            # library kernel names encode tile, layout and precision: same names, same code
            "kernels_identify_code": True,
            "shape": s.describe(),
            "flops": s.flops,
            "bytes": s.bytes,
            "working_set_bytes": s.bytes,
            "rel_error": err,
            "first_call_s": first_call_s,
            "fp32_precision": fp32_precision_label(s.dtype, s.tf32),
            JOB_DEFAULT: self.library == default_library(),
            **self._more_meta(),
        }

    def _more_meta(self) -> dict[str, Any]:
        """Facts this family adds to the shared ones."""
        return {}

    def run(self, calls: int) -> None:
        d = self._data
        if not self._held:
            raise CandidateError(f"{self.name}: run before setup")
        with _pinned_blas(self.library), fp32_precision("matmul", d.spec.tf32):
            for _ in range(calls):
                d.multiply()

    def teardown(self) -> None:
        if self._held:
            self._held = False
            self._data.release()


class TorchMatmul(BlasGemm):
    """torch.matmul(A, B, out=C) with one BLAS library pinned."""

    family = FAMILY

    def _more_meta(self) -> dict[str, Any]:
        import torch

        return {
            "bf16_reduced_precision_reduction": bool(
                torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
            ),
        }


@contextmanager
def _pinned_blas(library: str) -> Iterator[None]:
    """Pin torch's preferred BLAS library for the calls inside, then restore it."""
    import torch

    pick = torch.backends.cuda.preferred_blas_library
    prev = pick()
    pick(library)
    try:
        yield
    finally:
        pick(prev)


def default_library() -> str:
    """The library torch prefers in a process that never chose one (``cublas`` unless
    ``TORCH_BLAS_PREFER_CUBLASLT`` says otherwise): what a job runs without gpuwatchd."""
    import torch

    pick = getattr(torch.backends.cuda, "preferred_blas_library", None)
    return "cublas" if pick is None else str(pick().name).lower()


def available_libraries() -> tuple[str, ...]:
    """The BLAS libraries this torch can be told to prefer (empty: no switch at all)."""
    import torch

    if not hasattr(torch.backends.cuda, "preferred_blas_library"):
        return ("cublas",)
    if torch.version.hip is not None:
        return ()
    return BLAS_LIBRARIES


def build(workload: Workload, session: DeviceSession) -> list[TorchMatmul]:
    """One candidate per BLAS library (``params.blas`` narrows the list)."""
    spec = parse_gemm(workload, ("bfloat16", "float16", "float32"))
    wanted = choices_param(workload, "blas", BLAS_LIBRARIES)
    device = require_cuda_device(session, FAMILY)
    have = available_libraries()
    libs = [lib for lib in wanted if lib in have]
    if not libs:
        raise CandidateError(f"{FAMILY}: this torch offers none of {list(wanted)} (has {have})")
    data = GemmData(spec, device)
    return [TorchMatmul(lib, data) for lib in libs]
