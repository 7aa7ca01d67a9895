"""Compiles the NVML backend's fast ``read`` from the field table, once per backend.

``read`` runs at 10 Hz per GPU, and a loop over the table costs more per field (its
iteration, unpacking and star-call) than the NVML call it makes. So, as ``dataclasses``
does for ``__init__``, the table is turned into the source of one straight-line function
(one ``if``/``try`` per getter, in table order) and compiled: the driver round trips are
the only per-field cost left. The source is built from the table only (pynvml names and
keys of trusted code, no outside input) and is kept on the function as ``__source__``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from gpuwatchd.telemetry.types import Sample

#: One fast getter: its key, the bound function, its constant arguments and the
#: (Sample slot, converter) of each field it fills.
FastCall = tuple[
    str, Callable[..., Any], tuple[int, ...], tuple[tuple[int, Callable[..., Any]], ...]
]


def compile_read(
    calls: Sequence[FastCall],
    slots: int,
    carried: Sequence[int],
    env: dict[str, Any],
) -> Callable[[int], Sample]:
    """``read(gpu)`` for ``calls``; ``slots`` Sample field values, ``carried`` the slots
    filled from ``g.carried`` (the slow reading's values, in that order).

    ``env`` supplies the backend's parts the function uses: ``gpus_get``, ``live``,
    ``now``, ``catch``, ``field_error`` and ``fast_failures``.
    """
    names = [f"s{i}" for i in range(slots)]
    lines = [
        "def read(gpu):",
        "    g = gpus_get(gpu)",
        "    if g is None or g.lost is not None:",
        "        g = live(gpu)",
        "    t = now()",
        "    h = g.handle",
        "    skip = g.unsupported",
        "    failed = []",
        f"    {' = '.join(names)} = None",
    ]
    if carried:
        lines.append(f"    {', '.join(names[s] for s in carried)}, = g.carried")
    namespace: dict[str, Any] = {**env, "new_sample": Sample}
    for i, (key, fn, args, fills) in enumerate(calls):
        namespace[f"f{i}"] = fn
        call_args = ", ".join(["h", *(str(int(a)) for a in args)])
        lines += [
            f"    if {key!r} not in skip:",
            "        try:",
            f"            r = f{i}({call_args})",
            "        except catch as exc:",
            f"            field_error(g, {key!r}, exc, failed)",
            "        else:",
        ]
        for j, (slot, convert) in enumerate(fills):
            namespace[f"c{i}_{j}"] = convert
            lines.append(f"            {names[slot]} = c{i}_{j}(r)")
    lines += [
        "    if failed or g.failing:",
        "        fast_failures(g, failed)",
        f"    return new_sample(gpu, t, {', '.join(names)}, slow=g.slow,"
        " field_errors=g.field_errors)",
    ]
    source = "\n".join(lines) + "\n"
    exec(compile(source, "<gpuwatchd.telemetry.nvml_read>", "exec"), namespace)
    read: Callable[[int], Sample] = namespace["read"]
    read.__source__ = source  # type: ignore[attr-defined]
    return read
