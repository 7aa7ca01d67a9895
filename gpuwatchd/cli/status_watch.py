"""``gpuwatchd status --watch``: the daemon's state as a live table, until q or Ctrl-C.

Each refresh fetches ``/api/v1/state`` and draws, with rich, one row per GPU (gate,
temperature, power, SM clock, utilisation, throttle reasons in short) and one row per
compute process (PID, user, device memory, the Kubernetes pod where the daemon knows
it), within :data:`WIDTH` columns: a longer cell ends in an ellipsis. A daemon that
stops answering shows as one line over the last table until it answers again.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import select
import sys
import termios
import time
import tty
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from rich import box
from rich.console import Console, Group, RenderableType
from rich.constrain import Constrain
from rich.live import Live
from rich.table import Table
from rich.text import Text

from gpuwatchd.api.gpu_state import GpuState, ProcessState
from gpuwatchd.api.state import StateDocument, parse_state
from gpuwatchd.cli.common import CliError
from gpuwatchd.cli.state_text import gpu_health, tuning_line

#: The widest the view gets, whatever the terminal: it fits a 100-column pane.
WIDTH = 100
#: Throttle reasons as the GPU rows spell them (NVML's names are too long for a cell).
SHORT_REASONS: dict[str, str] = {
    "gpu_idle": "idle",
    "applications_clocks_setting": "app-clk",
    "sw_power_cap": "pwr-cap",
    "hw_slowdown": "hw-slow",
    "sync_boost": "sync",
    "sw_thermal_slowdown": "sw-therm",
    "hw_thermal_slowdown": "hw-therm",
    "hw_power_brake_slowdown": "pwr-brake",
    "display_clock_setting": "disp-clk",
}
_GIB = float(2**30)


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else f"{value:{spec}}"


def _reasons(gpu: GpuState) -> str:
    if gpu.throttle_reasons is None:
        return "-"
    return ",".join(SHORT_REASONS.get(r, r) for r in gpu.throttle_reasons) or "none"


def _gpu_table(gpus: tuple[GpuState, ...]) -> Table:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, header_style="bold")
    for name, justify in (
        ("GPU", "right"),
        ("NAME", "left"),
        ("GATE", "left"),
        ("TEMP", "right"),
        ("POWER", "right"),
        ("SM MHz", "right"),
        ("UTIL", "right"),
        ("THROTTLE", "left"),
    ):
        table.add_column(name, justify=justify, no_wrap=True, overflow="ellipsis")  # type: ignore[arg-type]
    table.columns[1].max_width = 24
    table.columns[-1].no_wrap = False  # the one that gives way when a row is too wide
    for gpu in gpus:
        health = gpu_health(gpu)
        gate = f"{gpu.state} ({health})" if health else gpu.state
        table.add_row(
            str(gpu.gpu),
            gpu.name or "-",
            Text(gate, style="green" if gpu.open else "yellow"),
            _num(gpu.temp_c, ".0f") + ("C" if gpu.temp_c is not None else ""),
            _num(gpu.power_w, ".0f") + ("W" if gpu.power_w is not None else ""),
            _num(gpu.sm_clock_mhz, ".0f"),
            "-" if gpu.util_gpu_ratio is None else f"{gpu.util_gpu_ratio:.0%}",
            _reasons(gpu),
        )
    return table


def _why_lines(gpus: tuple[GpuState, ...]) -> list[Text]:
    """Why each shut gate is shut, one line per GPU, cut to the view's width."""
    lines = []
    for gpu in gpus:
        if not gpu.open and gpu.reasons:
            why = Text(f"GPU {gpu.gpu} {gpu.state}: {'; '.join(gpu.reasons)}", style="dim")
            why.no_wrap, why.overflow = True, "ellipsis"
            lines.append(why)
    return lines


def _pod(proc: ProcessState) -> str:
    if proc.pod is None:
        return "-"
    where = f"{proc.namespace}/{proc.pod}" if proc.namespace else proc.pod
    return f"{where}/{proc.container}" if proc.container else where


