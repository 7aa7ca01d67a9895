"""Faulty inputs for the fault-injection suite, generated from tables.

Shared by ``tests/test_faults_*.py`` (fast, a sample where a case is slow) and
``bench/faults_*.py`` (every case, through the real command line). Each generator
returns ``(name, content)`` pairs with distinct names, so a failure names its case and a
count is a count of distinct inputs. Nothing here imports the exporter or the daemon:
:func:`store_writer_main` runs in a child process that the suite kills.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import typing
from collections.abc import Iterator
from pathlib import Path

from gpuwatchd.config.loader import DaemonConfig
from gpuwatchd.drift.config import DriftConfig
from gpuwatchd.gate import GateConfig
from gpuwatchd.store import SessionMeta, open_store, sqlite_store
from gpuwatchd.telemetry.settings import ReplayConfig
from gpuwatchd.telemetry.sim.settings import SimConfig
from gpuwatchd.tuning.settings import ProtocolConfig, TuningConfig
from gpuwatchd.tuning.types import (
    CandidateStats,
    Regime,
    RegimeResult,
    SessionStatus,
    Versions,
    Workload,
)

#: TOML values no numeric setting may take (``1e400`` reads as infinity).
BAD_NUMBERS = (
    "inf",
    "-inf",
    "nan",
    "1e15",
    "1e400",
    "-1",
    "-1e-9",
    "123456789012345678901234567890",
    '"5"',
    "true",
    "[]",
    "{}",
    "1979-05-27",
)
#: TOML values no true/false setting may take.
BAD_BOOLS = ('"yes"', "1", "[]")
#: TOML values no text setting may take.
BAD_TEXTS = ("5", "[]", "{ a = 1 }", "false")
#: TOML values no list-of-text setting may take.
BAD_LISTS = ('"x"', "[1]", "[[]]", '["nosuch-x"]')
#: Text settings with their own rule: values that break it.
BAD_NAMED = {
    "daemon.backend": ('"cuda"', '""'),
    "daemon.listen": ('"nohost"', '"1.2.3.4:99999"', '":-1"', '"[::1"'),
    "daemon.log_level": ('"loud"', '"INFO "'),
    "daemon.control_group": ('"nosuchgroup-gpuwatchd"', '"a\\u0000b"'),
    "daemon.pod_resources_socket": ('"kubelet.sock"', '"/a\\u0000b"'),
    "daemon.web_config": ('"/nonexistent/web-config.yml"',),
    "sim.scenario": ('"nosuch"', '""'),
    "tuning.windows": ('["25:00-26:00"]', '["22:00"]', '["x-y"]'),
    "tuning.regimes": ("[]", '["cool"]'),
    "tuning.protocol.flush_l2": ('"sometimes"',),
}

#: The sections the generator walks: (TOML table, its dataclass).
SECTIONS: tuple[tuple[str, type], ...] = (
    ("daemon", DaemonConfig),
    ("sim", SimConfig),
    ("replay", ReplayConfig),
    ("gate", GateConfig),
    ("tuning", TuningConfig),
    ("tuning.protocol", ProtocolConfig),
    ("drift", DriftConfig),
)

_GOOD_WORKLOAD = {
    "name": "'w'",
    "op": "'matmul'",
    "shape": "{ m = 64, n = 64, k = 64 }",
    "dtype": "'float32'",
    "families": "['cpu.matmul']",
}
#: ``[[workload]]`` tables that must be refused: one key replaced (None: removed).
BAD_WORKLOADS: dict[str, dict[str, str | None]] = {
    "op-fft": {"op": "'fft'"},
    "op-empty": {"op": "''"},
    "op-number": {"op": "3"},
    "op-not-run-by-family": {"op": "'conv2d'"},
    "shape-negative-m": {"shape": "{ m = -1, n = 64, k = 64 }"},
    "shape-zero-k": {"shape": "{ m = 64, n = 64, k = 0 }"},
    "shape-float-n": {"shape": "{ m = 64, n = 6.5, k = 64 }"},
    "shape-missing-k": {"shape": "{ m = 64, n = 64 }"},
    "shape-unknown-key": {"shape": "{ m = 64, n = 64, k = 64, z = 1 }"},
    "shape-not-table": {"shape": "[64, 64, 64]"},
    "shape-empty": {"shape": "{}"},
    "shape-missing": {"shape": None},
    "families-empty": {"families": "[]"},
    "families-unknown": {"families": "['nosuch.family']"},
    "families-text": {"families": "'cpu.matmul'"},
    "name-missing": {"name": None},
    "name-empty": {"name": "' '"},
    "dtype-missing": {"dtype": None},
    "params-not-table": {"params": "5"},
    "unknown-key": {"colour": "'red'"},
    "conv-channels": {
        "op": "'conv2d'",
        "families": "['cpu.conv2d']",
        "shape": "{ input = [1, 3, 8, 8], weight = [4, 2, 3, 3] }",
    },
    "conv-kernel-too-big": {
        "op": "'conv2d'",
        "families": "['cpu.conv2d']",
        "shape": "{ input = [1, 3, 8, 8], weight = [4, 3, 11, 11] }",
    },
    "conv-stride-zero": {
        "op": "'conv2d'",
        "families": "['cpu.conv2d']",
        "shape": "{ input = [1, 3, 8, 8], weight = [4, 3, 3, 3], stride = 0 }",
    },
    "conv-input-3d": {
        "op": "'conv2d'",
        "families": "['cpu.conv2d']",
        "shape": "{ input = [3, 8, 8], weight = [4, 3, 3, 3] }",
    },
    "bmm-without-batch": {"op": "'bmm'", "families": "['torch.gemm']"},
}

#: Whole files that must be refused: broken TOML, structure, nesting, encoding.
BAD_FILES: dict[str, str | bytes] = {
    "toml-unclosed-table": "[daemon\n",
    "toml-bare-value": "poll_interval_s\n",
    "toml-duplicate-key": "[gate]\nsettle_s = 1\nsettle_s = 2\n",
    "toml-duplicate-table": "[gate]\n[gate]\n",
    "toml-nested-500-arrays": "[daemon]\nlisten = " + "[" * 500 + "]" * 500 + "\n",
    "toml-nested-5000-arrays": "x = " + "[" * 5000 + "]" * 5000 + "\n",
    "toml-nested-inline-tables": "x = " + "{a = " * 600 + "1" + "}" * 600 + "\n",
    "toml-not-utf8": b"[daemon]\nlisten = '\xff\xfe'\n",
    "toml-nul-byte": "[daemon]\nlisten = ':9844'\x00\n",
    "section-unknown": "[nosuch]\nx = 1\n",
    "section-not-table": "daemon = 5\n",
    "section-array-of-tables": "[[daemon]]\nlisten = ':1'\n",
    "key-unknown": "[daemon]\npoll_interval = 0.5\n",
    "protocol-unknown-key": "[tuning.protocol]\nwarmup = 1\n",
    "protocol-not-table": "[tuning]\nprotocol = 5\n",
    "workload-not-array": "workload = 5\n",
    "workload-twice": "".join(
        "[[workload]]\n" + "".join(f"{k} = {v}\n" for k, v in _GOOD_WORKLOAD.items())
        for _ in range(2)
    ),
    "gate-throttled-above-min": "[gate]\nclock_ratio_min = 0.8\nclock_ratio_throttled = 0.9\n",
    "drift-load-over-window": "[drift]\nwindow_s = 60\nmin_load_s = 120\n",
    "protocol-max-below-min": "[tuning.protocol]\nmin_rounds = 5\nmax_rounds = 2\n",
}


def _field_kind(cls: type, name: str) -> str:
    hint = typing.get_type_hints(cls)[name]
    if typing.get_origin(hint) is tuple:
        return "list"
    if hint is bool:
        return "bool"
    if hint in (int, float):
        return "number"
    if hint is str:
        return "text"
    return "other"


def _table(section: str, body: str) -> str:
    return f"[{section}]\n{body}\n"


def bad_configs() -> Iterator[tuple[str, str | bytes]]:
    """Every generated config: a key of every section times the values it must refuse."""
    for section, cls in SECTIONS:
        for f in dataclasses.fields(cls):
            kind = _field_kind(cls, f.name)
            key = f"{section}.{f.name}"
            values = {
                "number": BAD_NUMBERS,
                "bool": BAD_BOOLS,
                "text": BAD_TEXTS,
                "list": BAD_LISTS,
            }.get(kind, ())
            for value in (*values, *BAD_NAMED.get(key, ())):
                yield f"{key}={value}", _table(section, f"{f.name} = {value}")
    for name, changes in BAD_WORKLOADS.items():
        table = {**_GOOD_WORKLOAD, **changes}
        body = "".join(f"{k} = {v}\n" for k, v in table.items() if v is not None)
        yield f"workload:{name}", "[[workload]]\n" + body
    yield from BAD_FILES.items()


def write_case(directory: Path, name: str, content: str | bytes, suffix: str) -> Path:
    """Write one case to a file named after it (names are made file-safe)."""
    safe = "".join(c if c.isalnum() or c in "-_.=" else "_" for c in name)[:120]
    path = directory / f"{safe}{suffix}"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


# -- traces ------------------------------------------------------------------------------------

_DEVICE = {"index": 0, "uuid": "GPU-0", "name": "Sim H200", "max_sm_clock_mhz": 1980}
_HEADER = {"format": "gpuwatchd-trace/1", "device": _DEVICE, "sample_period_s": 0.1}
_SAMPLE = {"t": 0.0, "gpu": 0, "temp_c": 40, "power_w": 120, "sm_clock_mhz": 1980, "reasons": 0}


def _lines(*objs: object) -> str:
    return "".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs)


def _header(**changes: object) -> dict[str, object]:
    return {k: v for k, v in {**_HEADER, **changes}.items() if v is not None}


def _sample(**changes: object) -> dict[str, object]:
    return {k: v for k, v in {**_SAMPLE, **changes}.items() if v is not None}


def bad_traces() -> Iterator[tuple[str, str | bytes]]:
    """Trace files the replay reader must refuse with one line naming file, line and field."""
    ok = _sample(t=1.0)
    yield "empty", ""
    yield "blank-lines-only", "\n  \n\n"
    yield "not-json", "hello\n"
    yield "header-array", _lines([1, 2])
    yield "header-wrong-format", _lines(_header(format="gpuwatchd-trace/9"), ok)
    yield "header-no-device", _lines(_header(device=None), ok)
    yield "header-device-empty", _lines(_header(device=[]), ok)
    yield "header-device-text", _lines(_header(device="h200"), ok)
    yield "header-device-no-uuid", _lines(_header(device={"index": 0, "name": "x"}), ok)
    yield "header-device-index-negative", _lines(_header(device=[{**_DEVICE, "index": -1}]), ok)
    yield "header-device-twice", _lines(_header(device=[_DEVICE, _DEVICE]), ok)
    yield "header-no-period", _lines(_header(sample_period_s=None), ok)
    yield "header-period-zero", _lines(_header(sample_period_s=0), ok)
    yield "header-period-text", _lines(_header(sample_period_s="fast"), ok)
    yield "header-events-object", _lines(_header(events={"t": 1}), ok)
    yield "header-event-not-object", _lines(_header(events=[5]), ok)
    yield "header-event-t-nan", _lines(_header(events=[{"t": float("nan"), "what": "x"}]), ok)
    yield "header-fields-list", _lines(_header(fields=["t"]), ok)
    yield "header-only", _lines(_header())
    yield "header-on-line-2", "\n" + _lines(_header(), ok)
    yield "sample-array", _lines(_header(), [1, 2, 3])
    yield "sample-no-t", _lines(_header(), _sample(t=None))
    yield "sample-t-text", _lines(_header(), _sample(t="0"))
    yield "sample-t-infinity", _lines(_header(), _sample(t=float("inf")))
    yield "sample-gpu-unknown", _lines(_header(), _sample(gpu=7))
    yield "sample-gpu-negative", _lines(_header(), _sample(gpu=-1))
    yield "sample-gpu-float", _lines(_header(), _sample(gpu=0.5))
    yield "sample-temp-text", _lines(_header(), _sample(temp_c="hot"))
    yield "sample-power-negative", _lines(_header(), _sample(power_w=-5))
    yield "sample-reasons-float", _lines(_header(), _sample(reasons=1.5))
    yield "sample-util-over-100", _lines(_header(), _sample(util=150))
    yield "sample-procs-huge", _lines(_header(), _sample(procs=10**9))
    yield "sample-unknown-key", _lines(_header(), _sample(fan=50))
    yield "sample-time-backwards", _lines(_header(), _sample(t=2.0), _sample(t=1.0))
    yield "sample-nested-100k", _lines(_header(), "[" * 100_000 + "]" * 100_000)
    yield "sample-nested-objects", _lines(_header(), '{"a":' * 5000 + "1" + "}" * 5000)
    yield "sample-int-5000-digits", _lines(_header(), '{"t": ' + "9" * 5000 + "}")
    yield "sample-truncated", _lines(_header(), ok) + '{"t": 2, "gpu"'
    yield "second-gpu-no-samples", _lines(_header(device=[_DEVICE, {**_DEVICE, "index": 1}]), ok)
    yield "not-utf8", _lines(_header()).encode() + b"\xff\xfe\xfd\n"
    yield "nul-bytes", _lines(_header()) + "\x00\x00\x00\n"
    yield "random-bytes", bytes(range(256)) * 4


# -- a store writer to kill --------------------------------------------------------------------


def kill_meta() -> SessionMeta:
    """The session the store writer records, over and over."""
    workload = Workload("gemm", "matmul", {"m": 64, "n": 64, "k": 64}, "bf16", ("torch.matmul",))
    return SessionMeta(
        gpu_uuid="GPU-kill",
        gpu_index=0,
        gpu_model="NVIDIA H200",
        backend="sim",
        workloads=(workload,),
        regimes=(Regime.UNTHROTTLED, Regime.SUSTAINED),
        versions=Versions(driver="580.159.04", torch="2.11.0"),
        extra={"pad": "x" * 2000},  # enough bytes per session to span WAL pages
    )


def store_writer_main(path: str) -> None:
    """Write complete sessions to the store at ``path`` forever, printing each committed id.

    A line on stdout means the session's last transaction committed: the parent kills
    this process at random and checks that every printed session survived whole.
    """
    meta = kill_meta()

    def result(regime: Regime) -> RegimeResult:
        cands = tuple(
            CandidateStats(
                name=f"cand{i}",
                family="torch.matmul",
                regime=regime,
                median_s=1e-3 * (1 + i / 10),
                spread=0.01,
                samples=20,
                rejected=0,
                sm_clock_hz=1.98e9,
                power_w=400.0,
                temp_c=50.0,
                energy_j_per_call=0.4,
                reasons=0,
                meta={"config": [i, 2 * i]},
            )
            for i in range(8)
        )
        return RegimeResult("gemm", regime, cands, "cand0", False, 0.09, 0.01)

    results = [result(Regime.UNTHROTTLED), result(Regime.SUSTAINED)]
    store = open_store(path)  # a file or a postgresql:// URL
    print("ready", flush=True)
    while True:
        sid = store.start_session(meta)
        for r in results:
            store.record_result(sid, r)
        store.finish_session(sid, SessionStatus.COMPLETED)
        sys.stdout.write(f"{sid}\n")
        sys.stdout.flush()


def store_holder_main(path: str) -> None:
    """Start one session at ``path``, print its id and keep it running until killed."""
    store = sqlite_store(path)
    print(store.start_session(kill_meta()), flush=True)
    time.sleep(3600)


def writer_command(path: Path, main: str = "store_writer_main") -> list[str]:
    """The command line that runs ``main`` (:func:`store_writer_main`) on ``path``."""
    here = str(Path(__file__).resolve().parent)
    code = f"import sys; sys.path.insert(0, {here!r}); import fault_cases; "
    code += f"fault_cases.{main}(sys.argv[1])"
    return [sys.executable, "-c", code, str(path)]


def child_env() -> dict[str, str]:
    """The environment for a child gpuwatchd: unbuffered, the package importable."""
    root = str(Path(__file__).resolve().parent.parent)
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{root}:{path}".rstrip(":")}


def run_gpuwatchd(args: list[str], timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """``python -m gpuwatchd ARGS`` as a child (:func:`child_env`), its output as text."""
    return subprocess.run(
        [sys.executable, "-m", "gpuwatchd", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),
    )


def run_daemon_on(
    source: list[str], state_dir: Path, control_socket: Path, timeout: float = 30.0
) -> subprocess.CompletedProcess[str]:
    """``gpuwatchd run SOURCE`` on an ephemeral port, expected to refuse and exit."""
    return run_gpuwatchd(
        ["run", *source, "--listen", "127.0.0.1:0", "--state-dir", str(state_dir),
         "--control-socket", str(control_socket)],
        timeout,
    )  # fmt: skip


def refused_in_one_line(res: subprocess.CompletedProcess[str], prefix: str = "gpuwatchd: ") -> bool:
    """Exit 2 with exactly one stderr line, starting with ``prefix``."""
    lines = res.stderr.splitlines()
    return res.returncode == 2 and len(lines) == 1 and lines[0].startswith(prefix)
