"""Workloads added to the config are tuned on GPUs that were tuned before.

The drift detector asks for the configured set only when something changes on a GPU,
and adding a workload changes nothing it watches: a workload added by a reload (SIGHUP)
on a tuned GPU was never requested. A daemon on the simulated backend, its GPU's
``sim-gemm`` winners in the store, gets a second workload by a reload.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

from builders import candidate, seed_session, wait_until

from gpuwatchd.config import load_config
from gpuwatchd.daemon.process import Daemon
from gpuwatchd.store.rows import SessionMeta
from gpuwatchd.tuning.types import Regime, RegimeResult

SECOND = (
    "[[workload]]\nname = 'sim-gemm-small'\nop = 'matmul'\n"
    "shape = { m = 1024, n = 1024, k = 1024 }\ndtype = 'bfloat16'\nfamilies = ['sim']\n"
)


def _config(tmp: Path, workloads: list[str], extra: str = "") -> str:
    names = ", ".join(repr(n) for n in workloads)
    return (
        f'[daemon]\nbackend = "sim"\nlisten = "127.0.0.1:0"\nstate_dir = "{tmp}"\n'
        f'control_socket = "{tmp / "c.sock"}"\npoll_interval_s = 0.05\n'
        f"[tuning]\nenabled = false\nworkloads = [{names}]\n{extra}"
    )


def _seed_winners(daemon: Daemon, workload: str) -> None:
    """A completed session of ``workload`` on the daemon's GPU 0, every regime tuned."""
    info = daemon.board.get(0).info  # type: ignore[union-attr]
    assert info is not None
    (w,) = [x for x in daemon.runnable() if x.name == workload]
    regimes = tuple(Regime(r) for r in daemon.cfg.tuning.regimes)
    meta = SessionMeta.for_device(info, backend="sim", workloads=(w,), regimes=regimes)
    pair = (
        candidate("sim[a]", Regime.UNTHROTTLED, 1e-3),
        candidate("sim[b]", Regime.UNTHROTTLED, 2e-3),
    )
    results = [
        RegimeResult(
            workload, r, tuple(replace(c, regime=r) for c in pair), "sim[a]", False, 0.5, 0.01
        )
        for r in regimes
    ]
    seed_session(daemon.store, meta, results)


def test_a_workload_added_by_a_reload_is_requested_on_a_gpu_tuned_before(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(_config(tmp_path, ["sim-gemm"]))
    daemon = Daemon(load_config(str(path)), config_path=str(path))
    thread = threading.Thread(target=daemon.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: daemon.board.get(0) is not None and daemon.board.get(0).info is not None,  # type: ignore[union-attr]
                   15, "GPU 0 polled")  # fmt: skip
        _seed_winners(daemon, "sim-gemm")
        wait_until(lambda: 0 in daemon.drift.view() and daemon.drift.view()[0].reference_clock_hz
                   is not None, 15, "GPU 0's reference from the store")  # fmt: skip
        daemon.tuner.withdraw(["sim-gemm"])  # whatever the first look asked for
        daemon.drift_tick()
        assert daemon.tuner.pending() == {}, "tuned: nothing to ask for"

        path.write_text(_config(tmp_path, ["sim-gemm", "sim-gemm-small"], SECOND))
        assert daemon.reload()
        daemon.drift_tick()
        assert daemon.tuner.pending() == {0: ("sim-gemm-small",)}  # only the new one

        daemon.tuner.withdraw(["sim-gemm-small"])
        daemon.drift_tick()  # asked once, not at every check
        assert daemon.tuner.pending() == {}
    finally:
        daemon.request_stop()
        thread.join(10)
    assert not thread.is_alive()
