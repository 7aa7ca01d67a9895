"""check-config on a web config that is valid but unwise: exit 0, but not a bare OK
(issue 26, finding 10: OK for a certificate expiring in 5 days, client-certificate auth
without a client CA, basic auth without TLS). An expired certificate stays an error
(tests/test_tls_expiry.py)."""

from __future__ import annotations

import datetime as dt
import logging
from pathlib import Path

import pytest
from tls_pki import make_cert, server_for_localhost, write_pair

from gpuwatchd.cli.main import main
from gpuwatchd.serve.web.config import load_web_config
from gpuwatchd.serve.web.security import WebSecurity

HASH = "$2y$04$" + "a" * 53


def _server_pair(directory: Path, days_left: float = 400.0) -> str:
    now = dt.datetime.now(dt.UTC)
    server = server_for_localhost(
        make_cert("Test CA", ca=True),
        not_before=now - dt.timedelta(days=1),
        not_after=now + dt.timedelta(days=days_left),
    )
    write_pair(directory, "server", server)
    return "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"


def _check(directory: Path, web: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    (directory / "web.yml").write_text(web)
    (directory / "c.toml").write_text("")
    code = main(
        [
            "check-config",
            "--config",
            str(directory / "c.toml"),
            "--web-config",
            str(directory / "web.yml"),
        ]
    )
    out, err = capsys.readouterr()
    return code, out.splitlines()[0], err


@pytest.mark.parametrize(
    ("case", "expect"),
    [
        ("expiring", "in 5.0 days; renew it"),
        ("basic auth without TLS", "basic_auth_users without tls_server_config"),
        ("client certificates without a CA", "RequireAndVerifyClientCert without client_ca_file"),
    ],
)
def test_an_unwise_web_config_is_ok_with_a_warning(
    case: str, expect: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if case == "expiring":
        web = _server_pair(tmp_path, days_left=5)
    elif case == "basic auth without TLS":
        web = f"basic_auth_users:\n  scraper: '{HASH}'\n"
    else:
        web = _server_pair(tmp_path) + "  client_auth_type: RequireAndVerifyClientCert\n"
    code, ok_line, err = _check(tmp_path, web, capsys)
    assert code == 0, err
    assert ok_line.endswith(": OK, with 1 warning"), ok_line
    (line,) = err.splitlines()
    assert line.startswith("gpuwatchd: warning: web config ") and expect in line, line


def test_a_sound_web_config_is_a_bare_ok(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    web = _server_pair(tmp_path) + f"basic_auth_users:\n  scraper: '{HASH}'\n"
    code, ok_line, err = _check(tmp_path, web, capsys)
    assert (code, err) == (0, "") and ok_line.endswith(": OK")


def test_the_daemon_logs_the_same_warnings_at_load(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "web.yml").write_text(f"basic_auth_users:\n  scraper: '{HASH}'\n")
    with caplog.at_level(logging.WARNING, logger="gpuwatchd"):
        WebSecurity(load_web_config(tmp_path / "web.yml"))
    (record,) = caplog.records
    assert "basic_auth_users without tls_server_config" in record.getMessage()
