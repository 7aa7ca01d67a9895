"""Configuration: the shipped example stays the defaults, sections validate strictly."""

from __future__ import annotations

import dataclasses
import datetime as dt
import tomllib
from pathlib import Path

import pytest
from fault_cases import BAD_NUMBERS

from gpuwatchd.config import (
    Config,
    ConfigError,
    StoreConfig,
    check_store_access,
    parse_config,
    resolve_state_dir,
    store_location,
    store_password_file,
    store_path,
)
from gpuwatchd.sessions.fleet_settings import FleetConfig
from gpuwatchd.tuning.windows import in_windows, parse_windows

EXAMPLE = Path(__file__).parent.parent / "examples" / "config.toml"


def test_example_config_documents_exactly_the_defaults():
    cfg = parse_config(tomllib.loads(EXAMPLE.read_text()))
    defaults = Config()
    for section in ("daemon", "sim", "replay", "gate", "tuning", "drift", "store", "fleet"):
        assert getattr(cfg, section) == getattr(defaults, section), section
    names = [w.name for w in cfg.workloads]
    assert "attention-proj-fp16" in names and "sim-gemm" in names
    assert len(names) == len(set(names))


def test_workload_tables_replace_and_add():
    cfg = parse_config(
        {
            "workload": [
                {
                    "name": "sim-gemm",
                    "op": "matmul",
                    "shape": {"m": 64, "n": 64, "k": 64},
                    "dtype": "bfloat16",
                    "families": ["sim"],
                },
            ]
        }
    )
    assert cfg.workload("sim-gemm").shape == {"m": 64, "n": 64, "k": 64}
    with pytest.raises(ValueError, match="unknown workload 'x'"):
        cfg.workload("x")


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        (
            {
                "workload": [
                    {"name": "a", "op": "matmul", "shape": {}, "dtype": "f", "families": ["sim"]}
                ]
            },
            "workload[0].shape",
        ),
        (
            {
                "workload": [
                    {"name": "a", "op": "m", "shape": {"m": 1}, "dtype": "f", "families": []}
                ]
            },
            "workload[0].families",
        ),
        ({"workload": [{"name": "a", "bogus": 1}]}, "workload[0].bogus: unknown key"),
        ({"tuning": {"windows": ["22:00"]}}, "tuning.windows[0]: expected HH:MM-HH:MM"),
        ({"tuning": {"max_concurrent": 0}}, "tuning.max_concurrent: must be >= 1"),
        ({"tuning": {"protocol": {"spread_target": 0}}}, "tuning.protocol.spread_target"),
        ({"tuning": {"protocol": 3}}, "tuning.protocol: expected a [tuning.protocol] table"),
        ({"daemon": {"listen": "host:notaport"}}, "daemon.listen"),
        # A scheduler or drift tick faster than 10 Hz would only spin.
        ({"tuning": {"check_interval_s": 1e-9}}, "tuning.check_interval_s: must be >= 0.1"),
        ({"drift": {"check_interval_s": 0.05}}, "drift.check_interval_s: must be >= 0.1"),
        ({"tuning": {"resume_max_age_s": -1.0}}, "tuning.resume_max_age_s: must be >= 0"),
    ],
)
def test_bad_values_name_the_key(doc, needle):
    with pytest.raises(ConfigError) as exc:
        parse_config(doc, source="c.toml")
    assert needle in str(exc.value) and str(exc.value).startswith("c.toml: ")
    assert "\n" not in str(exc.value)


def test_quiet_hours_wrap_midnight():
    w = parse_windows(["22:00-06:00"])
    assert in_windows(w, dt.datetime(2026, 1, 1, 23, 30))
    assert in_windows(w, dt.datetime(2026, 1, 1, 5, 59))
    assert not in_windows(w, dt.datetime(2026, 1, 1, 6, 0))
    assert not in_windows(w, dt.datetime(2026, 1, 1, 12, 0))
    assert in_windows([], dt.datetime(2026, 1, 1, 12, 0))


def test_state_dir_rule(monkeypatch, tmp_path):
    assert resolve_state_dir(str(tmp_path)) == tmp_path
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/gpuwatchd-x")
    assert resolve_state_dir("") == Path("/var/lib/gpuwatchd-x")
    monkeypatch.delenv("STATE_DIRECTORY")
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert resolve_state_dir("") == tmp_path / "gpuwatchd"


