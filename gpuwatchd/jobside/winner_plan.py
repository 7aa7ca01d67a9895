"""Which recorded winner a job applies to each captured shape, decided without touching torch.

Convolutions: each forward convolution shape gets the fastest recorded cuDNN choice
(heuristic or benchmark pick) in the memory format the model already uses
(``memory_format="keep"``), or the overall winner, format included (``"winner"``: the
model's matching layers are then converted). GEMMs: torch lets a job choose only the
BLAS library, for the whole process, so the plan takes the library with the least
estimated GEMM time over all captured shapes (calls times the recorded median).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuwatchd.client import RankedCandidate, Winner
from gpuwatchd.tuning.captured import CapturedCall, workload_for

MEMORY_FORMATS = ("keep", "winner")
_CUDNN_NAME = re.compile(
    r"^cudnn\[(?P<pick>heuristic|benchmark),(?P<fmt>contiguous|channels_last)\]$"
)


@dataclass(frozen=True, slots=True)
class ConvChoice:
    """The cuDNN choice for one captured forward-convolution shape."""

    workload: str
    call: CapturedCall  # the largest-share call of the shape
    candidate: str
    pick: str  # "heuristic" or "benchmark": cudnn.benchmark for the first call
    memory_format: str  # "contiguous" or "channels_last"
    median_s: float | None

    @property
    def converts(self) -> bool:
        """The choice's memory format differs from what the model used."""
        return self.memory_format != self.call.layout


@dataclass(frozen=True, slots=True)
class BlasChoice:
    """The BLAS library for the process and the estimated GEMM time of each library."""

    library: str | None
    estimated_s: dict[str, float]
    shapes: int  # captured GEMM shapes with a winner measured for every library


@dataclass(frozen=True, slots=True)
class WinnerPlan:
    convs: tuple[ConvChoice, ...]
    blas: BlasChoice
    skipped: tuple[tuple[str, str], ...]  # (workload, why) for shapes left as they are

    def describe(self) -> str:
        lines = [
            f"conv {c.workload}: {c.pick} pick, {c.memory_format}"
            + (" (converts the layer)" if c.converts else "")
            for c in self.convs
        ]
        if self.blas.library is not None:
            est = ", ".join(
                f"{k} {v * 1e3:.3f} ms" for k, v in sorted(self.blas.estimated_s.items())
            )
            lines.append(
                f"GEMMs: {self.blas.library} ({self.blas.shapes} shape(s); "
                f"estimated per capture: {est})"
            )
        lines += [f"skipped {name}: {why}" for name, why in self.skipped]
        return "\n".join(lines) or "nothing to apply"


def plan_winners(
    calls: Iterable[CapturedCall],
    winners: Mapping[str, Winner],
    memory_format: str = "keep",
) -> WinnerPlan:
    """The plan for ``calls`` given the recorded ``winners`` (by workload name)."""
    if memory_format not in MEMORY_FORMATS:
        raise ValueError(f"memory_format: expected keep or winner, got {memory_format!r}")
    convs: dict[str, CapturedCall] = {}
    gemm_calls: dict[str, int] = {}
    for call in calls:
        if not call.tunable:
            continue
        name = workload_for(call).name
        if call.kind == "conv2d":
            best = convs.get(name)
            convs[name] = call if best is None or call.share > best.share else best
        else:
            gemm_calls[name] = gemm_calls.get(name, 0) + call.calls
    skipped: list[tuple[str, str]] = []
    chosen: list[ConvChoice] = []
    for name, call in convs.items():
        w = winners.get(name)
        if w is None:
            skipped.append((name, "no winner recorded"))
            continue
        choice = _conv_choice(name, call, w, memory_format)
        if choice is None:
            skipped.append((name, f"no measured {call.layout} choice recorded"))
        else:
            chosen.append(choice)
    blas = _blas_choice(gemm_calls, winners, skipped)
    return WinnerPlan(tuple(chosen), blas, tuple(skipped))


def _conv_choice(name: str, call: CapturedCall, w: Winner, memory_format: str) -> ConvChoice | None:
    if memory_format == "winner":
        parsed = _cudnn_choice(w.candidate, w.meta)
        if parsed is not None:
            return ConvChoice(name, call, w.candidate, *parsed, w.median_s)
    for c in _measured(w.ranked):
        parsed = _cudnn_choice(c.name, c.meta)
        if parsed is not None and parsed[1] == call.layout:
            return ConvChoice(name, call, c.name, *parsed, c.median_s)
    return None


def _cudnn_choice(name: str, meta: Mapping[str, Any]) -> tuple[str, str] | None:
    """(pick, memory format) of a ``torch.conv2d`` candidate, from its meta or its name."""
    pick, fmt = meta.get("pick"), meta.get("memory_format")
    if pick in ("heuristic", "benchmark") and fmt in ("contiguous", "channels_last"):
        return str(pick), str(fmt)
    m = _CUDNN_NAME.match(name)
    return (m["pick"], m["fmt"]) if m else None


def _measured(ranked: Iterable[RankedCandidate]) -> list[RankedCandidate]:
    return sorted((c for c in ranked if c.median_s is not None), key=lambda c: c.median_s or 0.0)


def _blas_choice(
    gemm_calls: Mapping[str, int], winners: Mapping[str, Winner], skipped: list[tuple[str, str]]
) -> BlasChoice:
    per_shape: dict[str, dict[str, float]] = {}
    for name, count in gemm_calls.items():
        w = winners.get(name)
        if w is None:
            skipped.append((name, "no winner recorded"))
            continue
        times = {c.name: c.median_s * count for c in _measured(w.ranked) if c.median_s}
        if times:
            per_shape[name] = times
    libraries = set.intersection(*(set(t) for t in per_shape.values())) if per_shape else set()
    if not libraries:
        return BlasChoice(None, {}, 0)
    totals = {lib: sum(t[lib] for t in per_shape.values()) for lib in sorted(libraries)}
    best = min(totals, key=lambda lib: totals[lib])
    return BlasChoice(best, totals, len(per_shape))


def latest_by_workload(winners: Iterable[Winner]) -> dict[str, Winner]:
    """The newest winner of each workload (what :meth:`Client.winner` would return)."""
    out: dict[str, Winner] = {}
    for w in winners:
        seen = out.get(w.workload)
        if seen is None or w.measured_at > seen.measured_at:
            out[w.workload] = w
    return out
