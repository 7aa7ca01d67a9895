"""The HTTP server: routes, JSON shape, errors, keep-alive, shutdown and parse_listen."""

from __future__ import annotations

import gzip
import http.client
import json
import math
import socket
import time
from typing import Any

import pytest
from builders import DAEMON_INFO, board_of, capped, h200, judged

from gpuwatchd.api.state import STATE_FORMAT, build_state_json
from gpuwatchd.config.listen import DEFAULT_PORT, parse_listen
from gpuwatchd.exporter import build_registry
from gpuwatchd.exporter.render import MetricsRenderer
from gpuwatchd.gate import GateState
from gpuwatchd.monitor.board import PollHealth, StateBoard
from gpuwatchd.serve import HttpServer
from gpuwatchd.serve.http import Request, Routes, request_path
from gpuwatchd.telemetry.types import DeviceInfo, Sample, ThrottleReason

R = ThrottleReason


def make_board() -> StateBoard:
    """GPU 0 power-capped and slowed down by the hardware; GPU 1 lost with its last reading."""
    capped_gpu = judged(
        0,
        h200(driver_version="580.159.04"),
        capped(reasons=R.SW_POWER_CAP | R.HW_SLOWDOWN, extra={"fan_ratio": math.nan}),
        GateState.THROTTLED,
        ("power capped",),
        health=PollHealth(True, 0.0011, last_success_t=12.5, last_success_unix=1000.0),
        energy_j=5000.0,
        throttle_seconds={R.SW_POWER_CAP: 10.0},
    )
    lost_gpu = judged(
        1,
        DeviceInfo(1, "GPU-bbbb", "NVIDIA H200"),
        Sample(1, t=3.0, temp_c=80.0),
        GateState.UNAVAILABLE,
        ("gpu lost",),
        since=4.0,
        health=PollHealth(False, 0.002, lost=True, error="GPU 1 is lost", last_success_unix=990.0),
    )
    return board_of(capped_gpu, lost_gpu)


@pytest.fixture
def board() -> StateBoard:
    return make_board()