def test_components_get_their_sections_not_the_whole_config():
    cfg = parse_config(
        {
            "daemon": {"backend": "sim"},
            "sim": {"gpus": 2, "scenario": "power-cap", "seed": 7},
            "replay": {"trace": "t.jsonl", "loop": False},
            "tuning": {"max_concurrent": 2, "workloads": ["sim-gemm"]},
        }
    )
    spec = cfg.backend_spec()
    assert (spec.kind, spec.sim, spec.replay) == ("sim", cfg.sim, cfg.replay)
    setup = cfg.tuning_setup()
    assert (setup.tuning, setup.workloads, setup.sim) == (cfg.tuning, cfg.workloads, cfg.sim)
    assert setup.workload("sim-gemm") == cfg.workload("sim-gemm")
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        setup.workload("nope")


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"sim": {"scenario": "lava"}}, "c.toml: sim.scenario: unknown 'lava' (known: "),
        ({"sim": {"gpus": 0}}, "c.toml: sim.gpus: must be in [1, 1024], got 0"),
        ({"replay": {"speed": -1}}, "c.toml: replay.speed: must be > 0, got -1"),
        ({"tuning": {"regimes": ["hot"]}}, "c.toml: tuning.regimes: must be a subset of"),
        ({"daemon": {"backend": "cuda"}}, "c.toml: daemon.backend: must be one of"),
    ],
)
def test_section_types_defined_by_components_keep_their_messages(doc, message):
    with pytest.raises(ConfigError) as exc:
        parse_config(doc, source="c.toml")
    assert str(exc.value).startswith(message)


def test_example_documents_every_store_key():
    keys = {f.name for f in dataclasses.fields(StoreConfig)}
    assert set(tomllib.loads(EXAMPLE.read_text())["store"]) == keys


def test_store_location_is_the_state_file_a_sqlite_path_or_the_url():
    state = {"daemon": {"state_dir": "/srv/state"}}
    assert store_location(parse_config(state)) == store_path("/srv/state")
    sqlite = parse_config({**state, "store": {"url": "/data/tuning.db"}})
    assert store_location(sqlite) == Path("/data/tuning.db")
    assert store_password_file(sqlite) is None
    url = "postgresql://gpuwatchd@db:5432/gpuwatchd?sslmode=verify-full"
    pg = parse_config({"store": {"url": url, "password_file": "/run/secrets/pw"}})
    assert store_location(pg) == url and store_password_file(pg) == Path("/run/secrets/pw")


@pytest.mark.parametrize(
    ("store", "message"),
    [
        (
            {"url": "postgresql://fleet:hunter2@db/gw"},
            "c.toml: store.url: the URL holds a password; put it in [store] password_file",
        ),
        ({"url": "postgresql://fleet@db/gw?password=hunter2"}, "c.toml: store.url: the URL holds"),
        ({"url": "mysql://fleet:hunter2@db/gw"}, "c.toml: store.url: expected a postgresql://"),
        ({"url": "state/gpuwatchd.db"}, "c.toml: store.url: a SQLite file must be an absolute"),
        ({"url": 5}, "c.toml: store.url: expected a string, got 5"),
        ({"password_file": "pw"}, "c.toml: store.password_file: must be an absolute path"),
        ({"password_file": "/pw"}, "c.toml: store.password_file: only a postgresql:// store.url"),
        (
            {"uri": "postgresql://db/gw"},
            "c.toml: store.uri: unknown key (known keys: call_timeout_s, ",
        ),
    ],
)
def test_bad_store_keys_are_one_line_and_never_show_a_password(store, message):
    with pytest.raises(ConfigError) as exc:
        parse_config({"store": store}, source="c.toml")
    text = str(exc.value)
    assert text.startswith(message) and "\n" not in text
    assert "hunter2" not in text


