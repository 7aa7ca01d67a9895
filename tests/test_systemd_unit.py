"""The shipped systemd unit: systemd-analyze finds no warning and scores it OK, and the
settings the daemon relies on (notify, watchdog, GPU device access) are present."""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parent.parent / "systemd" / "gpuwatchd.service"
SHIPPED_BINARY = "/usr/local/bin/gpuwatchd"
MAX_EXPOSURE = 3.0

# Character-device names from /proc/devices on an H200 host (driver 580.159.04).
H200_PROC_DEVICES_NVIDIA = {
    "nvidia": 195,
    "nvidiactl": 195,
    "nvidia-uvm": 238,
    "nvidia-nvswitch": 239,
    "nvidia-nvlink": 240,
    "nvidia-caps": 241,
    "nvidia-caps-imex-channels": 242,
}

ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """Section -> key -> every value in order (systemd keys such as DeviceAllow= repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), defaultdict(list))
            continue
        assert current is not None, f"key outside a section: {line!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not a key=value line: {line!r}"
        current[key.strip()].append(value.strip())
    return sections


def _service() -> dict[str, list[str]]:
    return parse_unit(UNIT.read_text())["Service"]


def _verifiable_copy(tmp_path: Path, text: str | None = None) -> Path:
    """The unit with ExecStart's binary swapped for one that exists (verify stats it)."""
    text = UNIT.read_text() if text is None else text
    assert text.count(f"ExecStart={SHIPPED_BINARY} ") == 1
    path = tmp_path / "gpuwatchd.service"
    path.write_text(text.replace(f"ExecStart={SHIPPED_BINARY} ", f"ExecStart={sys.executable} "))
    return path


def _analyze(*args: str) -> subprocess.CompletedProcess[str]:
    assert ANALYZE is not None
    env = dict(os.environ)
    # Messages to stderr, uncoloured, at notice and above: warnings without debug chatter.
    env.update(SYSTEMD_LOG_TARGET="console", SYSTEMD_LOG_LEVEL="notice", SYSTEMD_LOG_COLOR="0")
    env.pop("SYSTEMD_PAGER", None)
    return subprocess.run(
        [ANALYZE, "--no-pager", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


def verify_problems(path: Path) -> list[str]:
    """Lines `systemd-analyze verify` prints about this unit, plus a failing exit status."""
    result = _analyze("verify", "--man=no", "--generators=no", str(path))
    lines = (result.stdout + result.stderr).splitlines()
    problems = [line for line in lines if path.name in line]
    if result.returncode != 0:
        problems.append(f"exit status {result.returncode}: {result.stderr.strip()}")
    return problems


def security_report(path: Path) -> tuple[float, dict[str, bool]]:
    """Overall exposure and each check's pass (True) or fail, from the offline analysis."""
    result = _analyze("security", "--offline=yes", str(path))
    assert result.returncode == 0, result.stderr
    match = re.search(
        rf"Overall exposure level for {re.escape(path.name)}: (\d+\.\d+)", result.stdout
    )
    assert match is not None, result.stdout
    checks = {}
    for line in result.stdout.splitlines():
        mark, _, rest = line.partition(" ")
        if mark in ("✓", "✗") and rest:
            checks[rest.split()[0]] = mark == "✓"
    return float(match.group(1)), checks


@needs_analyze
def test_verify_reports_nothing_about_the_unit(tmp_path: Path) -> None:
    assert verify_problems(_verifiable_copy(tmp_path)) == []


@needs_analyze
@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("NotifyAccess=main", "NotifyAcess=main"),  # unknown key: warned, exit status 0
        ("Type=notify\n", "Type=notify-reload\n"),  # needs systemd 253: warned, exit status 0
    ],
)
def test_verify_check_catches_warnings(tmp_path: Path, old: str, new: str) -> None:
    text = UNIT.read_text()
    assert old in text
    problems = verify_problems(_verifiable_copy(tmp_path, text.replace(old, new, 1)))
    assert problems, "a warning about the unit went unnoticed"


@needs_analyze
def test_verify_catches_a_missing_binary(tmp_path: Path) -> None:
    path = tmp_path / "gpuwatchd.service"
    path.write_text(UNIT.read_text().replace(SHIPPED_BINARY, str(tmp_path / "absent")))
    assert any("absent" in p for p in verify_problems(path))


