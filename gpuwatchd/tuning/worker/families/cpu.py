"""``cpu.matmul``, ``cpu.conv2d`` and ``cpu.bmm``: real torch CPU ops, so the whole path runs
without a GPU.

Each candidate is a genuinely different way to compute the op (library call, einsum,
k-blocked accumulation, transposed layout; direct conv with and without oneDNN,
channels_last, im2col + GEMM; one batched call or one GEMM per batch entry), checked
against a float64 reference in ``setup``.
torch is imported inside the functions only: the daemon imports this registry module
to list families and must stay torch-free.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from gpuwatchd.tuning.dtypes import DTYPES
from gpuwatchd.tuning.families import specs_for
from gpuwatchd.tuning.ops import conv_shape
from gpuwatchd.tuning.types import Workload
from gpuwatchd.tuning.worker.candidate import Candidate, CandidateError, DeviceSession
from gpuwatchd.validate import one_line

if TYPE_CHECKING:
    import torch

#: The families this module implements (gpuwatchd/tuning/families/cpu.py).
MATMUL, CONV2D, BMM = specs_for(__name__)

#: Relative Frobenius error allowed against the float64 reference, per dtype.
TOLERANCE = {"float32": 1e-4, "float64": 1e-10, "bfloat16": 3e-2, "float16": 5e-3}

Inputs = tuple["torch.Tensor", ...]
Fn = Callable[..., "torch.Tensor"]


class TorchCpuCandidate:
    """One CPU implementation: ``make`` builds its inputs, ``fn`` computes the op."""

    def __init__(
        self,
        name: str,
        family: str,
        make: Callable[[], tuple[Inputs, torch.Tensor]],
        fn: Fn,
        config: dict[str, Any],
        flops: float,
        working_set_bytes: int,
        tolerance: float,
        context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        self.name = name
        self.family = family
        self._make = make
        self._fn = fn
        self._config = config
        self._flops = flops
        self._ws = working_set_bytes
        self._tol = tolerance
        self._context = context
        self._inputs: Inputs | None = None

    def setup(self) -> None:
        """Build inputs, run once, and compare with the float64 reference."""
        import torch

        try:
            inputs, reference = self._make()
            with self._context():
                out = self._fn(*inputs)
        except (RuntimeError, ValueError, TypeError) as e:
            raise CandidateError(f"{self.name}: {one_line(e)}") from e
        if out.shape != reference.shape:
            raise CandidateError(f"{self.name}: output shape {tuple(out.shape)} != reference")
        err = float(torch.linalg.norm(out.double() - reference) / torch.linalg.norm(reference))
        if not err <= self._tol:  # also catches NaN
            raise CandidateError(f"{self.name}: relative error {err:.3g} > {self._tol:g}")
        self._inputs = inputs

    def run(self, calls: int) -> None:
        if self._inputs is None:
            raise CandidateError(f"{self.name}: run before setup")
        fn, inputs = self._fn, self._inputs
        with self._context():
            for _ in range(calls):
                fn(*inputs)

    def meta(self) -> dict[str, Any]:
        return {
            "config": dict(self._config),
            "flops": self._flops,
            "working_set_bytes": self._ws,
        }

    def teardown(self) -> None:
        self._inputs = None


def _dtype(w: Workload) -> torch.dtype:
    import torch

    key = DTYPES.get(w.dtype.lower())
    if key is None:
        known = ", ".join(sorted(DTYPES))
        raise ValueError(f"workload {w.name}: dtype {w.dtype!r} not supported (known: {known})")
    return getattr(torch, key)


def _positive_int(w: Workload, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(
            f"workload {w.name}: shape.{key} must be a positive integer, got {value!r}"
        )
    return value


def _seeded(seed: int) -> torch.Generator:
    import torch

    return torch.Generator().manual_seed(seed)


# -- cpu.matmul -------------------------------------------------------------------------


def matmul_family(w: Workload, session: DeviceSession) -> list[Candidate]:
    """C = A @ B for shape ``m, n, k``: library matmul, mm into a preallocated output,
    einsum, B stored transposed, and k-blocked accumulation with addmm."""
    import torch

    MATMUL.require_op(w.name, w.op)
    m, n, k = (_positive_int(w, key, w.shape.get(key)) for key in ("m", "n", "k"))
    dtype = _dtype(w)
    tol = TOLERANCE[str(dtype).removeprefix("torch.")]
    esize = torch.empty((), dtype=dtype).element_size()
    ws = (m * k + k * n + m * n) * esize
    flops = 2.0 * m * n * k
    seed = int(w.params.get("seed", 0))

    def inputs(transpose_b: bool = False, out: bool = False) -> tuple[Inputs, torch.Tensor]:
        g = _seeded(seed)
        a = torch.randn(m, k, generator=g, dtype=torch.float64)
        b = torch.randn(k, n, generator=g, dtype=torch.float64)
        ref = a @ b
        bb = b.t().contiguous().to(dtype) if transpose_b else b.to(dtype)
        extra = (torch.empty(m, n, dtype=dtype),) if out else ()
        return (a.to(dtype), bb, *extra), ref

    def blocked(bk: int) -> Fn:
        def fn(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
            torch.mm(a[:, :bk], b[:bk], out=c)
            for k0 in range(bk, k, bk):
                c.addmm_(a[:, k0 : k0 + bk], b[k0 : k0 + bk])
            return c

        return fn

    def cand(
        name: str, make: Callable[[], tuple[Inputs, torch.Tensor]], fn: Fn, **cfg: Any
    ) -> TorchCpuCandidate:
        return TorchCpuCandidate(name, MATMUL.name, make, fn, {"impl": name, **cfg}, flops, ws, tol)

    cands: list[Candidate] = [
        cand("torch.matmul", inputs, torch.matmul),
        cand("torch.mm[out]", lambda: inputs(out=True), lambda a, b, c: torch.mm(a, b, out=c)),
        cand("einsum", inputs, lambda a, b: torch.einsum("ik,kj->ij", a, b)),
        cand("matmul[b^T]", lambda: inputs(transpose_b=True), lambda a, bt: a @ bt.t()),
    ]
    for bk in (64, 256):
        if bk < k:
            cands.append(cand(f"blocked[k{bk}]", lambda: inputs(out=True), blocked(bk), bk=bk))
    return cands


# -- cpu.bmm ----------------------------------------------------------------------------


def bmm_family(w: Workload, session: DeviceSession) -> list[Candidate]:
    """C[i] = A[i] @ B[i] for shape ``batch, m, n, k``: torch.bmm, bmm into a preallocated
    output, einsum, and one mm per batch entry."""
    import torch

    BMM.require_op(w.name, w.op)
    b, m, n, k = (_positive_int(w, key, w.shape.get(key)) for key in ("batch", "m", "n", "k"))
    dtype = _dtype(w)
    tol = TOLERANCE[str(dtype).removeprefix("torch.")]
    esize = torch.empty((), dtype=dtype).element_size()
    ws = b * (m * k + k * n + m * n) * esize
    flops = 2.0 * b * m * n * k
    seed = int(w.params.get("seed", 0))

    def inputs(out: bool = False) -> tuple[Inputs, torch.Tensor]:
        g = _seeded(seed)
        x = torch.randn(b, m, k, generator=g, dtype=torch.float64)
        y = torch.randn(b, k, n, generator=g, dtype=torch.float64)
        extra = (torch.empty(b, m, n, dtype=dtype),) if out else ()
        return (x.to(dtype), y.to(dtype), *extra), torch.bmm(x, y)

    def per_entry(x: torch.Tensor, y: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        for i in range(b):
            torch.mm(x[i], y[i], out=c[i])
        return c

    def cand(name: str, make: Callable[[], tuple[Inputs, torch.Tensor]], fn: Fn) -> Candidate:
        return TorchCpuCandidate(name, BMM.name, make, fn, {"impl": name}, flops, ws, tol)

    return [
        cand("torch.bmm", inputs, torch.bmm),
        cand("torch.bmm[out]", lambda: inputs(out=True), lambda x, y, c: torch.bmm(x, y, out=c)),
        cand("einsum", inputs, lambda x, y: torch.einsum("bik,bkj->bij", x, y)),
        cand("mm per entry", lambda: inputs(out=True), per_entry),
    ]


# -- cpu.conv2d -------------------------------------------------------------------------


def conv2d_family(w: Workload, session: DeviceSession) -> list[Candidate]:
    """2-D convolution for shape ``input`` (N,C,H,W), ``weight`` (K,C,R,S), ``stride``,
    ``padding`` (the conv shape rule, :func:`~gpuwatchd.tuning.ops.conv_shape`; no groups
    or dilation): oneDNN direct conv (contiguous and channels_last), torch's native conv
    with oneDNN off, and im2col (unfold) + GEMM."""
    import torch
    import torch.nn.functional as F

    CONV2D.require_op(w.name, w.op)
    conv = conv_shape(w.shape, f"workload {w.name}: shape")
    if conv.groups != 1 or conv.dilation != (1, 1):
        raise ValueError(f"workload {w.name}: family {CONV2D.name} runs no groups or dilation")
    nb, c, h, wd = conv.input
    kk, _, r, s = conv.weight
    stride, padding = conv.stride, conv.padding
    _, _, ho, wo = conv.output
    dtype = _dtype(w)
    tol = TOLERANCE[str(dtype).removeprefix("torch.")]
    esize = torch.empty((), dtype=dtype).element_size()
    ws = (nb * c * h * wd + kk * c * r * s + nb * kk * ho * wo) * esize
    flops = 2.0 * nb * kk * ho * wo * c * r * s
    seed = int(w.params.get("seed", 0))

    def inputs(channels_last: bool = False) -> tuple[Inputs, torch.Tensor]:
        g = _seeded(seed)
        x = torch.randn(nb, c, h, wd, generator=g, dtype=torch.float64)
        wt = torch.randn(kk, c, r, s, generator=g, dtype=torch.float64)
        ref = F.conv2d(x, wt, stride=stride, padding=padding)
        x, wt = x.to(dtype), wt.to(dtype)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
            wt = wt.contiguous(memory_format=torch.channels_last)
        return (x, wt), ref

    def direct(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, wt, stride=stride, padding=padding)

    def im2col(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
        cols = F.unfold(x, (r, s), padding=padding, stride=stride)  # N, C*R*S, L
        out = wt.reshape(kk, -1) @ cols  # N, K, L
        return out.reshape(nb, kk, ho, wo)

    @contextlib.contextmanager
    def no_onednn() -> Iterator[None]:
        # set_flags touches only what it is given; flags() would also flip TF32.
        was = torch.backends.mkldnn.set_flags(_enabled=False, _fp32_precision=None)[0]
        try:
            yield
        finally:
            torch.backends.mkldnn.set_flags(_enabled=was, _fp32_precision=None)

    def cand(
        name: str, make: Callable[[], tuple[Inputs, torch.Tensor]], fn: Fn, **kw: Any
    ) -> TorchCpuCandidate:
        return TorchCpuCandidate(name, CONV2D.name, make, fn, {"impl": name}, flops, ws, tol, **kw)

    return [
        cand("conv2d", inputs, direct),
        cand("conv2d[channels_last]", lambda: inputs(channels_last=True), direct),
        cand("conv2d[native]", inputs, direct, context=no_onednn),
        cand("im2col+gemm", inputs, im2col),
    ]