def request(
    srv: HttpServer, method: str, path: str, headers: dict[str, str] | None = None
) -> tuple[int, http.client.HTTPMessage, bytes]:
    conn = http.client.HTTPConnection(*srv.address, timeout=5)
    try:
        conn.request(method, path, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.headers, response.read()
    finally:
        conn.close()


def test_default_port_is_not_taken_by_other_gpu_exporters() -> None:
    assert DEFAULT_PORT == 9844


def test_port_zero_binds_a_real_port(server: HttpServer) -> None:
    host, port = server.address
    assert host == "127.0.0.1" and port > 0
    assert server.url == f"http://127.0.0.1:{port}"


def test_healthz_and_index(server: HttpServer) -> None:
    status, headers, body = request(server, "GET", "/healthz")
    assert (status, body) == (200, b"ok\n")
    status, headers, body = request(server, "GET", "/")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    for path in (b"/metrics", b"/api/v1/state", b"/healthz"):
        assert path in body


def test_state_json_shape(server: HttpServer) -> None:
    status, headers, body = request(server, "GET", "/api/v1/state")
    assert status == 200 and headers["Content-Type"] == "application/json; charset=utf-8"
    doc = json.loads(body)
    assert doc["format"] == STATE_FORMAT
    assert [g["gpu"] for g in doc["gpus"]] == [0, 1]
    gpu0 = doc["gpus"][0]
    assert gpu0["uuid"] == "GPU-aaaa"
    assert gpu0["info"]["name"] == "NVIDIA H200" and gpu0["info"]["max_sm_clock_mhz"] == 1980.0
    assert gpu0["info"]["pci_bus_id"] is None
    sample = gpu0["sample"]
    assert sample["temp_c"] == 61.0 and sample["power_w"] == 693.5
    assert sample["sm_clock_mhz"] == 1440.0 and sample["util_gpu_ratio"] == 0.97
    assert sample["mem_clock_mhz"] is None  # unsupported: null, never 0
    assert sample["throttle_reasons"] == ["sw_power_cap", "hw_slowdown"]
    assert sample["compute_pids"] == [4242]
    assert sample["extra"] == {"fan_ratio": None}  # NaN is not JSON
    assert gpu0["energy_j"] == 5000.0
    assert (
        len(gpu0["throttle_seconds"]) == len(R) and gpu0["throttle_seconds"]["sw_power_cap"] == 10
    )
    assert gpu0["gate"] == {
        "state": "throttled",
        "open": False,
        "reasons": ["power capped"],
        "t_s": 12.5,
        "since_s": 2.5,
        "in_state_s": 10.0,
        "disturbed_at_s": None,
    }
    assert gpu0["poll"]["success"] is True and gpu0["poll"]["duration_s"] == 0.0011
    gpu1 = doc["gpus"][1]
    assert gpu1["poll"]["lost"] is True and gpu1["poll"]["error"] == "GPU 1 is lost"
    assert gpu1["sample"]["temp_c"] == 80.0  # last words of a lost GPU stay visible here
    assert gpu1["gate"]["state"] == "unavailable"


def test_state_json_ages_from_injected_clock(board: StateBoard) -> None:
    doc = build_state_json(board, DAEMON_INFO, now=lambda: 1010.0)
    assert doc["generated_unix"] == 1010.0
    assert doc["daemon"] == {"version": "9.9.9", "backend": "sim", "python_version": "3.11.7"}
    assert [g["poll"]["last_success_age_s"] for g in doc["gpus"]] == [10.0, 20.0]


def test_custom_state_json_is_served(board: StateBoard) -> None:
    registry = build_registry(board, DAEMON_INFO)
    with HttpServer(board, registry, ("127.0.0.1", 0), lambda: {"tuning": {"ok": 1}}) as srv:
        status, _, body = request(srv, "GET", "/api/v1/state")
    assert status == 200 and json.loads(body) == {"tuning": {"ok": 1}}


def test_failing_state_json_gives_500_and_server_survives(board: StateBoard) -> None:
    def broken() -> dict[str, Any]:
        raise RuntimeError("db locked")

    with HttpServer(board, build_registry(board, DAEMON_INFO), ("127.0.0.1", 0), broken) as srv:
        status, _, body = request(srv, "GET", "/api/v1/state")
        assert status == 500 and json.loads(body)["error"] == "internal error"
        assert request(srv, "GET", "/healthz")[0] == 200


@pytest.mark.parametrize(
    "path", ["/nope", "/metrics/", "/metrics//", "/api/v1/state/x", "/%ff%fe", "/" + "a" * 5000]
)
def test_unknown_paths_get_json_404(server: HttpServer, path: str) -> None:
    status, headers, body = request(server, "GET", path)
    assert status == 404 and headers["Content-Type"].startswith("application/json")
    doc = json.loads(body)
    assert doc["error"] == "not found" and doc["status"] == 404
    assert len(doc["path"]) <= 200


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
def test_non_get_methods_get_405_with_allow(server: HttpServer, method: str) -> None:
    status, headers, body = request(server, method, "/metrics")
    assert status == 405 and headers["Allow"] == "GET, HEAD"
    assert json.loads(body) == {"error": "method not allowed", "status": 405, "method": method}


def test_query_strings_are_ignored(server: HttpServer) -> None:
    status, _, body = request(server, "GET", "/metrics?name[]=x&debug=%zz&&=")
    assert status == 200 and b"gpuwatchd_gpu_temperature_celsius" in body
    status, _, body = request(server, "GET", "/api/v1/state?pretty#frag")
    assert status == 200 and json.loads(body)["format"] == STATE_FORMAT


def test_head_sends_headers_only(server: HttpServer) -> None:
    conn = http.client.HTTPConnection(*server.address, timeout=5)
    conn.request("HEAD", "/metrics")
    response = conn.getresponse()
    assert response.status == 200 and int(response.headers["Content-Length"]) > 1000
    assert response.read() == b""
    conn.request("GET", "/healthz")  # same connection still in sync after a HEAD
    assert conn.getresponse().read() == b"ok\n"
    conn.close()


def test_gzip_when_accepted(server: HttpServer) -> None:
    status, headers, body = request(server, "GET", "/metrics", {"Accept-Encoding": "gzip"})
    assert status == 200 and headers["Content-Encoding"] == "gzip"
    assert gzip.decompress(body).startswith(b"# HELP gpuwatchd_build_info")


def test_keep_alive_survives_a_rejected_post_with_body(server: HttpServer) -> None:
    conn = http.client.HTTPConnection(*server.address, timeout=5)
    conn.request("POST", "/metrics", body=b'{"start": "tuning"}')
    response = conn.getresponse()
    assert response.status == 405
    response.read()
    conn.request("GET", "/healthz")
    response = conn.getresponse()
    assert (response.status, response.read()) == (200, b"ok\n")
    conn.close()


def raw_exchange(srv: HttpServer, data: bytes) -> bytes:
    with socket.create_connection(srv.address, timeout=5) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):  # the server closes after a protocol error
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (b"GET /metrics HTTP/1.x\r\n\r\n", 400),
        (b"GET /metrics HTTP/3.0\r\n\r\n", 505),
        (b"BREW /metrics HTTP/1.1\r\n\r\n", 501),
        (b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", 414),
    ],
)
def test_protocol_errors_answer_json_and_server_lives_on(
    server: HttpServer, data: bytes, status: int
) -> None:
    reply = raw_exchange(server, data)
    head, _, reply = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status)
    assert b"Content-Type: application/json" in head and b"Connection: close" in head
    assert json.loads(reply)["status"] == status
    assert request(server, "GET", "/healthz")[0] == 200


def test_http09_garbage_does_not_hurt_the_server(server: HttpServer) -> None:
    assert b'"status": 400' in raw_exchange(server, b"\x00\xff GARBAGE\r\n\r\n")
    assert request(server, "GET", "/healthz")[0] == 200


