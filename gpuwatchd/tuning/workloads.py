"""The workloads gpuwatchd ships, and parsing of ``[[workload]]`` tables from the config.

Shipped examples: the bf16 8192^3 GEMM of docs/design.md (Triton tile configs and cuBLAS),
a tall bf16 GEMM, the cuDNN conv of the public L4 report, an fp16 channels_last conv,
``sim-gemm`` for the simulated GPU (its winner flips between regimes, as on the H200)
and two CPU workloads so the whole path runs on a machine without a GPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpuwatchd.tuning import families as family_specs
from gpuwatchd.tuning.ops import check_workload, plugin_families
from gpuwatchd.tuning.types import Workload
from gpuwatchd.validate import fail, key_path, need_text

DEFAULT_WORKLOADS: tuple[Workload, ...] = (
    Workload(
        name="gemm-bf16-8192",
        op="matmul",
        shape={"m": 8192, "n": 8192, "k": 8192},
        dtype="bfloat16",
        families=("triton.matmul", "torch.matmul"),
    ),
    Workload(
        name="gemm-bf16-4096x4096x16384",
        op="matmul",
        shape={"m": 4096, "n": 4096, "k": 16384},
        dtype="bfloat16",
        families=("triton.matmul", "torch.matmul"),
    ),
    Workload(
        name="conv-l4-report",
        op="conv2d",
        shape={"input": [64, 3, 224, 224], "weight": [64, 3, 3, 3], "stride": 1, "padding": 1},
        dtype="float32",
        families=("torch.conv2d",),
        # torch lets cuDNN use TF32 for fp32 convs by default; so did the L4 report's user.
        params={"tf32": True},
    ),
    Workload(
        name="conv-fp16-channels-last",
        op="conv2d",
        shape={"input": [64, 64, 56, 56], "weight": [64, 64, 3, 3], "stride": 1, "padding": 1},
        dtype="float16",
        families=("torch.conv2d",),
        # a job whose model and input are channels_last: that is its default to beat
        params={
            "input_layout": "channels_last",
            "weight_layout": "channels_last",
            "memory_formats": ["channels_last"],
        },
    ),
    Workload(
        name="sim-gemm",
        op="matmul",
        shape={"m": 8192, "n": 8192, "k": 8192},
        dtype="bfloat16",
        families=("sim",),
    ),
    Workload(
        name="cpu-matmul",
        op="matmul",
        shape={"m": 256, "n": 256, "k": 256},
        dtype="float32",
        families=("cpu.matmul",),
    ),
    Workload(
        name="cpu-conv2d",
        op="conv2d",
        shape={"input": [4, 3, 32, 32], "weight": [8, 3, 3, 3], "stride": 1, "padding": 1},
        dtype="float32",
        families=("cpu.conv2d",),
    ),
)

_KEYS = ("name", "op", "shape", "dtype", "families", "params")


def device_kind(workload: Workload) -> str:
    """Where a workload's candidates run: ``sim``, ``cpu`` or ``cuda``."""
    return family_specs.device_kind(workload.families)


def parse_workloads(tables: Sequence[Any], where: str = "workload") -> tuple[Workload, ...]:
    """Validate ``[[workload]]`` tables; raises ValueError naming the bad field.

    Each op's shape is checked as the built-in families will read it (``tuning.ops``).
    """
    if not isinstance(tables, list):
        raise ValueError(f"{where}: expected an array of tables ([[workload]])")
    plugins = plugin_families()
    out: list[Workload] = []
    seen: set[str] = set()
    for i, t in enumerate(tables):
        here = f"{where}[{i}]"
        if not isinstance(t, Mapping):
            raise ValueError(f"{here}: expected a table")
        for key in t:
            if key not in _KEYS:
                known = ", ".join(_KEYS)
                raise ValueError(f"{key_path(here, key)}: unknown key (known keys: {known})")
        for key in ("name", "op", "dtype"):
            need_text(t.get(key), f"{here}.{key}")
        name = t["name"]
        if not name.isprintable() or name != name.strip():
            raise fail(
                f"{here}.name",
                "expected a name without control characters or surrounding spaces",
                name,
            )
        if name in seen:
            raise ValueError(f"{here}.name: workload {name!r} is defined twice")
        seen.add(name)
        if not isinstance(t.get("shape"), Mapping) or not t["shape"]:
            raise fail(f"{here}.shape", "expected a non-empty table", t.get("shape"))
        fams = t.get("families")
        if not isinstance(fams, list) or not fams or not all(isinstance(f, str) for f in fams):
            raise fail(f"{here}.families", "expected a non-empty list of family names", fams)
        params = t.get("params", {})
        if not isinstance(params, Mapping):
            raise fail(f"{here}.params", "expected a table", params)
        workload = Workload(
            name=name,
            op=t["op"],
            shape=dict(t["shape"]),
            dtype=t["dtype"],
            families=tuple(fams),
            params=dict(params),
        )
        check_workload(workload, here, plugins)
        out.append(workload)
    return tuple(out)


def find_workload(workloads: Sequence[Workload], name: str) -> Workload:
    """The workload called ``name``; ValueError listing the known ones otherwise."""
    for w in workloads:
        if w.name == name:
            return w
    known = ", ".join(w.name for w in workloads)
    raise ValueError(f"unknown workload {name!r} (known: {known})")


def merge_workloads(
    defaults: Sequence[Workload], configured: Sequence[Workload]
) -> tuple[Workload, ...]:
    """Configured workloads replace shipped ones of the same name and add new ones."""
    by_name = {w.name: w for w in defaults}
    for w in configured:
        by_name[w.name] = w
    return tuple(by_name.values())
