"""Build grafana/gpuwatchd-fleet.json: the fleet dashboard, written as code.

One picture of every gpuwatchd daemon a Prometheus (or Thanos, or a federation) scrapes:
GPU models and driver versions, throttle time per host, hosts whose sustained clock
falls behind their fleet's median for the same GPU model and power limit, tuning
coverage, disagreements between hosts and the work the shared store saved. The
per-host dashboard is grafana/gpuwatchd.json; both are written with the panel builders
of grafana/dashboard_kit.py, so they look and validate alike.

Run ``python3 grafana/build_fleet_dashboard.py`` after editing; a test fails while the
committed JSON differs from what this script writes.
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
    Panel,
    Section,
    bargauge,
    builtin_annotation,
    dashboard,
    datasource_variable,
    inst,
    instance_variable,
    stat,
    state_timeline,
    table,
    target,
    thresholds,
    timeseries,
    write_or_check,
)
from dashboard_kit import render as render_json  # noqa: E402

OUTPUT = HERE / "gpuwatchd-fleet.json"
UID = "gpuwatchd-fleet"
HOST_GPU_LEGEND = "{{instance}} GPU {{gpu}}"
#: The alert's threshold: a GPU under 95% of its group's median is an outlier.
OUTLIER_RATIO = 0.95
#: Groups of fewer GPUs name no outlier (see gpuwatchd/drift/fleet.py MIN_PEERS).
MIN_PEERS = 3
#: Throttle reasons that slow a GPU under load (gpu_idle is not a slowdown).
SLOWDOWN_SEL = 'reason=~"sw_power_cap|sw_thermal_slowdown|hw_thermal_slowdown|hw_slowdown"'
NOT_IDLE_SEL = 'reason!="gpu_idle"'
COMPLETED_SEL = 'status="completed"'


def clock_ratio() -> str:
    """Each GPU's sustained clock as a fraction of its group's fleet median."""
    return (
        f"{inst('gpuwatchd_fleet_sustained_clock_hertz')}\n"
        "  / on (instance, job, gpu, uuid, gpu_model, power_limit_watts)\n"
        f"  {inst('gpuwatchd_fleet_median_sustained_clock_hertz')}"
    )


def outliers() -> str:
    """GPUs under the alert's threshold in groups large enough to judge."""
    return (
        f"(\n  {clock_ratio()}\n) < {OUTLIER_RATIO}\n"
        "and on (instance, job, gpu_model, power_limit_watts)\n"
        f"{inst('gpuwatchd_fleet_peers')} >= {MIN_PEERS}"
    )


# -- the panels -----------------------------------------------------------------------


def inventory_panels() -> list[tuple[Panel, int, int]]:
    info = inst("gpuwatchd_gpu_info")
    return [
        (
            table(
                "GPU models × driver versions",
                "GPUs and hosts per GPU model and driver version across the selected "
                "daemons: winners are shared only between identical stacks, so each row is "
                "a fleet of its own.",
                [
                    target(f"count by (name, driver_version) ({info})", instant=True, table=True),
                    target(
                        "count by (name, driver_version) (\n"
                        f"  count by (instance, name, driver_version) ({info})\n)",
                        instant=True,
                        table=True,
                    ),
                ],
                columns=("name", "driver_version", "Value #A", "Value #B"),
                rename={
                    "name": "GPU model",
                    "driver_version": "driver",
                    "Value #A": "GPUs",
                    "Value #B": "hosts",
                },
                merge=True,
            ),
            12,
            8,
        ),
        (
            table(
                "gpuwatchd versions",
                "Daemons per gpuwatchd version and telemetry backend: a rollout in progress "
                "shows as two rows.",
                [
                    target(
                        f"count by (version, backend) ({inst('gpuwatchd_build_info')})",
                        instant=True,
                        table=True,
                    )
                ],
                columns=("version", "backend", "Value"),
                rename={"Value": "daemons"},
            ),
            6,
            8,
        ),
        (
            stat(
                "Daemons and GPUs",
                "gpuwatchd daemons answering scrapes, and the GPUs they watch.",
                [
                    target(f"count({inst('gpuwatchd_build_info')})", "daemons", instant=True),
                    target(f"count({inst('gpuwatchd_gpu_info')})", "GPUs", instant=True),
                ],
                "short",
                [("blue", None)],
            ),
            6,
            8,
        ),
    ]


