"""Which recorded winner a job applies to each captured shape, decided without touching torch.

The rule everywhere: what the job runs without gpuwatchd (its *default*) is one of the
measured candidates, and a recorded choice replaces it only when the worker found it
faster than the default beyond the noise (the candidate's ``vs_default`` verdict).
Otherwise the default stays and the plan says so.

Convolutions: each forward convolution shape gets the fastest cuDNN pick (heuristic or
benchmark) measured in the job's own input and weight layouts that beats the default
(the heuristic pick in those layouts). A benchmark pick that landed on other kernels
when the worker made it again (``meta["reproducible"]`` false) is never chosen: a job
can ask cuDNN for the mode, not for the kernels. ``memory_format="winner"`` also weighs converting
the *whole model* and its input to another memory format: only when every captured conv
shape was measured in that format (both operands in it, as after
``model.to(memory_format=...)``) and the summed conv time beats the kept choices beyond
the noise. A single layer is never converted alone: its input would be converted on
every call.

GEMMs: torch lets a job choose only the BLAS library, for the whole process, so the plan
weighs the library's estimated time over all captured shapes (calls times the recorded
median) against the default library's, and says per shape what the process-wide choice
gives up.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpuwatchd.tuning.families.torch_conv import DEFAULT_PICK
from gpuwatchd.tuning.submitted.captured import CONV_LAYOUTS as _LAYOUTS
from gpuwatchd.tuning.submitted.captured import CapturedCall, workload_for
from gpuwatchd.tuning.winners import JOB_DEFAULT, VS_DEFAULT

if TYPE_CHECKING:
    from gpuwatchd.api.winners import RankedCandidate, Winner

MEMORY_FORMATS = ("keep", "winner")
#: The library torch prefers in a process that never chose one.
DEFAULT_BLAS = "cublas"
_CUDNN_NAME = re.compile(
    r"^cudnn\[(?P<pick>heuristic|benchmark),"
    r"(?:(?P<fmt>contiguous|channels_last)|x:(?P<x>contiguous|channels_last)"
    r"\+w:(?P<w>contiguous|channels_last))\]$"
)


@dataclass(frozen=True, slots=True)
class ConvChoice:
    """The cuDNN choice for one captured forward-convolution shape."""

    workload: str
    call: CapturedCall  # the largest-share call of the shape
    candidate: str
    pick: str  # "heuristic" or "benchmark": cudnn.benchmark for the first call
    layouts: tuple[str, str]  # (input, weight) memory formats it was measured with
    median_s: float | None
    kept_default: bool  # nothing beat the job's default beyond the noise
    kernels: tuple[str, ...] = ()  # what the measured candidate launched

    @property
    def memory_format(self) -> str:
        """The uniform format of both operands, or ``mixed``."""
        return self.layouts[0] if self.layouts[0] == self.layouts[1] else "mixed"

    @property
    def acts(self) -> bool:
        """Whether applying it changes anything the job would do on its own."""
        return not self.kept_default


@dataclass(frozen=True, slots=True)
class BlasChoice:
    """The BLAS library for the process and the estimated GEMM time of each library.

    ``library`` is None when the default stays (or nothing was measured); ``given_up``
    lists, per shape whose own best library is not the one chosen, (workload, its best
    library, the fraction it runs slower with the chosen one).
    """

    library: str | None
    estimated_s: dict[str, float]
    shapes: int  # captured GEMM shapes with a winner measured for every library
    default: str = DEFAULT_BLAS
    reason: str = ""
    given_up: tuple[tuple[str, str, float], ...] = ()


@dataclass(frozen=True, slots=True)
class WinnerPlan:
    convs: tuple[ConvChoice, ...]
    blas: BlasChoice
    skipped: tuple[tuple[str, str], ...]  # (workload, why) for shapes left as they are
    #: the memory format the whole model and its input go to, or None (as the job has it)
    model_format: str | None = None
    model_format_reason: str = ""

    def describe(self) -> str:
        lines = []
        if self.model_format is not None:
            lines.append(f"model and input: {self.model_format} ({self.model_format_reason})")
        elif self.model_format_reason:
            lines.append(f"model memory format kept: {self.model_format_reason}")
        for c in self.convs:
            what = f"{c.pick} pick, {_layout_text(c.layouts)}"
            if c.kept_default:
                what = f"default kept ({what}): nothing beat it beyond the noise"
            lines.append(f"conv {c.workload}: {what}")
        b = self.blas
        if b.estimated_s:
            est = ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in sorted(b.estimated_s.items()))
            pick = b.library or f"{b.default} (default kept)"
            lines.append(
                f"GEMMs: {pick} ({b.shapes} shape(s); estimated per capture: {est})"
                + (f"; {b.reason}" if b.reason else "")
            )
            lines += [
                f"  {name}: its own best is {best}, {loss * 100:.1f}% slower with {pick}"
                for name, best, loss in b.given_up
            ]
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
    kept: dict[str, ConvChoice] = {}
    for name, call in convs.items():
        w = winners.get(name)
        if w is None:
            skipped.append((name, "no winner recorded"))
            continue
        choice = _conv_choice(name, call, w, call.layouts)
        if choice is None:
            skipped.append((name, "the job's default was not measured in its own layouts"))
        else:
            kept[name] = choice
    model_format, why = None, ""
    if memory_format == "winner" and kept:
        model_format, why, switched = _model_format(convs, winners, kept)
        if model_format is not None:
            kept.update(switched)
    blas = _blas_choice(gemm_calls, winners, skipped)
    return WinnerPlan(tuple(kept.values()), blas, tuple(skipped), model_format, why)


# -- convolutions --------------------------------------------------------------------------


def _conv_choice(
    name: str, call: CapturedCall, w: Winner, layouts: tuple[str, str]
) -> ConvChoice | None:
    """The fastest pick in ``layouts`` that beats the job's default there, else the default.

    None when the default in ``layouts`` was never measured (nothing safe to compare).
    """
    mine = [(c, parsed) for c, parsed in _conv_candidates(w) if parsed[1] == layouts]
    default = next((c for c, (pick, _) in mine if pick == DEFAULT_PICK), None)
    if default is None or default.median_s is None:
        return None
    for c, (pick, lay) in mine:  # fastest first
        if c is default:
            break
        if beats_default(c.meta) and _reproducible(c):
            return ConvChoice(name, call, c.name, pick, lay, c.median_s, False, _kernels(c))
    return ConvChoice(
        name, call, default.name, DEFAULT_PICK, layouts, default.median_s, True, _kernels(default)
    )


def _model_format(
    convs: Mapping[str, CapturedCall],
    winners: Mapping[str, Winner],
    kept: Mapping[str, ConvChoice],
) -> tuple[str | None, str, dict[str, ConvChoice]]:
    """Whether converting the whole model to one memory format beats the kept choices.

    Every captured conv shape must have a measured choice in that format; the summed time
    (calls x median) must beat the kept choices' by more than the summed noise: each
    switched candidate's noise against the job's default, weighted by its shape's time.
    That bounds the sum's error even when every shape's errs the same way, and a small
    noisy shape weighs as little as it costs.
    """
    unplanned = next((n for n in convs if n not in kept), None)
    if unplanned is not None:  # its time cannot be weighed: no switch, whatever the format
        return None, f"{unplanned}: the job's default was not measured in its layouts", {}
    job_layouts = {call.layouts for call in convs.values()}
    best_reason = "no captured conv shape was measured in another memory format"
    for fmt in _LAYOUTS:
        if job_layouts == {(fmt, fmt)}:
            continue  # the model already runs in it
        switched: dict[str, ConvChoice] = {}
        for name, call in convs.items():
            w = winners.get(name)
            fastest = _fastest_in(w, (fmt, fmt)) if w is not None else None
            if fastest is None:
                best_reason = f"{name} was not measured in {fmt}"
                break
            # in a converted model nothing is the job's default any more: pin every pick
            c, pick = fastest
            switched[name] = ConvChoice(
                name, call, c.name, pick, (fmt, fmt), c.median_s, False, _kernels(c)
            )
        else:
            noises = {n: _noise(winners[n], switched[n].candidate) for n in kept}
            unknown = next((n for n, x in noises.items() if x is None), None)
            if unknown is not None:
                best_reason = f"{unknown}: no noise recorded against the job's default in {fmt}"
                continue
            keep_s = sum(_time(kept[n]) for n in kept)
            switch_s = sum(_time(switched[n]) for n in kept)
            spread = sum((noises[n] or 0.0) * max(_time(kept[n]), _time(switched[n])) for n in kept)
            noise = spread / keep_s if keep_s > 0 else 0.0
            if keep_s > 0 and switch_s < keep_s * (1.0 - noise):
                gain = 1.0 - switch_s / keep_s
                reason = f"summed conv time {gain * 100:.1f}% less, beyond the noise {noise:.1%}"
                return fmt, reason, switched
            best_reason = f"{fmt} does not beat the kept choices beyond the noise {noise:.1%}"
    return None, best_reason, {}


def _fastest_in(w: Winner, layouts: tuple[str, str]) -> tuple[RankedCandidate, str] | None:
    """The fastest measured, reproducible candidate in ``layouts`` and its pick."""
    return next(
        (
            (c, pick)
            for c, (pick, lay) in _conv_candidates(w)
            if lay == layouts and _reproducible(c)
        ),
        None,
    )


def measured_layouts(w: Winner) -> set[tuple[str, str]]:
    """The (input, weight) layouts some cuDNN candidate of ``w`` was measured in: what a
    plan can weigh for the shape (a model-wide format needs its uniform pair here)."""
    return {lay for _, (_, lay) in _conv_candidates(w)}


def _time(choice: ConvChoice) -> float:
    return (choice.median_s or 0.0) * choice.call.calls


def _conv_candidates(w: Winner) -> list[tuple[RankedCandidate, tuple[str, tuple[str, str]]]]:
    """Measured cuDNN candidates, fastest first, with (pick, (input, weight) layouts)."""
    out = []
    for c in _measured(w.ranked):
        parsed = _cudnn_choice(c.name, c.meta)
        if parsed is not None:
            out.append((c, parsed))
    return out


def _cudnn_choice(name: str, meta: Mapping[str, Any]) -> tuple[str, tuple[str, str]] | None:
    """(pick, (input, weight) layouts) of a ``torch.conv2d`` candidate, from meta or name."""
    pick = meta.get("pick")
    x, w = meta.get("input_layout"), meta.get("weight_layout")
    if x is None and w is None and meta.get("memory_format") in _LAYOUTS:
        x = w = meta["memory_format"]  # recorded before layouts were kept apart
    if pick in ("heuristic", "benchmark") and x in _LAYOUTS and w in _LAYOUTS:
        return str(pick), (str(x), str(w))
    m = _CUDNN_NAME.match(name)
    if m is None:
        return None
    fmt = m["fmt"]
    return m["pick"], ((fmt, fmt) if fmt else (m["x"], m["w"]))


def _layout_text(layouts: tuple[str, str]) -> str:
    x, w = layouts
    return x if x == w else f"input {x}, weight {w}"


# -- the default and the noise ---------------------------------------------------------------


def beats_default(meta: Mapping[str, Any]) -> bool:
    """The worker's verdict in a candidate's meta: faster than the job's default beyond
    the noise."""
    verdict = meta.get(VS_DEFAULT)
    return isinstance(verdict, Mapping) and verdict.get("beats") is True


def _reproducible(c: RankedCandidate) -> bool:
    """False only where the worker saw the pick land on other kernels when made again."""
    return c.meta.get("reproducible") is not False


def _kernels(c: RankedCandidate) -> tuple[str, ...]:
    names = c.meta.get("kernels")
    return tuple(str(n) for n in names) if isinstance(names, list) else ()


def _noise(w: Winner, candidate: str) -> float | None:
    """The noise the candidate's margin over the default had to beat; None where the
    stored verdict has none that is a finite fraction >= 0 (stored rows are untrusted)."""
    for c in w.ranked:
        if c.name == candidate:
            verdict = c.meta.get(VS_DEFAULT)
            noise = verdict.get("noise") if isinstance(verdict, Mapping) else None
            if isinstance(noise, int | float) and not isinstance(noise, bool):
                return float(noise) if math.isfinite(noise) and noise >= 0 else None
    return None


def _measured(ranked: Iterable[RankedCandidate]) -> list[RankedCandidate]:
    return sorted((c for c in ranked if c.median_s is not None), key=lambda c: c.median_s or 0.0)


# -- GEMMs ------------------------------------------------------------------------------------


def _blas_choice(
    gemm_calls: Mapping[str, int], winners: Mapping[str, Winner], skipped: list[tuple[str, str]]
) -> BlasChoice:
    per_shape: dict[str, dict[str, float]] = {}
    best_of: dict[str, str] = {}
    noise = 0.0
    default = DEFAULT_BLAS
    for name, count in gemm_calls.items():
        w = winners.get(name)
        if w is None:
            skipped.append((name, "no winner recorded"))
            continue
        measured = _measured(w.ranked)
        times = {c.name: c.median_s * count for c in measured if c.median_s}
        if not times:
            continue
        per_shape[name] = times
        marked = next((c.name for c in measured if c.meta.get(JOB_DEFAULT)), None)
        default = marked or default
        own = next((c for c in measured if beats_default(c.meta)), None)
        best_of[name] = own.name if own is not None else default
        noise = max([noise] + [_noise(w, c.name) or 0.0 for c in measured])
    libraries = set.intersection(*(set(t) for t in per_shape.values())) if per_shape else set()
    if not libraries:
        return BlasChoice(None, {}, 0, default)
    totals = {lib: sum(t[lib] for t in per_shape.values()) for lib in sorted(libraries)}
    best = min(totals, key=lambda lib: totals[lib])
    if default not in totals:
        return BlasChoice(None, totals, len(per_shape), default, "the default was not measured")
    chosen, reason = None, ""
    if best != default and totals[best] < totals[default] * (1.0 - noise):
        chosen = best
        gain = 1.0 - totals[best] / totals[default]
        reason = f"{gain * 100:.1f}% less GEMM time than {default}, beyond the noise {noise:.1%}"
    elif best != default:
        reason = f"{best} does not beat {default} beyond the noise {noise:.1%}"
    running = chosen or default
    given_up = tuple(
        (name, best_of[name], per_shape[name][running] / per_shape[name][best_of[name]] - 1.0)
        for name in per_shape
        if best_of[name] != running and best_of[name] in per_shape[name]
    )
    return BlasChoice(chosen, totals, len(per_shape), default, reason, given_up)


def latest_by_workload(winners: Iterable[Winner]) -> dict[str, Winner]:
    """The newest winner of each workload (what :meth:`Client.winner` would return)."""
    out: dict[str, Winner] = {}
    for w in winners:
        seen = out.get(w.workload)
        if seen is None or w.measured_at > seen.measured_at:
            out[w.workload] = w
    return out
