"""The client API: GPU state and the gate wait, winners from the daemon or the store file."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from builders import (
    STACK,
    board_of,
    candidate,
    capped,
    closed_url,
    h200,
    judged,
    seed_session,
    session_meta,
)
from json_server import JsonServer, Route
from prometheus_client.registry import CollectorRegistry

import gpuwatchd.client as client_mod
import gpuwatchd.client.discovery
import gpuwatchd.config
from gpuwatchd.api.winners import parse_winners_query, winners_json
from gpuwatchd.client import Client, GpuwatchdError, GpuwatchdUnavailable, parse_winners
from gpuwatchd.gate import GateState
from gpuwatchd.monitor.board import StateBoard
from gpuwatchd.serve.http import HttpServer
from gpuwatchd.store import sqlite_store
from gpuwatchd.telemetry.types import ThrottleReason
from gpuwatchd.tuning.types import (
    CandidateStats,
    Regime,
    RegimeResult,
)

ROOT = Path(__file__).resolve().parents[1]
U, S = Regime.UNTHROTTLED, Regime.SUSTAINED
BIG = "triton[128x256x64,s3,w8,g8]"
SMALL = "triton[128x128x64,s4,w4,g8]"


# -- fixtures --------------------------------------------------------------------------------


class FakeDaemon(JsonServer):
    """Serves scripted JSON documents per path; the last one of a list repeats."""

    def __init__(self) -> None:
        self.docs: dict[str, list[Any]] = {}
        super().__init__({})

    def route(self, path: str) -> Route | None:
        docs = self.docs.get(path)
        if not docs:
            return None
        return lambda _handler: (200, docs.pop(0) if len(docs) > 1 else docs[0])


@pytest.fixture
def fake() -> Iterator[FakeDaemon]:
    with FakeDaemon() as daemon:
        yield daemon


class FakeTime:
    """monotonic() and sleep() for the client: sleeping advances the clock at once."""

    def __init__(self) -> None:
        self.t = 100.0
        self.sleeps: list[float] = []

    def now(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += s


@pytest.fixture(autouse=True)
def no_host_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Tests never see the host's daemon config, env or state directory."""
    monkeypatch.setattr(gpuwatchd.config, "DEFAULT_CONFIG_PATH", tmp_path / "absent.toml")
    monkeypatch.setattr(gpuwatchd.client.discovery, "_SYSTEM_STATE_DIR", tmp_path / "system")
    for var in ("GPUWATCHD_URL", "GPUWATCHD_STORE", "http_proxy", "HTTP_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "state"))
    monkeypatch.setenv("GPUWATCHD_CONTROL_SOCKET", str(tmp_path / "no-daemon.sock"))


def board_with_gpu(state: GateState = GateState.WARMING, procs: tuple[int, ...] = ()) -> StateBoard:
    info = h200(uuid="GPU-4AE2C0DE-0000-1111-2222-333344445555")
    why = ("power spread 337-694W > 28W",)
    return board_of(judged(0, info, capped(procs=procs), state, why))


def state_doc(
    t: float,
    gate: str = "busy",
    *,
    pids: list[int] | None = None,
    temp: float = 40.0,
    power: float = 120.0,
    stalled: bool = False,
    gate_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A /api/v1/state document for GPU 0 with a quiet reading at daemon time ``t``."""
    doc: dict[str, Any] = {
        "format": "gpuwatchd-state/1",
        "gpus": [
            {
                "gpu": 0,
                "uuid": "GPU-aaaa",
                "info": {
                    "name": "NVIDIA H200",
                    "max_sm_clock_mhz": 1980.0,
                    "power_limit_w": 700.0,
                    "slowdown_temp_c": 87.0,
                },
                "sample": {
                    "t_s": t,
                    "temp_c": temp,
                    "power_w": power,
                    "sm_clock_mhz": 1980.0,
                    "util_gpu_ratio": 0.0,
                    "throttle_reasons": [],
                    "compute_pids": pids if pids is not None else [],
                },
                "gate": {
                    "state": gate,
                    "open": gate == "cool_stable",
                    "reasons": [f"{gate} because the test says so"],
                    "in_state_s": 1.0,
                },
                "poll": {"success": True, "stalled": stalled, "lost": False},
            }
        ],
    }
    if gate_config is not None:
        doc["gate_config"] = gate_config
    return doc


def cand(name: str, regime: Regime, median: float | None) -> CandidateStats:
    """A candidate; a Triton one also carries its config, read from its name."""
    stats = candidate(name, regime, median)
    if stats.family != "triton.matmul":
        return stats
    label = name[len("triton[") : -1]
    bm, bn, bk = (int(x) for x in label.split(",")[0].split("x"))
    config = {
        "block_m": bm,
        "block_n": bn,
        "block_k": bk,
        "num_stages": int(label.split(",")[1][1:]),
        "num_warps": int(label.split(",")[2][1:]),
        "group_m": 8,
    }
    return replace(stats, meta={**stats.meta, "config": config})


def make_store(path: Path) -> Path:
    """A store with one completed session: triton wins cool, cuBLAS wins sustained."""
    cool = (cand(SMALL, U, 1.10e-3), cand(BIG, U, 1.00e-3), cand("cublas", U, 1.02e-3))
    hot = (cand(BIG, S, 1.40e-3), cand("cublas", S, 1.33e-3), cand(SMALL, S, None))
    results = [
        RegimeResult("gemm", U, cool, BIG, False, 0.02, 0.005),
        RegimeResult("gemm", S, hot, "cublas", False, 0.05, 0.005),
    ]
    with sqlite_store(path) as store:
        seed_session(store, session_meta(), results)
    return path


# -- importing ---------------------------------------------------------------------------------


def test_client_and_integrations_import_without_torch() -> None:
    code = (
        "import sys, gpuwatchd.client, gpuwatchd.triton_configs, gpuwatchd.torch\n"
        "heavy = sorted(m for m in ('torch', 'triton', 'prometheus_client') if m in sys.modules)\n"
        "print(','.join(heavy) or 'clean')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "clean"


# -- state -----------------------------------------------------------------------------------


def test_state_reads_the_real_daemon_document() -> None:
    board = board_with_gpu(GateState.THROTTLED, procs=(4242,))
    with HttpServer(board, CollectorRegistry(), ("127.0.0.1", 0)) as server:
        client = Client(server.url)
        st = client.state(0)
        by_uuid = client.state("4ae2c0de-0000-1111-2222-333344445555")  # torch's spelling
    assert replace(st, sample_age_s=None) == replace(by_uuid, sample_age_s=None)
    assert (st.gpu, st.name, st.state, st.open) == (0, "NVIDIA H200", "throttled", False)
    assert st.reasons == ("power spread 337-694W > 28W",)
    assert (st.temp_c, st.power_w, st.sm_clock_mhz, st.max_sm_clock_mhz) == (
        61.0,
        693.5,
        1440.0,
        1980.0,
    )
    assert st.throttle_reasons == ("sw_power_cap",)
    assert st.compute_pids == (4242,)
    assert st.in_state_s == 10.0
    assert not st.ready
    assert "throttle sw_power_cap" in st.describe()
    sample = st.to_sample()
    assert sample is not None and sample.reasons == ThrottleReason.SW_POWER_CAP


def test_state_of_a_gpu_the_daemon_does_not_watch_lists_the_watched(fake: FakeDaemon) -> None:
    fake.docs["/api/v1/state"] = [state_doc(1.0)]
    with pytest.raises(ValueError, match=r"gpu 3: not watched .* \(GPUs: 0 \(GPU-aaaa\)\)"):
        Client(fake.url).state(3)


def test_tuning_flag_comes_from_the_daemon_tuning_key(fake: FakeDaemon) -> None:
    doc = state_doc(1.0)
    doc["tuning"] = {"enabled": True, "running_gpus": [0], "pending": {}}
    fake.docs["/api/v1/state"] = [doc]
    assert Client(fake.url).state(0).tuning


def test_unreachable_daemon_is_a_one_line_error() -> None:
    url = closed_url()
    with pytest.raises(GpuwatchdUnavailable) as err:
        Client(url, timeout=0.5).state(0)
    msg = str(err.value)
    assert url in msg and "not reachable" in msg and "\n" not in msg


def test_bad_state_document_names_the_field(fake: FakeDaemon) -> None:
    doc = state_doc(1.0)
    doc["gpus"][0]["sample"]["temp_c"] = "hot"
    fake.docs["/api/v1/state"] = [doc]
    with pytest.raises(GpuwatchdError, match=r"gpus\[gpu=0\]\.sample\.temp_c: expected a number"):
        Client(fake.url).state(0)


def test_http_proxy_settings_are_not_used_for_the_daemon(
    fake: FakeDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("http_proxy", closed_url())
    monkeypatch.setenv("no_proxy", "")
    fake.docs["/api/v1/state"] = [state_doc(1.0, "cool_stable")]
    assert Client(fake.url).state(0).open


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"url": "localhost:9844"}, "url"),
        ({"timeout": 0}, "timeout"),
        ({"timeout": True}, "timeout"),
    ],
)
def test_bad_client_arguments_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    kwargs.setdefault("url", "http://127.0.0.1:1")
    with pytest.raises(ValueError, match=rf"^{field}: "):
        Client(**kwargs)


# -- waiting for the gate ----------------------------------------------------------------------


def test_wait_returns_once_the_gate_opens(fake: FakeDaemon) -> None:
    fake.docs["/api/v1/state"] = [
        state_doc(1.0, "warming"),
        state_doc(1.5, "warming"),
        state_doc(2.0, "cool_stable"),
    ]
    clock = FakeTime()
    seen: list[str] = []
    st = Client(fake.url, clock=clock.now, sleep=clock.sleep).wait_until_stable(
        0, 60, poll_s=0.5, on_poll=lambda s: seen.append(s.state)
    )
    assert st.open and st.judged_by == "daemon" and st.t_s == 2.0
    assert clock.sleeps == [0.5, 0.5]
    assert seen == ["warming", "warming", "cool_stable"]


def test_wait_times_out_naming_the_last_state_and_reasons(fake: FakeDaemon) -> None:
    fake.docs["/api/v1/state"] = [state_doc(1.0, "throttled")]
    clock = FakeTime()
    client = Client(fake.url, clock=clock.now, sleep=clock.sleep)
    with pytest.raises(TimeoutError, match=r"after 3s; last: gpu 0 throttled: throttled because"):
        client.wait_until_stable(0, 3, poll_s=1.0)
    assert sum(clock.sleeps) == pytest.approx(3.0)


def test_wait_does_not_accept_an_open_gate_with_a_stalled_poll(fake: FakeDaemon) -> None:
    fake.docs["/api/v1/state"] = [state_doc(1.0, "cool_stable", stalled=True)]
    clock = FakeTime()
    client = Client(fake.url, clock=clock.now, sleep=clock.sleep)
    with pytest.raises(TimeoutError, match="poll stalled"):
        client.wait_until_stable(0, 2)


SMALL_GATE = {"settle_s": 2.0, "window_s": 2.0, "min_samples": 3}


def own_process_docs(pids: list[int], n: int = 30, jump_at: float | None = None) -> list[Any]:
    """The daemon calls the GPU busy (our own context) while the reading is quiet."""
    docs = []
    for i in range(n):
        t = 1.0 + 0.5 * i
        temp = 60.0 if jump_at is not None and t == jump_at else 40.0
        docs.append(state_doc(t, "busy", pids=pids, temp=temp, gate_config=SMALL_GATE))
    return docs


def test_wait_re_judges_a_gpu_busy_only_with_this_process(fake: FakeDaemon) -> None:
    fake.docs["/api/v1/state"] = own_process_docs([os.getpid()])
    clock = FakeTime()
    st = Client(fake.url, clock=clock.now, sleep=clock.sleep).wait_until_stable(0, 60)
    assert st.open and st.judged_by == "client"
    assert st.t_s is not None and st.t_s - 1.0 >= SMALL_GATE["settle_s"]
    assert st.t_s < 5.0  # opens once settled, not at the timeout


def test_own_process_re_judging_still_sees_disturbances(fake: FakeDaemon) -> None:
    fake.docs["/api/v1/state"] = own_process_docs([os.getpid()], jump_at=2.5)
    clock = FakeTime()
    st = Client(fake.url, clock=clock.now, sleep=clock.sleep).wait_until_stable(0, 60)
    assert st.open and st.t_s is not None
    assert st.t_s >= 2.5 + SMALL_GATE["window_s"] + SMALL_GATE["settle_s"] - 0.5


@pytest.mark.parametrize("pids", [[os.getpid(), 999999], [999999]])
def test_foreign_processes_keep_the_gate_shut(fake: FakeDaemon, pids: list[int]) -> None:
    fake.docs["/api/v1/state"] = own_process_docs(pids)
    clock = FakeTime()
    client = Client(fake.url, clock=clock.now, sleep=clock.sleep)
    with pytest.raises(TimeoutError, match=r"busy: .*foreign compute process.*999999|busy because"):
        client.wait_until_stable(0, 10)


def test_wait_rejects_bad_timeouts(fake: FakeDaemon) -> None:
    client = Client(fake.url)
    with pytest.raises(ValueError, match=r"^timeout: "):
        client.wait_until_stable(0, -1)
    with pytest.raises(ValueError, match=r"^poll_s: "):
        client.wait_until_stable(0, 1, poll_s=0)


# -- winners ---------------------------------------------------------------------------------


def test_winner_from_the_store_file(tmp_path: Path) -> None:
    path = make_store(tmp_path / "w.db")
    client = Client(closed_url(), store=path)
    cool = client.winner("gemm", "unthrottled")
    hot = client.winner("gemm", Regime.SUSTAINED, gpu_model="NVIDIA H200")
    assert cool is not None and hot is not None
    assert (cool.candidate, cool.family, cool.median_s) == (BIG, "triton.matmul", 1.00e-3)
    assert cool.kernels == (f"kernel_of_{BIG}",)
    assert cool.config is not None and cool.config["block_n"] == 256
    assert [c.name for c in cool.ranked] == [BIG, "cublas", SMALL]
    assert (hot.candidate, hot.family) == ("cublas", "torch.matmul")
    assert [c.name for c in hot.ranked] == ["cublas", BIG, SMALL]  # unmeasured last
    assert cool.versions == STACK and cool.source == str(path)
    assert client.winner("conv", "unthrottled") is None
    assert client.winner("gemm", "unthrottled", gpu_model="NVIDIA L4") is None


def test_winner_rejects_a_bad_regime(tmp_path: Path) -> None:
    client = Client(closed_url(), store=make_store(tmp_path / "w.db"))
    with pytest.raises(ValueError, match=r"^regime: expected one of unthrottled, sustained"):
        client.winner("gemm", "hot")


def test_winner_from_the_daemon_matches_the_store(fake: FakeDaemon, tmp_path: Path) -> None:
    path = make_store(tmp_path / "w.db")
    with sqlite_store(path, readonly=True) as store:
        fake.docs["/api/v1/winners"] = [winners_json(store, workload="gemm", regime=S)]
    from_daemon = Client(fake.url).winner("gemm", "sustained")
    from_store = Client(closed_url(), store=path).winner("gemm", "sustained")
    assert from_daemon is not None and from_store is not None
    assert from_daemon.source == fake.url
    assert from_daemon == replace(from_store, source=fake.url)
    assert fake.requests == ["/api/v1/winners?workload=gemm&regime=sustained"]


def test_winner_falls_back_to_the_default_store_when_the_daemon_lacks_the_endpoint(
    tmp_path: Path,
) -> None:
    path = make_store(tmp_path / "state" / "gpuwatchd.db")  # $STATE_DIRECTORY, as the daemon
    with HttpServer(StateBoard(), CollectorRegistry(), ("127.0.0.1", 0)) as server:
        w = Client(server.url).winner("gemm", "unthrottled")
    assert w is not None and w.candidate == BIG and w.source == str(path)


def test_no_daemon_and_no_store_names_both(tmp_path: Path) -> None:
    url = closed_url()
    with pytest.raises(GpuwatchdUnavailable) as err:
        Client(url, timeout=0.5).winner("gemm", "unthrottled")
    msg = str(err.value)
    assert "\n" not in msg
    assert url in msg and str(tmp_path / "state" / "gpuwatchd.db") in msg


def test_winners_document_is_strict_json_and_filtered(tmp_path: Path) -> None:
    with sqlite_store(make_store(tmp_path / "w.db"), readonly=True) as store:
        all_doc = winners_json(store, now=lambda: 5.0)
        cool_doc = winners_json(store, regime="unthrottled")
        none_doc = winners_json(store, gpu_model="NVIDIA L4")
    text = json.dumps(all_doc, allow_nan=False)
    assert json.loads(text)["format"] == "gpuwatchd-winners/1"
    assert [(w["workload"], w["regime"]) for w in all_doc["winners"]] == [
        ("gemm", "sustained"),
        ("gemm", "unthrottled"),
    ]
    assert [w["regime"] for w in cool_doc["winners"]] == ["unthrottled"]
    assert none_doc["winners"] == []
    assert len(parse_winners(all_doc)) == 2


def test_winners_query_parsing() -> None:
    assert parse_winners_query("/api/v1/winners") == {}
    assert parse_winners_query("/api/v1/winners?workload=gemm&regime=sustained") == {
        "workload": "gemm",
        "regime": Regime.SUSTAINED,
    }
    with pytest.raises(ValueError, match="'gpu' is not one of"):
        parse_winners_query("/api/v1/winners?gpu=0")
    with pytest.raises(ValueError, match=r"^regime: "):
        parse_winners_query("/api/v1/winners?regime=hot")
    with pytest.raises(ValueError, match="'workload' must be given once"):
        parse_winners_query("/api/v1/winners?workload=a&workload=b")


def test_bad_winners_document_names_the_field(fake: FakeDaemon, tmp_path: Path) -> None:
    with sqlite_store(make_store(tmp_path / "w.db"), readonly=True) as store:
        doc = winners_json(store, regime="unthrottled")
    doc["winners"][0]["regime"] = "hot"
    fake.docs["/api/v1/winners"] = [doc]
    with pytest.raises(GpuwatchdUnavailable, match=r"winners\[0\]\.regime: expected one of"):
        Client(fake.url).winner("gemm", "unthrottled")


# -- defaults and shortcuts ------------------------------------------------------------------


def test_defaults_follow_the_daemon_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[daemon]\nlisten = "0.0.0.0:9900"\nstate_dir = "{tmp_path / "sd"}"\n')
    monkeypatch.setattr(gpuwatchd.config, "DEFAULT_CONFIG_PATH", cfg)
    assert Client().url == "http://127.0.0.1:9900"
    assert client_mod.default_store_paths()[0] == tmp_path / "sd" / "gpuwatchd.db"
    monkeypatch.setenv("GPUWATCHD_URL", "http://10.0.0.7:9844")
    assert Client().url == "http://10.0.0.7:9844"


def test_winners_fall_back_to_the_daemon_configs_store_url(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = make_store(tmp_path / "elsewhere" / "tuning.db")
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[store]\nurl = "{path}"\n')
    monkeypatch.setattr(gpuwatchd.config, "DEFAULT_CONFIG_PATH", cfg)
    assert client_mod.default_store_paths()[0] == path
    assert gpuwatchd.client.discovery.default_store_url() is None  # a file, not PostgreSQL
    w = Client(closed_url(), timeout=0.5).winner("gemm", "unthrottled")
    assert w is not None and w.candidate == BIG and w.source == str(path)
    pw = tmp_path / "pw"
    url = "postgresql://gpuwatchd@db.example/gw"
    cfg.write_text(f'[store]\nurl = "{url}"\npassword_file = "{pw}"\n')
    assert gpuwatchd.client.discovery.default_store_url() == (url, pw)


def test_module_shortcuts_use_the_environment(
    fake: FakeDaemon, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake.docs["/api/v1/state"] = [state_doc(1.0, "cool_stable")]
    monkeypatch.setenv("GPUWATCHD_URL", fake.url)
    monkeypatch.setenv("GPUWATCHD_STORE", str(make_store(tmp_path / "w.db")))
    assert client_mod.state(0).open
    seen: list[str] = []
    assert client_mod.wait_until_stable(0, 1, on_poll=lambda s: seen.append(s.state)).open
    assert seen == ["cool_stable"]
    w = client_mod.winner("gemm", "sustained")
    assert w is not None and w.candidate == "cublas"
    assert not any(r.startswith("/api/v1/winners") for r in fake.requests)  # store was given


@pytest.mark.parametrize("name", ["state", "wait_until_stable", "winner"])
def test_module_shortcuts_take_exactly_the_methods_arguments(name: str) -> None:
    method = list(inspect.signature(getattr(Client, name)).parameters.values())[1:]
    assert list(inspect.signature(getattr(client_mod, name)).parameters.values()) == method
