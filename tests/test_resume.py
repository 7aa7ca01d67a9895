"""Sessions resume: a preempted session's finished (workload, regime) pairs are reused.

The runner runs small fake workers (as in ``test_worker_runner.py``) that log the pairs
they were asked for, report a result per pair, and can hang after some results so the
session is preempted; the store is the real SQLite one. One test drives the real sim
worker, whose results go out one regime at a time.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from store_backends import KINDS, make_backend

from gpuwatchd.sessions.resume import remaining_spec
from gpuwatchd.sessions.runner import SessionOutcome, TuneRunner
from gpuwatchd.store import SqlStore, StoreError, sqlite_store
from gpuwatchd.telemetry.sim import SimBackend
from gpuwatchd.telemetry.types import DeviceInfo
from gpuwatchd.tuning.session_spec import SessionSpec, SessionSpecError, SimSpec
from gpuwatchd.tuning.settings import DEFAULT_RESUME_MAX_AGE_S, ProtocolConfig
from gpuwatchd.tuning.types import Regime, SessionStatus, Versions, Workload
from gpuwatchd.tuning.workloads import DEFAULT_WORKLOADS

U, S = Regime.UNTHROTTLED, Regime.SUSTAINED
BOTH = (U, S)
INFO = DeviceInfo(
    index=0,
    uuid="GPU-aaaa",
    name="Test GPU",
    driver_version="580.1",
    max_sm_clock_mhz=1980.0,
    power_limit_w=700.0,
)
W1 = Workload("w1", "matmul", {"m": 64, "n": 64, "k": 64}, "fp32", ("fam",))
W2 = Workload("w2", "matmul", {"m": 32, "n": 32, "k": 32}, "fp32", ("fam",))
SPEC = SessionSpec(0, INFO.uuid, "cpu", (W1, W2), BOTH, time_budget_s=400.0)
ALL_PAIRS = [("w1", U), ("w1", S), ("w2", U), ("w2", S)]

#: Logs the pairs it is asked for, sends a result for each (its own PID in every
#: candidate's meta), and hangs instead of sending result number HANG_AFTER.
FAKE_WORKER = """
import json, os, sys, time
job = json.loads(sys.stdin.read())
def send(d):
    sys.stdout.write(json.dumps(d) + "\\n"); sys.stdout.flush()
by = job.get("workload_regimes", {})
pairs = [(w["name"], r) for w in job["workloads"] for r in by.get(w["name"], job["regimes"])]
with open(os.environ["JOB_LOG"], "a") as f:
    f.write(json.dumps({"pairs": pairs, "budget": job["time_budget_s"], "by": by}) + "\\n")
send({"type": "hello", "pid": os.getpid(), "versions": {"torch": os.environ["FAKE_TORCH"]}})
def cand(name, median, regime):
    return {"name": name, "family": "fam", "regime": regime, "median_s": median,
            "spread": 0.01, "samples": 7, "rejected": 1, "sm_clock_hz": 1.9e9,
            "power_w": 600.0, "temp_c": 60.0, "energy_j_per_call": 0.5, "reasons": 0,
            "meta": {"pid": os.getpid()}}
def hang_at(i):
    if i == int(os.environ["HANG_AFTER"]):
        open(os.environ["JOB_LOG"] + ".hung", "w").close()
        while True:
            time.sleep(0.01)
for i, (w, r) in enumerate(pairs):
    hang_at(i)
    send({"type": "result", "result": {
        "workload": w, "regime": r, "winner": "a", "tie": False, "margin": 0.5,
        "noise": 0.01, "candidates": [cand("a", 1e-3, r), cand("b", 2e-3, r)]}})
hang_at(len(pairs))
if os.environ.get("CRASH"):
    sys.exit(3)
