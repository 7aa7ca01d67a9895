"""The figures of ``bench/gpu_resnet_ab.py``, torch-free: the order arms are timed in,
per-round ratios with a confidence interval of their median, per-cell verdicts, and a
table of a run.

A *cell* is one layer (or the whole training step) of one variant, timed in every arm.
Each round times every arm once, back to back on one stream; an arm's ratio in a round
is its time over ``default``'s in that round, so drift slower than a round cancels. The
figure of a cell is the median of its per-round ratios with a distribution-free CI
(:func:`gpuwatchd.tuning.worker.stats.median_ci`). "Not slower beyond 1%" is shown for a
cell only when the CI's upper end is at most :data:`LIMIT`; ``default_again`` (the
default once more) is the A/A control of every cell.

The rounds follow a Williams design (:func:`williams_orders`): every arm is timed in
every position, and right after every other arm, equally often, so neither a position
in the round nor the arm before it can favour one arm.
"""

from __future__ import annotations

import json
import tarfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gpuwatchd.tuning.worker.cuda_session import KernelLaunch
from gpuwatchd.tuning.worker.stats import median, median_ci

#: The claim of a cell: no slower than the default beyond this ratio.
LIMIT = 1.01
BASE = "default"
AA = "default_again"
GW = "gpuwatchd"
#: Every arm, the reference first: the job alone, the A/A control, gpuwatchd applied, and
#: ``cudnn.benchmark`` with its first step on a cool idle GPU or beside a neighbour's load.
ARMS = (BASE, AA, GW, "bench_cool", "bench_loaded")
CONFIDENCE = 0.95
#: The kernel of ``torch.cuda._sleep``: launched before each profiled segment as its start.
MARKER = "spin_kernel"


def williams_orders(n: int) -> list[list[int]]:
    """Orders of ``n`` arms balanced for position and for the arm timed just before.

    ``n`` orders for even ``n``, ``2 n`` for odd ``n`` (each order and its reverse).
    """
    if n < 1:
        raise ValueError(f"williams_orders: need at least one arm, got {n}")
    base = [0]
    lo, hi = 1, n - 1
    while len(base) < n:
        base.append(lo)
        lo += 1
        if len(base) < n:
            base.append(hi)
            hi -= 1
    rows = [[(b + i) % n for b in base] for i in range(n)]
    if n % 2:
        rows += [list(reversed(r)) for r in rows]
    return rows


def ratio_cell(
    times: Mapping[str, Sequence[float]], base: str = BASE, confidence: float = CONFIDENCE
) -> dict[str, dict[str, Any]]:
    """Per arm: median seconds, and the median of its per-round ratios to ``base`` with CI."""
    ref = times[base]
    out: dict[str, dict[str, Any]] = {}
    for arm, xs in times.items():
        if len(xs) != len(ref):
            raise ValueError(f"ratio_cell: {arm} has {len(xs)} rounds, {base} {len(ref)}")
        ratios = [t / b for t, b in zip(xs, ref, strict=True)]
        lo, hi = median_ci(ratios, confidence)
        out[arm] = {
            "median_s": median(xs),
            "ratio": median(ratios),
            "ci": [lo, hi],
            "rounds": len(ratios),
        }
    return out


def verdict(cell: Mapping[str, Any], limit: float = LIMIT) -> str:
    """``faster`` (CI below 1), ``within`` (CI's top at most ``limit``), ``slower`` (CI's
    bottom above ``limit``), else ``unresolved``; ``no CI`` for a bare median."""
    ci = cell.get("ci")
    if not ci:
        return "no CI"
    lo, hi = ci
    if hi < 1.0:
        return "faster"
    if hi <= limit:
        return "within"
    if lo > limit:
        return "slower"
    return "unresolved"


def split_segments(seq: Sequence[KernelLaunch], count: int) -> list[list[KernelLaunch]]:
    """Every launch of one profiler session cut at the :data:`MARKER` kernels into the
    ``count`` segments they start, each segment's distinct launches in order.
    ValueError when the markers seen are not ``count``."""
    parts: list[list[KernelLaunch]] = []
    for k in seq:
        if MARKER in k.name:
            parts.append([])
        elif parts and k not in parts[-1]:
            parts[-1].append(k)
    if len(parts) != count:
        raise ValueError(f"profiler: {len(parts)} marked segments for {count} calls")
    return parts


# -- one run's table ---------------------------------------------------------------------------


def _cell(value: Any) -> dict[str, Any]:
    """A cell of either format: a dict with a CI, or a median ratio alone (a bare number
    per layer, ``ratio_to_default`` with quartiles per step: the median-only format of
    ``bench/data/h100-resnet50-ab.json``)."""
    if isinstance(value, Mapping):
        if "ratio" in value:
            return dict(value)
        return {"ratio": float(value["ratio_to_default"])}
    return {"ratio": float(value)}


