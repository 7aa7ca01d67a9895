"""Tuning vocabulary shared by the daemon (which never imports torch) and the worker.

Everything here is plain data that crosses the daemon/worker process boundary as JSON.
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any


class Regime(enum.StrEnum):
    """The two thermal regimes every candidate is measured in."""

    UNTHROTTLED = "unthrottled"  # full boost clock, no throttle reason: short batches, pauses
    SUSTAINED = "sustained"  # back-to-back until clocks/power settle: what a training loop sees


class SessionStatus(enum.StrEnum):
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"  # crash, hang (timeout), garbage output, bad workload
    PREEMPTED = "preempted"  # another process wanted the GPU; retried at the next open gate
    DEFERRED = "deferred"  # never started: gate shut, outside the time window, ...


@dataclass(frozen=True, slots=True)
class Workload:
    """A named op with shapes and dtype, e.g. a bf16 8192^3 GEMM.

    ``shape`` is op specific: matmul uses m, n, k; conv2d uses input (N,C,H,W),
    weight (K,C,R,S), stride, padding; sim ops use their own keys. ``families``
    lists the candidate families that turn it into candidates.
    """

    name: str
    op: str
    shape: dict[str, Any]
    dtype: str
    families: tuple[str, ...]
    params: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "op": self.op,
            "shape": self.shape,
            "dtype": self.dtype,
            "families": list(self.families),
            "params": self.params,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Workload:
        return cls(
            name=str(d["name"]),
            op=str(d["op"]),
            shape=dict(d["shape"]),
            dtype=str(d["dtype"]),
            families=tuple(d["families"]),
            params=dict(d.get("params", {})),
        )


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """One timed batch of ``calls`` calls, tagged with the GPU state read around it."""

    candidate: str
    regime: Regime
    seconds_per_call: float
    calls: int
    sm_clock_mhz: float | None
    power_w: float | None
    temp_c: float | None
    reasons: int  # ThrottleReason bits seen before or after the batch
    rejected: bool = False
    reject_reason: str | None = None


@dataclass(frozen=True, slots=True)
class CandidateStats:
    """Per-candidate statistics for one regime."""

    name: str
    family: str
    regime: Regime
    median_s: float | None  # None when every batch was rejected
    spread: float | None  # relative spread (IQR / median) of accepted batches
    samples: int  # accepted batches
    rejected: int  # discarded batches (throttled during an unthrottled batch, ...)
    sm_clock_hz: float | None  # mean SM clock over accepted batches
    power_w: float | None
    temp_c: float | None
    energy_j_per_call: float | None
    reasons: int  # union of ThrottleReason bits seen on accepted batches
    meta: dict[str, Any] = field(default_factory=dict)  # kernel names, config, ...


@dataclass(frozen=True, slots=True)
class RegimeResult:
    """Outcome of one regime for one workload: the winner, or a tie when within noise."""

    workload: str
    regime: Regime
    candidates: tuple[CandidateStats, ...]
    winner: str | None
    tie: bool
    margin: float | None  # (runner_up - winner) / winner
    noise: float | None  # the relative noise the margin had to beat


@dataclass(frozen=True, slots=True)
class Versions:
    """The software stack a timing depends on; winners are keyed by all of it.

    ``cuda`` is the CUDA runtime torch was built against: it decides the cuBLAS
    and cuDNN kernels on offer, and torch's version string does not always carry it.
    A field that is unknown (no torch on a sim run, say) is ``None``.
    """

    driver: str | None = None
    cuda: str | None = None
    torch: str | None = None
    triton: str | None = None
    cudnn: str | None = None

    def key(self) -> str:
        """Canonical JSON (sorted keys, no spaces, nulls kept): equal stacks, equal keys."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    def merge(self, other: Versions) -> Versions:
        """These versions with every field ``other`` knows taking precedence."""
        known = {f.name: getattr(other, f.name) for f in fields(other)}
        return replace(self, **{k: v for k, v in known.items() if v is not None})

    @classmethod
    def from_json(cls, d: Any) -> Versions:
        """Parse a versions mapping; unknown keys are ignored, values must be strings."""
        if not isinstance(d, dict):
            raise ValueError(f"versions must be an object, got {type(d).__name__}")
        out: dict[str, str | None] = {}
        for f in fields(cls):
            v = d.get(f.name)
            if v is not None and not isinstance(v, str):
                raise ValueError(f"versions.{f.name} must be a string, got {v!r}")
            out[f.name] = v
        return cls(**out)
