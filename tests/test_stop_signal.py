"""The stop flag periodic threads sleep on: wakes every sleeper at once, and for good."""

from __future__ import annotations

import signal
import threading
import time

from gpuwatchd.monitor.stop_signal import StopSignal


def test_a_wait_times_out_false_until_set_and_is_true_at_once_after() -> None:
    stop = StopSignal()
    assert not stop.is_set()
    assert stop.wait(0.01) is False
    assert stop.wait(-1.0) is False  # a deadline already past: no sleep
    stop.set()
    stop.set()  # twice is harmless
    assert stop.is_set()
    assert all(stop.wait(30.0) for _ in range(3))
    assert stop.wait() is True


def test_setting_it_wakes_every_sleeper() -> None:
    stop = StopSignal()
    woke: list[bool] = []
    sleepers = [threading.Thread(target=lambda: woke.append(stop.wait(30.0))) for _ in range(5)]
    for t in sleepers:
        t.start()
    time.sleep(0.05)
    stop.set()
    for t in sleepers:
        t.join(5.0)
    assert woke == [True] * 5


def test_a_signal_handler_setting_it_wakes_the_main_thread() -> None:
    stop = StopSignal()
    previous = signal.signal(signal.SIGALRM, lambda *_: stop.set())
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        started = time.monotonic()
        assert stop.wait(30.0) is True
        assert time.monotonic() - started < 10.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