def clock_panels() -> list[tuple[Panel, int, int]]:
    ratio = timeseries(
        "Sustained clock vs fleet median",
        "Each GPU's learned sustained-load SM clock as a fraction of the median of the "
        "fleet's GPUs of the same model and power limit. Under the dashed 95% line for "
        "15 minutes (in a group of 3 or more GPUs) raises GpuwatchdHostSlowerThanFleet: "
        "check that host's cooling, fans and power limit.",
        [target(clock_ratio(), HOST_GPU_LEGEND)],
        "percentunit",
    )
    defaults = ratio["fieldConfig"]["defaults"]
    defaults["thresholds"] = thresholds(("red", None), ("transparent", OUTLIER_RATIO))
    defaults["custom"]["thresholdsStyle"] = {"mode": "dashed"}
    return [
        (ratio, 12, 9),
        (
            table(
                "Outlier hosts",
                "GPUs whose sustained clock is more than 5% under their fleet's median for "
                "the same GPU model and power limit, now (groups of 3 or more GPUs only). "
                "Empty is good.",
                [target(outliers(), instant=True, table=True)],
                columns=("instance", "gpu", "uuid", "gpu_model", "power_limit_watts", "Value"),
                rename={
                    "gpu_model": "GPU model",
                    "power_limit_watts": "power limit W",
                    "Value": "of fleet median",
                },
                units={"of fleet median": "percentunit"},
            ),
            12,
            9,
        ),
        (
            timeseries(
                "Sustained clock per GPU and fleet median",
                "Learned sustained-load SM clock of every GPU (solid) and the fleet's median "
                "for each GPU model and power limit (dashed).",
                [
                    target(
                        inst("gpuwatchd_fleet_sustained_clock_hertz"),
                        f"{HOST_GPU_LEGEND} ({{{{gpu_model}}}}, {{{{power_limit_watts}}}} W)",
                    ),
                    target(
                        "max by (gpu_model, power_limit_watts) "
                        f"({inst('gpuwatchd_fleet_median_sustained_clock_hertz')})",
                        "median {{gpu_model}}, {{power_limit_watts}} W",
                    ),
                ],
                "hertz",
                limits={"B": "blue"},
            ),
            16,
            8,
        ),
        (
            bargauge(
                "GPUs per model and power limit",
                "GPUs in each fleet median. Outliers are named only from 3 GPUs on.",
                [
                    target(
                        f"max by (gpu_model, power_limit_watts) ({inst('gpuwatchd_fleet_peers')})",
                        "{{gpu_model}}, {{power_limit_watts}} W",
                        instant=True,
                    )
                ],
                "short",
                decimals=0,
            ),
            8,
            8,
        ),
    ]


def throttle_panels() -> list[tuple[Panel, int, int]]:
    seconds = "gpuwatchd_gpu_throttle_seconds_total"
    return [
        (
            bargauge(
                "Throttle time per host in range",
                "Seconds throttled in the selected range, summed over each host's GPUs, by "
                "reason. A host far above its peers under the same jobs runs hot or capped.",
                [
                    target(
                        "sum by (instance, reason) (increase("
                        f"{inst(seconds, NOT_IDLE_SEL)}"
                        "[$__range])) > 0",
                        "{{instance}} {{reason}}",
                        instant=True,
                    )
                ],
                "s",
            ),
            12,
            9,
        ),
        (
            timeseries(
                "Share of time throttled per host",
                "Fraction of time the average GPU of each host spent power-capped or in "
                "thermal slowdown (any of them counts once).",
                [
                    target(
                        "avg by (instance) (max by (instance, gpu) (rate("
                        f"{inst(seconds, SLOWDOWN_SEL)}"
                        "[$__rate_interval])))",
                        "{{instance}}",
                    )
                ],
                "percentunit",
                minimum=0,
                maximum=1,
            ),
            12,
            9,
        ),
    ]


