"""Build the configured telemetry backend. Imports each backend only when chosen."""

from __future__ import annotations

from gpuwatchd.config import Config
from gpuwatchd.telemetry.backend import Backend, BackendUnavailable, Clock


def open_backend(cfg: Config, sim_clock: Clock | None = None) -> Backend:
    """Open ``cfg.daemon.backend``; raises :class:`BackendUnavailable` with one line.

    ``sim_clock`` replaces the sim backend's real-time clock (``tune`` fast-forwards).
    """
    kind = cfg.daemon.backend
    if kind == "nvml":
        from gpuwatchd.telemetry.nvml import NvmlBackend

        return NvmlBackend()
    if kind == "sim":
        from gpuwatchd.telemetry.clocks import ScaledClock
        from gpuwatchd.telemetry.sim import SimBackend

        try:
            return SimBackend(
                gpus=cfg.sim.gpus,
                scenario=cfg.sim.scenario,
                seed=cfg.sim.seed,
                clock=sim_clock or ScaledClock(cfg.sim.speed),
            )
        except ValueError as exc:
            raise BackendUnavailable(f"sim: {exc}") from None
    if kind == "replay":
        from gpuwatchd.telemetry.replay import ReplayBackend

        if not cfg.replay.trace:
            raise BackendUnavailable("replay: no trace file given (use --trace FILE)")
        return ReplayBackend(cfg.replay.trace, speed=cfg.replay.speed, loop=cfg.replay.loop)
    raise BackendUnavailable(f"unknown backend {kind!r} (known: nvml, sim, replay)")
