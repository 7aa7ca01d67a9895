"""Record the GEMMs and convolutions a model really runs, forward and backward, with their time.

:func:`capture` is a context manager around a few training or inference steps. Inside
it a ``TorchDispatchMode`` sees every ATen op below autograd, the backward pass's
included (autograd carries the mode to its own threads), and notes each ``mm``,
``addmm``, ``bmm``, ``baddbmm``, ``convolution`` and ``convolution_backward``: shapes,
layout (which operand is transposed; contiguous or channels_last), dtype, the job's
TF32 setting, forward or backward, and how often. Each such call is timed where it
runs: between two CUDA events on its stream on a GPU (what its kernels took, gaps
between them included), with ``time.perf_counter`` on a machine without one; its share
is of the whole block's span on the same clock.

No profiler is ever started: CUPTI, once attached, stays with the process and slows it
in bursts for the rest of its life. What the capture costs while the block runs is two
event records per tracked call and the mode's Python dispatch of every op; when the
block ends the mode is gone and nothing of it is left running.

The result (:class:`Capture`) prints as a table, turns into workloads for the existing
families (:mod:`gpuwatchd.tuning.submitted.captured`), writes them as TOML ``[[workload]]``
tables or JSON, and submits them to the daemon (or its spool). A JSON capture loads
again in a later process (:meth:`Capture.load`), so a job applies its winners there
before the model's first forward pass without capturing again.

A forward convolution run under the capture fills cuDNN's per-thread plan cache for its
shape with the pick the job had then (see :mod:`gpuwatchd.jobside.apply_winners`); the
capture remembers which (thread, conv key) it ran, so ``apply_winners`` can say when a
recorded pick can no longer take effect in this process.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuwatchd.jobside.requests import Submission
from gpuwatchd.jobside.workload_submit import submit_workloads
from gpuwatchd.tuning.intake.workload_requests import workloads_toml
from gpuwatchd.tuning.submitted.captured import (
    CapturedCall,
    CapturedSet,
    check_share,
    parse_capture,
    share_table,
)
from gpuwatchd.tuning.types import Workload

#: Attribute a captured model keeps its capture under (for ``apply_winners(model)``).
MODEL_ATTR = "_gpuwatchd_capture"
_GEMMS = ("mm", "addmm", "bmm", "baddbmm")
_CONVS = ("convolution", "convolution_backward")


@dataclass(frozen=True, slots=True)
class _Signature:
    """What makes two calls the same tuning-relevant call."""

    kind: str
    aten: str
    phase: str
    dtype: str
    shape: tuple[tuple[str, Any], ...]
    layout: str
    bias: bool
    tf32: bool
    weight_layout: str | None = None


#: A cuDNN conv plan-cache key as far as a job can tell: (dtype, shape, layouts, tf32).
ConvPlanKey = tuple[str, tuple[tuple[str, Any], ...], tuple[str, str], bool]
#: (thread id, key) -> the pick (``heuristic``/``benchmark``) a captured forward conv
#: cached on that thread; cuDNN's plan cache keeps it for the life of the process.
_CACHED_PLANS: dict[tuple[int, ConvPlanKey], str] = {}
_CACHED_PLANS_LOCK = threading.Lock()


def conv_plan_key(dtype: str, shape: Any, layouts: tuple[str, str], tf32: bool) -> ConvPlanKey:
    """The key under which this process's plan cache holds a forward conv's pick."""
    items = shape.items() if isinstance(shape, dict) else shape
    norm = tuple((k, tuple(v) if isinstance(v, list | tuple) else v) for k, v in items)
    return (dtype, norm, layouts, tf32)


def cached_pick(key: ConvPlanKey, thread: int | None = None) -> str | None:
    """The pick a capture left cached for ``key`` on ``thread`` (default: this one)."""
    ident = threading.get_ident() if thread is None else thread
    with _CACHED_PLANS_LOCK:
        return _CACHED_PLANS.get((ident, key))


def _note_cached_plan(sig: _Signature) -> None:
    import torch

    layouts = (sig.layout, sig.weight_layout or sig.layout)
    key = conv_plan_key(sig.dtype, sig.shape, layouts, sig.tf32)
    pick = "benchmark" if torch.backends.cudnn.benchmark else "heuristic"
    with _CACHED_PLANS_LOCK:
        _CACHED_PLANS.setdefault((threading.get_ident(), key), pick)


@dataclass(slots=True)
class _Tally:
    """Signatures in first-seen order and their call counts."""

    index: dict[_Signature, int] = field(default_factory=dict)
    counts: list[int] = field(default_factory=list)

    def note(self, sig: _Signature) -> int:
        i = self.index.get(sig)
        if i is None:
            i = self.index[sig] = len(self.counts)
            self.counts.append(0)
        self.counts[i] += 1
        return i


def _operand_layout(t: Any) -> str:
    """``n`` for a row-major matrix operand, ``t`` for a transposed (column-major) one."""
    rows, cols = t.shape[-2], t.shape[-1]
    s_row, s_col = t.stride()[-2], t.stride()[-1]
    if s_col == 1 and (rows == 1 or s_row >= cols):
        return "n"
    if s_row == 1 and (cols == 1 or s_col >= rows):
        return "t"
    return "n"  # any other strides: torch copies the operand to row-major first


def _tf32(op: str) -> bool:
    """Whether the job lets ``op`` (``matmul`` or ``conv``) use TF32 for float32."""
    import torch

    node = (
        torch.backends.cuda.matmul
        if op == "matmul"
        else getattr(torch.backends.cudnn, "conv", None)
    )
    mode = getattr(node, "fp32_precision", None)
    if mode in ("tf32", "ieee"):
        return mode == "tf32"
    if mode is not None:  # "none": inherits the global setting
        return getattr(torch.backends, "fp32_precision", "ieee") == "tf32"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        legacy = torch.backends.cuda.matmul if op == "matmul" else torch.backends.cudnn
        return bool(legacy.allow_tf32)


def _phase() -> str:
    import torch

    task = getattr(torch._C, "_current_graph_task_id", lambda: -1)()
    return "backward" if task != -1 else "forward"


def _dtype_name(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


def signature(name: str, args: tuple[Any, ...]) -> _Signature | None:
    """The signature of one ATen call (``name`` is its overload packet), None if untracked."""
    if name in _GEMMS:
        biased = name in ("addmm", "baddbmm")
        a, b = (args[1], args[2]) if biased else (args[0], args[1])
        if a.dim() != b.dim() or a.dim() not in (2, 3):
            return None
        batch = a.shape[0] if a.dim() == 3 else 1
        dtype = _dtype_name(b)
        shape: tuple[tuple[str, Any], ...] = (
            ("batch", batch),
            ("m", a.shape[-2]),
            ("n", b.shape[-1]),
            ("k", a.shape[-1]),
        )
        layout = _operand_layout(a) + _operand_layout(b)
        tf32 = dtype == "float32" and _tf32("matmul")
        return _Signature("gemm", name, _phase(), dtype, shape, layout, biased, tf32)
    if name == "convolution":
        x, w, bias = args[0], args[1], args[2]
        stride, padding, dilation, transposed, groups = args[3], args[4], args[5], args[6], args[8]
        phase, has_bias = _phase(), bias is not None
    elif name == "convolution_backward":
        x, w = args[1], args[2]
        stride, padding, dilation, transposed, groups = args[4], args[5], args[6], args[7], args[9]
        phase, has_bias = "backward", args[3] is not None and bool(args[10][2])
    else:
        return None
    if transposed or x.dim() != 4 or len(stride) != 2:
        return None
    dtype = _dtype_name(x)
    shape = (
        ("input", tuple(x.shape)),
        ("weight", tuple(w.shape)),
        ("stride", tuple(stride)),
        ("padding", tuple(padding)),
        ("dilation", tuple(dilation)),
        ("groups", int(groups)),
    )
    tf32 = dtype == "float32" and _tf32("conv")
    x_layout = _conv_layout(x)
    return _Signature(
        "conv2d", name, phase, dtype, shape, x_layout, has_bias, tf32, _weight_layout(w, x_layout)
    )


def _conv_layout(x: Any) -> str:
    import torch

    if x.is_contiguous():
        return "contiguous"
    if x.is_contiguous(memory_format=torch.channels_last):
        return "channels_last"
    return "contiguous"  # torch makes other layouts contiguous before cuDNN sees them


def _weight_layout(w: Any, input_layout: str) -> str:
    """The weight's memory format; one valid in both (a 1x1 kernel) follows the input's,
    as torch's conv then runs it in the input's format with no conversion."""
    import torch

    if w.is_contiguous() and w.is_contiguous(memory_format=torch.channels_last):
        return input_layout
    return _conv_layout(w)


class _Clock:
    """Times spans on one clock: CUDA events on the current stream, else perf_counter.

    ``mark()`` returns a token; ``seconds(a, b)`` reads the span between two tokens once
    everything has run (after :meth:`finish`)."""

    def __init__(self, use_cuda: bool) -> None:
        self.use_cuda = use_cuda

    def mark(self) -> Any:
        if not self.use_cuda:
            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def finish(self) -> None:
        if self.use_cuda:
            import torch

            torch.cuda.synchronize()

    def seconds(self, start: Any, end: Any) -> float:
        if self.use_cuda:
            return float(start.elapsed_time(end)) / 1e3
        return float(end - start)


def _make_mode(tally: _Tally, clock: _Clock, spans: list[tuple[int, Any, Any]]) -> Any:
    """The dispatch mode: note each tracked call and the clock marks around it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class GemmConvRecorder(TorchDispatchMode):  # type: ignore[misc]
        def __torch_dispatch__(
            self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
        ) -> Any:
            kwargs = kwargs or {}
            name = func.overloadpacket.__name__
            sig = signature(name, args) if name in _GEMMS or name in _CONVS else None
            if sig is None:
                return func(*args, **kwargs)
            i = tally.note(sig)
            if sig.kind == "conv2d" and sig.phase == "forward":
                _note_cached_plan(sig)
            start = clock.mark()
            out = func(*args, **kwargs)
            spans.append((i, start, clock.mark()))  # list.append: safe from autograd threads
            return out

    return GemmConvRecorder()


