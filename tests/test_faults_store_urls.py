"""Store strings: a PostgreSQL URL or libpq key=value string reaches PostgreSQL in every
command and in the client, never a file path; other schemes and malformed strings are one
line; a password never shows, wherever it was written.
"""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import pytest
from fault_cases import run_gpuwatchd
from pg_server import PASSWORD, PostgresServer

import gpuwatchd.client.discovery
from gpuwatchd.client import Client
from gpuwatchd.store import StoreError, open_store, redact_url, urls

SECRET = "hunter2-Secret"
DATA = Path(__file__).parent / "data"


def _one_error_line(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode != 0, res.stdout + res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert SECRET not in res.stdout + res.stderr
    return lines[0]


def _key_value(server: PostgresServer, db: str) -> str:
    return f"host={server.root} port={server.port} user=postgres dbname={db}"


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        (f"postgresql://fleet:{SECRET}@db:5432/gw", "postgresql://fleet:***@db:5432/gw"),
        (
            f"postgres://fleet@db/gw?password={SECRET}&x=1",
            "postgres://fleet@db/gw?password=***&x=1",
        ),
        (f"postgres://fleet@db/gw?pass%77ord={SECRET}", "postgres://fleet@db/gw?pass%77ord=***"),
        (f"postgresql://fleet:pa?{SECRET}@db/gw", "postgresql://fleet:***@db/gw"),
        (f"postgresql://fleet:pa/{SECRET}@db/gw", "postgresql://fleet:***@db/gw"),
        (f"host=db password={SECRET} dbname=gw", "host=db password=*** dbname=gw"),
        (f"host=db password = '{SECRET} \\' x' dbname=gw", "host=db password = *** dbname=gw"),
        (f"host=db sslpassword={SECRET}", "host=db sslpassword=***"),
        (f"mysql://fleet:{SECRET}@db/gw", "mysql://fleet:***@db/gw"),
        (f"postgresql:fleet:{SECRET}@db/gw", "postgresql:fleet:***@db/gw"),
        (f"POSTGRES:fleet:{SECRET}@db", "POSTGRES:fleet:***@db"),
        (f"postgresql:?password={SECRET}", "postgresql:?password=***"),
        (f"postgresql://fleet:{SECRET}@[::1/gw", "postgresql://fleet:***@[::1/gw"),
        (
            "postgresql://db1:5432,db2:5433/gw?user=a@b",
            "postgresql://db1:5432,db2:5433/gw?user=a@b",
        ),
        ("/var/lib/gpuwatchd/gpuwatchd.db", "/var/lib/gpuwatchd/gpuwatchd.db"),
    ],
)
def test_redaction_hides_every_password(text: str, shown: str) -> None:
    assert redact_url(text) == shown
    assert urls.url_has_password(text) is (SECRET in text)


def test_a_malformed_key_value_string_shows_its_keys_only() -> None:
    shown = redact_url(f"host=db password='{SECRET}")
    assert SECRET not in shown and "host, password" in shown
    assert redact_url(f"password=x{SECRET}=1 y") == "a malformed key=value string (keys: password)"
    with pytest.raises(ValueError):
        urls.url_has_password(f"host=db password='{SECRET}")


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("postgresql://db/gw", str),
        ("POSTGRES://db/gw", str),
        ("host=db dbname=gw", str),
        ("  dbname=gw", str),
        ("/var/lib/g.db", Path),
        ("g.db", Path),
        ("./host=db", Path),
    ],
)
def test_store_target_tells_postgres_from_files(text: str, kind: type) -> None:
    assert isinstance(urls.store_target(text), kind)


@pytest.mark.parametrize("text", ["mysql://u@db/gw", "sqlite:///tmp/g.db", "file:/tmp/g.db"])
def test_other_schemes_are_refused(text: str) -> None:
    with pytest.raises(StoreError, match="unsupported URL scheme"):
        urls.store_target(text)


# -- every command ------------------------------------------------------------------------


