"""sd_notify client: exact datagrams on a real AF_UNIX socket, abstract names, no-op mode."""

from __future__ import annotations

import logging
import os
import re
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from gpuwatchd.daemon.sdnotify import Notifier, watchdog_interval_s


@pytest.fixture
def receiver() -> Iterator[tuple[socket.socket, str]]:
    """A bound datagram socket in place of systemd's (short path: sun_path holds 108 bytes)."""
    with tempfile.TemporaryDirectory(prefix="sdn") as d:
        path = os.path.join(d, "notify")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(path)
        sock.settimeout(2.0)
        try:
            yield sock, path
        finally:
            sock.close()


def _notifier(path: str) -> Notifier:
    return Notifier.from_env({"NOTIFY_SOCKET": path})


def test_each_message_arrives_as_one_exact_datagram(receiver: tuple[socket.socket, str]) -> None:
    sock, path = receiver
    n = _notifier(path)
    assert n.enabled
    assert n.ready()
    assert n.watchdog()
    assert n.stopping()
    assert n.status("tuning gpu 0: 3/12 candidates")
    assert n.ready(status="serving")
    got = [sock.recv(4096) for _ in range(5)]
    assert got == [
        b"READY=1",
        b"WATCHDOG=1",
        b"STOPPING=1",
        b"STATUS=tuning gpu 0: 3/12 candidates",
        b"READY=1\nSTATUS=serving",
    ]
    n.close()


def test_status_newlines_are_folded_so_no_fake_fields_are_injected(
    receiver: tuple[socket.socket, str],
) -> None:
    sock, path = receiver
    _notifier(path).status("gpu lost\nREADY=1")
    assert sock.recv(4096) == b"STATUS=gpu lost READY=1"


def test_reloading_carries_current_monotonic_usec(receiver: tuple[socket.socket, str]) -> None:
    sock, path = receiver
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert _notifier(path).reloading()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    match = re.fullmatch(rb"RELOADING=1\nMONOTONIC_USEC=(\d+)", sock.recv(4096))
    assert match is not None
    assert before <= int(match.group(1)) <= after


def test_abstract_socket_address() -> None:
    name = f"gpuwatchd-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.settimeout(2.0)
    try:
        n = Notifier.from_env({"NOTIFY_SOCKET": "@" + name})
        assert n.ready()
        assert sock.recv(4096) == b"READY=1"
    finally:
        sock.close()