class Capture:
    """What :func:`capture` saw. Read it after the ``with`` block ends."""

    def __init__(self) -> None:
        self._set: CapturedSet | None = None

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Capture:
        """A capture written as JSON by :meth:`write`, in this or a later process.

        ValueError naming the file and the bad field for anything else (a TOML file holds
        workloads only, not the calls a plan needs).
        """
        p = Path(path)
        if p.suffix.lower() == ".toml":
            raise ValueError(
                f"{p}: a TOML capture holds workloads only; write the capture as JSON "
                "(Capture.write('capture.json')) to load it again"
            )
        try:
            doc = json.loads(p.read_text(encoding="utf-8"))
        except OSError as e:
            raise ValueError(f"{p}: cannot read: {e.strerror or e}") from e
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise ValueError(f"{p}: not a JSON capture: {e}") from e
        out = cls()
        out._finish(parse_capture(doc, str(p)))
        return out

    @property
    def captured(self) -> CapturedSet:
        if self._set is None:
            raise RuntimeError("the capture is still running: read it after the with block")
        return self._set

    @property
    def calls(self) -> tuple[CapturedCall, ...]:
        """Every signature seen, largest share of the time first."""
        return self.captured.calls

    def workloads(self, top: int | None = None, min_share: float = 0.0) -> tuple[Workload, ...]:
        """The workloads that tune these calls (``top`` N, at least ``min_share``)."""
        return self.captured.workloads(top=top, min_share=min_share)

    def table(self, limit: int | None = None) -> str:
        return share_table(self.captured, limit)

    def __str__(self) -> str:
        return self.table() if self._set is not None else "<capture still running>"

    def to_json(self) -> dict[str, Any]:
        return self.captured.to_json()

    def write(
        self, path: str | os.PathLike[str], top: int | None = None, min_share: float = 0.0
    ) -> Path:
        """``.toml``: ``[[workload]]`` tables (daemon config, ``gpuwatchd workloads add``);
        anything else: the JSON capture document, calls and workloads, which
        :meth:`load` reads back. Returns the path."""
        p = Path(path)
        if p.suffix.lower() == ".toml":
            comment = (
                f"Captured by gpuwatchd.torch.capture() on {self.captured.device or 'CPU'}, "
                f"torch {self.captured.torch}.\nAdd with `gpuwatchd workloads add {p.name}`."
            )
            text = workloads_toml(self.workloads(top=top, min_share=min_share), comment)
        else:
            text = json.dumps(self.to_json(), indent=2) + "\n"
        p.write_text(text, encoding="utf-8")
        return p

    def submit(
        self,
        top: int | None = None,
        min_share: float = 0.0,
        *,
        socket_path: str | os.PathLike[str] | None = None,
        spool_dir: str | os.PathLike[str] | None = None,
    ) -> Submission:
        """Hand the workloads to the daemon (``add_workloads``), else to its spool."""
        workloads = self.workloads(top=top, min_share=min_share)
        if not workloads:
            return Submission("failed", "the capture holds no tunable GEMM or convolution")
        source = {
            "kind": "capture",
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "torch": self.captured.torch,
            "device": self.captured.device,
        }
        return submit_workloads(workloads, source, socket_path=socket_path, spool_dir=spool_dir)

    def _finish(self, captured: CapturedSet) -> None:
        self._set = captured


