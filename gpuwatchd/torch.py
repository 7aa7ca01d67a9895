"""PyTorch integration: let ``cudnn.benchmark`` tune inside an open gate.

With ``torch.backends.cudnn.benchmark = True`` cuDNN times its algorithms on the first
call of each new shape and keeps the pick for the life of the process, whatever state
the GPU was in at that moment (a neighbour's load, a power cap, heat).
:func:`tune_first_call` makes that first call wait for gpuwatchd's gate, so the pick is
made on a cool, idle, stable GPU (and, asked to, reports which kernels were picked).

The plan cache of torch's cuDNN v8 path is per thread and keyed by shapes, strides and
dtype, not by the benchmark flag: run the first call on the thread that will run the
rest, and the shapes tuned here keep their pick even if the flag is turned off after.

A model's own shapes: :func:`capture` records the GEMMs and convolutions a few steps
run (shapes, layouts, time shares) and submits them as workloads; a later process loads
the saved capture (:func:`load_capture`) and :func:`apply_winners` makes the recorded
winners run from the model's first call. torch.compile:
:func:`capture_compiled` records the GEMMs Inductor lowers, and
:func:`use_inductor_winners` installs the winners as Inductor's lookup table, so
``mode="max-autotune"`` compiles without benchmarking.

This module is ``gpuwatchd.torch``; ``import torch`` below is the real torch (absolute
imports), imported when a function is first called.
"""

from __future__ import annotations

import math
import os
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

from gpuwatchd.client import Client, GpuState, GpuwatchdUnavailable
from gpuwatchd.jobside.apply_winners import AppliedWinners, apply_winners
from gpuwatchd.jobside.capture import Capture, capture, load_capture
from gpuwatchd.jobside.inductor import (
    CompiledCapture,
    InductorWinners,
    capture_compiled,
    inductor_lookup_table,
    use_inductor_winners,
)
from gpuwatchd.tuning.worker.cuda_session import launched_kernels

__all__ = [
    "AppliedWinners",
    "Capture",
    "CompiledCapture",
    "FirstCall",
    "InductorWinners",
    "apply_winners",
    "capture",
    "capture_compiled",
    "current_gpu_uuid",
    "inductor_lookup_table",
    "load_capture",
    "steady_state_time",
    "tune_first_call",
    "use_inductor_winners",
]


class FirstCall(NamedTuple):
    """What :func:`tune_first_call` returns.

    ``kernels``: GPU kernels one more call launched after the tuning call (the picks,
    not the candidates cuDNN tried); empty unless ``profile=True``. ``waited_s``: time
    spent waiting for the gate. ``state``: the GPU when the call ran (None: ungated).
    """

    result: Any
    kernels: tuple[str, ...]
    waited_s: float
    state: GpuState | None


def _torch() -> Any:
    """The real torch (a seam for tests without CUDA)."""
    import torch

    return torch


def _require_cuda(what: str) -> Any:
    torch = _torch()
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"{what} needs a CUDA GPU (torch {torch.__version__}, CUDA build {torch.version.cuda})"
        )
    return torch


def current_gpu_uuid() -> str:
    """UUID of the current CUDA device: how the daemon's GPU is found whatever
    ``CUDA_VISIBLE_DEVICES`` renumbered."""
    torch = _require_cuda("current_gpu_uuid")
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    uuid = getattr(props, "uuid", None)
    if uuid is None:
        raise RuntimeError("this torch does not report device UUIDs: pass gpu=<daemon index>")
    return str(uuid)


