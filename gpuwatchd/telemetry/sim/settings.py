"""The ``[sim]`` table: which simulated GPUs ``--backend sim`` runs, and how fast."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuwatchd.validate import check


def _known_scenario(name: str) -> bool:
    from gpuwatchd.telemetry.sim.scenarios import SCENARIOS

    if name not in SCENARIOS:
        raise ValueError(f"sim.scenario: unknown {name!r} (known: {', '.join(SCENARIOS)})")
    return True


@dataclass(frozen=True, slots=True)
class SimConfig:
    """The simulated GPU (``--backend sim``); a sim tuning session replays the same one."""

    gpus: int = field(default=1, metadata=check(lambda v: 1 <= v <= 1024, "must be in [1, 1024]"))
    scenario: str = field(default="idle", metadata=check(_known_scenario, ""))
    seed: int = 0
    #: Simulated seconds per real second. The model steps at most 1 s of simulated time at
    #: a time, so a read at speed 1e15 never returns: 1000 is plenty for fast tests.
    speed: float = field(
        default=1.0, metadata=check(lambda v: 0 < v <= 1000, "must be in (0, 1000]")
    )
    #: Scenario time (simulated seconds) the GPUs start at: ``fan-failure`` with 12600
    #: starts 3.5 h into its cooling decline. The model plays the scenario up to it first.
    start_s: float = field(default=0.0, metadata=check(lambda v: v >= 0, "must be >= 0"))