def test_stop_is_fast_even_with_an_idle_keep_alive_client(board: StateBoard) -> None:
    srv = HttpServer(board, build_registry(board, DAEMON_INFO), ("127.0.0.1", 0))
    srv.start()
    address = srv.address
    idle = http.client.HTTPConnection(*address, timeout=5)
    idle.request("GET", "/healthz")
    assert idle.getresponse().read() == b"ok\n"  # connection stays open, handler waits
    started = time.monotonic()
    srv.stop()
    assert time.monotonic() - started < 1.0
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(address, timeout=1)
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        idle.request("GET", "/healthz")  # the kept-alive connection was cut, not served
        idle.getresponse()
    idle.close()
    srv.stop()  # idempotent


def test_start_twice_and_busy_port_fail_clearly(server: HttpServer, board: StateBoard) -> None:
    with pytest.raises(RuntimeError, match="already started"):
        server.start()
    host, port = server.address
    other = HttpServer(board, build_registry(board, DAEMON_INFO), (host, port))
    with pytest.raises(OSError, match=rf"cannot listen on 127\.0\.0\.1:{port}: "):
        other.start()


def test_a_host_name_is_resolved_and_a_non_ascii_one_refused_in_one_line(
    board: StateBoard,
) -> None:
    with HttpServer(board, build_registry(board, DAEMON_INFO), ("localhost", 0)) as srv:
        assert request(srv, "GET", "/healthz")[0] == 200
    other = HttpServer(board, build_registry(board, DAEMON_INFO), ("gpü.invalid", 0))
    with pytest.raises(OSError, match=r"listen address 'gpü\.invalid': cannot resolve host"):
        other.start()


def test_out_of_range_port_is_refused(board: StateBoard) -> None:
    with pytest.raises(ValueError, match="listen port 70000 is out of range 0-65535"):
        HttpServer(board, build_registry(board, DAEMON_INFO), ("127.0.0.1", 70000))


def test_routes_work_without_sockets(board: StateBoard) -> None:
    renderer = MetricsRenderer(build_registry(board, DAEMON_INFO), board.all)
    routes = Routes(renderer, lambda: build_state_json(board))
    assert routes.handle(Request("GET", "/healthz")).status == 200
    metrics = routes.handle(Request("GET", "http://example.org/metrics?x=1"))
    assert metrics.status == 200 and b"gpuwatchd_gpu_sm_clock_hertz" in metrics.body
    om = routes.handle(Request("GET", "/metrics", accept="application/openmetrics-text"))
    assert om.content_type.startswith("application/openmetrics-text")


@pytest.mark.parametrize(
    ("target", "path"),
    [
        ("/metrics?x=1", "/metrics"),
        ("/api/v1/state#top", "/api/v1/state"),
        ("/metric%73", "/metrics"),
        ("http://host:9844/healthz?a", "/healthz"),
        ("ftp://host/metrics", ""),
        ("http://[bad/metrics", ""),
        ("*", ""),
    ],
)
def test_request_path(target: str, path: str) -> None:
    assert request_path(target) == path


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:9844", ("127.0.0.1", 9844)),
        (":9844", ("", 9844)),
        ("[::1]:9844", ("::1", 9844)),
        ("[::]:0", ("::", 0)),
        ("localhost:65535", ("localhost", 65535)),
        (" gpu-host.example.org:80 ", ("gpu-host.example.org", 80)),
    ],
)
def test_parse_listen_accepts(text: str, expected: tuple[str, int]) -> None:
    assert parse_listen(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("9844", "expected HOST:PORT"),
        ("localhost", "expected HOST:PORT"),
        ("127.0.0.1:", "missing port"),
        ("127.0.0.1:http", "port 'http' is not a number"),
        ("127.0.0.1:-1", "port '-1' is not a number"),
        ("127.0.0.1:١٢", "is not a number"),
        (":65536", "port 65536 is out of range 0-65535"),
        ("::1:9844", "put an IPv6 address in brackets"),
        ("[::1:9844", "missing ']'"),
        ("[::1]9844", "expected ':PORT' after ']'"),
        ("[nope]:9844", "'nope' is not an IPv6 address"),
        ("bad host:9844", "host 'bad host' is not a valid hostname"),
        ("", "expected HOST:PORT"),
    ],
)
def test_parse_listen_rejects_with_one_line(text: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_listen(text)
    error = str(info.value)
    assert message in error and "\n" not in error
    assert error.startswith(f"listen address {text!r}")


def test_ipv6_loopback_when_available(board: StateBoard) -> None:
    try:
        socket.socket(socket.AF_INET6).close()
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("IPv6 loopback is not available on this host")
    with HttpServer(board, build_registry(board, DAEMON_INFO), parse_listen("[::1]:0")) as srv:
        assert srv.url.startswith("http://[::1]:")
        assert request(srv, "GET", "/healthz")[0] == 200
