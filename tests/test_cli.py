"""The command line's shape: one module per command, no loop back to ``cli.main``."""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

import pytest

from gpuwatchd.cli import main as cli_main
from gpuwatchd.cli.common import EXIT_CONFIG, EXIT_RUNTIME, CliError
from gpuwatchd.cli.status import local_url

CLI_DIR = Path(cli_main.__file__).parent
BURN = Path(__file__).parent / "data" / "h200-matmul-burn.jsonl"


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_no_cli_module_imports_main() -> None:
    offenders = [
        p.name
        for p in sorted(CLI_DIR.glob("*.py"))
        if p.name != "main.py" and "gpuwatchd.cli.main" in _imported_modules(p)
    ]
    assert offenders == []


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_commands_are_listed_in_order_and_dispatch_to_their_module() -> None:
    """The parser lists ``COMMANDS`` in order, and every module of cli/ with an
    ``add_parser`` is one of them (a command module left out of the list fails here)."""
    subs = _subcommands(cli_main.build_parser())
    assert list(subs) == list(cli_main.COMMANDS)
    modules = {
        p.stem.replace("_", "-")
        for p in CLI_DIR.glob("*.py")
        if p.stem != "common" and "def add_parser" in p.read_text()
    }
    assert modules == set(cli_main.COMMANDS)
    for name, sub in subs.items():
        assert sub.get_default("func") is cli_main.command_module(name).run, name


def test_a_command_line_builds_only_the_parser_of_the_command_it_names() -> None:
    """Its parser and help are those of the full one; --help and typos still see them all."""
    assert cli_main.commands_for(["run", "--backend", "sim"]) == ("run",)
    assert cli_main.commands_for(["--help"]) == cli_main.COMMANDS
    assert cli_main.commands_for(["rn"]) == cli_main.COMMANDS
    alone = _subcommands(cli_main.build_parser(("run",)))
    assert list(alone) == ["run"]
    full = _subcommands(cli_main.build_parser())["run"]
    assert alone["run"].format_help() == full.format_help()


def test_a_cli_error_is_one_line_with_its_exit_code(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def fail(args: argparse.Namespace) -> int:
        raise CliError("broken\u2009thing", EXIT_CONFIG)

    parser = cli_main.build_parser()
    monkeypatch.setattr(cli_main, "build_parser", lambda _commands: parser)
    _subcommands(parser)["check-config"].set_defaults(func=fail)
    assert cli_main.main(["check-config"]) == EXIT_CONFIG
    assert capsys.readouterr().err == "gpuwatchd: broken\u2009thing\n"


def test_check_config_of_the_defaults(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("")
    assert cli_main.main(["check-config", "--config", str(cfg)]) == 0
    ok, tuning = capsys.readouterr().out.strip().splitlines()
    assert ok.endswith(": OK") and tuning.startswith("tuning: ")


def test_plot_timeline_bad_header_t0_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = BURN.read_text().splitlines()
    header = json.loads(lines[0])
    header["t0_unix"] = "yesterday"
    trace = tmp_path / "bad-t0.jsonl"
    trace.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    rc = cli_main.main(["plot-timeline", "--trace", str(trace), "--out", str(tmp_path / "t.png")])
    err = capsys.readouterr().err
    assert rc == EXIT_RUNTIME
    assert err.count("\n") == 1 and "bad-t0.jsonl:1: field 't0_unix'" in err
    assert not (tmp_path / "t.png").exists()


def test_plot_timeline_unknown_gpu_is_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = cli_main.main(
        ["plot-timeline", "--trace", str(BURN), "--gpu", "4", "--out", str(tmp_path / "t.png")]
    )
    assert rc == EXIT_CONFIG
    assert "--gpu 4: not in" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("listen", "https", "url"),
    [
        (":9844", False, "http://127.0.0.1:9844"),
        ("0.0.0.0:9000", True, "https://127.0.0.1:9000"),
        ("[::1]:9844", False, "http://[::1]:9844"),
        ("[::]:9844", False, "http://127.0.0.1:9844"),
        ("gpu-host:80", False, "http://gpu-host:80"),
    ],
)
def test_status_finds_a_local_daemon(listen: str, https: bool, url: str) -> None:
    assert local_url(listen, https=https) == url