def test_tune_with_a_postgres_url_tunes_into_postgres_and_writes_no_file(
    postgres_server: PostgresServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = postgres_server.new_database()
    monkeypatch.chdir(tmp_path)
    res = run_gpuwatchd(
        ["tune", "--backend", "sim", "--workload", "sim-gemm", "--regime", "unthrottled",
         "--store", postgres_server.url(db)],
        timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert list(tmp_path.iterdir()) == [], "a URL became a local path"
    assert postgres_server.sql(db, "SELECT status FROM sessions") == [("completed",)]
    report = run_gpuwatchd(["report", "--store", _key_value(postgres_server, db)])
    assert report.returncode == 0 and "sim-gemm" in report.stdout, report.stderr
    fleet = run_gpuwatchd(["report", "--fleet", "--store", _key_value(postgres_server, db)])
    assert fleet.returncode == 0, fleet.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["tune", "--backend", "sim", "--workload", "sim-gemm", "--regime", "unthrottled"],
        ["report"],
        ["report", "--fleet"],
    ],
)
@pytest.mark.parametrize(
    ("store", "expect"),
    [
        (f"postgresql://fleet:{SECRET}@127.0.0.1:1/gw", "fleet:***@"),
        (f"host=127.0.0.1 port=1 password={SECRET} dbname=gw", "password=***"),
        (f"mysql://fleet:{SECRET}@db/gw", "unsupported URL scheme 'mysql'"),
        (f"postgresql://fleet:{SECRET}@[::1/gw", "fleet:***@"),
        (f"host=db password='{SECRET}", "malformed key=value string"),
    ],
)
def test_bad_store_strings_are_one_redacted_line_in_every_command(
    argv: list[str], store: str, expect: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    res = run_gpuwatchd([*argv, "--store", store])
    line = _one_error_line(res)
    assert expect in line, line
    assert list(tmp_path.iterdir()) == [], "a store string became a local path"


NO_SLASHES = f"postgresql:fleet:{SECRET}@db/gw"


@pytest.mark.parametrize(
    "argv",
    [
        ["tune", "--backend", "sim", "--workload", "sim-gemm", "--regime", "unthrottled"],
        ["report"],
        ["report", "--fleet"],
        ["plot-timeline", "--trace", str(DATA / "h200-matmul-burn.jsonl"), "--out", "t.png",
         "--t0-unix", "1700000000"],
    ],
)  # fmt: skip
def test_a_url_without_slashes_is_redacted_on_the_command_line(
    argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    line = _one_error_line(run_gpuwatchd([*argv, "--store", NO_SLASHES]))
    assert "fleet:***@db" in line, line


@pytest.mark.parametrize(
    "argv", [["check-config"], ["store", "prune"], ["run", "--backend", "sim"]]
)
def test_a_url_without_slashes_is_redacted_from_the_config(argv: list[str], tmp_path: Path) -> None:
    cfg = tmp_path / "g.toml"
    cfg.write_text(f"[store]\nurl = '{NO_SLASHES}'\n")
    line = _one_error_line(run_gpuwatchd([*argv, "--config", str(cfg)]))
    assert "holds a password" in line and "fleet:***@db" in line, line


def test_an_unreachable_postgres_store_is_named_redacted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    res = run_gpuwatchd(["report", "--store", "host=127.0.0.1 port=1 dbname=gw user=fleet"])
    line = _one_error_line(res)
    assert "cannot open store host=127.0.0.1 port=1 dbname=gw user=fleet" in line
    assert list(tmp_path.iterdir()) == []


def test_check_config_takes_key_value_strings_and_names_malformed_urls(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text('[store]\nurl = "host=db.example dbname=gw user=gpuwatchd"\n')
    res = run_gpuwatchd(["check-config", "--config", str(good)])
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr
    for url, expect in (
        ("postgresql://gpuwatchd@[::1/gw", "not a valid PostgreSQL connection string"),
        (f"host=db password={SECRET}", "holds a password"),
        (f"mysql://gpuwatchd:{SECRET}@db/gw", "expected a postgresql:// URL"),
        ("host=db dbname=gw nonsense=1", 'invalid connection option "nonsense"'),
    ):
        bad = tmp_path / "bad.toml"
        bad.write_text(f"[store]\nurl = '{url}'\n")
        line = _one_error_line(run_gpuwatchd(["check-config", "--config", str(bad)]))
        assert expect in line, line


# -- the client ---------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["url", "key_value"])
def test_the_clients_gpuwatchd_store_reaches_postgres(
    postgres_server: PostgresServer,
    monkeypatch: pytest.MonkeyPatch,
    form: str,
) -> None:
    db = postgres_server.new_database()
    open_store(postgres_server.url(db)).close()  # a migrated, empty fleet store
    location = postgres_server.url(db) if form == "url" else _key_value(postgres_server, db)
    monkeypatch.setenv("GPUWATCHD_STORE", location)
    monkeypatch.setattr(gpuwatchd.client.discovery, "_daemon_config", lambda: None)
    client = Client(url="http://127.0.0.1:1", timeout=0.2, control_socket=False)
    assert client.winners() == []


def test_the_client_shows_its_store_redacted(
    postgres_server: PostgresServer, caplog: pytest.LogCaptureFixture
) -> None:
    db = postgres_server.new_database()
    url = f"postgresql://fleet:{PASSWORD}@127.0.0.1:{postgres_server.port}/{db}"
    client = Client(url="http://127.0.0.1:1", store=url, timeout=0.2, control_socket=False)
    assert PASSWORD not in repr(client) and "fleet:***@" in repr(client)
    with caplog.at_level(logging.DEBUG):
        try:
            client.winners()
        except Exception as exc:  # refused: the URL holds a password
            assert PASSWORD not in str(exc) and "fleet:***@" in str(exc)
    assert all(PASSWORD not in r.getMessage() for r in caplog.records)


def test_a_postgres_store_object_never_holds_its_string_unredacted_in_where(
    postgres_server: PostgresServer,
) -> None:
    db = postgres_server.new_database()
    with open_store(_key_value(postgres_server, db)) as store:
        assert store.shared
        assert store.where == _key_value(postgres_server, db)
