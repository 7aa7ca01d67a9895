"""Make a job's captured shapes run with their recorded winners, from the first call on.

The order that works: capture once and write it (``Capture.write("capture.json")``);
in every later process, load it (:func:`gpuwatchd.torch.load_capture`) and call
:func:`apply_winners` *before the model's first forward pass*, on the thread that runs
the forward pass.

Why. In torch's cuDNN v8 path the execution plan picked by a shape's first call is
cached per thread, keyed by shapes, strides, dtype and math mode but not by the
benchmark flag, and reused for the life of the process. :func:`apply_winners` runs each
chosen shape's first call itself, with ``cudnn.benchmark`` set as the winner says and in
the layouts it was measured in, then restores the flag: the model's own calls of that
shape then run the winner's plan. A forward pass that ran first (a capture in the same
process included) has already cached the job's own pick for its shapes on that thread;
a different pick for those shapes cannot take effect there, and the result says so
(``blocked``) instead of pretending.

What it applies is exactly what was measured, or nothing: a conv choice in the job's own
layouts; a benchmark pick only where the worker saw it land on the same kernels every
time it made the pick again on fresh threads (``reproducible``) under this process's
torch and cuDNN, since a job can ask cuDNN for the mode, not for the kernels; the whole
model and its input converted to another memory format only when the plan found that
faster for the summed convs (never one layer alone); the BLAS library, process-wide,
only when it beats the default. Everything else stays as the job has it.

It leaves nothing behind: no profiler is started in the job's process (CUPTI, once
attached, stays and slows the process in bursts), no thread is started, the job's random
state is not drawn from, and ``cudnn.benchmark`` is put back after each first call. The
only process-wide switches it may change are the ones the plan says it applied: the BLAS
library, and the model's memory format.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpuwatchd.client import Client
from gpuwatchd.jobside.capture import MODEL_ATTR, Capture, cached_pick, conv_plan_key
from gpuwatchd.jobside.winner_plan import ConvChoice, WinnerPlan, latest_by_workload, plan_winners
from gpuwatchd.tuning.types import Regime

if TYPE_CHECKING:
    from gpuwatchd.api.winners import Winner

#: Attribute a converted model keeps its input-conversion hook handle under.
_HOOK_ATTR = "_gpuwatchd_memory_format_hook"


@dataclass(frozen=True, slots=True)
class AppliedWinners:
    """What :func:`apply_winners` did: the plan, the first calls it ran, the library set.

    ``blocked``: (workload, why) for choices that could not take effect in this process.
    """

    plan: WinnerPlan
    warmed: tuple[str, ...]  # conv workloads whose first call ran with the chosen pick
    model_format: str | None  # the memory format the model and its input were put in
    blas_library: str | None
    blocked: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        lines = [self.plan.describe()]
        lines += [f"not applied {name}: {why}" for name, why in self.blocked]
        return "\n".join(lines)


def apply_winners(
    target: Any,
    regime: Regime | str = Regime.SUSTAINED,
    *,
    capture: Capture | None = None,
    client: Client | None = None,
    gpu_model: str | None = "auto",
    memory_format: str = "keep",
) -> AppliedWinners:
    """Apply the recorded winners to the shapes a :class:`Capture` saw.

    ``target``: the model (with ``capture=`` a loaded capture, or a model captured with
    ``capture(model)`` in this process), or the capture itself.
    ``gpu_model="auto"`` uses winners measured on this GPU's model only (None: any).
    ``memory_format="winner"`` also weighs converting the whole model and its input to
    another memory format (needs the model); ``"keep"`` leaves the layouts as they are.
    """
    import torch

    model = None if isinstance(target, Capture) else target
    cap = capture if capture is not None else target if isinstance(target, Capture) else None
    if cap is None and model is not None:
        cap = getattr(model, MODEL_ATTR, None)
    if not isinstance(cap, Capture):
        raise ValueError(
            "apply_winners: no capture for this model; pass capture=load_capture(path), "
            "or run a few steps inside gpuwatchd.torch.capture(model) first"
        )
    if memory_format == "winner" and model is None:
        raise ValueError("apply_winners: memory_format='winner' needs the model, not the capture")
    if not torch.cuda.is_available():
        raise RuntimeError("apply_winners needs a CUDA GPU")
    client = client if client is not None else Client()
    model_name = torch.cuda.get_device_name() if gpu_model == "auto" else gpu_model
    winners = latest_by_workload(client.winners(regime=regime, gpu_model=model_name))
    plan = plan_winners(cap.calls, winners, memory_format)
    if plan.model_format is not None and model is not None:
        convert_model(model, plan.model_format)
    warmed: list[str] = []
    blocked: list[tuple[str, str]] = []
    stack = _this_stack()
    for choice in plan.convs:
        if not choice.acts:
            continue
        why = plan_cache_conflict(choice) or _stack_mismatch(choice, winners, stack)
        if why is not None:
            blocked.append((choice.workload, why))
            continue
        _first_call(choice)
        warmed.append(choice.workload)
    if plan.blas.library is not None:
        torch.backends.cuda.preferred_blas_library(plan.blas.library)
    return AppliedWinners(plan, tuple(warmed), plan.model_format, plan.blas.library, tuple(blocked))


def _this_stack() -> dict[str, str | None]:
    """The torch and cuDNN versions of this process, as the worker records them."""
    import torch

    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {"torch": torch.__version__, "cudnn": str(cudnn) if cudnn is not None else None}


def _stack_mismatch(
    choice: ConvChoice, winners: Mapping[str, Winner], stack: Mapping[str, str | None]
) -> str | None:
    """Why a benchmark pick measured under another torch or cuDNN is not applied here:
    its kernels were seen (and seen to repeat) under the recorded stack only."""
    w = winners.get(choice.workload)
    if choice.pick != "benchmark" or w is None:
        return None
    for field in ("torch", "cudnn"):
        recorded = getattr(w.versions, field)
        if recorded is not None and recorded != stack[field]:
            return (
                f"measured under {field} {recorded}, this process has {stack[field]}: "
                "the default stays"
            )
    return None


def plan_cache_conflict(choice: ConvChoice, thread: int | None = None) -> str | None:
    """Why ``choice`` cannot take effect on this thread (a capture cached another pick)."""
    call = choice.call
    key = conv_plan_key(call.dtype, call.shape, choice.layouts, call.tf32)
    cached = cached_pick(key, threading.get_ident() if thread is None else thread)
    if cached is None or cached == choice.pick:
        return None
    return (
        f"a capture in this process already ran this shape with the {cached} pick, and "
        "cuDNN keeps that plan for the thread: load the saved capture in a new process and "
        "call apply_winners before the first forward pass"
    )


def convert_model(model: Any, memory_format: str) -> None:
    """The model's parameters and every 4-D input of its forward pass in ``memory_format``.

    Converting the input at the model's entry, once per forward pass, is what
    ``model.to(memory_format=...)`` plus a converted input batch does in a job; the
    measured candidates assumed exactly that.
    """
    import torch

    fmt = _torch_format(memory_format)
    model.to(memory_format=fmt)
    old = getattr(model, _HOOK_ATTR, None)
    if old is not None:
        old.remove()

    def convert(a: Any) -> Any:
        return (
            a.contiguous(memory_format=fmt) if isinstance(a, torch.Tensor) and a.dim() == 4 else a
        )

    def to_format(
        _module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        # keyword inputs too: model(pixel_values=x) must reach the convs as measured
        return tuple(convert(a) for a in args), {k: convert(v) for k, v in kwargs.items()}

    hook = model.register_forward_pre_hook(to_format, with_kwargs=True)
    setattr(model, _HOOK_ATTR, hook)


def _torch_format(layout: str) -> Any:
    import torch

    return torch.channels_last if layout == "channels_last" else torch.contiguous_format


#: Where :func:`_first_call` makes its tensors (a seam for the CPU test of what is left).
DEVICE = "cuda"


def _first_call(choice: ConvChoice) -> None:
    """The shape's first conv, with the chosen pick and layouts, so its plan is cached on
    this thread; ``cudnn.benchmark`` is as the job had it again on return."""
    import torch
    import torch.nn.functional as F

    s = choice.call.shape
    dt = getattr(torch, choice.call.dtype)
    x_fmt, w_fmt = (_torch_format(lay) for lay in choice.layouts)
    g = torch.Generator(device=DEVICE).manual_seed(0)  # the job's own random state untouched
    x = torch.randn(s["input"], dtype=dt, device=DEVICE, generator=g)
    w = torch.randn(s["weight"], dtype=dt, device=DEVICE, generator=g)
    x, w = x.contiguous(memory_format=x_fmt), w.contiguous(memory_format=w_fmt)
    b = (
        torch.randn(s["weight"][0], dtype=dt, device=DEVICE, generator=g)
        if choice.call.bias
        else None
    )
    cudnn = torch.backends.cudnn
    previous = cudnn.benchmark
    try:
        cudnn.benchmark = choice.pick == "benchmark"
        with torch.no_grad():
            F.conv2d(x, w, b, s["stride"], s["padding"], s["dilation"], s["groups"])
        if x.is_cuda:
            torch.cuda.synchronize()
    finally:
        cudnn.benchmark = previous
