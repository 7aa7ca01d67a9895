"""Workload rules and meta facts that several GPU families share, each written once.

The GEMM and conv families read the same ``params`` (``tf32``, ``seed``, lists of
choices), judge results with the same per-dtype tolerance and record the same fp32
precision; the two Triton families read the same facts off a compiled kernel.
"""

from __future__ import annotations

from typing import Any

from gpuwatchd.tuning.types import Workload


def float_tolerance(dtype: str, tf32: bool) -> float:
    """Largest relative Frobenius error accepted against a float64 reference."""
    if dtype == "float32":
        return 1e-2 if tf32 else 1e-4
    return 1e-2 if dtype == "float16" else 2e-2


def fp32_precision_label(dtype: str, tf32: bool) -> str | None:
    """``tf32`` or ``ieee`` for a float32 workload, None for the half-precision ones."""
    return ("tf32" if tf32 else "ieee") if dtype == "float32" else None


def positive_dims(workload: Workload, keys: tuple[str, ...], where: str) -> dict[str, int]:
    """``shape[key]`` for each key, each a positive integer; ValueError naming the bad one."""
    dims: dict[str, int] = {}
    for key in keys:
        v = workload.shape.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{where}: shape.{key} must be a positive integer, got {v!r}")
        dims[key] = v
    return dims


def bool_param(workload: Workload, key: str, where: str) -> bool:
    """``params[key]`` (default false), which must be true or false."""
    v = workload.params.get(key, False)
    if not isinstance(v, bool):
        raise ValueError(f"{where}: params.{key} must be true or false, got {v!r}")
    return v


def seed_param(workload: Workload, where: str) -> int:
    """``params.seed`` (default 0), which must be an integer."""
    seed = workload.params.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"{where}: params.seed must be an integer, got {seed!r}")
    return seed


def choices_param(workload: Workload, key: str, allowed: tuple[str, ...]) -> list[str]:
    """``params[key]`` (default: all of ``allowed``): a non-empty list of allowed names,
    duplicates dropped, order kept."""
    raw = workload.params.get(key, list(allowed))
    where = f"workload {workload.name!r}: params.{key}"
    if not isinstance(raw, list | tuple) or not raw:
        raise ValueError(f"{where} must be a non-empty list, got {raw!r}")
    for v in raw:
        if v not in allowed:
            raise ValueError(f"{where} entries must be one of {', '.join(allowed)}, got {v!r}")
    return list(dict.fromkeys(raw))


def compiled_facts(compiled: Any) -> dict[str, Any]:
    """Registers, spills and the shared memory Triton really allocated, where it says."""
    out: dict[str, Any] = {}
    for key in ("n_regs", "n_spills"):
        v = getattr(compiled, key, None)
        if isinstance(v, int):
            out[key] = v
    shared = getattr(getattr(compiled, "metadata", None), "shared", None)
    if isinstance(shared, int):
        out["smem_bytes"] = shared
    return out