@contextmanager
def capture(model: Any = None, *, timer: str = "auto") -> Iterator[Capture]:
    """Record the GEMM and convolution calls of the steps run inside the block.

    ``timer``: ``cuda`` (GPU time, CUDA events), ``cpu`` (wall time on the host), or
    ``auto`` (``cuda`` when CUDA is available). ``model``, when given, keeps the capture
    so that ``apply_winners(model)`` finds its shapes. No profiler is started. Run the
    steps eagerly: a CUDA graph being captured cannot record timing events.
    """
    import torch

    if timer not in ("auto", "cuda", "cpu"):
        raise ValueError(f"timer: expected auto, cuda or cpu, got {timer!r}")
    use_cuda = torch.cuda.is_available() if timer == "auto" else timer == "cuda"
    clock = _Clock(use_cuda)
    tally = _Tally()
    spans: list[tuple[int, Any, Any]] = []
    result = Capture()
    begin = clock.mark()
    with _make_mode(tally, clock, spans):
        yield result
    end = clock.mark()
    clock.finish()
    times = [0.0] * len(tally.counts)
    for i, start, stop in spans:
        times[i] += clock.seconds(start, stop)
    total = clock.seconds(begin, end)
    device = torch.cuda.get_device_name() if use_cuda else None
    calls = _calls(tally, times, total)
    result._finish(
        CapturedSet(calls, "cuda" if use_cuda else "cpu", total, device, torch.__version__)
    )
    if model is not None:
        setattr(model, MODEL_ATTR, result)


def _calls(tally: _Tally, times: list[float], total: float) -> tuple[CapturedCall, ...]:
    out = []
    for sig, i in tally.index.items():
        shape = {k: list(v) if isinstance(v, tuple) else v for k, v in sig.shape}
        share = check_share(times[i] / total) if total > 0 else 0.0
        out.append(
            CapturedCall(
                kind=sig.kind,
                aten=sig.aten,
                phase=sig.phase,
                dtype=sig.dtype,
                shape=shape,
                layout=sig.layout,
                bias=sig.bias,
                tf32=sig.tf32,
                calls=tally.counts[i],
                time_s=times[i],
                share=share,
                weight_layout=sig.weight_layout,
            )
        )
    out.sort(key=lambda c: -c.time_s)
    return tuple(out)


def load_capture(path: str | os.PathLike[str]) -> Capture:
    """:meth:`Capture.load`: a JSON capture written by :meth:`Capture.write`."""
    return Capture.load(path)
