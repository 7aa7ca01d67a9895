"""Served TLS certificates: expiry read from the PEM, warned about, exported as a metric."""

from __future__ import annotations

import datetime as dt
import logging
import shutil
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from builders import DAEMON_INFO, board_of, full_h200
from prometheus_client.parser import text_string_to_metric_families
from tls_pki import cert_pem, make_cert, server_for_localhost, write_pair

from gpuwatchd.exporter import build_registry
from gpuwatchd.exporter.collectors.tls import TlsCertificateCollector
from gpuwatchd.monitor.board import StateBoard
from gpuwatchd.serve import HttpServer
from gpuwatchd.serve import http as http_module
from gpuwatchd.serve.web.certinfo import read_certificates
from gpuwatchd.serve.web.config import WebConfig, load_web_config

METRIC = "gpuwatchd_tls_certificate_expiry_timestamp_seconds"
UTC = dt.UTC


def when(year: int, month: int = 1, day: int = 2) -> dt.datetime:
    return dt.datetime(year, month, day, 3, 4, 5, tzinfo=UTC)


@pytest.mark.parametrize(
    ("not_after", "serial"),
    [
        (when(2031, 6, 7), 1),  # UTCTime
        (when(2049, 12, 31), 0x80FF),  # UTCTime, serial with its high bit set
        (when(2061, 3, 4), 2**150 + 7),  # GeneralizedTime (2050 and later)
    ],
)
def test_expiry_serial_and_cn_match_what_cryptography_reads(
    not_after: dt.datetime, serial: int
) -> None:
    ca = make_cert("Test CA", ca=True)
    leaf = make_cert("scrape.example.org", ca, not_after=not_after, serial=serial)
    (info, ca_info) = read_certificates(cert_pem(leaf[0]) + cert_pem(ca[0]), "/etc/x.pem")
    assert info.not_after == not_after.timestamp()
    assert info.serial_number == f"{serial:X}" and info.subject_cn == "scrape.example.org"
    assert info.source == "/etc/x.pem"
    assert ca_info.subject_cn == "Test CA"
    assert ca_info.not_after == ca[0].not_valid_after_utc.timestamp()


def test_a_damaged_certificate_is_named() -> None:
    pem = b"-----BEGIN CERTIFICATE-----\nMIIBAAAA\n-----END CERTIFICATE-----\n"
    with pytest.raises(ValueError, match=r"^x.pem: certificate 1 is not valid X.509"):
        read_certificates(pem, "x.pem")


def tls_config(directory: Path, days_left: float) -> WebConfig:
    now = dt.datetime.now(UTC)
    ca = make_cert("Test CA", ca=True)
    server = server_for_localhost(
        ca,
        not_before=now - dt.timedelta(days=400),
        not_after=now + dt.timedelta(days=days_left),
    )
    write_pair(directory, "server", server)
    path = directory / "web.yml"
    path.write_text("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n")
    return load_web_config(path)


def served(board: StateBoard, config: WebConfig | None = None, **kw: Any) -> HttpServer:
    """An HTTP server whose registry exports its certificates, as the daemon wires it."""
    registry = build_registry(board, DAEMON_INFO)
    srv = HttpServer(board, registry, ("127.0.0.1", 0), web_config=config, **kw)
    registry.register(TlsCertificateCollector(srv.certificates))
    return srv


def scrape(srv: HttpServer) -> str:
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # the cert may be expired
    with urllib.request.urlopen(srv.url + "/metrics", context=ctx, timeout=5) as response:
        return response.read().decode()


def expiry_series(text: str) -> dict[tuple[str, str, str], float]:
    return {
        (s.labels["cert"], s.labels["subject_cn"], s.labels["serial_number"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == METRIC
    }


def test_an_expired_certificate_is_warned_about_and_exported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = tls_config(tmp_path, days_left=-3)
    board = board_of(full_h200())
    with caplog.at_level(logging.WARNING, logger="gpuwatchd"):
        srv = served(board, config)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "TLS certificate 'localhost'" in warnings[0]
    assert "expired at" in warnings[0] and "renew it" in warnings[0]
    with srv:
        text = scrape(srv)
    ((cert, cn, serial), expiry), *rest = expiry_series(text).items()
    assert not rest and cert == str(tmp_path / "server.crt") and cn == "localhost"
    assert serial and expiry < time.time() - 2 * 86400


def test_the_warning_repeats_periodically_and_a_reload_shows_the_renewed_cert(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http_module, "CERT_CHECK_INTERVAL_S", 0.2)
    board = board_of(full_h200())
    config = tls_config(tmp_path, days_left=5)
    with (
        caplog.at_level(logging.WARNING, logger="gpuwatchd"),
        served(board, config, metrics_max_age_s=0) as srv,
    ):
        time.sleep(0.7)
        soon = [r.getMessage() for r in caplog.records if "expires at" in r.getMessage()]
        assert len(soon) >= 3 and "in 5.0 days" in soon[0]  # at load, then periodically
        (old,) = expiry_series(scrape(srv)).values()
        renewed = tls_config(tmp_path, days_left=90)
        srv.reload_web_config(renewed)
        caplog.clear()
        (new,) = expiry_series(scrape(srv)).values()
        assert new - old == pytest.approx(85 * 86400, abs=60)
        time.sleep(0.5)
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_plain_http_exports_no_certificate() -> None:
    board = board_of(full_h200())
    with served(board) as srv:
        text = urllib.request.urlopen(srv.url + "/metrics", timeout=5).read().decode()
    assert METRIC not in text


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_the_metric(tmp_path: Path) -> None:
    board = board_of(full_h200())
    config = tls_config(tmp_path, days_left=30)
    with served(board, config) as srv:
        text = scrape(srv)
    assert METRIC in text
    result = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, check=False
    )
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


@pytest.mark.parametrize("days_left", [-3.0, 5.0])
def test_check_config_refuses_an_expired_certificate_naming_file_and_date(
    tmp_path: Path, days_left: float, capsys: pytest.CaptureFixture[str]
) -> None:
    """Soon to expire is OK with a warning (the daemon warns too); expired is one line,
    exit 2."""
    from gpuwatchd.cli import main as cli_main
    from gpuwatchd.cli.common import EXIT_CONFIG

    tls_config(tmp_path, days_left=days_left)
    (tmp_path / "c.toml").write_text("")
    argv = ["check-config", "--config", str(tmp_path / "c.toml")]
    code = cli_main.main([*argv, "--web-config", str(tmp_path / "web.yml")])
    err = capsys.readouterr().err
    if days_left > 0:
        assert code == 0 and err.count("\n") == 1, err
        assert "gpuwatchd: warning: " in err and "in 5.0 days; renew it" in err, err
        return
    assert code == EXIT_CONFIG and len(err.strip().splitlines()) == 1, err
    expiry = read_certificates((tmp_path / "server.crt").read_bytes(), "")[0].not_after
    date = dt.datetime.fromtimestamp(expiry, UTC).strftime("%Y-%m-%d %H:%M UTC")
    assert str(tmp_path / "server.crt") in err and f"expired at {date}" in err