@pytest.mark.parametrize("env", [{}, {"NOTIFY_SOCKET": ""}])
def test_unset_socket_is_a_noop_that_opens_nothing(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_socket(*args: object, **kwargs: object) -> socket.socket:
        raise AssertionError("a disabled notifier must not create a socket")

    monkeypatch.setattr(socket, "socket", no_socket)
    n = Notifier.from_env(env)
    assert not n.enabled
    results = [n.ready("x"), n.watchdog(), n.reloading(), n.stopping(), n.status("x")]
    assert results == [False] * 5


def test_from_env_defaults_to_process_environment(
    receiver: tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sock, path = receiver
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    assert Notifier.from_env().watchdog()
    assert sock.recv(4096) == b"WATCHDOG=1"


@pytest.mark.parametrize("value", ["relative/notify", "@"])
def test_malformed_address_names_the_variable(value: str) -> None:
    with pytest.raises(ValueError, match="NOTIFY_SOCKET"):
        Notifier.from_env({"NOTIFY_SOCKET": value})


def test_unset_environment_hides_variables_from_children(
    receiver: tuple[socket.socket, str],
) -> None:
    sock, path = receiver
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1", "KEEP": "1"}
    n = Notifier.from_env(env, unset_environment=True)
    assert env == {"KEEP": "1"}
    assert n.watchdog_interval_s() is None  # WATCHDOG_PID=1 is not us
    assert n.ready()
    assert sock.recv(4096) == b"READY=1"


def test_send_failure_returns_false_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    with tempfile.TemporaryDirectory(prefix="sdn") as d:
        path = os.path.join(d, "notify")
        n = _notifier(path)
        with caplog.at_level(logging.DEBUG, logger="gpuwatchd.daemon.sdnotify"):
            assert n.watchdog() is False
            assert n.watchdog() is False
        levels = [r.levelno for r in caplog.records]
        assert levels == [logging.WARNING, logging.DEBUG]

        # Once systemd's socket is back, sends succeed and a later outage warns again.
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(path)
        sock.settimeout(2.0)
        try:
            assert n.watchdog()
            assert sock.recv(4096) == b"WATCHDOG=1"
        finally:
            sock.close()
        os.unlink(path)
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="gpuwatchd.daemon.sdnotify"):
            assert n.watchdog() is False
        assert [r.levelno for r in caplog.records] == [logging.WARNING]


def test_full_receive_queue_never_blocks_the_caller(receiver: tuple[socket.socket, str]) -> None:
    """A stalled systemd must not hang the watchdog thread: excess pings fail fast."""
    _, path = receiver
    n = _notifier(path)
    results: list[bool] = []
    worker = threading.Thread(target=lambda: results.extend(n.watchdog() for _ in range(5000)))
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "send blocked on a full queue"
    assert results[0] is True
    assert False in results


class TestNotifierWatchdogInterval:
    """The daemon asks its notifier; the value is read once, before any unsetting."""

    def test_captured_from_env_for_our_pid(self) -> None:
        env = {
            "NOTIFY_SOCKET": "/run/systemd/notify",
            "WATCHDOG_USEC": "30000000",
            "WATCHDOG_PID": str(os.getpid()),
        }
        n = Notifier.from_env(env, unset_environment=True)
        assert env == {}
        assert n.watchdog_interval_s() == 15.0

    def test_none_without_a_socket_to_ping(self) -> None:
        assert Notifier.from_env({"WATCHDOG_USEC": "30000000"}).watchdog_interval_s() is None

    def test_none_when_systemd_set_no_watchdog(self) -> None:
        n = Notifier.from_env({"NOTIFY_SOCKET": "/run/systemd/notify"})
        assert n.watchdog_interval_s() is None

    def test_malformed_watchdog_usec_is_reported_by_from_env(self) -> None:
        with pytest.raises(ValueError, match="WATCHDOG_USEC"):
            Notifier.from_env({"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "soon"})


class TestWatchdogInterval:
    def test_unset_means_no_watchdog(self) -> None:
        assert watchdog_interval_s({}) is None
        assert watchdog_interval_s({"WATCHDOG_USEC": ""}) is None

    def test_half_the_timeout_without_pid(self) -> None:
        assert watchdog_interval_s({"WATCHDOG_USEC": "30000000"}) == 15.0

    def test_half_the_timeout_when_pid_is_ours(self) -> None:
        env = {"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}
        assert watchdog_interval_s(env) == 15.0
        assert (
            watchdog_interval_s({"WATCHDOG_USEC": "500000", "WATCHDOG_PID": "42"}, pid=42) == 0.25
        )

    def test_pid_mismatch_means_not_for_us(self) -> None:
        env = {"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}
        assert watchdog_interval_s(env) is None

    def test_reads_process_environment_by_default(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("WATCHDOG_USEC", "4000000")
        monkeypatch.delenv("WATCHDOG_PID", raising=False)
        assert watchdog_interval_s() == 2.0

    @pytest.mark.parametrize(
        ("env", "field"),
        [
            ({"WATCHDOG_USEC": "30s"}, "WATCHDOG_USEC"),
            ({"WATCHDOG_USEC": "0"}, "WATCHDOG_USEC"),
            ({"WATCHDOG_USEC": "-5"}, "WATCHDOG_USEC"),
            ({"WATCHDOG_USEC": "1000", "WATCHDOG_PID": "self"}, "WATCHDOG_PID"),
        ],
    )
    def test_malformed_values_name_the_field(self, env: dict[str, str], field: str) -> None:
        with pytest.raises(ValueError, match=field):
            watchdog_interval_s(env)
