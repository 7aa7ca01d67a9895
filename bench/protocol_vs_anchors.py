"""gpuwatchd's measurement protocol against the anchors', on a simulated GPU with known truth.

For each of ``--sets`` random candidate sets (``bench/sim_world.py``: 3-10 kernels within
0.5-5% of the best at full clock, heavy / near-the-cap / light power, started on a cool
or a just-loaded GPU, with timing noise, outliers, clock steps and throttle episodes),
every protocol runs on its own fresh copy of the same simulated GPU, in simulated time:

- ``gpuwatchd``: the real :func:`gpuwatchd.tuning.worker.protocol.tune`, both regimes,
  with today's ``ProtocolConfig`` defaults, one set per job; ``gpuwatchd.queued`` the
  same, ``--queue`` sets per job through ``tune_queue`` (as the worker does);
  ``gpuwatchd.round1`` and ``gpuwatchd.classic`` the defaults after the first round of
  deciding faster and before issue 13 (``bench/protocol_history.py``);
- ``cudnn.sample_once`` / ``cudnn.median_of_three`` / ``cudnn.till_stable``,
  ``triton.do_bench`` (as ``triton.autotune`` uses it) and ``nvbench`` (cold, stdrel):
  ``bench/anchor_protocols.py``. An anchor makes one pick, judged against both regimes.

Reported per protocol and regime: the share of wrong picks, the mean, 95th-percentile
and worst regret (how much slower the pick truly is than the best), and per set the
time the protocol held the GPU, the time the GPU ran kernels, and the energy drawn.
For gpuwatchd's protocols, where the GPU time went: timed batches (accepted and
rejected, as measured), pauses (between batches and to cool), the sustained regime's
settling, and the rest (warm-ups, the power probe, L2 flushes).

    nice -n 10 python3 bench/protocol_vs_anchors.py --sets 1000 \
        --out bench/data/sim-protocol-vs-anchors.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from anchor_protocols import cudnn_find, nvbench_cold, triton_autotune
from protocol_history import CLASSIC, ROUND_1
from sim_world import BenchKernel, CandidateSet, NoisySession, make_set

from gpuwatchd.tuning.settings import ProtocolConfig
from gpuwatchd.tuning.types import BatchRecord, Regime, RegimeResult, Workload
from gpuwatchd.tuning.worker.protocol import tune_queue

REGIMES = ("unthrottled", "sustained")
#: What each anchor's cache clear writes: Triton's 256 MB buffer, nvbench's L2 size.
FLUSH_BYTES = {"triton.do_bench": 256_000_000, "nvbench": 50 * 2**20}

Picks = dict[str, str | None]
#: Runs one protocol over candidate sets on one session (a queue of them, or just one).
Runner = Callable[[NoisySession, Sequence[CandidateSet]], list[Picks]]


def gpuwatchd_runner(cfg: ProtocolConfig) -> Runner:
    def run(session: NoisySession, csets: Sequence[CandidateSet]) -> list[Picks]:
        queue = [
            (Workload(f"set-{c.index}", "matmul", {"set": c.index}, "bf16", ("bench.sim",)),
             session.kernels(c))
            for c in csets
        ]  # fmt: skip

        def on_batch(rec: BatchRecord) -> None:
            session.timed_s += rec.seconds_per_call * rec.calls

        results = tune_queue(queue, session, REGIMES, cfg, on_batch)
        session.settle_s += sum(
            float(r.candidates[0].meta.get("settle_s", 0.0))
            for rs in results
            for r in rs
            if r.candidates and r.regime is Regime.SUSTAINED
        )
        return [{r.regime.value: _first(r) for r in rs} for rs in results]

    return run


def _first(r: RegimeResult) -> str | None:
    """The winner, or on a tie the fastest median: what a caller uses either way."""
    for c in r.candidates:
        if c.median_s is not None:
            return c.name
    return None


def anchor_runner(pick: Callable[[NoisySession, list[BenchKernel]], str]) -> Runner:
    def run(session: NoisySession, csets: Sequence[CandidateSet]) -> list[Picks]:
        return [dict.fromkeys(REGIMES, pick(session, session.kernels(c))) for c in csets]

    return run


#: Protocols that tune ``--queue`` sets together on one device, as one worker job does.
QUEUED = ("gpuwatchd.queued",)


#: ``--variant NAME:KEY=VALUE,...``: today's defaults with some knobs changed, run as
#: protocol ``gpuwatchd.NAME`` beside the others (set in :func:`main`, read by workers).
VARIANTS: dict[str, ProtocolConfig] = {}


def parse_variant(text: str) -> tuple[str, ProtocolConfig]:
    """``NAME:KEY=VALUE,...`` -> (name, ProtocolConfig); each value parsed as its default's
    type. ValueError names what is wrong."""
    name, sep, knobs = text.partition(":")
    if not sep or not name or not knobs:
        raise ValueError(f"{text!r}: expected NAME:KEY=VALUE[,KEY=VALUE...]")
    defaults = ProtocolConfig()
    changes: dict[str, Any] = {}
    for item in knobs.split(","):
        key, eq, value = item.partition("=")
        if not eq or not hasattr(defaults, key):
            raise ValueError(f"{item!r}: expected KEY=VALUE with a ProtocolConfig field")
        kind = type(getattr(defaults, key))
        changes[key] = value.lower() in ("1", "true", "yes") if kind is bool else kind(value)
    return name, dataclasses.replace(defaults, **changes)


def protocols() -> dict[str, Runner]:
    return {
        **{f"gpuwatchd.{n}": gpuwatchd_runner(c) for n, c in VARIANTS.items()},
        "gpuwatchd": gpuwatchd_runner(ProtocolConfig()),
        "gpuwatchd.queued": gpuwatchd_runner(ProtocolConfig()),
        "gpuwatchd.round1": gpuwatchd_runner(ROUND_1),
        "gpuwatchd.classic": gpuwatchd_runner(CLASSIC),
        "cudnn.sample_once": anchor_runner(lambda s, k: cudnn_find(s, k, "sample_once").pick),
        "cudnn.median_of_three": anchor_runner(
            lambda s, k: cudnn_find(s, k, "median_of_three").pick
        ),
        "cudnn.till_stable": anchor_runner(lambda s, k: cudnn_find(s, k, "till_stable").pick),
        "triton.do_bench": anchor_runner(lambda s, k: triton_autotune(s, k).pick),
        "nvbench": anchor_runner(lambda s, k: nvbench_cold(s, k).pick),
    }


@dataclass(frozen=True, slots=True)
class Row:
    """One protocol on one candidate set."""

    protocol: str
    index: int
    kind: str
    start: str
    n: int
    regret: dict[str, float]  # per regime
    wall_s: float  # simulated seconds the protocol held the GPU
    busy_s: float  # simulated seconds the GPU ran kernels (flushes included)
    energy_j: float  # energy the GPU drew meanwhile (idle power included)
    timed_s: float  # gpuwatchd's: the timed batches, as measured (0 for an anchor)
    paused_s: float  # the GPU left idle on purpose (between batches, to cool)
    settle_s: float  # gpuwatchd's: the sustained regime's settling


def run_group(args: tuple[Sequence[int], int, Sequence[str]]) -> list[Row]:
    """Every protocol on the sets ``indices``: queued ones on one device, the rest one each."""
    indices, seed, names = args
    csets = [make_set(i, seed) for i in indices]
    runners = protocols()
    rows = []
    for name in names:
        queues = [csets] if name in QUEUED else [[c] for c in csets]
        for queue in queues:
            session = NoisySession(queue[0], name)
            session.flush_bytes = FLUSH_BYTES.get(name, session.flush_bytes)
            picks = runners[name](session, queue)
            share = 1.0 / len(queue)  # time and energy per tuned workload
            for cset, pick in zip(queue, picks, strict=True):
                rows.append(
                    Row(
                        protocol=name,
                        index=cset.index,
                        kind=cset.kind,
                        start=cset.start,
                        n=len(cset.kernels),
                        regret={r: cset.regret(r, pick.get(r)) for r in REGIMES},
                        wall_s=session.elapsed_s() * share,
                        busy_s=session.busy_s * share,
                        energy_j=session.used_energy_j() * share,
                        timed_s=session.timed_s * share,
                        paused_s=session.paused_s * share,
                        settle_s=session.settle_s * share,
                    )
                )
    return rows


def summarize(rows: Iterable[Row]) -> dict[str, Any]:
    """Per protocol: per regime wrong-pick share and regret; per set time and energy."""
    by: dict[str, list[Row]] = {}
    for r in rows:
        by.setdefault(r.protocol, []).append(r)
    out: dict[str, Any] = {}
    for name, rs in by.items():
        entry: dict[str, Any] = {"sets": len(rs)}
        for regime in REGIMES:
            regrets = sorted(r.regret[regime] for r in rs)
            entry[regime] = {
                "wrong_pick_rate": sum(x > 0 for x in regrets) / len(regrets),
                "costly_pick_rate": sum(x > 0.005 for x in regrets) / len(regrets),
                "mean_regret": sum(regrets) / len(regrets),
                "p95_regret": regrets[min(len(regrets) - 1, math.ceil(0.95 * len(regrets)) - 1)],
                "worst_regret": regrets[-1],
            }
        for key in ("wall_s", "busy_s", "energy_j", "timed_s", "paused_s", "settle_s"):
            entry[f"mean_{key}"] = sum(getattr(r, key) for r in rs) / len(rs)
        out[name] = entry
    return out


def breakdown(rows: Sequence[Row], field: str) -> dict[str, dict[str, Any]]:
    """:func:`summarize` per value of ``field`` (kind or start)."""
    values = sorted({getattr(r, field) for r in rows})
    return {v: summarize(r for r in rows if getattr(r, field) == v) for v in values}


#: The anchor whose measurement time the goal is stated against.
TIME_REFERENCE = "triton.do_bench"


def markdown(summary: dict[str, Any]) -> str:
    ref = summary.get(TIME_REFERENCE)
    lines = [
        "| protocol | regime | wrong picks | picks >0.5% slower | mean regret | p95 | worst |"
        " GPU held per set | x do_bench's | GPU busy | energy |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, e in summary.items():
        ratio = f"{e['mean_wall_s'] / ref['mean_wall_s']:.2f}x" if ref else "-"
        for regime in REGIMES:
            g = e[regime]
            lines.append(
                f"| {name} | {regime} | {g['wrong_pick_rate']:.1%} | {g['costly_pick_rate']:.1%}"
                f" | {g['mean_regret']:.2%} | {g['p95_regret']:.2%} | {g['worst_regret']:.2%}"
                f" | {e['mean_wall_s']:.2f} s | {ratio} | {e['mean_busy_s']:.2f} s"
                f" | {e['mean_energy_j']:.0f} J |"
            )
    return "\n".join(lines)


def time_markdown(summary: dict[str, Any]) -> str:
    """Where each gpuwatchd protocol's GPU time went, per set."""
    lines = [
        "| protocol | GPU held per set | timed batches | pauses | settling | warm-ups, probe,"
        " flushes |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, e in summary.items():
        if e["mean_timed_s"] <= 0:
            continue  # an anchor: its time is its measurement
        wall, timed, paused, settle = (
            e[f"mean_{k}"] for k in ("wall_s", "timed_s", "paused_s", "settle_s")
        )
        rest = wall - timed - paused - settle
        lines.append(
            f"| {name} | {wall:.2f} s | {timed:.2f} s | {paused:.2f} s | {settle:.2f} s"
            f" | {rest:.2f} s |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sets", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    ap.add_argument(
        "--queue", type=int, default=4, help="sets per job for the queued protocols (default 4)"
    )
    ap.add_argument("--protocols", nargs="*", help="a subset of the protocols, by name")
    ap.add_argument("--out", type=Path, help="write the summary and every row as JSON here")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE,...",
        help="also today's protocol with these ProtocolConfig knobs, as gpuwatchd.NAME",
    )
    args = ap.parse_args(argv)
    for text in args.variant:
        try:
            name, cfg = parse_variant(text)
        except (ValueError, TypeError) as exc:
            ap.error(f"--variant {exc}")
        VARIANTS[name] = cfg
    names = list(args.protocols or protocols())
    unknown = sorted(set(names) - set(protocols()))
    if unknown:
        ap.error(f"--protocols: unknown {unknown} (known: {', '.join(protocols())})")
    t0 = time.process_time()
    k = max(1, args.queue)
    work = [(range(i, min(i + k, args.sets)), args.seed, names) for i in range(0, args.sets, k)]
    if args.jobs > 1:
        with multiprocessing.Pool(args.jobs) as pool:
            chunks = pool.map(run_group, work, chunksize=2)
    else:
        chunks = [run_group(w) for w in work]
    rows = [r for chunk in chunks for r in chunk]
    summary = summarize(rows)
    print(markdown(summary))
    print(f"\n{time_markdown(summary)}")
    for field in ("kind", "start"):
        for value, s in breakdown(rows, field).items():
            print(f"\n{field} = {value}: {s[names[0]]['sets']} sets\n{markdown(s)}")
    print(f"\n{args.sets} sets, {time.process_time() - t0:.0f} s CPU in this process")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "command": " ".join(["python3", "bench/protocol_vs_anchors.py", *sys.argv[1:]]),
            "sets": args.sets,
            "seed": args.seed,
            "queue": k,
            "summary": summary,
            "by_kind": breakdown(rows, "kind"),
            "by_start": breakdown(rows, "start"),
            "row_fields": list(ROW_FIELDS),
            "rows": [_row_json(r) for r in rows],
        }
        args.out.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    return 0


#: One row per protocol and set in the JSON output, as a list in this order.
ROW_FIELDS = ("protocol", "set", "kind", "start", "n", "regret_unthrottled",
              "regret_sustained", "wall_s", "busy_s", "energy_j", "timed_s", "paused_s",
              "settle_s")  # fmt: skip


def _row_json(r: Row) -> list[Any]:
    return [
        r.protocol,
        r.index,
        r.kind,
        r.start,
        r.n,
        round(r.regret["unthrottled"], 6),
        round(r.regret["sustained"], 6),
        round(r.wall_s, 3),
        round(r.busy_s, 3),
        round(r.energy_j, 1),
        round(r.timed_s, 3),
        round(r.paused_s, 3),
        round(r.settle_s, 3),
    ]


if __name__ == "__main__":
    raise SystemExit(main())