def tuning_panels() -> list[tuple[Panel, int, int]]:
    return [
        (
            table(
                "Tuning coverage",
                "Workloads with a fresh winner in the shared store per GPU model and "
                "software stack (driver, CUDA, torch, Triton, cuDNN): hosts with that stack "
                "run these without tuning them.",
                [
                    target(
                        "max by (gpu_model, versions) "
                        f"({inst('gpuwatchd_fleet_coverage_workloads')})",
                        instant=True,
                        table=True,
                    )
                ],
                columns=("gpu_model", "versions", "Value"),
                rename={"gpu_model": "GPU model", "Value": "workloads"},
            ),
            12,
            8,
        ),
        (
            table(
                "Disagreements",
                "Winners two hosts measured differently beyond noise: every disagreement the "
                "store holds, and those of the last 24 hours (what the alert looks at). The "
                "fleet kept its winner unless it was older than max_winner_age_s. "
                "`gpuwatchd report --fleet` names the hosts.",
                [
                    target(
                        "max by (gpu_model, workload, regime) "
                        f"({inst('gpuwatchd_fleet_disagreements')}) > 0",
                        instant=True,
                        table=True,
                    ),
                    target(
                        "max by (gpu_model, workload, regime) "
                        f"({inst('gpuwatchd_fleet_recent_disagreements')})",
                        instant=True,
                        table=True,
                    ),
                ],
                columns=("gpu_model", "workload", "regime", "Value #A", "Value #B"),
                rename={
                    "gpu_model": "GPU model",
                    "Value #A": "disagreements",
                    "Value #B": "last 24 h",
                },
                merge=True,
            ),
            12,
            8,
        ),
        (
            bargauge(
                "Work the fleet saved in range",
                "Tuning work skipped because another host had measured it (by reason), work "
                "re-measured anyway to verify the fleet, and work left to the host holding "
                "its claim, in the selected range.",
                [
                    target(
                        "sum by (reason) (increase("
                        f"{inst('gpuwatchd_fleet_work_skipped_total')}[$__range]))",
                        "skipped: {{reason}}",
                        instant=True,
                    ),
                    target(
                        f"sum(increase({inst('gpuwatchd_fleet_verified_total')}[$__range]))",
                        "re-measured to verify",
                        instant=True,
                    ),
                    target(
                        "sum(increase("
                        f"{inst('gpuwatchd_fleet_claimed_elsewhere_total')}[$__range]))",
                        "claimed by another host",
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
                "Work skipped per host in range",
                "Tuning work each host skipped in the selected range thanks to the fleet.",
                [
                    target(
                        "sum by (instance) (increase("
                        f"{inst('gpuwatchd_fleet_work_skipped_total')}[$__range]))",
                        "{{instance}}",
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
            bargauge(
                "Tuning sessions per host in range",
                "Completed tuning sessions per host in the selected range: with a shared "
                "store, each workload is tuned by one host, not all of them.",
                [
                    target(
                        "sum by (instance) (increase("
                        f"{inst('gpuwatchd_tune_sessions_total', COMPLETED_SEL)}"
                        "[$__range]))",
                        "{{instance}}",
                        instant=True,
                    )
                ],
                "short",
                decimals=0,
            ),
            8,
            8,
        ),
    ]


def sync_panels() -> list[tuple[Panel, int, int]]:
    return [
        (
            timeseries(
                "Fleet sync age",
                "Seconds since each daemon last read the fleet from the shared store; the "
                "fleet series it exports are that old. It syncs every minute.",
                [target(inst("gpuwatchd_fleet_sync_age_seconds"), "{{instance}}")],
                "s",
                minimum=0,
            ),
            12,
            7,
        ),
        (
            state_timeline(
                "Fleet sync",
                "Whether each daemon's latest sync with the shared store succeeded; while it "
                "fails, its fleet series keep their last values.",
                [target(inst("gpuwatchd_fleet_sync_success"), "{{instance}}")],
                {"0": ("failing", "red"), "1": ("ok", "green")},
            ),
            12,
            7,
        ),
    ]


def sections() -> list[Section]:
    """Rows top to bottom, each with its panels and their (width, height)."""
    return [
        ("Fleet inventory", inventory_panels()),
        ("Sustained clocks across the fleet", clock_panels()),
        ("Throttling per host", throttle_panels()),
        ("Tuning across the fleet", tuning_panels()),
        ("Shared store", sync_panels()),
    ]


def variables() -> list[dict[str, Any]]:
    """The data source and the instance variable of the per-host dashboard (no GPU one)."""
    return [datasource_variable(), instance_variable()]


def build() -> dict[str, Any]:
    """The whole dashboard as a JSON-ready dict."""
    return dashboard(
        uid=UID,
        title="gpuwatchd fleet",
        description=(
            "gpuwatchd fleet: GPU models and driver versions, throttle time per host, hosts "
            "whose sustained clock falls behind their fleet's median, tuning coverage, "
            "disagreements and the work the shared store saved."
        ),
        sections=sections(),
        annotations=[builtin_annotation()],
        variables=variables(),
        tags=["gpu", "nvidia", "gpuwatchd", "fleet"],
        refresh="1m",
        time_from="now-24h",
        links=[
            {
                "asDropdown": False,
                "icon": "dashboard",
                "includeVars": True,
                "keepTime": True,
                "tags": ["gpuwatchd"],
                "targetBlank": False,
                "title": "gpuwatchd dashboards",
                "type": "dashboards",
            }
        ],
    )


def render() -> str:
    """The file's exact text."""
    return render_json(build())


def main(argv: Sequence[str]) -> int:
    """Write the dashboard (``--check``: only say whether the committed file is current)."""
    return write_or_check(OUTPUT, render(), Path(__file__).name, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
