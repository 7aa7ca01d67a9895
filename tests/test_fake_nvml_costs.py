"""The costed NVML fake the daemon-cost benches run on: each call lasts what the table says,
injected faults still work, and it refuses to count calls it no longer counts."""

from __future__ import annotations

import time

import pynvml  # type: ignore[import-untyped]
import pytest
from fakes_nvml import CallCost, FakeNvml


def test_a_costed_call_lasts_its_cost_and_faults_still_apply() -> None:
    fake = FakeNvml(1, costs={"nvmlDeviceGetPowerUsage": CallCost(3000.0, 1000.0)})
    fake.nvmlInit()
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    started = time.perf_counter()
    assert fake.nvmlDeviceGetPowerUsage(handle) > 0
    assert time.perf_counter() - started >= 0.003
    fake.fail("nvmlDeviceGetPowerUsage", pynvml.NVML_ERROR_UNKNOWN, times=1)
    with pytest.raises(pynvml.NVMLError):
        fake.nvmlDeviceGetPowerUsage(handle)
    assert fake.nvmlDeviceGetPowerUsage(handle) > 0  # the fault was used up
    with pytest.raises(ValueError, match="does not count"):
        fake.count("nvmlDeviceGetPowerUsage")
