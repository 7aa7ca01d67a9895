"""The worker tunes a job's workloads in queued groups (``protocol.queue_workloads``).

``run_spec`` in this process on the simulated GPU: every workload of a group gets its
unthrottled regime before any sustained one, the later sustained regimes settle on the
heat the earlier ones left, results go out one by one as they are decided, progress
names the right place in the job, per-workload regimes (a resumed session) hold, and
building and setting the candidates up is spent from the job's budget.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import pytest

from gpuwatchd.telemetry.sim import SimBackend
from gpuwatchd.tuning.session_spec import (
    Hello,
    Message,
    Progress,
    ResultMessage,
    SessionSpec,
    SimSpec,
)
from gpuwatchd.tuning.settings import ProtocolConfig
from gpuwatchd.tuning.types import Regime, Workload
from gpuwatchd.tuning.worker import main
from gpuwatchd.tuning.worker.candidate import Candidate, DeviceSession
from gpuwatchd.tuning.worker.devices import SimSession
from gpuwatchd.tuning.worker.main import EXIT_OK, Channel, run_spec

U, S = Regime.UNTHROTTLED, Regime.SUSTAINED
GEMMS = tuple(
    Workload(f"sim-gemm-{m}", "matmul", {"m": m, "n": 8192, "k": 8192}, "bfloat16", ("sim",))
    for m in (8192, 4096, 2048)
)


class Recorder(Channel):
    def __init__(self) -> None:
        self.messages: list[Message] = []

    def send(self, msg: Message) -> None:
        self.messages.append(msg)


def session_spec(queue_workloads: int, **kw: object) -> SessionSpec:
    info = SimBackend(gpus=1, scenario="idle", seed=3).device_info(0)
    protocol = ProtocolConfig(time_budget_s=20.0, queue_workloads=queue_workloads)
    return SessionSpec(0, info.uuid, "sim", GEMMS, (U, S), protocol, 120.0, SimSpec("idle", 3, 1),
                   **kw)  # type: ignore[arg-type]  # fmt: skip


def run(spec: SessionSpec) -> list[Message]:
    channel = Recorder()
    assert run_spec(spec, channel, lambda: False) == EXIT_OK
    assert isinstance(channel.messages[0], Hello)
    return channel.messages[1:]


def results(msgs: list[Message]) -> list[tuple[str, Regime]]:
    return [(m.result.workload, m.result.regime) for m in msgs if isinstance(m, ResultMessage)]


def test_a_queued_group_times_unthrottled_first_then_sustained_on_carried_heat() -> None:
    msgs = run(session_spec(queue_workloads=3))
    names = [w.name for w in GEMMS]
    assert results(msgs) == [(n, U) for n in names] + [(n, S) for n in names]
    sustained = [m.result for m in msgs if isinstance(m, ResultMessage) and m.result.regime is S]
    assert "settled_on_carried_heat" not in sustained[0].candidates[0].meta
    assert all(r.candidates[0].meta.get("settled_on_carried_heat") for r in sustained[1:])
    # Each regime's first progress message says how many pairs of the job were done.
    first: dict[tuple[str, Regime], Progress] = {}
    done_before: dict[tuple[str, Regime], int] = {}
    sent = 0
    for m in msgs:
        if isinstance(m, ResultMessage):
            sent += 1
        elif isinstance(m, Progress) and (m.workload, m.regime) not in first:
            first[(m.workload, m.regime)] = m
            done_before[(m.workload, m.regime)] = sent
    assert set(first) == set(results(msgs))
    for key, p in first.items():
        assert p.done == done_before[key] and p.total == 6, key
        assert p.elapsed_s is not None and p.elapsed_s < 5.0, key  # its own regime's clock
        assert p.budget_s is not None and 0 < p.budget_s <= 20.0


def test_one_workload_at_a_time_and_groups_smaller_than_the_job() -> None:
    names = [w.name for w in GEMMS]
    assert results(run(session_spec(queue_workloads=1))) == [(n, r) for n in names for r in (U, S)]
    # Two groups: the first two workloads queued together, then the third alone.
    assert results(run(session_spec(queue_workloads=2))) == [
        (names[0], U), (names[1], U), (names[0], S), (names[1], S), (names[2], U), (names[2], S),
    ]  # fmt: skip


def test_a_resumed_specs_per_workload_regimes_hold_in_the_queue() -> None:
    spec = session_spec(
        queue_workloads=3, workload_regimes={GEMMS[1].name: (S,), GEMMS[2].name: (U,)}
    )
    names = [w.name for w in GEMMS]
    assert results(run(spec)) == [(names[0], U), (names[2], U), (names[0], S), (names[1], S)]


def test_the_jobs_budget_is_shared_by_the_queued_regime_runs() -> None:
    spec = replace(session_spec(queue_workloads=3), time_budget_s=6.0)
    msgs = run(spec)
    budgets = {(m.workload, m.regime): m.budget_s for m in msgs if isinstance(m, Progress)}
    assert budgets[(GEMMS[0].name, U)] == 1.0  # 6 s over six regime runs
    assert all(b is not None and b <= 6.0 for b in budgets.values())


def test_building_and_setting_up_candidates_spends_the_jobs_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each workload's candidates take 1 s of the device's time to build (compiling):
    counted, the job ends within its 6 s; uncounted, it overran by the set-up."""
    sessions: list[DeviceSession] = []
    build = main.candidates_for

    def slow_build(workload: Workload, session: DeviceSession, *rest: Any) -> Iterable[Candidate]:
        assert isinstance(session, SimSession)
        sessions.append(session)
        session.clock.advance(1.0)
        return build(workload, session, *rest)

    monkeypatch.setattr(main, "candidates_for", slow_build)
    for queued in (1, 3):
        sessions.clear()
        msgs = run(replace(session_spec(queue_workloads=queued), time_budget_s=6.0))
        assert len(results(msgs)) == 6
        assert sessions[0].now() <= 6.0 + 0.05, queued  # a batch over at most