def test_the_password_file_must_be_readable_and_not_empty_on_this_host(tmp_path: Path):
    pw = tmp_path / "password"
    url = "postgresql://gpuwatchd@db/gw"
    cfg = parse_config({"store": {"url": url, "password_file": str(pw)}}, source="c.toml")
    with pytest.raises(ConfigError, match=f"^c.toml: store.password_file: cannot read {pw}: "):
        check_store_access(cfg)
    pw.write_text("\n")
    with pytest.raises(ConfigError, match=f"^c.toml: store.password_file: {pw} is empty$"):
        check_store_access(cfg)
    pw.write_text("s3cret\n")
    check_store_access(cfg)
    check_store_access(parse_config({}))  # the state-dir file needs nothing


def test_the_example_documents_every_fleet_key():
    assert set(tomllib.loads(EXAMPLE.read_text())["fleet"]) == {
        f.name for f in dataclasses.fields(FleetConfig)
    }


def test_the_fleet_table_is_read_and_checked():
    cfg = parse_config(
        {
            "fleet": {
                "enabled": False,
                "max_winner_age_s": 3600,
                "verify_fraction": 1,
                "claim_ttl_s": 60,
            }
        }
    )
    assert cfg.fleet == FleetConfig(
        enabled=False, max_winner_age_s=3600.0, verify_fraction=1.0, claim_ttl_s=60.0
    )
    assert cfg.fleet.renew_every_s == 20.0
    assert parse_config({}).fleet == FleetConfig()
    assert FleetConfig().verify_fraction == 0.05 and FleetConfig().claim_ttl_s == 600.0


@pytest.mark.parametrize(
    ("fleet", "message"),
    [
        ({"verify_fraction": 1.5}, "c.toml: fleet.verify_fraction: must be within [0, 1], got 1.5"),
        ({"verify_fraction": -0.1}, "c.toml: fleet.verify_fraction: must be within [0, 1]"),
        ({"verify_fraction": "5%"}, "c.toml: fleet.verify_fraction: expected a number, got '5%'"),
        ({"max_winner_age_s": 0}, "c.toml: fleet.max_winner_age_s: must be > 0, got 0"),
        ({"max_winner_age_s": 1e12}, "c.toml: fleet.max_winner_age_s: expected seconds from 0"),
        ({"claim_ttl_s": 5}, "c.toml: fleet.claim_ttl_s: must be >= 10, got 5"),
        ({"enabled": "yes"}, "c.toml: fleet.enabled: expected true or false, got 'yes'"),
        ({"ttl_s": 60}, "c.toml: fleet.ttl_s: unknown key (known keys: claim_ttl_s, enabled, "),
        # renewed every third of the lease, from the scheduler's tick
        ({"claim_ttl_s": 12}, "c.toml: fleet.claim_ttl_s: must be at least 3 x tuning.check"),
    ],
)
def test_bad_fleet_keys_are_one_line(fleet, message):
    with pytest.raises(ConfigError) as exc:
        parse_config({"fleet": fleet}, source="c.toml")
    text = str(exc.value)
    assert text.startswith(message) and "\n" not in text


@pytest.mark.parametrize("value", BAD_NUMBERS)
def test_no_fleet_number_takes_a_bad_value(value):
    for key in ("max_winner_age_s", "verify_fraction", "claim_ttl_s", "sync_interval_s"):
        with pytest.raises(ConfigError, match=f"^fleet.{key}: "):
            parse_config(tomllib.loads(f"[fleet]\n{key} = {value}\n"))


def test_a_faster_tick_allows_a_shorter_claim():
    cfg = parse_config({"tuning": {"check_interval_s": 1}, "fleet": {"claim_ttl_s": 10}})
    assert cfg.fleet.claim_ttl_s == 10.0


def test_resume_max_age_reaches_the_daemons_runners(tmp_path):
    """[tuning] resume_max_age_s is what each GPU's TuneRunner is built with (0: no resume)."""
    from gpuwatchd.store import sqlite_store

    cfg = parse_config({"tuning": {"resume_max_age_s": 0.0}}, source="c.toml")
    assert cfg.tuning.resume_max_age_s == 0.0
    from gpuwatchd.daemon.process import runner_factory

    with sqlite_store(tmp_path / "tune.db") as store:
        runner = runner_factory(cfg)(store, on_finished=lambda e: None)
        assert runner.resume_max_age_s == 0.0
