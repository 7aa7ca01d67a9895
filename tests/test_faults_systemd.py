"""The unit does not restart a daemon that exits 2 (bad configuration).

``gpuwatchd run`` exits 2 for a bad config or command line (tests/test_faults_config.py
checks that), which no restart can fix; 1 (no driver yet, a port in use) may clear up.
"""

from __future__ import annotations

from test_systemd_unit import UNIT, parse_unit


def test_exit_status_2_is_not_restarted_and_others_are() -> None:
    service = parse_unit(UNIT.read_text())["Service"]
    assert service["Restart"] == ["on-failure"]
    assert service["RestartPreventExitStatus"] == ["2"]
    assert "SuccessExitStatus" not in service  # 2 still shows as a failure in systemctl