def tune_first_call(
    fn: Callable[..., Any],
    *args: Any,
    gpu: int | str | None = None,
    timeout: float = 600.0,
    client: Client | None = None,
    require_gate: bool = True,
    keep_benchmark: bool = True,
    profile: bool = False,
    on_poll: Callable[[GpuState], None] | None = None,
    **kwargs: Any,
) -> FirstCall:
    """Run ``fn(*args, **kwargs)`` with ``cudnn.benchmark`` on, once the gate is open.

    Steps: enable benchmark mode, finish this process's queued GPU work, wait for the
    gate of ``gpu`` (daemon index or UUID; default: the current CUDA device), run the
    call (cuDNN picks its algorithms here), synchronize. ``profile=True`` then runs
    ``fn`` once more under torch.profiler to read the kernels picked (``fn`` must be
    safe to call twice): a diagnostic, since the profiler's CUPTI subscription stays
    with the process and slows it in bursts for the rest of its life.

    ``fn``'s own keyword arguments go in ``kwargs``, except those named like the ones
    here (wrap ``fn`` in a lambda for those). ``on_poll`` is handed to
    :meth:`Client.wait_until_stable` (log why the job waits).
    ``keep_benchmark=False`` restores the previous flag afterwards, so shapes met later
    get the heuristic pick instead of being timed at an arbitrary moment. Raises
    TimeoutError when the gate stays shut for ``timeout`` seconds (the call is not
    made). When the daemon is unreachable it raises GpuwatchdUnavailable, or with
    ``require_gate=False`` warns and runs the call ungated.
    """
    torch = _require_cuda("tune_first_call")
    client = client if client is not None else Client()
    target = gpu if gpu is not None else current_gpu_uuid()
    cudnn = torch.backends.cudnn
    previous = cudnn.benchmark
    cudnn.benchmark = True
    tuned = False
    try:
        torch.cuda.synchronize()  # our own queued work must not load the GPU we wait on
        t0 = time.monotonic()
        state: GpuState | None
        try:
            state = client.wait_until_stable(target, timeout, own_pids=_own_pids(), on_poll=on_poll)
        except GpuwatchdUnavailable as exc:
            if require_gate:
                raise
            warnings.warn(f"running the first call ungated: {exc}", RuntimeWarning, stacklevel=2)
            state = None
        waited_s = time.monotonic() - t0
        tuned = True
        result = fn(*args, **kwargs)
        torch.cuda.synchronize()
        kernels = tuple(launched_kernels(lambda: fn(*args, **kwargs))) if profile else ()
    finally:
        if not (tuned and keep_benchmark):
            cudnn.benchmark = previous
    return FirstCall(result, kernels, waited_s, state)


def _own_pids() -> frozenset[int]:
    return frozenset({os.getpid()})


def steady_state_time(
    fn: Callable[..., Any],
    *args: Any,
    iters: int = 100,
    warmup: int = 10,
    repeats: int = 5,
    pause_s: float = 0.0,
    **kwargs: Any,
) -> float:
    """Median seconds per call of ``fn(*args, **kwargs)``, timed with CUDA events.

    ``warmup`` untimed calls, then ``repeats`` batches of ``iters`` back-to-back calls
    (``pause_s`` apart), each timed between two events on the current stream. Calls
    must be long enough (tens of microseconds) that launching them keeps the GPU busy.
    """
    _check_count(iters, "iters", 1)
    _check_count(warmup, "warmup", 0)
    _check_count(repeats, "repeats", 1)
    if isinstance(pause_s, bool) or not isinstance(pause_s, int | float) or not pause_s >= 0:
        raise ValueError(f"pause_s: expected a number of seconds >= 0, got {pause_s!r}")
    torch = _require_cuda("steady_state_time")
    for _ in range(warmup):
        fn(*args, **kwargs)
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    per_call: list[float] = []
    for r in range(repeats):
        if r and pause_s:
            time.sleep(pause_s)
        start.record()
        for _ in range(iters):
            fn(*args, **kwargs)
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end)
        if not (math.isfinite(ms) and ms > 0):
            raise RuntimeError(f"CUDA events gave a bad time: {ms!r} ms")
        per_call.append(ms / 1e3 / iters)
    return statistics.median(per_call)


def _check_count(value: int, name: str, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
