"""The JSON documents: what each producer writes, its parser reads back; the shared GET."""

from __future__ import annotations

import base64
import json
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
from builders import (
    DAEMON_INFO,
    board_of,
    candidate,
    capped,
    closed_url,
    h200,
    judged,
    seed_session,
    session_meta,
)
from json_server import JsonServer, make_scratch_ca

from gpuwatchd.api.errors import GpuwatchdError
from gpuwatchd.api.fetch import (
    CaFileError,
    HttpStatusError,
    NotJsonError,
    UnreachableError,
    get_json,
    is_base_url,
)
from gpuwatchd.api.state import DaemonSection, build_state_json, parse_state
from gpuwatchd.api.winners import Winner, parse_winners, winners_json
from gpuwatchd.gate import GateConfig, GateState
from gpuwatchd.monitor.board import PollHealth, StateBoard
from gpuwatchd.store import WinnerRow, sqlite_store
from gpuwatchd.tuning.types import (
    Regime,
    RegimeResult,
    Versions,
    Workload,
)

U = Regime.UNTHROTTLED


def board() -> StateBoard:
    """GPU 0 power-capped and judged; GPU 1 whose last read failed, before any reading."""
    return board_of(
        judged(0, h200(), capped(), GateState.THROTTLED, ("power capped",)),
        judged(
            1,
            None,
            None,
            GateState.UNAVAILABLE,
            ("read failed: boom",),
            since=12.5,
            health=PollHealth(False, 0.5, error="boom"),
        ),
    )


def wire(doc: dict[str, Any]) -> dict[str, Any]:
    """The document as a reader gets it: through strict JSON."""
    out: dict[str, Any] = json.loads(json.dumps(doc, allow_nan=False))
    return out


# -- /api/v1/state ---------------------------------------------------------------------------


def test_state_reads_back_what_the_board_holds() -> None:
    doc = wire(build_state_json(board(), DAEMON_INFO, now=lambda: 1010.0))
    doc["tuning"] = {"enabled": True, "running_gpus": [0], "pending": {"1": ["gemm"]}}
    doc["gate_config"] = {"settle_s": 2.0, "min_samples": 3}
    st = parse_state(doc, "src")
    assert st.daemon == DaemonSection("9.9.9", "sim", "3.11.7")
    assert st.tuning is not None and st.tuning.pending == {"1": ("gemm",)}
    assert (st.gate().settle_s, st.gate().min_samples) == (2.0, 3)
    g0, g1 = st.gpus
    assert (g0.gpu, g0.uuid, g0.name, g0.state, g0.open) == (
        0,
        "GPU-aaaa",
        "NVIDIA H200",
        "throttled",
        False,
    )
    assert (g0.temp_c, g0.power_w, g0.sm_clock_mhz, g0.in_state_s) == (61.0, 693.5, 1440.0, 10.0)
    assert (g0.throttle_reasons, g0.compute_pids) == (("sw_power_cap",), (4242,))
    assert (g0.slowdown_temp_c, g0.power_limit_w, g0.max_sm_clock_mhz) == (87.0, 700.0, 1980.0)
    assert g0.sample_age_s == 10.0 and g0.poll_ok and g0.tuning
    assert (g1.name, g1.t_s, g1.throttle_reasons, g1.poll_ok, g1.tuning) == (
        None,
        None,
        None,
        False,
        False,
    )
    assert g1.reasons == ("read failed: boom",)


def test_state_without_the_daemon_sections_reads_as_absent() -> None:
    st = parse_state(wire(build_state_json(board())))
    assert (st.daemon, st.tuning, st.gate_config) == (None, None, None)
    assert st.gate() == GateConfig()
    assert not any(g.tuning for g in st.gpus)


def test_an_entry_without_a_gate_decision_is_unavailable() -> None:
    doc = wire(build_state_json(board()))
    del doc["gpus"][0]["gate"]
    g0 = parse_state(doc).gpus[0]
    assert (g0.state, g0.open, g0.reasons) == ("unavailable", False, ("no gate decision yet",))


