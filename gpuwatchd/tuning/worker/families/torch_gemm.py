"""``torch.gemm`` family: cuBLAS vs cuBLASLt for a GEMM as a model calls it.

``torch.matmul`` times a plain row-major GEMM. A model's GEMMs are often not that: an
``nn.Linear`` multiplies by its weight transposed (layout ``nt``), its backward pass
by transposed activations (``tn``), attention runs batched GEMMs (``bmm``). The BLAS
kernels picked differ per layout and batch, so this family builds the operands exactly
so: ``params.layout`` is two letters, one per operand, ``n`` for row-major and ``t`` for
a transposed (column-major) view; op ``bmm`` with ``shape.batch`` adds the batch.

Candidates are the libraries a job can choose (``torch.backends.cuda.
preferred_blas_library``), named as in ``torch.matmul`` (``cublas``, ``cublaslt``), so
:func:`gpuwatchd.torch.apply_winners` reads both families' winners alike.
"""

from __future__ import annotations

import math
import time
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
from gpuwatchd.tuning.worker.families.torch_matmul import (
    BLAS_LIBRARIES,
    _pinned_blas,
    available_libraries,
)

if TYPE_CHECKING:
    import torch

FAMILY = "torch.gemm"
LAYOUTS = ("nn", "nt", "tn", "tt")
_ELEM_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
#: Rows of C (of the first batch) checked against a float64 reference.
_CHECK_ROWS = 256


@dataclass(frozen=True, slots=True)
class StridedGemmSpec:
    """C[batch, m, n] = op(A) @ op(B) with each operand row-major or transposed."""

    batch: int  # 1 and op "matmul": plain 2-D operands
    m: int
    n: int
    k: int
    layout: str
    dtype: str
    tf32: bool
    seed: int

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.n * self.k

    @property
    def bytes(self) -> int:
        elems = self.batch * (self.m * self.k + self.k * self.n + self.m * self.n)
        return elems * _ELEM_BYTES[self.dtype]

    @property
    def tolerance(self) -> float:
        if self.dtype == "float32":
            return 1e-2 if self.tf32 else 1e-4
        return 1e-2 if self.dtype == "float16" else 2e-2

    def describe(self) -> dict[str, Any]:
        return {
            "batch": self.batch,
            "m": self.m,
            "n": self.n,
            "k": self.k,
            "layout": self.layout,
            "dtype": self.dtype,
        }


def parse_strided_gemm(workload: Workload) -> StridedGemmSpec:
    """Validate a ``matmul`` or ``bmm`` workload with ``params.layout``; ValueError."""
    where = f"workload {workload.name!r}"
    if workload.op not in ("matmul", "bmm"):
        raise ValueError(f"{where}: op must be 'matmul' or 'bmm' for {FAMILY}, got {workload.op!r}")
    keys = ("batch", "m", "n", "k") if workload.op == "bmm" else ("m", "n", "k")
    dims = {"batch": 1}
    for key in keys:
        v = workload.shape.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{where}: shape.{key} must be a positive integer, got {v!r}")
        dims[key] = v
    layout = workload.params.get("layout", "nn")
    if layout not in LAYOUTS:
        raise ValueError(
            f"{where}: params.layout must be one of {', '.join(LAYOUTS)}, got {layout!r}"
        )
    dtype = canonical_dtype(workload.dtype, tuple(_ELEM_BYTES), where)
    tf32 = workload.params.get("tf32", False)
    if not isinstance(tf32, bool):
        raise ValueError(f"{where}: params.tf32 must be true or false, got {tf32!r}")
    seed = workload.params.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"{where}: params.seed must be an integer, got {seed!r}")
    return StridedGemmSpec(
        dims["batch"], dims["m"], dims["n"], dims["k"], str(layout), dtype, tf32, seed
    )


class StridedGemmData:
    """Operands in the workload's layout, output and reference rows, shared by candidates."""

    def __init__(self, spec: StridedGemmSpec, device: torch.device) -> None:
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
            self.a = _operand(s.batch, s.m, s.k, s.layout[0], dt, self.device, g)
            self.b = _operand(s.batch, s.k, s.n, s.layout[1], dt, self.device, g)
            self.c = torch.empty(s.batch, s.m, s.n, dtype=dt, device=self.device)
            if s.batch == 1:
                self.a, self.b, self.c = self.a[0], self.b[0], self.c[0]
        self._holders += 1

    def release(self) -> None:
        self._holders = max(0, self._holders - 1)
        if self._holders == 0:
            self.a = self.b = self.c = self._rows = self._ref = None

    def multiply(self) -> None:
        import torch

        if self.spec.batch == 1:
            torch.mm(self.a, self.b, out=self.c)
        else:
            torch.bmm(self.a, self.b, out=self.c)

    def check(self, name: str) -> float:
        """Sampled rows of C (first batch) against float64; CandidateError over tolerance."""
        import torch

        s = self.spec
        a = self.a if s.batch == 1 else self.a[0]
        b = self.b if s.batch == 1 else self.b[0]
        c = self.c if s.batch == 1 else self.c[0]
        if self._ref is None:
            rows = torch.linspace(0, s.m - 1, min(s.m, _CHECK_ROWS), device=self.device)
            self._rows = rows.round().long().unique()
            self._ref = a[self._rows].double() @ b.double()
        err = relative_error(c[self._rows], self._ref)
        if not err <= s.tolerance:
            raise CandidateError(
                f"{name}: wrong result, relative error {err:.3g} over {s.tolerance:g} "
                "against a float64 reference"
            )
        return err

    def clear_output(self) -> None:
        self.c.fill_(math.nan)


def _operand(batch: int, rows: int, cols: int, layout: str, dt: Any, device: Any, g: Any) -> Any:
    """A (batch, rows, cols) operand, row-major (``n``) or a transposed view (``t``)."""
    import torch

    if layout == "n":
        return torch.randn(batch, rows, cols, dtype=dt, device=device, generator=g)
    stored = torch.randn(batch, cols, rows, dtype=dt, device=device, generator=g)
    return stored.transpose(-1, -2)


class StridedGemm(CandidateBase):
    """The GEMM in its layout with one BLAS library pinned."""

    family = FAMILY

    def __init__(self, library: str, data: StridedGemmData) -> None:
        super().__init__(library)
        self.library = library
        self._data = data
        self._held = False

    def _setup(self) -> None:
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
            "kernels_identify_code": True,
            "shape": s.describe(),
            "flops": s.flops,
            "bytes": s.bytes,
            "working_set_bytes": s.bytes,
            "rel_error": err,
            "first_call_s": first_call_s,
            "fp32_precision": ("tf32" if s.tf32 else "ieee") if s.dtype == "float32" else None,
        }

    def run(self, calls: int) -> None:
        if not self._held:
            raise CandidateError(f"{self.name}: run before setup")
        with _pinned_blas(self.library), fp32_precision("matmul", self._data.spec.tf32):
            for _ in range(calls):
                self._data.multiply()

    def teardown(self) -> None:
        if self._held:
            self._held = False
            self._data.release()


def build(workload: Workload, session: DeviceSession) -> list[StridedGemm]:
    """One candidate per BLAS library this torch can be told to prefer."""
    spec = parse_strided_gemm(workload)
    device = require_cuda_device(session, FAMILY)
    libs = [lib for lib in BLAS_LIBRARIES if lib in available_libraries()]
    if not libs:
        raise CandidateError(f"{FAMILY}: this torch offers no BLAS library choice")
    data = StridedGemmData(spec, device)
    return [StridedGemm(lib, data) for lib in libs]