"""


def same_stack(info: DeviceInfo) -> Versions:
    """What the fake worker reports, as installed now (the daemon reads the metadata)."""
    return Versions(driver=info.driver_version, torch="fake-1.0")


#: Lets a job whose every pair was measured complete without a worker, as the daemon does.
CHECKS_STACK: dict[str, Any] = {"versions_now": same_stack}


class Fake:
    """Runs sessions with the fake worker and reads back what each worker was asked."""

    def __init__(self, store: SqlStore, tmp_path: Path) -> None:
        self.store = store
        self.log = tmp_path / "jobs.jsonl"
        self.hung = Path(f"{self.log}.hung")

    def run(
        self,
        spec: SessionSpec = SPEC,
        info: DeviceInfo = INFO,
        *,
        hang_after: int = -1,
        torch: str = "fake-1.0",
        crash: bool = False,
        fresh_after: dict[str, float] | None = None,
        **runner_kw: Any,
    ) -> SessionOutcome:
        self.hung.unlink(missing_ok=True)
        env = {
            **os.environ,
            "JOB_LOG": str(self.log),
            "HANG_AFTER": str(hang_after),
            "FAKE_TORCH": torch,
            **({"CRASH": "1"} if crash else {}),
        }
        runner = TuneRunner(
            self.store, env=env, worker_cmd=[sys.executable, "-c", FAKE_WORKER], **runner_kw
        )

        def preempt() -> str | None:
            return "a job wants the GPU" if self.hung.exists() else None

        return runner.run_session(spec, info, "sim", preempt, None, 20, fresh_after=fresh_after)

    def preempted_after(self, n: int, **kw: Any) -> SessionOutcome:
        out = self.run(hang_after=n, **kw)
        assert (out.status, out.why) == (SessionStatus.PREEMPTED, "a job wants the GPU")
        assert len(self.store.results(out.session_id)) == n + len(out.reused_from)
        return out

    def asked(self) -> list[dict[str, Any]]:
        """What each worker so far was asked to measure, oldest first."""
        if not self.log.exists():
            return []
        lines = self.log.read_text().splitlines()
        return [
            {**d, "pairs": [(w, Regime(r)) for w, r in d["pairs"]]} for d in map(json.loads, lines)
        ]


@pytest.fixture
def fake(store: SqlStore, tmp_path: Path) -> Fake:
    return Fake(store, tmp_path)


def _candidates(store: SqlStore, session_id: int) -> dict[tuple[str, Regime], list[Any]]:
    return {
        (s.result.workload, s.result.regime): [
            (c.name, c.median_s, c.samples, c.rejected, c.meta) for c in s.result.candidates
        ]
        for s in store.results(session_id)
    }


# -- reuse -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("done", "by_workload"),
    [(1, {"w1": ["sustained"]}), (2, {}), (3, {"w2": ["sustained"]})],
)
def test_a_preempted_sessions_finished_pairs_are_not_measured_again(
    fake: Fake, store: SqlStore, done: int, by_workload: dict[str, list[str]]
) -> None:
    first = fake.preempted_after(done)
    out = fake.run()
    assert (out.status, out.why) == (SessionStatus.COMPLETED, None)
    asked = fake.asked()
    assert [a["pairs"] for a in asked] == [ALL_PAIRS, ALL_PAIRS[done:]]
    assert asked[1]["by"] == by_workload  # a workload with one regime left gets only it
    assert asked[1]["budget"] == pytest.approx(400.0 * (4 - done) / 4)  # same share per pair
    # The session's results: every pair, in the job's order; the first ones carried.
    assert [(r.workload, r.regime) for r in out.results] == ALL_PAIRS
    assert out.reused_from == dict.fromkeys(ALL_PAIRS[:done], first.session_id)
    before, after = _candidates(store, first.session_id), _candidates(store, out.session_id)
    assert set(after) == set(ALL_PAIRS)
    for pair in ALL_PAIRS[:done]:  # candidates and their statistics came along
        assert after[pair] == before[pair]
    worker_pids = {c[4]["pid"] for pair in ALL_PAIRS[done:] for c in after[pair]}
    assert worker_pids.isdisjoint({c[4]["pid"] for c in before[ALL_PAIRS[0]]})
    # Completing the session made winners of every pair, the carried ones included.
    winners = {(w.workload, w.regime): w.session_id for w in store.winners()}
    assert winners == dict.fromkeys(ALL_PAIRS, out.session_id)


def test_a_session_preempted_again_passes_on_what_it_carried(fake: Fake, store: SqlStore) -> None:
    first = fake.preempted_after(1)
    second = fake.preempted_after(1)  # carried w1 (unthrottled), measured w1 (sustained)
    assert second.reused_from == {("w1", U): first.session_id}
    third = fake.run()
    assert third.status is SessionStatus.COMPLETED
    assert [a["pairs"] for a in fake.asked()] == [ALL_PAIRS, ALL_PAIRS[1:], ALL_PAIRS[2:]]
    assert set(third.reused_from) == set(ALL_PAIRS[:2])
    # A carried result keeps when it was measured: its age never restarts.
    recorded = {
        (s.result.workload, s.result.regime): s.recorded_at for s in store.results(first.session_id)
    }
    carried = {(s.result.workload, s.result.regime): s for s in store.results(third.session_id)}
    assert carried[("w1", U)].recorded_at == recorded[("w1", U)]


def test_nothing_left_to_measure_completes_without_a_worker(fake: Fake, store: SqlStore) -> None:
    first = fake.preempted_after(4)  # every result sent, then preempted before exiting
    out = fake.run(**CHECKS_STACK)
    assert (out.status, out.why) == (SessionStatus.COMPLETED, None)
    assert len(fake.asked()) == 1  # no second worker
    assert out.reused_from == dict.fromkeys(ALL_PAIRS, first.session_id)
    row = store.session(out.session_id)
    assert row is not None and row.meta.versions.torch == "fake-1.0"  # the results' stack
    assert {(w.workload, w.regime) for w in store.winners()} == set(ALL_PAIRS)


def _upgraded(info: DeviceInfo) -> Versions:
    return Versions(driver=info.driver_version, torch="fake-2.0")


def _unreadable(info: DeviceInfo) -> Versions:
    raise OSError("metadata unreadable")


@pytest.mark.parametrize(
    "checks",
    [
        {"versions_now": _upgraded},
        {"versions_now": _unreadable},
        {},  # a runner that cannot read the installed versions does not trust them
    ],
    ids=["stack-changed", "versions-unreadable", "no-check"],
)
def test_nothing_left_to_measure_on_a_changed_stack_measures_every_pair_again(
    fake: Fake, store: SqlStore, checks: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    fake.preempted_after(4)
    caplog.set_level("INFO", "gpuwatchd.sessions.runner")
    out = fake.run(**checks, torch="fake-2.0")
    assert (out.status, out.why) == (SessionStatus.COMPLETED, None)
    assert [a["pairs"] for a in fake.asked()] == [ALL_PAIRS, ALL_PAIRS]
    assert out.reused_from == {}
    assert {s.versions.torch for s in store.results(out.session_id)} == {"fake-2.0"}
    assert "every pair was measured by preempted sessions, but" in caplog.text


def test_progress_counts_the_reused_pairs(fake: Fake, tmp_path: Path) -> None:
    fake.preempted_after(3)
    progress: list[dict[str, Any]] = []
    body = FAKE_WORKER.replace(
        "for i, (w, r) in enumerate(pairs):",
        "send({'type': 'progress', 'workload': pairs[0][0], 'regime': pairs[0][1],"
        " 'candidate': 'a', 'done': 0, 'total': len(pairs)})\n"
        "for i, (w, r) in enumerate(pairs):",
    )
    env = {**os.environ, "JOB_LOG": str(fake.log), "HANG_AFTER": "-1", "FAKE_TORCH": "fake-1.0"}
    runner = TuneRunner(fake.store, env=env, worker_cmd=[sys.executable, "-c", body])
    out = runner.run_session(SPEC, INFO, "sim", lambda: None, progress.append, 20)
    assert out.status is SessionStatus.COMPLETED
    assert [(p["done"], p["total"]) for p in progress] == [(3, 4)]


# -- what is never reused --------------------------------------------------------------------


@pytest.mark.parametrize(
    "change",
    [
        {"info": replace(INFO, uuid="GPU-bbbb")},
        {"info": replace(INFO, power_limit_w=600.0)},
        {"info": replace(INFO, power_limit_w=None)},
        {"info": replace(INFO, max_sm_clock_mhz=1755.0)},
        {"info": replace(INFO, driver_version="590.2")},
        {"resume_max_age_s": 0},
        {"now": lambda: time.time() + DEFAULT_RESUME_MAX_AGE_S + 60},  # 6 h later
    ],
    ids=["other-gpu", "power-limit", "power-limit-unknown", "max-clock", "driver", "off", "old"],
)
def test_results_that_no_longer_hold_are_measured_again(
    fake: Fake, store: SqlStore, change: dict[str, Any]
) -> None:
    fake.preempted_after(3)
    info = change.pop("info", INFO)
    spec = replace(SPEC, gpu_uuid=info.uuid)
    out = fake.run(spec, info, **change)
    assert (out.status, out.why) == (SessionStatus.COMPLETED, None)
    assert [a["pairs"] for a in fake.asked()] == [ALL_PAIRS, ALL_PAIRS]
    assert out.reused_from == {}
    assert len(store.results(out.session_id)) == 4


def test_recent_enough_results_are_reused_by_the_age_rule(fake: Fake) -> None:
    """The other side of "old": 5 hours later they still count."""
    fake.preempted_after(3)
    out = fake.run(now=lambda: time.time() + 5 * 3600)
    assert len(out.reused_from) == 3


def test_another_stack_measures_every_pair_again(fake: Fake, store: SqlStore) -> None:
    fake.preempted_after(3)
    out = fake.run(torch="fake-2.0")  # torch was upgraded since
    assert (out.status, out.why) == (SessionStatus.COMPLETED, None)
    # The first worker (asked for the rest) said hello with another stack: stopped, and
    # a second one measured the whole job.
    assert [a["pairs"] for a in fake.asked()] == [ALL_PAIRS, ALL_PAIRS[3:], ALL_PAIRS]
    assert out.reused_from == {}
    stored = store.results(out.session_id)
    assert len(stored) == 4 and {s.versions.torch for s in stored} == {"fake-2.0"}
    assert {w.versions.torch for w in store.winners()} == {"fake-2.0"}


def test_results_of_another_stack_are_not_mixed(fake: Fake) -> None:
    """Two preempted sessions on different stacks: only the newest stack's results count."""
    fake.preempted_after(2, torch="fake-1.0")
    fake.preempted_after(1, resume_max_age_s=0, torch="fake-2.0")  # newest: w1 unthrottled
    out = fake.run(torch="fake-2.0")
    assert out.status is SessionStatus.COMPLETED
    assert list(out.reused_from) == [("w1", U)]
    assert fake.asked()[-1]["pairs"] == ALL_PAIRS[1:]


