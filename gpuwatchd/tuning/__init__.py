"""Gated autotuning: workloads, candidate families, the measurement protocol, the worker.

The top level is the vocabulary the daemon and the worker share; work that jobs hand the
daemon is in :mod:`.submitted` (its formats and checks) and :mod:`.intake` (how it arrives).
"""
