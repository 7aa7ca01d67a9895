"""Make a job's captured shapes run with their recorded winners, from the first call on.

Convolutions: in torch's cuDNN v8 path the execution plan picked by a shape's first
call is cached (per thread, keyed by shapes, strides, dtype and math mode, not by the
benchmark flag) and reused for the life of the process. So for each captured
forward-convolution shape, :func:`apply_winners` runs that first call itself, with
``cudnn.benchmark`` set as the winner says (heuristic or benchmark pick) and in the
winning memory format, then restores the flag: the model's own calls of that shape
then run the winner's plan. Run it on the thread that runs the model's forward pass.

GEMMs: the BLAS library (cuBLAS or cuBLASLt) is the one GEMM choice torch gives a job,
and it is process-wide: the plan's library is set with
``torch.backends.cuda.preferred_blas_library``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpuwatchd.client import Client
from gpuwatchd.jobside.capture import MODEL_ATTR, Capture
from gpuwatchd.jobside.winner_plan import ConvChoice, WinnerPlan, latest_by_workload, plan_winners
from gpuwatchd.tuning.types import Regime


@dataclass(frozen=True, slots=True)
class AppliedWinners:
    """What :func:`apply_winners` did: the plan, the layers converted, the library set."""

    plan: WinnerPlan
    warmed: tuple[str, ...]  # conv workloads whose first call ran with the winner
    converted_layers: int
    blas_library: str | None

    def __str__(self) -> str:
        return self.plan.describe()


def apply_winners(
    target: Any,
    regime: Regime | str = Regime.SUSTAINED,
    *,
    client: Client | None = None,
    gpu_model: str | None = "auto",
    memory_format: str = "keep",
) -> AppliedWinners:
    """Apply the recorded winners to the shapes a :class:`Capture` saw.

    ``target``: the capture, or a model captured with ``capture(model)``.
    ``gpu_model="auto"`` uses winners measured on this GPU's model only (None: any).
    ``memory_format="winner"`` also converts the model's matching ``Conv2d`` layers to
    the winning memory format (needs ``target`` to be the model).
    """
    import torch

    model = None if isinstance(target, Capture) else target
    cap = target if isinstance(target, Capture) else getattr(target, MODEL_ATTR, None)
    if not isinstance(cap, Capture):
        raise ValueError(
            "apply_winners: no capture for this model; run a few steps inside "
            "gpuwatchd.torch.capture(model) first, or pass the capture"
        )
    if memory_format == "winner" and model is None:
        raise ValueError("apply_winners: memory_format='winner' needs the model, not the capture")
    if not torch.cuda.is_available():
        raise RuntimeError("apply_winners needs a CUDA GPU")
    client = client if client is not None else Client()
    model_name = torch.cuda.get_device_name() if gpu_model == "auto" else gpu_model
    winners = latest_by_workload(client.winners(regime=regime, gpu_model=model_name))
    plan = plan_winners(cap.calls, winners, memory_format)
    converted = 0
    warmed = []
    for choice in plan.convs:
        if choice.converts and model is not None:
            converted += _convert_layers(model, choice)
        _first_call(choice)
        warmed.append(choice.workload)
    if plan.blas.library is not None:
        torch.backends.cuda.preferred_blas_library(plan.blas.library)
    return AppliedWinners(plan, tuple(warmed), converted, plan.blas.library)


def _first_call(choice: ConvChoice) -> None:
    """The shape's first conv, with the winner's pick and format, so its plan is cached."""
    import torch
    import torch.nn.functional as F

    s = choice.call.shape
    dt = getattr(torch, choice.call.dtype)
    fmt = (
        torch.channels_last if choice.memory_format == "channels_last" else torch.contiguous_format
    )
    x = torch.randn(s["input"], dtype=dt, device="cuda").contiguous(memory_format=fmt)
    w = torch.randn(s["weight"], dtype=dt, device="cuda").contiguous(memory_format=fmt)
    b = torch.randn(s["weight"][0], dtype=dt, device="cuda") if choice.call.bias else None
    cudnn = torch.backends.cudnn
    previous = cudnn.benchmark
    try:
        cudnn.benchmark = choice.pick == "benchmark"
        with torch.no_grad():
            F.conv2d(x, w, b, s["stride"], s["padding"], s["dilation"], s["groups"])
        torch.cuda.synchronize()
    finally:
        cudnn.benchmark = previous


def _convert_layers(model: Any, choice: ConvChoice) -> int:
    """Put the model's Conv2d layers of this shape into the winning memory format."""
    import torch

    fmt = (
        torch.channels_last if choice.memory_format == "channels_last" else torch.contiguous_format
    )
    s = choice.call.shape
    n = 0
    for layer in model.modules():
        if not isinstance(layer, torch.nn.Conv2d):
            continue
        same = (
            list(layer.weight.shape) == s["weight"]
            and list(layer.stride) == s["stride"]
            and list(layer.dilation) == s["dilation"]
            and layer.groups == s["groups"]
            and isinstance(layer.padding, tuple)
            and list(layer.padding) == s["padding"]
        )
        if same:
            layer.to(memory_format=fmt)  # type: ignore[call-overload]  # documented, unstubbed
            n += 1
    return n