@pytest.mark.parametrize("how", ["completed", "failed"])
def test_only_preempted_sessions_are_resumed(fake: Fake, store: SqlStore, how: str) -> None:
    if how == "completed":
        assert fake.run().status is SessionStatus.COMPLETED
    else:
        assert fake.run(crash=True, hang_after=-1).status is SessionStatus.FAILED
    out = fake.run()
    assert out.status is SessionStatus.COMPLETED
    assert [a["pairs"] for a in fake.asked()] == [ALL_PAIRS, ALL_PAIRS]
    assert out.reused_from == {}


# -- what a later session or request makes stale: on SQLite and PostgreSQL ---------------------


@pytest.fixture(params=KINDS)
def either(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Fake]:
    """A :class:`Fake` on a store of each back end."""
    store = make_backend(request, tmp_path / "either.db").open()
    try:
        yield Fake(store, tmp_path)
    finally:
        store.close()


def test_a_completed_session_ends_what_earlier_preempted_ones_can_pass_on(either: Fake) -> None:
    """Preempted, then completed (reusing it), then a re-tune: the re-tune measures it all."""
    either.preempted_after(2)
    assert either.run().reused_from != {}  # completes the job, reusing the first session
    again = either.run()
    assert (again.status, again.reused_from) == (SessionStatus.COMPLETED, {})
    assert [a["pairs"] for a in either.asked()] == [ALL_PAIRS, ALL_PAIRS[2:], ALL_PAIRS]


