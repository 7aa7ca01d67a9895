"""Gated autotuning: workloads, candidate families, the measurement protocol, the worker."""
