"""Whether the tuning worker's Python can import what tuning needs (torch, Triton).

The daemon never imports torch; its worker runs under ``[tuning] worker_python`` (else
the daemon's own interpreter) and does. A plain ``pip install gpuwatchd`` brings no
torch, so every session needing it would fail in the worker. :class:`WorkerProbe` asks
that interpreter once, in a subprocess on its own thread (never on a scrape or a
scheduler tick), which of :data:`PROBED_MODULES` it can import; the scheduler then
starts no session needing a missing one (:func:`allows`) and the ``tuning`` collector
exports :func:`readiness` as ``gpuwatchd_tuning_ready``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from gpuwatchd.tuning.families import needs_of
from gpuwatchd.tuning.types import Workload
from gpuwatchd.tuning.worker_isolation import PYTHON_FLAGS, WORKER_CWD
from gpuwatchd.tuning.workloads import device_kind
from gpuwatchd.validate import one_line

log = logging.getLogger(__name__)

#: The third-party modules a worker may need, in the order their absence is reported.
PROBED_MODULES: tuple[str, ...] = ("torch", "triton")
#: Worker device kind -> modules it imports to open the device (``sim`` needs none).
DEVICE_MODULES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {"cuda": ("torch",), "cpu": ("torch",), "sim": ()}
)
#: Seconds the probe may take: a first ``import torch`` from a cold disk is slow.
PROBE_TIMEOUT_S = 120.0
#: What to do about a missing module, said in the warning and by ``check-config``.
FIX = (
    'install gpuwatchd[tune] in that environment or set [tuning] worker_python = "/path/to/'
    'venv/bin/python" (a Python that has torch and Triton)'
)

#: ``gpuwatchd_tuning_ready``'s reasons: ready only with ``ok``.
REASON_OK = "ok"
REASON_DISABLED = "disabled"
REASON_CHECKING = "checking"
REASON_PROBE_FAILED = "probe_failed"
#: ... and ``no_<module>`` for each of :data:`PROBED_MODULES` that work needs but lacks.

#: Imports each module named on the command line; prints {module: error or null}.
_PROBE_SCRIPT = """\
import importlib, json, sys
out = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
        out[name] = None
    except BaseException as e:
        out[name] = (type(e).__name__ + ": " + str(e)).splitlines()[0][:300]
