"""A throttle event shows in /metrics within two polls.

The real NVML backend reads a fake pynvml; the poller publishes to the board; the HTTP
server renders /metrics with its render cache on. A throttle reason that appears (or
clears) in NVML must be in the next scrapes after at most two polls, whether the
scraper asks right after each poll or scrapes on its own schedule while the sweeper runs.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator

import pynvml  # type: ignore[import-untyped]
import pytest
from fakes_nvml import FakeNvml

from gpuwatchd.exporter import DaemonInfo, build_registry
from gpuwatchd.gate import GateConfig
from gpuwatchd.monitor.board import GpuSnapshot, StateBoard
from gpuwatchd.monitor.poller import Poller
from gpuwatchd.serve import HttpServer
from gpuwatchd.telemetry.nvml import NvmlBackend

CAPPED = 'gpuwatchd_gpu_throttle_active{gpu="1",reason="sw_power_cap",uuid="GPU-fake-1"} 1.0'
UNCAPPED = 'gpuwatchd_gpu_throttle_active{gpu="1",reason="sw_power_cap",uuid="GPU-fake-1"} 0.0'
MAX_POLLS = 2


class Rig:
    """Fake NVML -> NvmlBackend -> Poller -> board -> HTTP /metrics, polls counted."""

    def __init__(self, period_s: float = 0.05) -> None:
        self.fake = FakeNvml(2)
        self.backend = NvmlBackend(nvml=self.fake, xid_wait_s=0.02)
        self.board = StateBoard()
        self.poller = Poller(self.backend, self.board, GateConfig(), period_s=period_s)
        self.polls = 0
        self._polled = threading.Condition()
        self.poller.add_listener(self._count)
        registry = build_registry(self.board, DaemonInfo.current("nvml"))
        self.http = HttpServer(self.board, registry, ("127.0.0.1", 0))
        self.http.start()

    def _count(self, snap: GpuSnapshot) -> None:
        if snap.index == 1:
            with self._polled:
                self.polls += 1
                self._polled.notify_all()

    def wait_polls(self, n: int, timeout: float = 5.0) -> None:
        with self._polled:
            assert self._polled.wait_for(lambda: self.polls >= n, timeout), "poller stopped"

    def scrape(self) -> str:
        host, port = self.http.address
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as response:
            return response.read().decode()

    def set_reasons(self, mask: int) -> None:
        self.fake.gpus[1].reasons = mask

    def close(self) -> None:
        self.poller.stop()
        self.http.stop()
        self.backend.close()


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    yield r
    r.close()


def polls_until_seen(rig: Rig, line: str) -> int:
    """Poll GPU 1 one poll at a time, scraping after each, until ``line`` is served."""
    for polls in range(1, 11):
        rig.poller.poll(1)
        if line in rig.scrape().splitlines():
            return polls
    raise AssertionError(f"{line!r} not served after 10 polls")


def test_a_throttle_reason_is_served_after_one_poll(rig: Rig) -> None:
    for _ in range(3):
        rig.poller.poll(0)
        rig.poller.poll(1)
    assert UNCAPPED in rig.scrape().splitlines()  # the body is now cached
    rig.set_reasons(pynvml.nvmlClocksEventReasonSwPowerCap)
    assert polls_until_seen(rig, CAPPED) <= MAX_POLLS
    rig.set_reasons(pynvml.nvmlClocksEventReasonGpuIdle)
    assert polls_until_seen(rig, UNCAPPED) <= MAX_POLLS


def test_a_scraper_on_its_own_clock_sees_it_within_two_polls(rig: Rig) -> None:
    """The sweeper polls at 20 Hz; a scraper scrapes back to back meanwhile."""
    rig.poller.start()
    rig.wait_polls(3)
    seen_at: list[int] = []
    flipped_at: list[int] = []
    stop = threading.Event()

    def scraper() -> None:
        while not stop.is_set():
            polls_before = rig.polls  # a body served now may be from any poll up to here
            if flipped_at and CAPPED in rig.scrape().splitlines():
                seen_at.append(polls_before)
                return
            time.sleep(0.002)

    thread = threading.Thread(target=scraper, daemon=True)
    thread.start()
    try:
        rig.wait_polls(rig.polls + 1)
        flipped_at.append(rig.polls)
        rig.set_reasons(pynvml.nvmlClocksEventReasonSwPowerCap)
        rig.wait_polls(flipped_at[0] + 10)
    finally:
        stop.set()
        thread.join(5)
    assert seen_at, "the throttle never showed in /metrics"
    # polls completed after the flip when a body showing it was served (0: the poll in
    # flight at the flip already read it)
    assert seen_at[0] - flipped_at[0] <= MAX_POLLS
