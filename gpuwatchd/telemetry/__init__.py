"""Telemetry backends (nvml, sim, replay) behind one interface."""