sys.stdout.write("\\n" + json.dumps(out) + "\\n")
"""


def needed_modules(workload: Workload) -> frozenset[str]:
    """Every module the worker may import to run ``workload`` (its device and families)."""
    needed = set(DEVICE_MODULES.get(device_kind(workload), ()))
    for family in workload.families:
        needed.update(needs_of(family))  # a plugin family: unknown, not blocked
    return frozenset(needed)


def blocking_module(workload: Workload, missing: Collection[str]) -> str | None:
    """The missing module that keeps every candidate of ``workload`` from running, or None.

    Its device's modules must import; of its families one whose modules import is enough
    (``triton.matmul`` beside ``torch.matmul`` without Triton: its candidates fail one by
    one, torch's are measured).
    """
    for module in DEVICE_MODULES.get(device_kind(workload), ()):
        if module in missing:
            return module
    blocked: list[str] = []
    for family in workload.families:
        lacks = [m for m in needs_of(family) if m in missing]
        if not lacks:
            return None
        blocked.append(lacks[0])
    return blocked[0] if blocked else None


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """What the worker's interpreter said of ``checked``: ``missing`` maps a module it
    could not import to why; ``failed`` says why the probe itself gave no answer (then
    nothing is known)."""

    python: str
    checked: tuple[str, ...] = PROBED_MODULES
    missing: Mapping[str, str] = field(default_factory=dict)
    failed: str | None = None

    def describe(self) -> str:
        """One line: what the interpreter lacks and the fix, or that it has everything."""
        if self.failed is not None:
            return f"could not check the tuning worker's Python {self.python}: {self.failed}"
        if not self.missing:
            return f"the tuning worker's Python {self.python} imports {', '.join(self.checked)}"
        lacks = "; ".join(f"{m} ({why})" for m, why in self.missing.items())
        return f"the tuning worker's Python {self.python} cannot import {lacks}: {FIX}"


def allows(result: ProbeResult | None, workload: Workload) -> bool:
    """Whether a session of ``workload`` may start: before the probe answers, only work
    needing no module; after, work whose modules import (all of it if the probe failed)."""
    needed = needed_modules(workload)
    if result is None:
        return not needed
    return result.failed is not None or blocking_module(workload, result.missing) is None


def readiness(
    result: ProbeResult | None, workloads: Iterable[Workload], enabled: bool = True
) -> tuple[bool, str]:
    """(ready, reason) for the work the daemon would tune: ``workloads``."""
    if not enabled:
        return False, REASON_DISABLED
    needed = frozenset().union(*(needed_modules(w) for w in workloads))
    if not needed:
        return True, REASON_OK
    if result is None:
        return False, REASON_CHECKING
    if result.failed is not None:
        return False, REASON_PROBE_FAILED
    blockers = {blocking_module(w, result.missing) for w in workloads}
    for module in PROBED_MODULES:
        if module in blockers:
            return False, f"no_{module}"
    return True, REASON_OK


def probe(
    python: str,
    modules: Sequence[str] = PROBED_MODULES,
    timeout_s: float = PROBE_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
) -> ProbeResult:
    """Run ``python`` once to import ``modules``; never raises.

    The environment is the worker's (``env``, default this process's) with no GPU
    visible: importing must not initialise a device. The interpreter runs as the
    worker's does (its flags, in ``/``), so neither a module in this process's working
    directory nor a user-site ``.pth`` runs in the probe.
    """
    run_env = dict(os.environ if env is None else env)
    run_env["CUDA_VISIBLE_DEVICES"] = ""
    checked = tuple(modules)
    try:
        done = subprocess.run(
            [python, *PYTHON_FLAGS, "-c", _PROBE_SCRIPT, *checked],
            stdin=subprocess.DEVNULL,
            cwd=WORKER_CWD,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=run_env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        took = f"importing {', '.join(checked)} took over {timeout_s:g} s"
        return ProbeResult(python, checked, failed=took)
    except OSError as exc:
        return ProbeResult(python, checked, failed=one_line(exc))
    lines = done.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else None
    except ValueError:
        answer = None
    if done.returncode != 0 or not isinstance(answer, dict):
        tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        failed = f"exit status {done.returncode}: {one_line(tail)}"
        return ProbeResult(python, checked, failed=failed)
    missing = {m: str(answer[m]) for m in checked if answer.get(m) is not None}
    return ProbeResult(python, checked, missing=missing)


class WorkerProbe:
    """Runs :func:`probe` once, on its own thread; :attr:`result` is None until it answers.

    Started only when some work needs a module (a sim-only daemon never pays for it);
    listeners (:meth:`add_listener`) are called with the result on that thread.
    """

    def __init__(self, python: str, run: Callable[[str], ProbeResult] = probe) -> None:
        self.python = python
        self._listeners: list[Callable[[ProbeResult], None]] = []
        self._run = run
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.result: ProbeResult | None = None

    def add_listener(self, fn: Callable[[ProbeResult], None]) -> None:
        """Call ``fn`` with the result when the probe answers."""
        self._listeners.append(fn)

    @property
    def started(self) -> bool:
        """Whether :meth:`start` has been called."""
        return self._thread is not None

    def start(self) -> None:
        """Start the probe unless it has started already."""
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(
                target=self._probe, name="gpuwatchd-worker-probe", daemon=True
            )
            self._thread.start()

    def wait(self, timeout: float | None = None) -> ProbeResult | None:
        """The result once the probe answered, waiting at most ``timeout`` (tests)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return self.result

    def _probe(self) -> None:
        result = self._run(self.python)
        self.result = result
        for fn in self._listeners:
            fn(result)