@needs_analyze
def test_security_exposure_is_low(tmp_path: Path) -> None:
    exposure, checks = security_report(_verifiable_copy(tmp_path))
    assert exposure <= MAX_EXPOSURE
    for name in (
        "User=/DynamicUser=",
        "NoNewPrivileges=",
        "MemoryDenyWriteExecute=",
        "RestrictAddressFamilies=~AF_NETLINK",
        "SystemCallFilter=~@privileged",
        "ProtectSystem=",
        "NotifyAccess=",
    ):
        assert checks.get(name) is True, f"{name} no longer passes"


@needs_analyze
def test_security_score_reacts_to_weakening(tmp_path: Path) -> None:
    """Guards the parser: dropping the sandbox must raise the parsed exposure."""
    strong, _ = security_report(_verifiable_copy(tmp_path))
    weak_text = "\n".join(
        line
        for line in UNIT.read_text().splitlines()
        if not line.startswith(("DynamicUser=", "CapabilityBoundingSet=", "SystemCallFilter="))
    )
    weak, checks = security_report(_verifiable_copy(tmp_path, weak_text))
    assert weak > strong + 1.0
    assert checks["User=/DynamicUser="] is False


def test_notify_watchdog_and_reload_wiring() -> None:
    service = _service()
    assert service["Type"] == ["notify"]
    assert service["NotifyAccess"] == ["main"]
    assert service["ExecStart"] == [f"{SHIPPED_BINARY} run"]
    assert service["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert service["WatchdogSec"] == ["30"]
    assert service["Restart"] == ["on-failure"]
    assert "PYTHONUNBUFFERED=1" in service["Environment"]


def test_runtime_directories_exist_for_state_config_and_socket() -> None:
    service = _service()
    for key in ("StateDirectory", "ConfigurationDirectory", "RuntimeDirectory", "CacheDirectory"):
        assert service[key] == ["gpuwatchd"], key


def test_gpu_devices_reachable_but_nothing_else() -> None:
    service = _service()
    assert service["PrivateDevices"] == ["no"], "PrivateDevices=yes hides /dev/nvidia*"
    assert service["DevicePolicy"] == ["closed"]
    allowed: dict[str, str] = {}
    for entry in service["DeviceAllow"]:
        pattern, _, access = entry.partition(" ")
        assert pattern.startswith("char-"), entry
        allowed[pattern.removeprefix("char-")] = access

    def access_for(name: str) -> str | None:
        hits = [acc for pat, acc in allowed.items() if fnmatch.fnmatchcase(name, pat)]
        return "".join(sorted(set("".join(hits)))) or None

    # What CUDA and NVML open on a real H200 host, matched as systemd matches (fnmatch).
    assert access_for("nvidia") == "rw"
    assert access_for("nvidiactl") == "rw"
    assert access_for("nvidia-uvm") == "rw"
    assert access_for("nvidia-caps") == "r"
    for unneeded in ("nvidia-nvswitch", "nvidia-nvlink", "nvidia-caps-imex-channels"):
        assert unneeded in H200_PROC_DEVICES_NVIDIA
        assert access_for(unneeded) is None, unneeded


def test_every_sandbox_setting_the_daemon_depends_on() -> None:
    service = _service()
    expected = {
        "DynamicUser": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "NoNewPrivileges": "yes",
        "CapabilityBoundingSet": "",
        "AmbientCapabilities": "",
        "ProtectKernelTunables": "yes",
        "ProtectKernelModules": "yes",
        "ProtectKernelLogs": "yes",
        "ProtectControlGroups": "yes",
        "ProtectClock": "yes",
        "ProtectHostname": "yes",
        "ProtectProc": "invisible",
        "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
        "RestrictNamespaces": "yes",
        "LockPersonality": "yes",
        "MemoryDenyWriteExecute": "yes",
        "RestrictRealtime": "yes",
        "RestrictSUIDSGID": "yes",
        "SystemCallArchitectures": "native",
        "UMask": "0077",
        "OOMPolicy": "continue",
    }
    for key, value in expected.items():
        assert service[key] == [value], key
    # ProcSubset=pid would hide /proc/driver/nvidia, which NVML and CUDA read.
    assert "ProcSubset" not in service
    assert service["SystemCallFilter"] == ["@system-service", "~@privileged"]
