"""``gpuwatchd status``: its fetch (flags, TLS, auth, one-line errors) and its table."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
from builders import board_of, capped, closed_url, h200, judged
from json_server import JsonServer, make_scratch_ca

from gpuwatchd.api.state import build_state_json
from gpuwatchd.cli.common import EXIT_CONFIG, EXIT_RUNTIME, CliError
from gpuwatchd.cli.main import main
from gpuwatchd.cli.status import PASSWORD_ENV, fetch_state, format_status
from gpuwatchd.exporter import DaemonInfo
from gpuwatchd.gate import GateState
from gpuwatchd.monitor.board import PollHealth
from gpuwatchd.telemetry.types import DeviceInfo, Sample, ThrottleReason


def state_doc() -> dict[str, Any]:
    """Three GPUs (capped, failing, lost) as the daemon serves them, tuning on GPU 0."""
    b = board_of(
        judged(
            0,
            h200(uuid="GPU-a", name="H200"),
            capped(t=1.0),
            GateState.THROTTLED,
            ("capped",),
            t=2.0,
            since=1.0,
        ),
        judged(
            1,
            DeviceInfo(1, "GPU-b", "H200"),
            Sample(1, t=1.0, temp_c=None, power_w=None, reasons=ThrottleReason(0)),
            GateState.UNAVAILABLE,
            ("failed",),
            t=2.0,
            since=1.0,
            health=PollHealth(False, 0.5, error="x"),
        ),
        judged(
            2,
            None,
            None,
            GateState.UNAVAILABLE,
            ("lost",),
            t=2.0,
            since=1.0,
            health=PollHealth(False, 0.5, lost=True),
        ),
    )
    doc: dict[str, Any] = json.loads(json.dumps(build_state_json(b, DaemonInfo("1.2", "sim", "3"))))
    doc["tuning"] = {"enabled": True, "running_gpus": [0], "pending": {"1": ["gemm", "conv"]}}
    return doc


TABLE = """\
gpuwatchd 1.2 · backend sim
GPU  NAME  TEMP    POWER     SM CLOCK      THROTTLE      GATE
0    H200  61/87C  694/700W  1440/1980MHz  sw_power_cap  throttled
     why: capped
1    H200  -       -         -             none          unavailable (FAILING)
     why: failed
2    -     -       -         -             -             unavailable (LOST)
     why: lost
