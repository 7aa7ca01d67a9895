"""The part every GPU family's candidate shares: a setup that cleans up after itself.

A GPU candidate takes scarce things in ``setup`` (the shared GEMM buffers, its own
thread, a compiled launcher). When setup fails half-way, what it took so far must be
given back at once: the protocol skips a failed candidate and never calls its
``teardown``. :class:`CandidateBase` does that once for every family; a family writes
``_setup`` (take, compile, check), ``run`` and an idempotent ``teardown``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class CandidateBase(ABC):
    """A :class:`~gpuwatchd.tuning.worker.candidate.Candidate` whose failed setup releases
    everything it took; ``meta`` is what ``_setup`` recorded in ``self._meta``."""

    family: str

    def __init__(self, name: str) -> None:
        self.name = name
        self._meta: dict[str, Any] = {}

    def setup(self) -> None:
        """Run :meth:`_setup`; on any failure, :meth:`teardown` before re-raising."""
        try:
            self._setup()
        except BaseException:
            self.teardown()
            raise

    def meta(self) -> dict[str, Any]:
        return dict(self._meta)

    @abstractmethod
    def _setup(self) -> None:
        """Allocate, compile, warm up once and check the result against a reference.

        Raise :class:`~gpuwatchd.tuning.worker.candidate.CandidateError` if it cannot
        run or computes the wrong answer.
        """

    @abstractmethod
    def run(self, calls: int) -> None:
        """Enqueue ``calls`` back-to-back calls."""

    @abstractmethod
    def teardown(self) -> None:
        """Release whatever :meth:`_setup` took so far; safe to call more than once."""
