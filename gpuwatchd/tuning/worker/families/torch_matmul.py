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
from typing import TYPE_CHECKING, Any

from gpuwatchd.tuning.types import Workload
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

if TYPE_CHECKING:
    import torch

FAMILY = "torch.matmul"
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
        if self.dtype == "float32":
            return 1e-2 if self.tf32 else 1e-4
        return 1e-2 if self.dtype == "float16" else 2e-2

    def describe(self) -> dict[str, Any]:
        return {"m": self.m, "n": self.n, "k": self.k, "dtype": self.dtype}


def parse_gemm(workload: Workload, dtypes: tuple[str, ...]) -> GemmSpec:
    """Validate a matmul workload; ValueError naming the bad field."""
    where = f"workload {workload.name!r}"
    if workload.op != "matmul":
        raise ValueError(f"{where}: op must be 'matmul' for a GEMM family, got {workload.op!r}")
    dims = {}
    for key in ("m", "n", "k"):
        v = workload.shape.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{where}: shape.{key} must be a positive integer, got {v!r}")
        dims[key] = v
    dtype = canonical_dtype(workload.dtype, dtypes, where)
    tf32 = workload.params.get("tf32", False)
    if not isinstance(tf32, bool):
        raise ValueError(f"{where}: params.tf32 must be true or false, got {tf32!r}")
    seed = workload.params.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"{where}: params.seed must be an integer, got {seed!r}")
    return GemmSpec(dims["m"], dims["n"], dims["k"], dtype, tf32, seed)


class GemmData:
    """Inputs, output and reference rows shared by one family's candidates.

    Allocated at the first ``acquire`` and freed when the last holder releases, so a
    family of a dozen candidates holds one copy of an 8192^3 GEMM's operands.
    """

    def __init__(self, spec: GemmSpec, device: torch.device) -> None:
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
            import torch

            s = self.spec
            dt = getattr(torch, s.dtype)
            g = torch.Generator(device=self.device).manual_seed(s.seed)
            self.a = torch.randn(s.m, s.k, dtype=dt, device=self.device, generator=g)
            self.b = torch.randn(s.k, s.n, dtype=dt, device=self.device, generator=g)
            self.c = torch.empty(s.m, s.n, dtype=dt, device=self.device)
        self._holders += 1

    def release(self) -> None:
        self._holders = max(0, self._holders - 1)
        if self._holders == 0:
            self.a = self.b = self.c = self._rows = self._ref = None

    def check(self, name: str) -> float:
        """Relative error of the sampled rows of C; CandidateError when over tolerance."""
        import torch

        s = self.spec
        if self._ref is None:
            rows = torch.linspace(0, s.m - 1, min(s.m, _CHECK_ROWS), device=self.device)
            self._rows = rows.round().long().unique()
            self._ref = self.a[self._rows].double() @ self.b.double()
        err = relative_error(self.c[self._rows], self._ref)
        if not err <= s.tolerance:
            raise CandidateError(
                f"{name}: wrong result, relative error {err:.3g} over {s.tolerance:g} "
                f"against a float64 reference"
            )
        return err

    def clear_output(self) -> None:
        """Poison C with NaN so a candidate that writes nothing cannot pass the check."""
        self.c.fill_(math.nan)


class TorchMatmul(CandidateBase):
    """torch.matmul(A, B, out=C) with one BLAS library pinned."""

    family = FAMILY

    def __init__(self, library: str, data: GemmData) -> None:
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
            "fp32_precision": ("tf32" if s.tf32 else "ieee") if s.dtype == "float32" else None,
            "bf16_reduced_precision_reduction": bool(
                torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
            ),
        }

    def run(self, calls: int) -> None:
        import torch

        d = self._data
        if not self._held:
            raise CandidateError(f"{self.name}: run before setup")
        with _pinned_blas(self.library), fp32_precision("matmul", d.spec.tf32):
            for _ in range(calls):
                torch.matmul(d.a, d.b, out=d.c)

    def teardown(self) -> None:
        if self._held:
            self._held = False
            self._data.release()


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
    wanted = workload.params.get("blas", list(BLAS_LIBRARIES))
    if not isinstance(wanted, list | tuple) or not wanted:
        raise ValueError(
            f"workload {workload.name!r}: params.blas must be a non-empty list, got {wanted!r}"
        )
    for lib in wanted:
        if lib not in BLAS_LIBRARIES:
            raise ValueError(
                f"workload {workload.name!r}: params.blas entries must be one of "
                f"{', '.join(BLAS_LIBRARIES)}, got {lib!r}"
            )
    device = require_cuda_device(session, FAMILY)
    have = available_libraries()
    libs = [lib for lib in dict.fromkeys(wanted) if lib in have]
    if not libs:
        raise CandidateError(f"{FAMILY}: this torch offers none of {list(wanted)} (has {have})")
    data = GemmData(spec, device)
    return [TorchMatmul(lib, data) for lib in libs]