tuning: running on GPU 0; GPU 1 waiting: gemm, conv"""


def test_the_table_shows_each_gpu_its_health_and_the_tuner() -> None:
    assert format_status(state_doc(), width=80) == TABLE


@pytest.mark.parametrize(
    ("tuning", "last_line"),
    [
        ({"enabled": False}, "tuning: disabled"),
        ({}, "tuning: idle, nothing pending"),
        (None, "     why: lost"),
    ],
)
def test_the_tuning_line(tuning: dict[str, Any] | None, last_line: str) -> None:
    doc = state_doc()
    doc["tuning"] = tuning
    assert format_status(doc).splitlines()[-1].startswith(last_line)


def test_no_gpus_and_no_daemon_section() -> None:
    assert format_status({"gpus": []}).splitlines()[1:] == ["(no GPUs)"]


# -- fetching --------------------------------------------------------------------------------


def _cli_error(**kw: Any) -> CliError:
    with pytest.raises(CliError) as err:
        fetch_state(**kw)
    assert "\n" not in str(err.value)
    return err.value


def test_fetch_over_tls_with_basic_auth(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ca = make_scratch_ca(tmp_path)
    doc = state_doc()

    def guarded(handler: Any) -> tuple[int, Any]:
        authorized = handler.headers.get("Authorization", "").startswith("Basic ")
        return (200, doc) if authorized else (401, b"")

    monkeypatch.setenv(PASSWORD_ENV, "s3cret")
    with JsonServer({"/api/v1/state": guarded}, tls=ca.server) as srv:
        got = fetch_state(srv.url + "/", timeout=2, cacert=str(ca.ca_file), user="prom")
        denied = _cli_error(base_url=srv.url, timeout=2, cacert=str(ca.ca_file))
    assert got == doc
    assert str(denied) == f"{srv.url}/api/v1/state: HTTP 401 Unauthorized"
    assert denied.code == EXIT_RUNTIME


def test_fetch_errors_name_the_flag_or_the_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    bad_url = _cli_error(base_url="notaurl")
    assert (str(bad_url), bad_url.code) == (
        "--url notaurl: expected http://HOST:PORT or https://HOST:PORT",
        EXIT_CONFIG,
    )
    no_password = _cli_error(base_url="http://127.0.0.1:1", user="prom")
    assert str(no_password) == f"--user prom: set the password in ${PASSWORD_ENV}"
    missing = tmp_path / "absent.pem"
    no_ca = _cli_error(base_url="https://127.0.0.1:1", cacert=str(missing))
    assert str(no_ca).startswith(f"--cacert {missing}: ") and no_ca.code == EXIT_RUNTIME
    url = closed_url()
    down = _cli_error(base_url=url, timeout=0.5)
    assert str(down).startswith(f"cannot reach gpuwatchd at {url}/api/v1/state: ")
    assert str(down).endswith(" (is the daemon running?)")


def test_wait_keeps_trying_until_a_starting_daemon_serves() -> None:
    doc = state_doc()
    url = closed_url()
    port = int(url.rsplit(":", 1)[1])
    servers: list[JsonServer] = []
    later = threading.Timer(
        0.5, lambda: servers.append(JsonServer({"/api/v1/state": lambda h: (200, doc)}, port=port))
    )
    later.start()
    try:
        got = fetch_state(url, timeout=1, wait=30)
    finally:
        later.join()
        for srv in servers:
            srv.__exit__()
    assert got == doc
    gave_up = _cli_error(base_url=closed_url(), timeout=0.5, wait=0.5)
    assert " after 0.5 s: " in str(gave_up) and str(gave_up).endswith("(is the daemon running?)")


@pytest.mark.parametrize("wait", ["-1", "nan", "601"])
def test_wait_out_of_range_is_refused_before_any_request(
    wait: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["status", "--url", closed_url(), "--wait", wait])
    assert (code, capsys.readouterr().err) == (
        EXIT_CONFIG,
        f"gpuwatchd: --wait {float(wait)}: must be 0 to 600 seconds\n",
    )


def test_fetch_rejects_a_document_that_is_not_the_state() -> None:
    bad_entry = state_doc()
    bad_entry["gpus"][0]["sample"]["temp_c"] = "hot"
    routes = {"/api/v1/state": lambda h: (200, {"gpus": "none"})}
    with JsonServer(routes) as srv:
        not_state = _cli_error(base_url=srv.url, timeout=2)
    with JsonServer({"/api/v1/state": lambda h: (200, bad_entry)}) as srv2:
        bad_field = _cli_error(base_url=srv2.url, timeout=2)
    assert str(not_state) == f"{srv.url}/api/v1/state: not a gpuwatchd state document"
    assert str(bad_field).startswith(f"{srv2.url}/api/v1/state: bad state document: ")
    assert "gpus[gpu=0].sample.temp_c: expected a number or null, got 'hot'" in str(bad_field)


def test_why_quotes_the_configured_threshold_and_the_hysteresis_apart() -> None:
    """util_max = 0.05 shows as 5.0%; the 4.0% it must fall under to reopen is explained."""
    from gpuwatchd.gate import GateConfig, evaluate

    info = h200()
    busy = Sample(0, t=10.0, temp_c=40.0, power_w=125.0, sm_clock_mhz=1980.0, util_gpu=1.0,
                  reasons=ThrottleReason(0))  # fmt: skip
    decision = evaluate([busy], info, GateConfig(util_max=0.05), prev=None)
    (why,) = decision.reasons
    doc = json.loads(json.dumps(build_state_json(
        board_of(judged(0, info, busy, decision.state, decision.reasons)),
        DaemonInfo("1.2", "sim", "3"),
    )))  # fmt: skip
    shown = " ".join(line.strip() for line in format_status(doc, width=80).splitlines()[3:])
    assert shown == f"why: {why}"
    assert why == "util 100.0%; needs ≤ 4.0% to reopen (util_max 5.0%)"
    opened = evaluate([busy], info, GateConfig(util_max=0.05, hyst_ratio=0.0), prev=None)
    assert opened.reasons == ("util 100.0%; needs ≤ 5.0% (util_max)",)


def test_plain_status_breaks_lines_between_words_within_80_columns() -> None:
    """A long WHY (a simulated GPU's name, two shut reasons) goes on lines of its own under
    the GPU's row, broken between words: an 80-column terminal never splits a word."""
    from gpuwatchd.gate import GateConfig, evaluate

    info = h200(name="NVIDIA H200 (simulated)")
    busy = Sample(0, t=10.0, temp_c=59.0, power_w=699.0, sm_clock_mhz=885.0, util_gpu=1.0,
                  reasons=ThrottleReason(0), procs=(4242,))  # fmt: skip
    decision = evaluate([busy], info, GateConfig(), prev=None)
    doc = json.loads(json.dumps(build_state_json(
        board_of(judged(0, info, busy, decision.state, ("SM clock 885 MHz = 45% of max 1980 "
                 "MHz; needs ≥ 96% to reopen (clock_ratio_min 95%)", *decision.reasons))),
        DaemonInfo("1.2", "sim", "3"),
    )))  # fmt: skip
    lines = format_status(doc, width=80).splitlines()
    assert all(len(line) <= 80 for line in lines), lines
    row, why = lines[2], lines[3:]
    assert row.split()[:4] == ["0", "NVIDIA", "H200", "(simulated)"]
    reasons = "; ".join(doc["gpus"][0]["gate"]["reasons"])
    assert len(why) > 1 and " ".join(line.strip() for line in why) == f"why: {reasons}"
