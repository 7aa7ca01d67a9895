"""What a job imports to ask the daemon: is my GPU ready to tune on, and which kernel won?

Importable without torch. The documents it reads are parsed by :mod:`gpuwatchd.api`,
the same code the daemon and the CLI use.
"""

from gpuwatchd.api.gpu_state import GpuState
from gpuwatchd.api.state import parse_gpu_state
from gpuwatchd.api.winners import RankedCandidate, Winner, parse_winners
from gpuwatchd.client.client import Client, state, wait_until_stable, winner
from gpuwatchd.client.discovery import (
    DEFAULT_URL,
    STORE_ENV,
    URL_ENV,
    default_store_paths,
    default_url,
)
from gpuwatchd.client.errors import GpuwatchdError, GpuwatchdUnavailable

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
