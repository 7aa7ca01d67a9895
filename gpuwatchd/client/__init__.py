"""What a job imports to ask the daemon: is my GPU ready to tune on, and which kernel won?

Importable without torch. The documents it reads are parsed by :mod:`gpuwatchd.api`,
the same code the daemon and the CLI use. Every job pays this import, so it loads no
store, exporter or CLI module: the winner types (whose rows are the store's) load when
first used (tests/test_job_imports.py pins the modules).
"""

from typing import TYPE_CHECKING, Any

from gpuwatchd.api.gpu_state import GpuState
from gpuwatchd.api.state import parse_gpu_state
from gpuwatchd.client.client import Client, state, wait_until_stable, winner
from gpuwatchd.client.discovery import (
    DEFAULT_URL,
    STORE_ENV,
    URL_ENV,
    default_store_paths,
    default_url,
)
from gpuwatchd.client.errors import GpuwatchdError, GpuwatchdUnavailable

if TYPE_CHECKING:
    from gpuwatchd.api.winners import RankedCandidate, Winner, parse_winners

#: Names read from :mod:`gpuwatchd.api.winners` on first use.
_WINNER_NAMES = ("RankedCandidate", "Winner", "parse_winners")


def __getattr__(name: str) -> Any:
    if name in _WINNER_NAMES:
        from gpuwatchd.api import winners

        return getattr(winners, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