def layer_rows(variant: str, doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per layer: the choice, whether it was applied, gpuwatchd and A/A cells,
    and whether gpuwatchd launched the default's kernels there (None: not profiled)."""
    rows = []
    for name, layer in doc.get("layers", {}).items():
        arms = layer.get("arms", layer)
        same = layer.get("same_launches", {}).get(GW)
        rows.append(
            {
                "variant": variant,
                "layer": name,
                "choice": layer.get("choice"),
                "applied": bool(layer.get("applied")),
                "share": layer.get("share"),
                "gw": _cell(arms[GW]),
                "aa": _cell(arms[AA]),
                "same_kernels": same,
                "others": {a: _cell(arms[a]) for a in ARMS[3:] if a in arms},
            }
        )
    return rows


def _text(cell: Mapping[str, Any]) -> str:
    ci = cell.get("ci")
    if not ci:
        return f"{cell['ratio']:.4f}"
    return f"{cell['ratio']:.4f} [{ci[0]:.4f}, {ci[1]:.4f}]"


def summarise(runs: Mapping[str, Mapping[str, Any]], limit: float = LIMIT) -> dict[str, Any]:
    """Counts and a markdown table over the variants of one run (``{variant: doc}``)."""
    rows = [r for v, doc in sorted(runs.items()) for r in layer_rows(v, doc)]
    over = [r for r in rows if r["gw"]["ratio"] > limit]
    aa_off = max((abs(r["aa"]["ratio"] - 1.0) for r in rows), default=0.0)
    counts = {
        "layers": len(rows),
        "gw_verdicts": _tally(verdict(r["gw"], limit) for r in rows),
        "aa_verdicts": _tally(verdict(r["aa"], limit) for r in rows),
        "gw_median_over_limit": len(over),
        "gw_median_over_limit_not_applied": sum(not r["applied"] for r in over),
        "aa_largest_deviation": aa_off,
        "not_applied_other_kernels": [
            f"{r['variant']} {r['layer']}"
            for r in rows
            if not r["applied"] and r["same_kernels"] is False
        ],
        "not_applied_unprofiled": sum(not r["applied"] and r["same_kernels"] is None for r in rows),
        "faster": [
            {"variant": r["variant"], "layer": r["layer"], "by": 1.0 - r["gw"]["ratio"]}
            for r in rows
            if verdict(r["gw"], limit) == "faster"
        ],
    }
    counts["step"] = {
        v: {"ratio": _cell(doc["step"][GW])["ratio"], "verdict": verdict(_cell(doc["step"][GW]))}
        for v, doc in sorted(runs.items())
        if GW in doc.get("step", {})
    }
    lines = [
        "| variant | layer | choice | applied | same kernels | gpuwatchd / default [95% CI] "
        "| A/A [95% CI] | verdict |",
        "| --- | --- | --- | --- | --- | ---: | ---: | --- |",
    ]
    for r in rows:
        same = {True: "yes", False: "NO", None: "?"}[r["same_kernels"]]
        lines.append(
            f"| {r['variant']} | {r['layer']} | {r['choice']} | {'yes' if r['applied'] else 'no'} "
            f"| {same} | {_text(r['gw'])} | {_text(r['aa'])} | {verdict(r['gw'], limit)} |"
        )
    steps = ["", "| variant | step: gpuwatchd [95% CI] | A/A | bench cool | bench loaded |",
             "| --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for v, doc in sorted(runs.items()):
        st = doc.get("step", {})
        if not st:
            continue
        cells = [_cell(st[a]) for a in (GW, AA, "bench_cool", "bench_loaded") if a in st]
        steps.append(f"| {v} | " + " | ".join(_text(c) for c in cells) + " |")
    return {"counts": counts, "table": "\n".join(lines + steps)}


def _tally(xs: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in xs:
        out[x] = out.get(x, 0) + 1
    return out


def load_runs(path: str | Path) -> dict[str, dict[str, Any]]:
    """``{run label: {variant: doc}}`` from an ``ab.tar.gz``, one ``ab-<variant>.json``, or
    a data file that keeps several runs (``{label: {variant: doc}}`` beside plain fields)."""
    p = Path(path)
    if p.name.endswith(".tar.gz"):
        docs: dict[str, Any] = {}
        with tarfile.open(p) as tar:
            for m in tar.getmembers():
                f = tar.extractfile(m) if m.isfile() and m.name.endswith(".json") else None
                if f is not None:
                    doc = json.load(f)
                    if isinstance(doc, dict) and "variant" in doc:
                        docs[str(doc["variant"])] = doc
        return {p.name: docs}
    doc = json.loads(p.read_text())
    if not isinstance(doc, dict):
        raise ValueError(f"{p}: not a JSON object")
    if "variant" in doc:
        return {p.name: {str(doc["variant"]): doc}}
    runs = {
        label: {v: d for v, d in run.items() if isinstance(d, dict) and "layers" in d}
        for label, run in doc.items()
        if isinstance(run, dict)
    }
    runs = {label: run for label, run in runs.items() if run}
    if not runs:
        raise ValueError(f"{p}: no A/B run in it (no per-variant documents with layers)")
    return runs
