"""Build grafana/gpuwatchd.json: the Grafana dashboard, written as code.

Hand-written rather than grafana-foundation-sdk: the SDK is generated per Grafana release
(a 300 KB wheel whose builders emit this same JSON), while ~400 lines of stdlib Python
keep the dashboard plain data that tests/test_dashboard.py checks against the metric
catalogue and tests/test_prometheus_e2e.py runs against a real Prometheus.

Run ``python3 grafana/build_dashboard.py`` after editing; a test fails while the
committed JSON differs from what this script writes. The panel, query, layout and
file-writing helpers it shares with the fleet dashboard are in grafana/dashboard_kit.py.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # dashboard_kit.py sits beside this script
    sys.path.insert(0, str(HERE))

from dashboard_kit import (  # noqa: E402
    DATASOURCE,
    GPU_LEGEND,
    INSTANCE_SEL,
    Panel,
    Section,
    bargauge,
    builtin_annotation,
    dashboard,
    datasource_variable,
    inst,
    instance_variable,
    label_values_variable,
    stat,
    state_timeline,
    table,
    target,
    timeseries,
    value_mappings,
    write_or_check,
)
from dashboard_kit import render as render_json  # noqa: E402

OUTPUT = HERE / "gpuwatchd.json"
GPU_SEL = 'instance=~"$instance", gpu=~"$gpu"'


#: Gate states in the order of their codes on the gate timeline (1 = cool_stable).
GATE_CODES = (
    ("cool_stable", "green"),
    ("warming", "yellow"),
    ("throttled", "orange"),
    ("busy", "purple"),
    ("unavailable", "red"),
)


def gpu(metric: str) -> str:
    """``metric`` filtered by both dashboard variables."""
    return f"{metric}{{{GPU_SEL}}}"


# -- the panels -----------------------------------------------------------------------


def _gate_state_query() -> str:
    lines = [
        f'gpuwatchd_gate_state{{{GPU_SEL}, state="{state}"}} * {code}'
        for code, (state, _) in enumerate(GATE_CODES, 1)
    ]
    return "sum without (state) (\n    " + "\n  or ".join(lines) + "\n)"


def _winners_query() -> str:
    joined = (
        f"(gpuwatchd_winner_seconds{{{INSTANCE_SEL}}}\n"
        "  * on (instance, job, gpu_model, workload, regime) group_left (candidate, tie)\n"
        f"  gpuwatchd_winner_info{{{INSTANCE_SEL}}})"
    )
    differ = f"(gpuwatchd_regime_winners_differ{{{INSTANCE_SEL}}} == 1)"
    branches = [
        f"label_replace(\n  {joined}\n  {op} on (instance, job, gpu_model, workload) {differ},\n"
        f'  "winners_differ", "{flag}", "", ""\n)'
        for op, flag in (("and", "yes"), ("unless", "no"))
    ]
    return "\nor\n".join(branches)


def tuning_seen(window: str, window_s: str) -> str:
    """1 where a worker ran or a session completed within ``window``, else 0, per GPU.

    A simulated session lasts well under a second, less than a scrape interval, so
    ``tune_running`` alone may never be scraped at 1; the GPU's last-tune time (the unix
    time a session completed) falling within the window shows the session all the same,
    its first ever included (when the series only appears). ``window_s``: the window in
    seconds, as a PromQL expression.
    """
    return (
        "max by (instance, gpu) (\n"
        f"  label_replace(max_over_time({gpu('gpuwatchd_tune_running')}[{window}]),"
        ' "seen", "running", "", "")\n'
        f"  or label_replace({gpu('gpuwatchd_last_tune_timestamp_seconds')}"
        f' > bool (time() - {window_s}), "seen", "ended", "", "")\n'
        ")"
    )


def telemetry_panels() -> list[tuple[Panel, int, int]]:
    return [
        (
            timeseries(
                "Temperature vs slowdown threshold",
                "GPU core temperature (and HBM temperature where the GPU reports it); the "
                "dashed line is the temperature at which the GPU starts thermal slowdown.",
                [
                    target(gpu("gpuwatchd_gpu_temperature_celsius")),
                    target(
                        gpu("gpuwatchd_gpu_slowdown_temperature_celsius"),
                        f"{GPU_LEGEND} slowdown",
                    ),
                    target(gpu("gpuwatchd_gpu_memory_temperature_celsius"), f"{GPU_LEGEND} HBM"),
                ],
                "celsius",
                limits={"B": "red"},
            ),
            12,
            8,
        ),
        (
            timeseries(
                "Power vs limit",
                "Board power draw; the dashed line is the enforced power limit. Draw at the "
                "limit means sw_power_cap.",
                [
                    target(gpu("gpuwatchd_gpu_power_watts")),
                    target(gpu("gpuwatchd_gpu_power_limit_watts"), f"{GPU_LEGEND} limit"),
                ],
                "watt",
                limits={"B": "orange"},
            ),
            12,
            8,
        ),
        (
            timeseries(
                "SM clock vs max",
                "Current SM clock; the dashed line is the maximum. A clock under the max with "
                "load means throttling.",
                [
                    target(gpu("gpuwatchd_gpu_sm_clock_hertz")),
                    target(gpu("gpuwatchd_gpu_max_sm_clock_hertz"), f"{GPU_LEGEND} max"),
                ],
                "hertz",
                limits={"B": "blue"},
            ),
            12,
            8,
        ),
        (
            timeseries(
                "Utilization",
                "Fraction of time a kernel ran on the GPU (solid) and the memory controller "
                "was busy. Context for the clocks: throttling only matters under load.",
                [
                    target(gpu("gpuwatchd_gpu_utilization_ratio")),
                    target(gpu("gpuwatchd_gpu_memory_utilization_ratio"), f"{GPU_LEGEND} memory"),
                ],
                "percentunit",
                minimum=0,
                maximum=1,
            ),
            12,
            8,
        ),
    ]


def memory_energy_panels() -> list[tuple[Panel, int, int]]:
    return [
        (
            timeseries(
                "GPU memory used vs total",
                "Framebuffer memory in use; the dashed line is the GPU's total.",
                [
                    target(gpu("gpuwatchd_gpu_memory_used_bytes")),
                    target(gpu("gpuwatchd_gpu_memory_total_bytes"), f"{GPU_LEGEND} total"),
                ],
                "bytes",
                limits={"B": "purple"},
                minimum=0,
            ),
            12,
            8,
        ),
        (
            timeseries(
                "Memory per compute process",
                "GPU memory of the compute processes using the most (gpuwatchd exports the "
                "top 8 per GPU).",
                [
                    target(
                        gpu("gpuwatchd_gpu_process_memory_bytes"), f"{GPU_LEGEND} pid {{{{pid}}}}"
                    )
                ],
                "bytes",
                minimum=0,
            ),
            12,
            8,
        ),
        (
            timeseries(
                "Compute processes",
                "Processes holding a CUDA context on the GPU; any that is not gpuwatchd's "
                "own worker shuts the gate (busy).",
                [target(gpu("gpuwatchd_gpu_compute_processes"))],
                "short",
                minimum=0,
            ),
            16,
            8,
        ),
        (
            bargauge(
                "Energy in range",
                "Energy each GPU drew over the selected time range (the NVML total energy "
                "counter, read off the fast poll).",
                [
                    target(
                        f"increase({gpu('gpuwatchd_gpu_energy_joules_total')}[$__range])",
                        instant=True,
                    )
                ],
                "joule",
            ),
            8,
            8,
        ),
    ]


def health_panels() -> list[tuple[Panel, int, int]]:
    return [
        (
            bargauge(
                "XID errors in range",
                "XID errors the driver reported in the selected range: all codes per GPU "
                "(0 while none has occurred), then by XID code (e.g. 79: fell off the bus, "
                "48: double-bit ECC, 13/31/43: application faults).",
                [
                    target(
                        "sum by (instance, gpu) (increase("
                        f"{gpu('gpuwatchd_gpu_xid_events_total')}[$__range]))",
                        f"{GPU_LEGEND} all XIDs",
                        instant=True,
                    ),
                    target(
                        "sum by (instance, gpu, xid) (increase("
                        f"{gpu('gpuwatchd_gpu_xid_errors_total')}[$__range]))",
                        f"{GPU_LEGEND} XID {{{{xid}}}}",
                        instant=True,
                    ),
                ],
                "short",
                decimals=0,
            ),
            8,
            8,
        ),
        (
            bargauge(
                "ECC errors in range",
                "ECC errors in GPU memory counted in the selected range (the volatile "
                "counters), corrected (single-bit) and uncorrected (double-bit). Absent on "
                "GPUs without ECC.",
                [
                    target(
                        "increase(gpuwatchd_gpu_ecc_errors_total"
                        f'{{{GPU_SEL}, scope="volatile"}}[$__range])',
                        f"{GPU_LEGEND} {{{{type}}}}",
                        instant=True,
                    )
                ],
                "short",
                decimals=0,
            ),
            8,
            8,
        ),
        (
            timeseries(
                "Remapped rows",
                "HBM rows remapped over the GPU's life, by the kind of error that caused "
                "it; a pending remap (1) needs a GPU reset, a failed one (1) means the GPU "
                "should be replaced.",
                [
                    target(gpu("gpuwatchd_gpu_remapped_rows"), f"{GPU_LEGEND} {{{{cause}}}}"),
                    target(gpu("gpuwatchd_gpu_row_remap_pending"), f"{GPU_LEGEND} pending"),
                    target(gpu("gpuwatchd_gpu_row_remap_failed"), f"{GPU_LEGEND} failed"),
                ],
                "short",
                minimum=0,
            ),
            8,
            8,
        ),
        (
            timeseries(
                "PCIe throughput",
                "Bytes per second over PCIe, to (TX) and from (RX) the GPU.",
                [
                    target(
                        f"rate({gpu('gpuwatchd_gpu_pcie_tx_bytes_total')}[$__rate_interval])",
                        f"{GPU_LEGEND} TX",
                    ),
                    target(
                        f"rate({gpu('gpuwatchd_gpu_pcie_rx_bytes_total')}[$__rate_interval])",
                        f"{GPU_LEGEND} RX",
                    ),
                ],
                "Bps",
                minimum=0,
            ),
            12,
            8,
        ),
        (
            timeseries(
                "PCIe replays",
                "PCIe packets replayed per second: a rising rate points at a bad link or riser.",
                [
                    target(
                        f"rate({gpu('gpuwatchd_gpu_pcie_replay_errors_total')}[$__rate_interval])"
                    )
                ],
                "short",
                minimum=0,
            ),
            12,
            8,
        ),
        (
            timeseries(
                "NVLink throughput",
                "Bytes per second over all NVLinks of the GPU. Absent on GPUs without NVLink.",
                [
                    target(
                        f"rate({gpu('gpuwatchd_gpu_nvlink_tx_bytes_total')}[$__rate_interval])",
                        f"{GPU_LEGEND} TX",
                    ),
                    target(
                        f"rate({gpu('gpuwatchd_gpu_nvlink_rx_bytes_total')}[$__rate_interval])",
                        f"{GPU_LEGEND} RX",
                    ),
                ],
                "Bps",
                minimum=0,
            ),
            16,
            8,
        ),
        (
            timeseries(
                "Fan speed",
                "Fan speed as a fraction of its maximum. Absent on passively cooled GPUs "
                "(most data-centre boards).",
                [target(gpu("gpuwatchd_gpu_fan_speed_ratio"))],
                "percentunit",
                minimum=0,
                maximum=1,
            ),
            8,
            8,
        ),
    ]


def gate_panels() -> list[tuple[Panel, int, int]]:
    return [
        (
            state_timeline(
                "Throttle reasons",
                "NVML clocks-event (throttle) reasons per GPU. sw_power_cap: the power limit; "
                "*_thermal_slowdown and hw_slowdown: heat.",
                [target(gpu("gpuwatchd_gpu_throttle_active"), f"{GPU_LEGEND} {{{{reason}}}}")],
                {"0": ("off", "transparent"), "1": ("active", "red")},
            ),
            18,
            10,
        ),
        (
            bargauge(
                "Time throttled in range",
                "Seconds each throttle reason was active in the selected range, per GPU "
                "(the reasons' accumulated time, so no short episode is lost between "
                "scrapes).",
                [
                    target(
                        "sum by (instance, gpu, reason) (increase("
                        f"{gpu('gpuwatchd_gpu_throttle_seconds_total')}[$__range])) > 0",
                        f"{GPU_LEGEND} {{{{reason}}}}",
                        instant=True,
                    )
                ],
                "s",
            ),
            6,
            10,
        ),
        (
            state_timeline(
                "Gate state",
                "Tuning gate per GPU. Only cool_stable (idle, cool and stable) lets gated "
                "tuning run.",
                [target(_gate_state_query())],
                {str(code): state for code, state in enumerate(GATE_CODES, 1)},
            ),
            18,
            7,
        ),
        (
            bargauge(
                "Gate open (share of range)",
                "Fraction of the selected time range each GPU's gate was open (cool_stable).",
                [target(f"avg_over_time({gpu('gpuwatchd_gate_open')}[$__range])", instant=True)],
                "percentunit",
                maximum=1,
            ),
            6,
            7,
        ),
    ]


def tuning_panels() -> list[tuple[Panel, int, int]]:
    return [
        (
            state_timeline(
                "Tuning running",
                "When a tuning worker ran on each GPU, or a session completed there, within "
                "the rate interval: a session shorter than a scrape still shows.",
                [target(tuning_seen("$__rate_interval", "$__rate_interval_ms / 1000"))],
                {"0": ("idle", "transparent"), "1": ("tuning", "blue")},
            ),
            16,
            6,
        ),
        (
            timeseries(
                "Workloads waiting for the gate",
                "Tuning work queued per GPU (first tuning, re-tunes, manual requests), "
                "waiting for its gate to open.",
                [target(gpu("gpuwatchd_tune_pending_workloads"))],
                "short",
                minimum=0,
            ),
            8,
            6,
        ),
        (
            bargauge(
                "Tune sessions in range",
                "Tuning sessions this daemon ran that ended in the selected range, by status "
                "(completed, failed, preempted, deferred).",
                [
                    target(
                        "sum by (status) (increase("
                        f"{inst('gpuwatchd_tune_sessions_total')}[$__range]))",
                        "{{status}}",
                        instant=True,
                    )
                ],
                "short",
                decimals=0,
            ),
            6,
            8,
        ),
        (
            bargauge(
                "Tune deferrals in range",
                "Tune jobs deferred in the selected range, by reason (gate shut, outside "
                "the time window, ...).",
                [
                    target(
                        "sum by (reason) (increase("
                        f"{inst('gpuwatchd_tune_deferred_total')}[$__range]))",
                        "{{reason}}",
                        instant=True,
                    )
                ],
                "short",
                decimals=0,
            ),
            6,
            8,
        ),
        (
            stat(
                "Time since last tune",
                "Time since the last completed tuning session on each GPU.",
                [
                    target(
                        f"time() - {gpu('gpuwatchd_last_tune_timestamp_seconds')}",
                        instant=True,
                    )
                ],
                "s",
                [("green", None), ("yellow", 604800)],
            ),
            6,
            8,
        ),
        (
            stat(
                "Tuning worker ready",
                "1 when the tuning worker's Python imports what the tuning work needs; 0 "
                "with the reason: no_torch or no_triton (install gpuwatchd[tune] there or set "
                "[tuning] worker_python), probe_failed, checking, disabled.",
                [target(inst("gpuwatchd_tuning_ready"), "{{instance}}: {{reason}}", instant=True)],
                "short",
                [("red", None), ("green", 1)],
            ),
            6,
            8,
        ),
        (
            stat(
                "Tuning store up and writable",
                "1 when the tuning store answered the daemon's last call, and (writable) when "
                "the daemon may write it. At 0 monitoring goes on and tuning waits; "
                "/api/v1/winners serves its last known winners, marked stale. Not writable: "
                "the store's schema is newer than this gpuwatchd and not compatible, or another "
                "machine holds this host name and machine id (the log says which). Session ends "
                "waiting: sessions whose end the store could not take yet (an outage, a lock "
                "held past every retry), kept in the state directory and recorded when it can.",
                [
                    target(inst("gpuwatchd_store_up"), "{{instance}}", instant=True),
                    target(inst("gpuwatchd_store_writable"), "{{instance}} writable", instant=True),
                    target(
                        inst("gpuwatchd_store_pending_results"),
                        "{{instance}} session ends waiting",
                        instant=True,
                    ),
                ],
                "short",
                [("red", None), ("green", 1)],
                steps_of={"C": [("green", None), ("orange", 1)]},  # none waiting is good
            ),
            6,
            8,
        ),
        (_winners_table(), 24, 9),
    ]


def _winners_table() -> Panel:
    return table(
        "Winners per regime",
        "The winning candidate of each workload in each thermal regime and its time per "
        "call. 'winners differ' is yes when the unthrottled and the sustained regime picked "
        "different candidates.",
        [target(_winners_query(), "__auto", instant=True, table=True)],
        columns=("instance", "workload", "regime", "candidate", "Value", "winners_differ"),
        rename={"Value": "time per call", "winners_differ": "winners differ"},
        overrides=[
            {
                "matcher": {"id": "byName", "options": "time per call"},
                "properties": [{"id": "unit", "value": "s"}, {"id": "decimals", "value": 3}],
            },
            {
                "matcher": {"id": "byName", "options": "winners differ"},
                "properties": [
                    {
                        "id": "mappings",
                        "value": value_mappings(
                            {"yes": ("DIFFER", "orange"), "no": ("same", "green")}
                        ),
                    },
                    {"id": "custom.cellOptions", "value": {"type": "color-background"}},
                ],
            },
        ],
        sort_by="workload",
    )


def drift_panels() -> list[tuple[Panel, int, int]]:
    return [
        (
            timeseries(
                "Clock drift vs winners' clock",
                "Signed relative difference between the sustained-load SM clock now and the "
                "clock the current winners were measured at. Beyond ±3% for long, a re-tune "
                "is scheduled. Shown once the GPU has winners and the daemon has seen a few "
                "minutes of sustained load (drift.settle_s + drift.min_load_s).",
                [target(gpu("gpuwatchd_clock_drift_ratio"))],
                "percentunit",
            ),
            16,
            8,
        ),
        (
            state_timeline(
                "Re-tune pending",
                "Re-tunes waiting for the next open gate, by trigger (never tuned, clock "
                "drift, power limit, versions, age).",
                [target(gpu("gpuwatchd_retune_pending"), f"{GPU_LEGEND} {{{{reason}}}}")],
                {"0": ("no", "transparent"), "1": ("pending", "orange")},
            ),
            8,
            8,
        ),
    ]


def health_of_gpuwatchd_panels() -> list[tuple[Panel, int, int]]:
    poll_state = (
        f"(gpuwatchd_gpu_lost{{{GPU_SEL}}} == 1) * 3\n"
        f"or (gpuwatchd_poll_stalled{{{GPU_SEL}}} == 1) * 2\n"
        f"or (gpuwatchd_poll_success{{{GPU_SEL}}} == 0) + 1\n"
        f"or gpuwatchd_poll_success{{{GPU_SEL}}} * 0"
    )
    stamp = gpu("gpuwatchd_last_poll_timestamp_seconds")
    return [
        (
            state_timeline(
                "Poll state",
                "Telemetry polling per GPU: ok, failing (the last poll failed), stalled (a "
                "read hung for more than two periods) or lost (fell off the bus).",
                [target(poll_state)],
                {
                    "0": ("ok", "green"),
                    "1": ("failing", "orange"),
                    "2": ("stalled", "red"),
                    "3": ("lost", "dark-red"),
                },
            ),
            12,
            7,
        ),
        (
            timeseries(
                "Age of last successful poll",
                "How old the last successful poll was when Prometheus scraped; the stale "
                "alert fires above 60 s.",
                [target(f"timestamp({stamp}) - {stamp}")],
                "s",
                minimum=0,
            ),
            12,
            7,
        ),
        (
            timeseries(
                "Poll duration",
                "Wall time of the last completed telemetry read per GPU.",
                [target(gpu("gpuwatchd_poll_duration_seconds"))],
                "s",
            ),
            6,
            7,
        ),
        (
            timeseries(
                "Field read errors",
                "NVML reads of one field that failed per second (only that field's series "
                "is missing meanwhile), by field.",
                [
                    target(
                        f"rate({gpu('gpuwatchd_gpu_field_errors_total')}[$__rate_interval])",
                        f"{GPU_LEGEND} {{{{field}}}}",
                    )
                ],
                "short",
                minimum=0,
            ),
            6,
            7,
        ),
        (
            state_timeline(
                "Scrape collectors",
                "Whether each gpuwatchd sub-collector (gpu, tuning, ...) succeeded in the "
                "scrape; a failing one drops only its own metrics.",
                [
                    target(
                        inst("gpuwatchd_scrape_collector_success"),
                        "{{instance}} {{collector}}",
                    )
                ],
                {"0": ("failing", "red"), "1": ("ok", "green")},
            ),
            6,
            7,
        ),
        (
            timeseries(
                "Scrape collector duration",
                "Time each gpuwatchd sub-collector took during the scrape.",
                [
                    target(
                        inst("gpuwatchd_scrape_collector_duration_seconds"),
                        "{{instance}} {{collector}}",
                    )
                ],
                "s",
            ),
            6,
            7,
        ),
    ]


def sections() -> list[Section]:
    """Rows top to bottom, each with its panels and their (width, height)."""
    return [
        ("Temperature, power and clocks", telemetry_panels()),
        ("Memory and energy", memory_energy_panels()),
        ("Throttling and gate", gate_panels()),
        ("Tuning", tuning_panels()),
        ("Clock drift", drift_panels()),
        ("GPU health: XID, ECC, PCIe, NVLink, fan", health_panels()),
        ("Collector health", health_of_gpuwatchd_panels()),
    ]


# -- the dashboard --------------------------------------------------------------------


def variables() -> list[dict[str, Any]]:
    """The data source, the daemons and the GPUs on them."""
    return [
        datasource_variable(),
        instance_variable(),
        label_values_variable(
            "gpu",
            "GPU",
            "GPU indices on the selected daemons",
            'label_values(gpuwatchd_gpu_info{instance=~"$instance"}, gpu)',
        ),
    ]


def annotation_list() -> list[dict[str, Any]]:
    """Grafana's own annotations and a mark where a GPU was tuning."""
    return [
        builtin_annotation(),
        {
            "datasource": DATASOURCE,
            "enable": True,
            "hide": False,
            "iconColor": "blue",
            "name": "Tuning",
            "expr": tuning_seen("1m", "60") + " == 1",
            "step": "1m",
            "titleFormat": "Tuning GPU {{gpu}}",
            "textFormat": "{{instance}}",
            "tagKeys": "gpu",
            "useValueForTime": False,
        },
    ]


def build() -> dict[str, Any]:
    """The whole dashboard as a JSON-ready dict."""
    return dashboard(
        uid="gpuwatchd",
        title="gpuwatchd",
        description=(
            "gpuwatchd: GPU temperature, power, clocks, memory, energy and health (XID, "
            "ECC, PCIe, NVLink), throttling, the tuning gate, gated tuning and its winners "
            "per thermal regime, clock drift and the daemon's own health."
        ),
        sections=sections(),
        annotations=annotation_list(),
        variables=variables(),
        tags=["gpu", "nvidia", "gpuwatchd"],
        refresh="30s",
        time_from="now-6h",
    )


def render() -> str:
    """The file's exact text."""
    return render_json(build())


def main(argv: Sequence[str]) -> int:
    """Write the dashboard (``--check``: only say whether the committed file is current)."""
    return write_or_check(OUTPUT, render(), "grafana/build_dashboard.py", argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