def test_what_was_preempted_after_the_last_completed_session_is_reused(either: Fake) -> None:
    assert either.run().status is SessionStatus.COMPLETED
    later = either.preempted_after(2)
    out = either.run()
    assert out.reused_from == dict.fromkeys(ALL_PAIRS[:2], later.session_id)
    assert either.asked()[-1]["pairs"] == ALL_PAIRS[2:]


def test_a_workload_redefined_under_its_name_is_measured_again(either: Fake) -> None:
    either.preempted_after(3)  # w1 in both regimes, w2 unthrottled, all at 64^3 / 32^3
    w1_big = Workload("w1", "matmul", {"m": 8192, "n": 8192, "k": 8192}, "fp16", ("fam",))
    out = either.run(replace(SPEC, workloads=(w1_big, W2)))
    assert list(out.reused_from) == [("w2", U)]  # w2 is what it was
    assert either.asked()[-1]["pairs"] == [("w1", U), ("w1", S), ("w2", S)]


def test_a_workload_stored_as_json_is_still_the_same_workload(either: Fake) -> None:
    """Tuples in a shape come back from the store as lists: the same definition."""
    conv = Workload("w1", "conv2d", {"input": (8, 64, 56, 56), "stride": (1, 1)}, "fp16", ("f",))
    spec = replace(SPEC, workloads=(conv, W2))
    either.run(spec, hang_after=2)
    out = either.run(spec)
    assert set(out.reused_from) == {("w1", U), ("w1", S)}