def _process_table(gpus: tuple[GpuState, ...]) -> Table | Text:
    rows = [(gpu.gpu, proc) for gpu in gpus for proc in gpu.processes]
    if not rows:
        return Text("no compute processes", style="dim")
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, header_style="bold")
    table.add_column("GPU", justify="right", no_wrap=True)
    table.add_column("PID", justify="right", no_wrap=True)
    table.add_column("USER", overflow="ellipsis", max_width=16)
    table.add_column("GPU MEM", justify="right", no_wrap=True)
    table.add_column("POD", overflow="ellipsis")  # the one that gives way to fit the width
    for gpu, proc in rows:
        used = proc.used_memory_bytes
        table.add_row(
            str(gpu),
            str(proc.pid),
            proc.user or "-",
            "-" if used is None else f"{used / _GIB:.1f} GiB",
            _pod(proc),
        )
    return table


def render(
    state: StateDocument | None, error: str | None, interval: float, now: dt.datetime
) -> RenderableType:
    """The whole view: banner, GPU rows, process rows, the tuner, and what keys do."""
    parts: list[RenderableType] = []
    banner = "gpuwatchd"
    if state is not None and state.daemon is not None:
        banner += f" {state.daemon.version or '?'} · backend {state.daemon.backend or '?'}"
    parts.append(Text(f"{banner} · {now:%H:%M:%S} · every {interval:g} s · q quits", style="bold"))
    if error is not None:
        parts.append(Text(error, style="red"))
    if state is not None:
        parts.append(_gpu_table(state.gpus) if state.gpus else Text("(no GPUs)"))
        parts.extend(_why_lines(state.gpus))
        parts.append(_process_table(state.gpus))
        if state.tuning is not None:
            parts.append(Text(tuning_line(state.tuning)))
    return Constrain(Group(*parts), width=WIDTH)


class Keys:
    """The terminal's keys, read one at a time without echo while the view runs."""

    def __init__(self, stream: TextIO = sys.stdin) -> None:
        self._stream = stream
        self._fd: int | None = None
        self._saved: Any = None

    @contextlib.contextmanager
    def raw(self) -> Iterator[Keys]:
        """cbreak mode on a terminal (Ctrl-C still interrupts); nothing on a pipe."""
        try:
            fd = self._stream.fileno()
        except (AttributeError, OSError, ValueError):
            fd = -1
        if fd < 0 or not os.isatty(fd):
            yield self
            return
        self._fd, self._saved = fd, termios.tcgetattr(fd)
        try:
            tty.setcbreak(fd)
            yield self
        finally:
            termios.tcsetattr(fd, termios.TCSADRAIN, self._saved)
            self._fd = None

    def quit_within(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds; True when q (or Q) was pressed meanwhile."""
        if self._fd is None:
            select.select([], [], [], timeout)
            return False
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self._fd], [], [], left)
            if not ready:
                return False
            key = os.read(self._fd, 1)
            if key in (b"q", b"Q") or not key:
                return True
        return False


def watch(
    fetch: Callable[[], dict[str, Any]],
    interval: float,
    console: Console | None = None,
    keys: Keys | None = None,
) -> int:
    """Redraw every ``interval`` seconds until q or Ctrl-C; exit status 0.

    The first fetch's error ends the command (no daemon to watch); a later one is shown
    above the last table until the daemon answers again.
    """
    console = console or Console()
    keys = keys or Keys()
    state: StateDocument | None = parse_state(fetch())
    try:
        with keys.raw(), Live(console=console, screen=True, auto_refresh=False) as live:
            error = None
            while True:
                live.update(render(state, error, interval, dt.datetime.now()), refresh=True)
                if keys.quit_within(interval):
                    return 0
                try:
                    state, error = parse_state(fetch()), None
                except CliError as exc:
                    error = str(exc)
    except KeyboardInterrupt:
        return 0
