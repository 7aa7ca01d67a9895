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

from dataclasses import dataclass
from typing import Any

from gpuwatchd.tuning.families import specs_for
from gpuwatchd.tuning.types import Workload
from gpuwatchd.tuning.worker.candidate import CandidateError, DeviceSession
from gpuwatchd.tuning.worker.cuda_session import (
    canonical_dtype,
    require_cuda_device,
)
from gpuwatchd.tuning.worker.families.common import (
    bool_param,
    float_tolerance,
    positive_dims,
    seed_param,
)
from gpuwatchd.tuning.worker.families.torch_matmul import (
    BLAS_LIBRARIES,
    BlasGemm,
    SharedGemmOperands,
    available_libraries,
)

(SPEC,) = specs_for(__name__)
FAMILY = SPEC.name
LAYOUTS = ("nn", "nt", "tn", "tt")
_ELEM_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


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
        return float_tolerance(self.dtype, self.tf32)

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
    SPEC.require_op(repr(workload.name), workload.op)
    keys = ("batch", "m", "n", "k") if workload.op == "bmm" else ("m", "n", "k")
    dims = {"batch": 1, **positive_dims(workload, keys, where)}
    layout = workload.params.get("layout", "nn")
    if layout not in LAYOUTS:
        raise ValueError(
            f"{where}: params.layout must be one of {', '.join(LAYOUTS)}, got {layout!r}"
        )
    dtype = canonical_dtype(workload.dtype, tuple(_ELEM_BYTES), where)
    tf32 = bool_param(workload, "tf32", where)
    seed = seed_param(workload, where)
    return StridedGemmSpec(
        dims["batch"], dims["m"], dims["n"], dims["k"], str(layout), dtype, tf32, seed
    )


class StridedGemmData(SharedGemmOperands[StridedGemmSpec]):
    """Operands in the workload's layout and the output; the check reads the first batch."""

    def _allocate(self) -> tuple[Any, Any, Any]:
        import torch

        s = self.spec
        dt = getattr(torch, s.dtype)
        g = torch.Generator(device=self.device).manual_seed(s.seed)
        a = _operand(s.batch, s.m, s.k, s.layout[0], dt, self.device, g)
        b = _operand(s.batch, s.k, s.n, s.layout[1], dt, self.device, g)
        c = torch.empty(s.batch, s.m, s.n, dtype=dt, device=self.device)
        if s.batch == 1:
            return a[0], b[0], c[0]
        return a, b, c

    def multiply(self) -> None:
        import torch

        if self.spec.batch == 1:
            torch.mm(self.a, self.b, out=self.c)
        else:
            torch.bmm(self.a, self.b, out=self.c)

    def _checked_matrices(self) -> tuple[Any, Any, Any]:
        if self.spec.batch == 1:
            return self.a, self.b, self.c
        return self.a[0], self.b[0], self.c[0]


def _operand(batch: int, rows: int, cols: int, layout: str, dt: Any, device: Any, g: Any) -> Any:
    """A (batch, rows, cols) operand, row-major (``n``) or a transposed view (``t``)."""
    import torch

    if layout == "n":
        return torch.randn(batch, rows, cols, dtype=dt, device=device, generator=g)
    stored = torch.randn(batch, cols, rows, dtype=dt, device=device, generator=g)
    return stored.transpose(-1, -2)


class StridedGemm(BlasGemm):
    """The GEMM in its layout with one BLAS library pinned."""

    family = FAMILY


def build(workload: Workload, session: DeviceSession) -> list[StridedGemm]:
    """One candidate per BLAS library this torch can be told to prefer."""
    spec = parse_strided_gemm(workload)
    device = require_cuda_device(session, FAMILY)
    libs = [lib for lib in BLAS_LIBRARIES if lib in available_libraries()]
    if not libs:
        raise CandidateError(f"{FAMILY}: this torch offers no BLAS library choice")
    data = StridedGemmData(spec, device)
    return [StridedGemm(lib, data) for lib in libs]
