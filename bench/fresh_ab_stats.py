"""Figures of a ``bench/gpu_fresh_process_ab.py`` run, torch-free, from its JSON.

    python3 bench/fresh_ab_stats.py bench/data/h200-fresh-process-ab.json

Prints the run's own table (``gpu_fresh_process_ab.markdown`` over the stored summary),
then per cell: each arm's median of process medians and their spread, the median spread
of chunks within one process, the A/A spread
(plain against plain-again), the gpuwatchd arm's worst chunk against the plain arms', and
a two-sided Mann-Whitney U p-value of gpuwatchd's process medians against all plain ones
(scipy's where it is installed, else an exact permutation of U over the pooled medians,
or 20,000 random permutations when there are more splits than that).
"""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_fresh_process_ab import PLAIN, markdown

EXACT_MAX_SPLITS = 20_000


def u_statistic(a: list[float], b: list[float]) -> float:
    """Mann-Whitney U of ``a`` over ``b``: pairs where a's value is larger, ties half."""
    return sum(1.0 if x > y else 0.5 if x == y else 0.0 for x in a for y in b)


def permutation_p(a: list[float], b: list[float], seed: int = 0) -> float:
    """Two-sided p of U under random assignment of the pooled values to the two groups."""
    pooled, n = a + b, len(a)
    centre = len(a) * len(b) / 2
    observed = abs(u_statistic(a, b) - centre)
    splits: list[tuple[int, ...]]
    if math.comb(len(pooled), n) <= EXACT_MAX_SPLITS:
        splits = list(itertools.combinations(range(len(pooled)), n))
    else:
        rng = random.Random(seed)
        splits = [tuple(rng.sample(range(len(pooled)), n)) for _ in range(EXACT_MAX_SPLITS)]
    extreme = 0
    for idx in splits:
        chosen = set(idx)
        x = [pooled[i] for i in idx]
        y = [v for i, v in enumerate(pooled) if i not in chosen]
        extreme += abs(u_statistic(x, y) - centre) >= observed - 1e-12
    return extreme / len(splits)


def mann_whitney_p(a: list[float], b: list[float]) -> tuple[float, str]:
    """Two-sided p-value and which test gave it."""
    try:
        from scipy.stats import mannwhitneyu
    except ImportError:
        return permutation_p(a, b), "permutation of U"
    return float(mannwhitneyu(a, b, alternative="two-sided").pvalue), "scipy mannwhitneyu"


def p_text(p: float) -> str:
    """A p-value as written in RESULTS.md."""
    return "< 0.001" if p < 0.001 else f"= {p:.3f}"


def spread(values: list[float]) -> float:
    """(max - min) / min, as a fraction."""
    return (max(values) - min(values)) / min(values)


def cell_figures(doc: dict[str, Any], cell: str) -> dict[str, Any]:
    """The extra figures of one cell from its processes."""
    procs = [p for p in doc["processes"] if p.get("cell") == cell and "chunks_ms" in p]
    arms: dict[str, Any] = {}
    for arm in doc["arms"]:
        medians = [p["median_ms"] for p in procs if p["arm"] == arm]
        mine = [p for p in procs if p["arm"] == arm]
        chunks = [c for p in mine for c in p["chunks_ms"]]
        if medians:
            arms[arm] = {
                "processes": len(medians),
                "median_of_medians_ms": statistics.median(medians),
                "process_medians_range_ms": [min(medians), max(medians)],
                "spread_of_process_medians": spread(medians),
                "worst_chunk_ms": max(chunks),
                "chunk_spread_in_a_process": statistics.median(
                    spread(p["chunks_ms"]) for p in mine
                ),
            }
    out: dict[str, Any] = {"arms": arms}
    plain = [p["median_ms"] for p in procs if p["arm"] in PLAIN]
    gw = [p["median_ms"] for p in procs if p["arm"] == "gpuwatchd"]
    if "plain" in arms and "plain_again" in arms:
        a, b = arms["plain"], arms["plain_again"]
        out["aa_spread_of_process_medians"] = spread(
            a["process_medians_range_ms"] + b["process_medians_range_ms"]
        )
        out["aa_ratio_median_of_medians"] = b["median_of_medians_ms"] / a["median_of_medians_ms"]
        if "gpuwatchd" in arms:
            plain_worst = max(a["worst_chunk_ms"], b["worst_chunk_ms"])
            out["gpuwatchd_worst_over_plain_worst"] = (
                arms["gpuwatchd"]["worst_chunk_ms"] / plain_worst - 1
            )
    if gw and plain:
        out["mann_whitney_p"], out["test"] = mann_whitney_p(gw, plain)
    return out


def report(doc: dict[str, Any]) -> str:
    """The run's table, then one line per cell and arm of the extra figures."""
    errors = sum(1 for p in doc["processes"] if "error" in p)
    left = sorted({x for p in doc["processes"] for x in p.get("left_behind", [])})
    lines = [
        markdown(doc["summary"], doc["cells"], doc["arms"]),
        "",
        f"rounds {doc['rounds']}, processes {len(doc['processes'])}, errors {errors}, "
        f"left behind: {', '.join(left) or 'nothing'}",
        "",
        "| cell | arm | processes | median of process medians, ms | process medians, ms "
        "| their spread | chunk spread within a process, median | worst chunk, ms |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    notes = []
    for cell in doc["cells"]:
        fig = cell_figures(doc, cell)
        for arm, a in fig["arms"].items():
            lo, hi = a["process_medians_range_ms"]
            lines.append(
                f"| {cell} | {arm} | {a['processes']} | {a['median_of_medians_ms']:.2f} "
                f"| {lo:.2f}–{hi:.2f} | {a['spread_of_process_medians']:.1%} "
                f"| {a['chunk_spread_in_a_process']:.1%} | {a['worst_chunk_ms']:.2f} |"
            )
        notes.append(
            f"- {cell}: A/A spread of process medians {fig['aa_spread_of_process_medians']:.1%}"
            f" (plain-again / plain, median of medians {fig['aa_ratio_median_of_medians']:.4f});"
            f" gpuwatchd's worst chunk {fig['gpuwatchd_worst_over_plain_worst']:+.1%} over the"
            f" plain arms' worst; gpuwatchd vs plain process medians: p "
            f"{p_text(fig['mann_whitney_p'])} ({fig['test']})"
        )
    return "\n".join([*lines, "", *notes])


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python3 bench/fresh_ab_stats.py RUN.json")
    print(report(json.loads(Path(sys.argv[1]).read_text())))


if __name__ == "__main__":
    main()