def test_work_asked_for_afresh_reuses_only_what_was_measured_since(either: Fake) -> None:
    """A re-tune of w1 reuses none of w1's older results, but a re-tune that is itself
    preempted resumes like any other session."""
    first = either.preempted_after(3)  # w1 in both regimes, w2 unthrottled
    asked_at = time.time()
    fresh = {"w1": asked_at}
    second = either.run(fresh_after=fresh, hang_after=1)  # measures w1 unthrottled again
    assert second.status is SessionStatus.PREEMPTED
    assert second.reused_from == {("w2", U): first.session_id}
    assert either.asked()[-1]["pairs"] == [("w1", U), ("w1", S), ("w2", S)]
    third = either.run(fresh_after=fresh)
    assert third.status is SessionStatus.COMPLETED
    # w2 (unthrottled) comes from second's carried copy, which keeps first's time.
    assert third.reused_from == dict.fromkeys([("w1", U), ("w2", U)], second.session_id)
    assert either.asked()[-1]["pairs"] == [("w1", S), ("w2", S)]


@pytest.mark.parametrize(
    ("fresh", "needle"),
    [
        ({"w1": float("nan")}, "fresh_after['w1']: expected a workload name and a finite time"),
        ({"": 1.0}, "fresh_after['']: expected a workload name"),
        ({"w1": True}, "fresh_after['w1']"),
        (["w1"], "fresh_after must be a mapping, got list"),
    ],
)
def test_bad_fresh_after_is_refused_in_one_line(store: SqlStore, fresh: Any, needle: str) -> None:
    runner = TuneRunner(store)
    with pytest.raises(ValueError) as err:
        runner.run_session(SPEC, INFO, "sim", lambda: None, None, 20, fresh_after=fresh)
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert store.sessions() == []  # refused before a session was started


def test_bad_resume_max_age_is_refused(store: SqlStore) -> None:
    for bad in (-1, float("inf"), float("nan"), "6h", True):
        with pytest.raises(ValueError, match="resume_max_age_s must be a finite number >= 0"):
            TuneRunner(store, resume_max_age_s=bad)  # type: ignore[arg-type]


# -- the job left ----------------------------------------------------------------------------


def test_remaining_spec_drops_finished_workloads_and_regimes() -> None:
    assert remaining_spec(SPEC, []) is SPEC
    assert remaining_spec(SPEC, ALL_PAIRS) is None
    left = remaining_spec(SPEC, [("w1", U), ("w1", S), ("w2", U)])
    assert left is not None
    assert [w.name for w in left.workloads] == ["w2"]
    assert left.workload_regimes == {"w2": (S,)}
    assert left.pairs() == [("w2", S)] and left.time_budget_s == pytest.approx(100.0)
    assert SessionSpec.loads(left.dumps()) == left
    again = remaining_spec(left, [("w2", S)])
    assert again is None


