"""``torch.conv2d`` family: the cuDNN kernels torch picks, heuristic and benchmark, per layout.

Candidates are measured as the job runs them. ``params.input_layout`` and
``params.weight_layout`` (``contiguous`` or ``channels_last``, default contiguous) are the
layouts the job's activations and weights have; a capture records them. For each pick
(heuristic: ``cudnn.benchmark=False``; benchmark: ``cudnn.benchmark=True``) there is:

- the job's own layouts, exactly as captured: a mixed pair (NCHW input, channels_last
  weight) is timed as it is, so the layout conversion torch pays on every call is in the
  time. The heuristic pick in the job's layouts is what the job runs without gpuwatchd:
  its meta says ``job_default`` and a winner must beat it beyond the noise;
- each uniform memory format (``params.memory_formats``, default both) that differs from
  the job's: input and weight both in that format, what the conv costs once the whole
  model and its input are converted (``model.to(memory_format=...)``). Such a candidate's
  meta says ``model_wide``: a job can take it only by converting the whole model.

Each candidate records the kernels it really launches (torch.profiler) in
``meta["kernels"]``. A benchmark pick is timed again on fresh threads at set-up: cuDNN's
benchmark mode may pick other kernels each time it runs, and a job can only ask for the
mode, not the kernels; ``meta["reproducible"]`` says whether every probe picked the same
kernels, and a pick that is not reproducible is never applied to a job.

Timing: the calls are replayed from CUDA graphs captured on the candidate's thread (its
plan already cached), so a batch measures the kernels' GPU time, not Python's launch
rate: inside a training step the GPU, not the launch, sets a conv's cost.

Why each candidate owns a thread. In ATen's cuDNN v8 path (``Conv_v8.cpp``,
``run_single_conv``) the chosen execution plan is cached per key, and the key holds the
shapes, strides/memory format, dtype, alignment, ``deterministic`` and ``allow_tf32``,
but *not* the benchmark flag; the cache is consulted before the flag is looked at, and
the heuristic path fills it too. So in one thread whichever pick runs first is reused by
the other whatever the flag says. The cache is declared ``thread_local`` (cuDNN plans
are not thread safe), so a candidate that does all its calls on its own thread keeps
its own pick. The v7 API (``TORCH_CUDNN_V8_API_DISABLED=1``) caches process-wide and
is refused. The flags themselves are process-global: they are set and restored around
each candidate's calls under one lock.

fp32 convs: cuDNN may use TF32 tensor cores unless told not to (torch's default allows
it). ``params.tf32`` (default false: true IEEE fp32) sets it explicitly and
``meta["fp32_precision"]`` records it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from gpuwatchd.tuning.families import specs_for
from gpuwatchd.tuning.families.torch_conv import DEFAULT_PICK, MEMORY_FORMATS, PICKS
from gpuwatchd.tuning.ops import ConvShape, conv_shape
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
    seed_param,
)

if TYPE_CHECKING:
    import torch

(SPEC,) = specs_for(__name__)
FAMILY = SPEC.name
_ELEM_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
#: Images of the batch checked against a float64 CPU reference (convs are per image).
_CHECK_IMAGES = 2
#: Fresh threads a benchmark pick is made on again to see whether it picks the same kernels.
_REPRODUCE_PROBES = 2
#: Calls in the larger timing graph; a batch replays it, then the one-call graph for the rest.
_GRAPH_CALLS = 16
_FLAGS_LOCK = threading.Lock()
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class ConvSpec(ConvShape):
    """y = conv2d(x, w) of a :class:`ConvShape`, with the dtype and params it runs in."""

    dtype: str
    tf32: bool
    bias: bool
    seed: int
    input_layout: str = "contiguous"
    weight_layout: str = "contiguous"

    @property
    def flops(self) -> int:
        n, k, ho, wo = self.output
        _, cg, r, s = self.weight
        return 2 * n * k * ho * wo * cg * r * s

    @property
    def bytes(self) -> int:
        """Compulsory traffic: read x and w once, write y once."""
        elems = _prod(self.input) + _prod(self.weight) + _prod(self.output)
        return elems * _ELEM_BYTES[self.dtype]

    @property
    def tolerance(self) -> float:
        return float_tolerance(self.dtype, self.tf32)

    def describe(self) -> dict[str, Any]:
        return {
            "input": list(self.input),
            "weight": list(self.weight),
            "stride": list(self.stride),
            "padding": list(self.padding),
            "dilation": list(self.dilation),
            "groups": self.groups,
            "dtype": self.dtype,
        }


def parse_conv(workload: Workload) -> ConvSpec:
    """Validate a conv2d workload; ValueError naming the bad field."""
    where = f"workload {workload.name!r}"
    SPEC.require_op(repr(workload.name), workload.op)
    c = conv_shape(workload.shape, f"{where}: shape")
    dtype = canonical_dtype(workload.dtype, tuple(_ELEM_BYTES), where)
    tf32 = bool_param(workload, "tf32", where)
    bias = bool_param(workload, "bias", where)
    seed = seed_param(workload, where)
    x_layout = _layout_param(workload, "input_layout", where)
    w_layout = _layout_param(workload, "weight_layout", where)
    return ConvSpec(
        c.input, c.weight, c.stride, c.padding, c.dilation, c.groups,
        dtype, tf32, bias, seed, x_layout, w_layout,
    )  # fmt: skip


class _OwnThread:
    """One worker thread, bound to the session's device and stream, that runs our calls."""

    def __init__(self, name: str, device: torch.device, stream: torch.cuda.Stream) -> None:
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=name, initializer=_bind, initargs=(device, stream)
        )

    def call(self, fn: Callable[..., _T], *args: Any) -> _T:
        return self._pool.submit(fn, *args).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _bind(device: torch.device, stream: torch.cuda.Stream) -> None:
    """Current device and stream are per thread in CUDA/torch: use the session's."""
    import torch

    torch.cuda.set_device(device)
    torch.cuda.set_stream(stream)