def _with(path: str, value: Any) -> dict[str, Any]:
    doc = wire(build_state_json(board()))
    *parents, last = path.split("/")
    target = doc
    for key in parents:
        target = target[int(key)] if isinstance(target, list) else target.setdefault(key, {})
    target[last] = value
    return doc


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"gpus": {}}, "src: not a gpuwatchd state document"),
        ([], "src: not a gpuwatchd state document"),
        (
            _with("format", "gpuwatchd-state/2"),
            "src: bad state document: format: expected 'gpuwatchd-state/1', "
            "got 'gpuwatchd-state/2'",
        ),
        (
            _with("gpus/0/poll/stalled", "no"),
            "src: bad state document: gpus[gpu=0].poll.stalled: expected true or false, got 'no'",
        ),
        (
            _with("gpus/1/gpu", "1"),
            "src: bad state document: gpus[].gpu: expected an integer, got '1'",
        ),
        (
            _with("tuning/pending", {"0": "gemm"}),
            "src: bad state document: tuning.pending.0: expected a list of strings, got 'gemm'",
        ),
        (
            _with("daemon", "9.9.9"),
            "src: bad state document: daemon: expected an object, got '9.9.9'",
        ),
        (
            _with("gate_config", [1]),
            "src: bad state document: gate_config: expected an object, got [1]",
        ),
    ],
)
def test_a_bad_state_document_names_the_field(doc: Any, message: str) -> None:
    with pytest.raises(GpuwatchdError) as err:
        parse_state(doc, "src")
    assert str(err.value) == message


def test_an_unknown_gate_threshold_matters_only_when_the_gate_is_re_run() -> None:
    st = parse_state(_with("gate_config", {"new_knob": 1}), "src")
    assert len(st.gpus) == 2
    with pytest.raises(GpuwatchdError, match=r"^src: bad state document: gate.new_knob: unknown"):
        st.gate()


# -- /api/v1/winners -------------------------------------------------------------------------


def _store(path: Path) -> Path:
    """One session of a 64³ GEMM, unthrottled only: ``a`` beats ``b``, ``c`` never ran."""
    gemm = Workload("gemm", "matmul", {"m": 64, "n": 64, "k": 64}, "bf16", ("torch.matmul",))
    versions = Versions(driver="580.159.04", torch="2.11.0")
    meta = session_meta(workloads=(gemm,), regimes=(U,), versions=versions)
    cands = tuple(
        candidate(name, U, median, meta={"kernels": [f"k_{name}"]})
        for name, median in (("b", 2e-3), ("a", 1e-3), ("c", None))
    )
    with sqlite_store(path) as store:
        seed_session(store, meta, [RegimeResult("gemm", U, cands, "a", False, 0.5, 0.01)])
    return path


def test_a_winner_is_the_stored_row_plus_its_ranking(tmp_path: Path) -> None:
    with sqlite_store(_store(tmp_path / "w.db"), readonly=True) as store:
        (row,) = store.winners(latest=True)
        doc = wire(winners_json(store, now=lambda: 5.0))
    (item,) = doc["winners"]
    assert list(item) == [f.name for f in fields(WinnerRow)] + ["meta", "ranked"]
    (w,) = parse_winners(doc, "src")
    assert isinstance(w, WinnerRow) and type(w) is Winner
    assert {f.name: getattr(w, f.name) for f in fields(WinnerRow)} == {
        f.name: getattr(row, f.name) for f in fields(WinnerRow)
    }
    assert (w.kernels, w.source) == (("k_a",), "src")
    assert [(c.name, c.median_s) for c in w.ranked] == [("a", 1e-3), ("b", 2e-3), ("c", None)]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("regime", "hot", "winners[0].regime: expected one of unthrottled, sustained, got 'hot'"),
        ("versions", None, "winners[0].versions must be an object, got NoneType"),
        ("measured_at", None, "winners[0].measured_at: expected a number, got None"),
        ("tie", 1, "winners[0].tie: expected true or false, got 1"),
        ("session_id", 1.5, "winners[0].session_id: expected an integer, got 1.5"),
    ],
)
def test_a_bad_winner_names_the_field(tmp_path: Path, field: str, value: Any, message: str) -> None:
    with sqlite_store(_store(tmp_path / "w.db"), readonly=True) as store:
        doc = wire(winners_json(store))
    doc["winners"][0][field] = value
    with pytest.raises(GpuwatchdError) as err:
        parse_winners(doc, "src")
    assert str(err.value) == "src: bad winners document: " + message


