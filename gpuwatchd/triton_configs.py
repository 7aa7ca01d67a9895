"""Triton integration: recorded winners as ``triton.Config`` objects.

``@triton.autotune`` times every config at start-up, on whatever state the GPU is in.
gpuwatchd has already measured the same configs per thermal regime, so a job can pin
the winner (``configs[:1]``: no autotuning at all) or hand the recorded candidates to
the autotuner fastest first. Config kwargs are those of gpuwatchd's ``triton.matmul``
kernel (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M); ``rename`` maps them to your kernel's.

Triton is imported only by :func:`triton_configs`; the rest is plain data.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from gpuwatchd.client import Client
from gpuwatchd.tuning.types import Regime
from gpuwatchd.tuning.worker.families.triton_matmul import FAMILY, TileConfig

if TYPE_CHECKING:
    from gpuwatchd.api.winners import Winner

#: The meta-parameters of the triton.matmul kernel, in the order Triton prints them.
META_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")
_NAME_RE = re.compile(r"triton\[(?P<label>[^\]]+)\]")
_IDENT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _config_dict(cfg: TileConfig) -> dict[str, int]:
    return {
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "GROUP_M": cfg.group_m,
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
    }


def configs_from_names(names: Iterable[str]) -> list[dict[str, int]]:
    """``["triton[128x256x64,s4,w8,g8]", ...]`` -> ``[{"BLOCK_M": 128, ..., "num_stages": 4}]``.

    ValueError naming the bad entry for a name that is not a Triton candidate.
    """
    out = []
    for i, name in enumerate(names):
        m = _NAME_RE.fullmatch(name) if isinstance(name, str) else None
        if m is None:
            raise ValueError(
                f"names[{i}]: expected a Triton candidate name like "
                f"'triton[128x256x64,s4,w8,g8]', got {name!r}"
            )
        try:
            out.append(_config_dict(TileConfig.parse(m["label"])))
        except ValueError as e:
            raise ValueError(f"names[{i}]: {e}") from None
    return out


def _tile(name: str, meta: Mapping[str, Any]) -> TileConfig:
    """The recorded config (``meta["config"]``), else the one spelled in the name."""
    raw = meta.get("config")
    if raw is not None:
        try:
            return TileConfig.from_json(raw)
        except (ValueError, TypeError):
            pass  # an older or foreign meta: the name still spells the config
    m = _NAME_RE.fullmatch(name)
    if m is None:
        raise ValueError("not a Triton candidate name and no recorded config")
    return TileConfig.parse(m["label"])


def winner_configs(winner: Winner, put_first: bool = True) -> list[dict[str, int]]:
    """The Triton configs of a winner's result as dicts, fastest first.

    Only Triton candidates that were timed in this regime are kept. ``put_first``
    moves the recorded winner to the front even where a tie or an older ranking put
    another candidate ahead. When cuBLAS (or another family) won, the list holds the
    Triton candidates alone, in their order; check ``winner.family``.
    """
    ranked = [
        (c.name, c.meta) for c in winner.ranked if c.family == FAMILY and c.median_s is not None
    ]
    if put_first and winner.family == FAMILY:
        ranked = [(winner.candidate, winner.meta)] + [r for r in ranked if r[0] != winner.candidate]
    out: list[dict[str, int]] = []
    for name, meta in ranked:
        try:
            cfg = _config_dict(_tile(name, meta))
        except ValueError as e:
            raise ValueError(f"winner of {winner.workload!r}: candidate {name!r}: {e}") from None
        if cfg not in out:
            out.append(cfg)
    return out


def _check_rename(rename: Mapping[str, str] | None) -> dict[str, str]:
    names = {k: k for k in META_KEYS}
    for key, new in (rename or {}).items():
        if key not in META_KEYS:
            raise ValueError(f"rename: key {key!r} is not one of {', '.join(META_KEYS)}")
        if not isinstance(new, str) or not _IDENT_RE.fullmatch(new):
            raise ValueError(f"rename[{key!r}]: expected a Python identifier, got {new!r}")
        names[key] = new
    return names


def to_triton(
    configs: Iterable[Mapping[str, int]], rename: Mapping[str, str] | None = None
) -> list[Any]:
    """Config dicts (from :func:`configs_from_names`) as ``triton.Config`` objects."""
    names = _check_rename(rename)
    try:
        import triton
    except ImportError as e:
        raise ImportError(f"gpuwatchd.triton_configs needs Triton: {e}") from None
    return [
        triton.Config(
            {names[k]: d[k] for k in META_KEYS},
            num_warps=d["num_warps"],
            num_stages=d["num_stages"],
        )
        for d in configs
    ]


def triton_configs(
    workload: str,
    regime: Regime | str,
    gpu_model: str | None = None,
    client: Client | None = None,
    put_first: bool = True,
    rename: Mapping[str, str] | None = None,
) -> list[Any]:
    """``triton.Config`` objects for the recorded winner of ``workload`` in ``regime``.

    The winner comes first (``put_first``), then the other Triton candidates of the
    same result, fastest first. Empty when nothing is recorded, so
    ``triton_configs(...) or my_configs`` falls back to your own list.
    """
    names = _check_rename(rename)  # bad input fails before any I/O
    client = client if client is not None else Client()
    winner = client.winner(workload, regime, gpu_model)
    if winner is None:
        return []
    return to_triton(winner_configs(winner, put_first), names)
