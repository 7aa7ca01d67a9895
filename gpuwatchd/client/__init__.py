"""What a job imports to ask the daemon: is my GPU ready to tune on, and which kernel won?

Importable without torch. The documents it reads are parsed by :mod:`gpuwatchd.api`,
the same code the daemon and the CLI use.
"""

from gpuwatchd.client.api import (
    DEFAULT_URL,
    STORE_ENV,
    URL_ENV,
    Client,
    GpuState,
    GpuwatchdError,
    GpuwatchdUnavailable,
    RankedCandidate,
    Winner,
    default_store_paths,
    default_url,
    parse_gpu_state,
    parse_winners,
    state,
    wait_until_stable,
    winner,
)

__all__ = [
    "DEFAULT_URL",
    "STORE_ENV",
    "URL_ENV",
    "Client",
    "GpuState",
    "GpuwatchdError",
    "GpuwatchdUnavailable",
    "RankedCandidate",
    "Winner",
    "default_store_paths",
    "default_url",
    "parse_gpu_state",
    "parse_winners",
    "state",
    "wait_until_stable",
    "winner",
]
