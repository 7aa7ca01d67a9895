"""Build the configured telemetry backend. Imports each backend only when chosen."""

from __future__ import annotations

from gpuwatchd.telemetry.backend import Backend, BackendUnavailable, Clock
from gpuwatchd.telemetry.settings import BACKENDS, BackendSpec


def open_backend(spec: BackendSpec, sim_clock: Clock | None = None) -> Backend:
    """Open ``spec.kind``; raises :class:`BackendUnavailable` with one line.

    ``sim_clock`` replaces the sim backend's real-time clock (``tune`` fast-forwards).
    """
    kind = spec.kind
    if kind == "nvml":
        from gpuwatchd.telemetry.nvml import NvmlBackend

        return NvmlBackend()
    if kind == "sim":
        from gpuwatchd.telemetry.clocks import ScaledClock
        from gpuwatchd.telemetry.sim import SimBackend

        sim = spec.sim
        try:
            return SimBackend(
                gpus=sim.gpus,
                scenario=sim.scenario,
                seed=sim.seed,
                clock=sim_clock or ScaledClock(sim.speed),
                start_s=sim.start_s,
            )
        except ValueError as exc:
            raise BackendUnavailable(f"sim: {exc}") from None
    if kind == "replay":
        from gpuwatchd.telemetry.replay import ReplayBackend

        replay = spec.replay
        if not replay.trace:
            raise BackendUnavailable("replay: no trace file given (use --trace FILE)")
        return ReplayBackend(replay.trace, speed=replay.speed, loop=replay.loop)
    raise BackendUnavailable(f"unknown backend {kind!r} (known: {', '.join(BACKENDS)})")