# -- the shared GET --------------------------------------------------------------------------


ROUTES = {
    "/doc": lambda h: (200, {"ok": True}),
    "/text": lambda h: (200, b"<html>"),
    "/boom": lambda h: (500, b""),
}


def test_get_json_decodes_and_names_each_failure() -> None:
    with JsonServer(ROUTES) as srv:
        assert get_json(srv.url + "/doc", timeout=2) == {"ok": True}
        with pytest.raises(HttpStatusError) as missing:
            get_json(srv.url + "/nope", timeout=2)
        with pytest.raises(HttpStatusError) as boom:
            get_json(srv.url + "/boom", timeout=2)
        with pytest.raises(NotJsonError) as text:
            get_json(srv.url + "/text", timeout=2)
    assert missing.value.code == 404
    assert str(missing.value) == f"{srv.url}/nope: HTTP 404 Not Found"
    assert str(boom.value) == f"{srv.url}/boom: HTTP 500 Internal Server Error"
    assert str(text.value) == f"{srv.url}/text: response is not JSON"


def test_get_json_from_nobody_is_one_line_naming_the_url() -> None:
    url = closed_url() + "/doc"
    with pytest.raises(UnreachableError) as err:
        get_json(url, timeout=0.5)
    assert str(err.value).startswith(url + ": ") and "\n" not in str(err.value)
    assert err.value.detail and err.value.where == url


def test_get_json_sends_basic_auth_and_ignores_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("http_proxy", closed_url())
    monkeypatch.setenv("no_proxy", "")
    with JsonServer(ROUTES) as srv:
        assert get_json(srv.url + "/doc", timeout=2, auth=("prom", "s3cret")) == {"ok": True}
    token = base64.b64encode(b"prom:s3cret").decode()
    assert srv.headers[0]["Authorization"] == f"Basic {token}"


def test_get_json_over_tls_trusts_the_given_ca_only(tmp_path: Path) -> None:
    ca = make_scratch_ca(tmp_path)
    with JsonServer(ROUTES, tls=ca.server) as srv:
        assert get_json(srv.url + "/doc", timeout=2, cafile=str(ca.ca_file)) == {"ok": True}
        with pytest.raises(UnreachableError, match="CERTIFICATE_VERIFY_FAILED"):
            get_json(srv.url + "/doc", timeout=2)
    missing = str(tmp_path / "absent.pem")
    with pytest.raises(CaFileError) as err:
        get_json(srv.url + "/doc", timeout=2, cafile=missing)
    assert err.value.where == missing and str(err.value).startswith(f"{missing}: ")


@pytest.mark.parametrize(
    ("url", "ok"),
    [
        ("http://127.0.0.1:9844", True),
        ("https://[::1]:9844/", True),
        ("127.0.0.1:9844", False),
        ("http://", False),
        ("ftp://host", False),
    ],
)
def test_is_base_url(url: str, ok: bool) -> None:
    assert is_base_url(url) is ok


def test_the_winners_document_reads_the_store_a_fixed_number_of_times(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No query per winner (N+1): two winners or eight, the same number of statements."""
    from gpuwatchd.store.conn import Conn

    counts = []
    for n in (2, 8):
        with sqlite_store(tmp_path / f"{n}.db") as store:
            for i in range(n):
                meta = session_meta(gpu_model=f"GPU model {i}", regimes=(U,))
                result = RegimeResult(
                    meta.workloads[0].name, U, (candidate("a", U, 1e-3),), "a", False, 0.1, 0.01
                )
                seed_session(store, meta, [result])
            seen: list[str] = []
            real = Conn.execute
            monkeypatch.setattr(
                Conn, "execute", lambda c, sql, args=(), real=real, seen=seen: (
                    seen.append(sql), real(c, sql, args))[1]
            )  # fmt: skip
            assert len(winners_json(store)["winners"]) == n
            monkeypatch.setattr(Conn, "execute", real)
            counts.append(len(seen))
    assert counts[0] == counts[1]
