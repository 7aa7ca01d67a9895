"""Users' work stays out of the per-workload series: bounded cardinality, same names.

A kernel tuned for 200 key values and 300 captured shapes add a handful of series, not
one winner series per key; shipped workloads keep ``gpuwatchd_winner_info`` and friends.
"""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gpuwatchd.exporter.collectors.tuning import TuningCollector, user_kernel
from gpuwatchd.monitor.board import StateBoard
from gpuwatchd.sessions.tuning_view import TuningSnapshot
from gpuwatchd.store.rows import WinnerRow
from gpuwatchd.tuning.submitted.kernels import workload_name
from gpuwatchd.tuning.types import Regime, Versions

MODEL = "NVIDIA H100 80GB HBM3"
SOFTMAX = ("user_kernels.softmax", "softmax_kernel", "ab" * 32)
NORM = ("user_kernels.layer_norm", "layer_norm_kernel", "cd" * 32)


def row(workload: str, regime: Regime, candidate: str = "a") -> WinnerRow:
    return WinnerRow(
        MODEL, Versions(), workload, regime, candidate, "f", 1e-4, 1.98e9, 0.05, False, 1,
        "GPU-0", 1000.0,
    )  # fmt: skip


def snapshot() -> TuningSnapshot:
    winners = [row("gemm-bf16-8192", r, "cublas") for r in Regime]
    keys = [workload_name(*SOFTMAX, f"n_cols={n};float16,float16") for n in range(200)]
    for i, name in enumerate(keys):
        winners.append(row(name, Regime.UNTHROTTLED, "BLOCK_N=1024"))
        winners.append(row(name, Regime.SUSTAINED, "BLOCK_N=2048" if i < 7 else "BLOCK_N=1024"))
    captured = [f"model.gemm.float16.{n}x64x64.nn" for n in range(300)]
    winners += [row(name, r) for name in captured[:250] for r in Regime]
    waiting = [workload_name(*NORM, f"N={n}") for n in range(5)] + captured[250:]
    return TuningSnapshot({}, {}, frozenset(), {0: tuple(waiting)}, None, tuple(winners))


def samples() -> tuple[Counter[str], str]:
    reg = CollectorRegistry()
    captured = frozenset(f"model.gemm.float16.{n}x64x64.nn" for n in range(300))
    reg.register(TuningCollector(StateBoard(), snapshot, added=lambda: captured))
    text = generate_latest(reg).decode()
    names = Counter(
        line.split("{")[0].split(" ")[0] for line in text.splitlines() if not line.startswith("#")
    )
    return names, text


def test_users_work_is_summed_up_per_kernel_and_in_total() -> None:
    names, text = samples()
    assert names["gpuwatchd_winner_info"] == 2  # the shipped workload's two regimes only
    assert names["gpuwatchd_winner_seconds"] == 2
    assert names["gpuwatchd_regime_winners_differ"] == 1
    assert names["gpuwatchd_user_kernel_keys"] == 4  # 2 kernels x {tuned, pending}
    kernel = "user_kernels.softmax.softmax_kernel@abababab"
    assert f'gpuwatchd_user_kernel_keys{{kernel="{kernel}",state="tuned"}} 200.0' in text
    norm = "user_kernels.layer_norm.layer_norm_kernel@cdcdcdcd"
    assert f'gpuwatchd_user_kernel_keys{{kernel="{norm}",state="pending"}} 5.0' in text
    assert f'gpuwatchd_user_kernel_regime_winners_differ_keys{{kernel="{kernel}"}} 7.0' in text
    assert 'gpuwatchd_added_workloads{state="defined"} 300.0' in text
    assert 'gpuwatchd_added_workloads{state="tuned"} 250.0' in text
    assert 'gpuwatchd_added_workloads{state="pending"} 50.0' in text
    assert sum(names.values()) < 40


def test_user_kernel_names_are_recognised() -> None:
    name = workload_name(*SOFTMAX, "n_cols=4096;float16")
    assert user_kernel(name) == "user_kernels.softmax.softmax_kernel@abababab"
    assert user_kernel("gemm-bf16-8192") is None


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_the_new_series_pass_promtool() -> None:
    _, text = samples()
    out = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                         text=True)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