@pytest.mark.parametrize(
    ("by", "needle"),
    [
        ({"w3": (S,)}, "spec.workload_regimes: expected names of the spec's workloads, got 'w3'"),
        ({"w1": ()}, "spec.workload_regimes.w1: expected a non-empty tuple of regimes"),
        ({"w1": (S, U)}, "expected some of ['unthrottled', 'sustained'], each once, in that order"),
        ({"w1": (S, S)}, "each once, in that order"),
    ],
)
def test_bad_workload_regimes_name_the_field(by: dict[str, Any], needle: str) -> None:
    with pytest.raises(SessionSpecError) as err:
        replace(SPEC, workload_regimes=by)
    assert needle in str(err.value)
    with pytest.raises(SessionSpecError, match=r"spec.workload_regimes.w1\[0\]: expected one of"):
        SessionSpec.loads(SPEC.dumps()[:-1] + ',"workload_regimes":{"w1":["lukewarm"]}}')


# -- the real sim worker ---------------------------------------------------------------------


def test_the_sim_worker_keeps_a_finished_regime_when_preempted_in_the_next(store: SqlStore) -> None:
    """Results go out one regime at a time, so a preemption in the sustained regime keeps
    the unthrottled one, and the next session measures the sustained regime alone."""
    sim_gemm = next(w for w in DEFAULT_WORKLOADS if w.name == "sim-gemm")
    info = SimBackend(gpus=1, scenario="power-cap", seed=3).device_info(0)
    protocol = ProtocolConfig(time_budget_s=20.0)
    sim = SimSpec("power-cap", 3, 1, speed=4.0)  # paced: the sustained regime lasts ~0.3 s
    spec = SessionSpec(0, info.uuid, "sim", (sim_gemm,), BOTH, protocol, 40.0, sim)
    in_sustained: list[bool] = []

    def progress(p: dict[str, Any]) -> None:
        in_sustained.append(p["regime"] == "sustained")

    def preempt() -> str | None:
        return "a job wants the GPU" if any(in_sustained) else None

    runner = TuneRunner(store)
    first = runner.run_session(spec, info, "sim", preempt, progress, 60)
    assert first.status is SessionStatus.PREEMPTED
    assert [(r.workload, r.regime) for r in first.results] == [("sim-gemm", U)]
    assert [s.result.regime for s in store.results(first.session_id)] == [U]
    progress_seen: list[dict[str, Any]] = []
    second = runner.run_session(spec, info, "sim", lambda: None, progress_seen.append, 60)
    assert (second.status, second.why) == (SessionStatus.COMPLETED, None)
    assert second.reused_from == {("sim-gemm", U): first.session_id}
    assert {p["regime"] for p in progress_seen} == {"sustained"}  # only it was measured
    assert [(r.workload, r.regime) for r in second.results] == [("sim-gemm", U), ("sim-gemm", S)]


def test_a_store_that_cannot_look_up_results_still_runs_the_whole_job(
    fake: Fake, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_lookup(*a: Any, **kw: Any) -> Any:
        raise StoreError("store tune.db: database is locked")

    fake.preempted_after(3)
    with sqlite_store(tmp_path / "tune.db") as broken:
        monkeypatch.setattr(broken, "resumable_results", broken_lookup)
        fake.store = broken
        out = fake.run()
    assert (out.status, out.why) == (SessionStatus.COMPLETED, None)
    assert [a["pairs"] for a in fake.asked()] == [ALL_PAIRS, ALL_PAIRS]
    assert out.reused_from == {}


def test_the_driver_rule_is_the_stack_rule() -> None:
    """Resuming compares drivers as drift does: the same version however it is spelt."""
    from gpuwatchd.sessions.resume import conditions_differ
    from gpuwatchd.store import SessionMeta

    def meta(driver: str | None) -> SessionMeta:
        return SessionMeta("GPU-a", 0, "H200", "sim", (), (U,), Versions(driver=driver), "h")

    assert conditions_differ(meta("580.1"), meta(" 580.1 ")) is None
    assert conditions_differ(meta("590.2"), meta("580.1")) == "driver 580.1, now 590.2"
    assert conditions_differ(meta(None), meta("580.1")) == "driver 580.1, now None"
