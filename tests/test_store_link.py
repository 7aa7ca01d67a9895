"""The store link: a look at the store only while there is something to look for.

The daemon's main loop pokes the link at every turn; a look (a probe, the listeners)
runs on a thread of its own, and only while the store is down or has just come back.
"""

from __future__ import annotations

import threading
import time

import pytest
from builders import wait_until

from gpuwatchd.daemon import store_link
from gpuwatchd.daemon.store_link import StoreLink
from gpuwatchd.store.backoff import CAP_S, Backoff
from gpuwatchd.store.errors import StoreUnavailable


class _Store:
    """``up`` and ``probe`` as SqlStore has them; counts probes and their threads."""

    def __init__(self, up: bool) -> None:
        self.up = up
        self.reachable = up
        self.probes: list[str] = []
        self.hold = threading.Event()
        self.hold.set()

    def probe(self) -> None:
        self.probes.append(threading.current_thread().name)
        self.hold.wait(10)
        if not self.reachable:
            raise StoreUnavailable("store down")
        self.up = True


def _looks(link: StoreLink) -> bool:
    return link._looking.locked()


def test_a_store_that_stays_up_is_never_looked_at() -> None:
    store = _Store(up=True)
    link = StoreLink(store)  # type: ignore[arg-type]
    heard: list[int] = []
    link.add_listener(lambda: heard.append(1))
    before = threading.active_count()
    for _ in range(5):
        link.poke()
        link._last_look = -store_link.CHECK_EVERY_S  # as if a second went by
        assert not _looks(link)
    assert threading.active_count() == before
    assert store.probes == [] and heard == []


def test_a_down_store_is_probed_off_the_callers_thread_and_the_listeners_hear_it_back() -> None:
    store = _Store(up=False)
    link = StoreLink(store)  # type: ignore[arg-type]
    heard: list[str] = []
    link.add_listener(lambda: heard.append(threading.current_thread().name))
    store.hold.clear()  # the probe hangs, as on an unreachable server
    link.poke()
    wait_until(lambda: len(store.probes) == 1, 5, "the first probe")
    link._last_look = -store_link.CHECK_EVERY_S
    link.poke()  # the first probe still waits: not doubled
    store.hold.set()
    wait_until(lambda: not _looks(link), 5, "the first look over")
    assert len(store.probes) == 1 and heard == []
    link._last_look = time.monotonic()
    link.poke()  # less than CHECK_EVERY_S since the last look began: none
    assert len(store.probes) == 1
    store.reachable = True
    link._last_look = -store_link.CHECK_EVERY_S
    link.poke()
    wait_until(lambda: heard != [], 5, "the listeners told")
    assert store.probes[-1] != threading.current_thread().name
    assert heard == ["gpuwatchd-store-link"]
    wait_until(lambda: not _looks(link), 5, "the look over")
    link._last_look = -store_link.CHECK_EVERY_S
    link.poke()  # up, and the listeners heard: nothing more to do
    assert not _looks(link) and len(store.probes) == 2 and len(heard) == 1


def test_a_store_back_by_itself_is_told_to_the_listeners_at_the_next_poke() -> None:
    store = _Store(up=False)
    link = StoreLink(store)  # type: ignore[arg-type]
    heard: list[int] = []
    link.add_listener(lambda: heard.append(1))
    store.up = True  # another call reached it: no probe needed, the listeners still hear
    assert link.due()
    link.poke()
    wait_until(lambda: heard == [1], 5, "the listeners told")
    assert store.probes == []
    wait_until(lambda: not link.due(), 5, "nothing left to do")


def test_a_look_whose_thread_cannot_start_is_tried_again_not_raised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cgroup out of threads must not take the daemon's main loop down with it."""
    store = _Store(up=False)
    link = StoreLink(store)  # type: ignore[arg-type]

    def no_thread(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    link.poke()  # logged, not raised
    assert not _looks(link)  # free for the next turn
    monkeypatch.undo()
    link._last_look = -store_link.CHECK_EVERY_S  # as if a second went by
    store.reachable = True
    link.poke()
    wait_until(lambda: store.up, 5, "the store back")


def test_failed_probes_back_off_with_jitter_up_to_a_minute_and_a_success_starts_over() -> None:
    """A fleet must not knock on a database coming back in step, once a second each (nor
    keep failing logins with a wrong password): each failed probe waits longer."""
    store = _Store(up=False)
    link = StoreLink(store)  # type: ignore[arg-type]
    waits = []
    for _ in range(12):
        link()  # one look, on this thread
        waits.append(link._wait_s)
    assert len(store.probes) == 12
    assert store_link.CHECK_EVERY_S / 2 <= waits[0] <= store_link.CHECK_EVERY_S
    assert waits[:6] == sorted(waits[:6]) and waits[5] >= 16.0  # doubling, jittered
    assert all(w <= CAP_S for w in waits) and waits[-1] >= CAP_S / 2
    store.reachable = True
    link()
    assert store.up and link._wait_s == store_link.CHECK_EVERY_S


def test_backoff_doubles_to_its_cap_with_equal_jitter_and_resets() -> None:
    low, high = Backoff(rand=lambda: 0.0), Backoff(rand=lambda: 1.0)
    assert [high.failed() for _ in range(8)] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert [low.failed() for _ in range(3)] == [0.5, 1, 2]
    low.reset()
    assert low.failed() == 0.5