class CudnnConv(CandidateBase):
    """F.conv2d through cuDNN with one pick mode and one memory format, on its own thread."""

    family = FAMILY

    def __init__(
        self, spec: ConvSpec, pick: str, layouts: tuple[str, str], device: torch.device
    ) -> None:
        super().__init__(f"cudnn[{pick},{layout_label(*layouts)}]")
        self.spec = spec
        self.pick = pick
        self.input_layout, self.weight_layout = layouts
        #: the uniform format of both operands, or "mixed" (the job's own mixed pair)
        self.memory_format = layouts[0] if layouts[0] == layouts[1] else "mixed"
        self._job_layouts = layouts == (spec.input_layout, spec.weight_layout)
        self._device = device
        self._thread: _OwnThread | None = None
        self._x: Any = None
        self._w: Any = None
        self._b: Any = None
        self._graphs: tuple[Any, Any] | None = None

    def _setup(self) -> None:
        """Pick the algorithm (on our thread), check against float64, read the kernels."""
        import torch

        stream = torch.cuda.current_stream(self._device)
        self._thread = _OwnThread(self.name, self._device, stream)
        try:
            y, pick_s = self._thread.call(self._first_call)
            err = self._check(y)
            del y
            # Profiled from this thread: CUPTI sees every thread's kernels, and Kineto
            # complains when its first session starts on a thread it was not set up on.
            kernels = launched_kernels(lambda: self.run(1))
            probes = [self._probe() for _ in range(_REPRODUCE_PROBES)] if self._benchmark else []
            self._graphs, timing = self._thread.call(self._capture_graphs)
        except RuntimeError as e:
            raise CandidateError(f"{self.name}: {type(e).__name__}: {first_line(e)}") from e
        if not kernels:
            raise CandidateError(f"{self.name}: the profiler saw no GPU kernel for the conv")
        s = self.spec
        self._meta = {
            "pick": self.pick,
            "cudnn_benchmark": self.pick == "benchmark",
            "memory_format": self.memory_format,
            "input_layout": self.input_layout,
            "weight_layout": self.weight_layout,
            JOB_DEFAULT: self._job_layouts and self.pick == DEFAULT_PICK,
            "model_wide": not self._job_layouts,
            "kernels": kernels,
            "reproducible": all(p == kernels for p in probes),
            "probe_kernels": [p for p in probes if p != kernels],
            "timing": timing,
            # library kernel names encode tile, layout and precision: same names, same code
            "kernels_identify_code": True,
            "pick_s": pick_s,
            "shape": s.describe(),
            "bias": s.bias,
            "flops": s.flops,
            "bytes": s.bytes,
            "working_set_bytes": s.bytes,
            "rel_error": err,
            "fp32_precision": fp32_precision_label(s.dtype, s.tf32),
            "cudnn_version": torch.backends.cudnn.version(),
            "cudnn_benchmark_limit": torch.backends.cudnn.benchmark_limit,
            "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        }

    @property
    def _benchmark(self) -> bool:
        return self.pick == "benchmark"

    def _probe(self) -> list[str]:
        """The kernels this pick lands on when made again on a fresh thread."""
        import torch

        assert self._thread is not None
        probe = _OwnThread(f"{self.name}-probe", self._device, torch.cuda.current_stream())
        try:
            probe.call(self._call_in_mode)  # the first call: the pick is made here
            return launched_kernels(lambda: probe.call(self._call_in_mode))
        finally:
            probe.close()

    def _call_in_mode(self) -> None:
        with self._mode():
            self._conv()

    def _capture_graphs(self) -> tuple[tuple[Any, Any] | None, str]:
        """Runs on our thread: graphs of 16 calls and of 1 call, or None where capture fails."""
        import torch

        try:
            graphs = []
            for n in (_GRAPH_CALLS, 1):
                g = torch.cuda.CUDAGraph()
                with self._mode(), torch.cuda.graph(g):
                    for _ in range(n):
                        self._conv()
                graphs.append(g)
            torch.cuda.synchronize(self._device)
        except RuntimeError:
            return None, "launches"
        return (graphs[0], graphs[1]), "cuda_graph"

    def _first_call(self) -> tuple[Any, float]:
        """Runs on our thread: make inputs, then the call where cuDNN picks the algorithm."""
        import torch

        s = self.spec
        dt = getattr(torch, s.dtype)
        g = torch.Generator(device=self._device).manual_seed(s.seed)
        x = torch.randn(s.input, dtype=dt, device=self._device, generator=g)
        w = torch.randn(s.weight, dtype=dt, device=self._device, generator=g)
        self._x = x.contiguous(memory_format=_torch_format(self.input_layout))
        self._w = w.contiguous(memory_format=_torch_format(self.weight_layout))
        if s.bias:
            self._b = torch.randn(s.weight[0], dtype=dt, device=self._device, generator=g)
        torch.cuda.synchronize(self._device)
        t0 = time.perf_counter()
        with self._mode():
            y = self._conv()
        torch.cuda.synchronize(self._device)
        return y, time.perf_counter() - t0

    def _check(self, y: torch.Tensor) -> float:
        """First images of the batch against a float64 CPU conv (independent of cuDNN)."""
        import torch.nn.functional as F

        s = self.spec
        n = min(_CHECK_IMAGES, s.input[0])
        x = self._x[:n].double().cpu()
        w = self._w.double().cpu()
        b = self._b.double().cpu() if self._b is not None else None
        ref = F.conv2d(x, w, b, s.stride, s.padding, s.dilation, s.groups)
        err = relative_error(y[:n].cpu(), ref)
        if not err <= s.tolerance:
            raise CandidateError(
                f"{self.name}: wrong result, relative error {err:.3g} over {s.tolerance:g}"
            )
        return err

    @contextmanager
    def _mode(self) -> Iterator[None]:
        """cudnn.benchmark and the fp32 math mode for our calls, restored after."""
        import torch

        with _FLAGS_LOCK:
            prev = torch.backends.cudnn.benchmark
            torch.backends.cudnn.benchmark = self.pick == "benchmark"
            try:
                with fp32_precision("conv", self.spec.tf32):
                    yield
            finally:
                torch.backends.cudnn.benchmark = prev

    def _conv(self) -> torch.Tensor:
        import torch.nn.functional as F

        s = self.spec
        return F.conv2d(self._x, self._w, self._b, s.stride, s.padding, s.dilation, s.groups)

    def _enqueue(self, calls: int) -> None:
        if self._graphs is not None:
            many, one = self._graphs
            for _ in range(calls // _GRAPH_CALLS):
                many.replay()
            for _ in range(calls % _GRAPH_CALLS):
                one.replay()
            return
        with self._mode():
            for _ in range(calls):
                self._conv()

    def run(self, calls: int) -> None:
        if self._thread is None:
            raise CandidateError(f"{self.name}: run before setup")
        self._thread.call(self._enqueue, calls)

    def teardown(self) -> None:
        if self._thread is not None:
            self._thread.close()
            self._thread = None
        self._graphs = None
        self._x = self._w = self._b = None


def _v8_api_disabled() -> bool:
    return os.environ.get("TORCH_CUDNN_V8_API_DISABLED", "").strip().lower() in (
        "1",
        "true",
        "yes",
        "on",
        "y",
    )


def candidate_layouts(spec: ConvSpec, formats: tuple[str, ...]) -> list[tuple[str, str]]:
    """(input, weight) layouts to time: the job's own first, then each other uniform format."""
    job = (spec.input_layout, spec.weight_layout)
    return [job] + [(f, f) for f in formats if (f, f) != job]


def build(workload: Workload, session: DeviceSession) -> list[CudnnConv]:
    """``params.picks`` x (the job's layouts + ``params.memory_formats``); the job's
    default (heuristic pick, the job's layouts) is always one of them."""
    spec = parse_conv(workload)
    picks = choices_param(workload, "picks", PICKS)
    if DEFAULT_PICK not in picks:
        picks = [DEFAULT_PICK, *picks]
    formats = choices_param(workload, "memory_formats", MEMORY_FORMATS)
    device = require_cuda_device(session, FAMILY)
    if _v8_api_disabled():
        raise CandidateError(
            f"{FAMILY}: TORCH_CUDNN_V8_API_DISABLED is set; the v7 API caches algorithm "
            "picks process-wide, so the heuristic and benchmark picks cannot both be measured"
        )
    import torch

    if torch.version.hip is not None or not torch.backends.cudnn.is_available():
        raise CandidateError(f"{FAMILY}: this torch has no cuDNN")
    layouts = candidate_layouts(spec, tuple(formats))
    return [CudnnConv(spec, p, lay, device) for p in picks for lay in layouts]


def layout_label(input_layout: str, weight_layout: str) -> str:
    """A candidate's layout in its name: one format, or ``x:<input>+w:<weight>`` when mixed."""
    if input_layout == weight_layout:
        return input_layout
    return f"x:{input_layout}+w:{weight_layout}"


def _torch_format(layout: str) -> Any:
    import torch

    return torch.channels_last if layout == "channels_last" else torch.contiguous_format


def _layout_param(workload: Workload, key: str, where: str) -> str:
    value = workload.params.get(key, "contiguous")
    if value not in MEMORY_FORMATS:
        raise ValueError(
            f"{where}: params.{key} must be one of {', '.join(MEMORY_FORMATS)}, got {value!r}"
        )
    return str(value)


def _prod(dims: tuple[int, ...]) -> int:
    out = 1
    for d in dims:
        out *= d
    return out
