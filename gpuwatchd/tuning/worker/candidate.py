"""What a candidate kernel and a measuring device look like to the protocol.

These run in the worker process only. A family turns a :class:`Workload` into
candidates; the protocol times them on a :class:`DeviceSession`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from gpuwatchd.telemetry.types import DeviceInfo, Sample
from gpuwatchd.tuning.types import Workload


class Candidate(Protocol):
    """One way to compute a workload (a Triton config, cuBLAS, a cuDNN algo pick, ...)."""

    name: str  # unique within the workload, e.g. "triton[128x256x64,s3,w8]"
    family: str  # e.g. "triton.matmul"

    def setup(self) -> None:
        """Allocate inputs, compile, warm up once and check the result against a reference.

        Raise :class:`CandidateError` if it cannot run or computes the wrong answer.
        """
        ...

    def run(self, calls: int) -> None:
        """Enqueue ``calls`` back-to-back calls (asynchronous on a GPU)."""
        ...

    def meta(self) -> dict[str, Any]:
        """Facts worth recording: config, kernel names, flop count, ..."""
        ...

    def teardown(self) -> None: ...


class CandidateError(Exception):
    """A candidate could not be built or computed a wrong result; it is skipped."""


class DeviceSession(Protocol):
    """The worker's handle on one GPU (or the CPU, or a simulated GPU).

    ``time_batch`` runs ``calls`` calls of a candidate and returns device-timed seconds
    for the whole batch (CUDA events on a GPU); ``sample`` reads telemetry (NVML, sim,
    or a GPU-less placeholder with absent fields); ``pause`` idles without load.
    """

    info: DeviceInfo

    def sample(self) -> Sample: ...

    def time_batch(self, candidate: Candidate, calls: int) -> float: ...

    def flush_l2(self) -> None: ...

    def pause(self, seconds: float) -> None: ...

    def now(self) -> float: ...


#: A family builds the candidates for one workload on one device session.
Family = Callable[[Workload, DeviceSession], Sequence[Candidate]]
