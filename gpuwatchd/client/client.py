"""The job-side client: is my GPU ready to tune on, and which kernel won?

Talks to a running daemon's read-only JSON endpoints (``/api/v1/state``,
``/api/v1/winners``) and, for winners, falls back to reading the store directly
(read-only): the store file, or the fleet's PostgreSQL store the daemon config names.
Read directly, the winners are the ones the daemon would serve: this host's own where it
measured one, else the fleet's (``$GPUWATCHD_HOST`` names the host, as for the daemon).
Importable without torch: a training job can ask before it touches CUDA.
Both documents are parsed by :mod:`gpuwatchd.api`, the same code ``gpuwatchd status``
uses; the defaults come from :mod:`gpuwatchd.client.discovery`.
"""

from __future__ import annotations

import functools
import inspect
import os
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from gpuwatchd.api.fetch import HttpStatusError, UnreachableError, get_json, is_base_url
from gpuwatchd.api.gpu_state import GpuState
from gpuwatchd.api.state import STATE_PATH, StateDocument, parse_state
from gpuwatchd.client.discovery import (
    STORE_ENV,
    URL_ENV,
    default_socket_path,
    default_store_paths,
    default_store_url,
    default_url,
)
from gpuwatchd.client.errors import GpuwatchdError, GpuwatchdUnavailable, NotServed
from gpuwatchd.telemetry.types import normalize_uuid
from gpuwatchd.tuning.types import Regime
from gpuwatchd.validate import field_error, is_finite, is_number

if TYPE_CHECKING:  # the gate and the store load when a call needs them: a job's import stays
    # cheap (tests/test_job_imports.py pins what it loads)
    from gpuwatchd.api.winners import Winner
    from gpuwatchd.client.own_gate import _DaemonJobGate, _OwnProcessGate


class Client:
    """Reads a gpuwatchd daemon (``url``) and its tuning store (``store``).

    ``url=None``/``store=None`` pick the defaults (:mod:`gpuwatchd.client.discovery`).
    Winners come from the daemon when it serves ``/api/v1/winners``, else from the store
    (file, or the daemon config's PostgreSQL URL); with ``store`` given (or
    ``$GPUWATCHD_STORE`` set) that store is read directly: a SQLite file, or a PostgreSQL
    URL or key=value string (its password from libpq's environment, ``PGPASSWORD``).
    ``control_socket`` (default: discovered) is where :meth:`wait_until_stable` asks the
    daemon to judge the GPU for this job; ``control_socket=False`` never asks.
    """

    def __init__(
        self,
        url: str | None = None,
        store: str | os.PathLike[str] | None = None,
        timeout: float = 2.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        control_socket: str | os.PathLike[str] | bool | None = None,
    ) -> None:
        if not is_number(timeout) or not timeout > 0:
            raise ValueError(field_error("timeout", "expected a number of seconds > 0", timeout))
        if not is_finite(timeout):
            raise ValueError(field_error("timeout", "expected a finite number of seconds", timeout))
        url = url if url is not None else default_url()
        if not is_base_url(url):
            raise ValueError(field_error("url", "expected http://HOST:PORT", url))
        self.url = url.rstrip("/")
        store = store if store is not None else os.environ.get(STORE_ENV) or None
        self._store_given = store is not None
        # Kept as given: a PostgreSQL connection string must never become a Path.
        self._store: str | os.PathLike[str] | None = store
        self.timeout = float(timeout)
        self._clock = clock
        self._sleep = sleep
        if control_socket is True:
            control_socket = None
        self._control: str | os.PathLike[str] | bool | None = control_socket

    def __repr__(self) -> str:
        from gpuwatchd.store import redact_url

        shown = redact_url(self._store) if self._store is not None else None
        return f"Client(url={self.url!r}, store={shown!r})"

    def _get_json(self, path: str, query: Mapping[str, str] | None = None) -> Any:
        url = self.url + path
        if query:
            url += "?" + urllib.parse.urlencode(query)
        try:
            return get_json(url, timeout=self.timeout)
        except HttpStatusError as exc:
            if exc.code == 404:
                raise NotServed(f"{url}: not served by this daemon (HTTP 404)") from None
            raise
        except UnreachableError as exc:
            raise GpuwatchdUnavailable(
                f"gpuwatchd daemon not reachable at {self.url}: {exc.detail} "
                f"(is it running? set {URL_ENV} or pass url=)"
            ) from None

    def state_document(self) -> dict[str, Any]:
        """The raw ``/api/v1/state`` document (checked to be one)."""
        doc: dict[str, Any] = self._get_json(STATE_PATH)
        parse_state(doc, self.url + STATE_PATH)
        return doc

    def _state(self) -> StateDocument:
        return parse_state(self._get_json(STATE_PATH), self.url + STATE_PATH)

    # -- state -------------------------------------------------------------------------

    def state(self, gpu: int | str) -> GpuState:
        """The daemon's view of one GPU: ``gpu`` is its index or its UUID.

        With this process holding a CUDA context on the GPU the daemon says ``busy``;
        :meth:`wait_until_stable` accounts for that, a single reading cannot.
        """
        return _find_gpu(self._state(), gpu, self.url)

    def wait_until_stable(
        self,
        gpu: int | str,
        timeout: float = 600.0,
        poll_s: float = 0.5,
        *,
        own_pids: Iterable[int] | None = None,
        on_poll: Callable[[GpuState], None] | None = None,
    ) -> GpuState:
        """Block until the GPU's gate is open and its reading fresh; return that state.

        This job's own processes never keep the gate shut. While processes are on a
        GPU the daemon does not call open, the daemon is asked over its control socket
        to judge the GPU for this job (``register_job``, ``job_gate``): it knows the
        job's host PIDs from the socket's credentials (so PID namespaces don't matter)
        and replays its own sample history without them, so quiet time before the call
        counts (``judged_by="daemon_for_job"``). Without a control socket, ``own_pids``
        (default: this process, as NVML must report it) are left out by re-running the
        gate here on the daemon's samples (``judged_by="client"``; ``poll_s`` is lowered
        to gather the gate's ``min_samples``), which first waits ``settle_s`` (10 s by
        default) of evidence, however long the GPU was quiet before. ``on_poll`` sees
        every state judged (to log why a job waits). Raises TimeoutError naming the last
        state and its reasons, and GpuwatchdUnavailable when the daemon stops answering.
        """
        from gpuwatchd.client.own_gate import _OwnProcessGate

        _check_seconds(timeout, "timeout", allow_zero=True)
        _check_seconds(poll_s, "poll_s", allow_zero=False)
        own = frozenset(own_pids) if own_pids is not None else frozenset({os.getpid()})
        deadline = self._clock() + timeout
        local: _OwnProcessGate | None = None
        daemon = self._job_gate()
        while True:
            doc = self._state()
            st = _find_gpu(doc, gpu, self.url)
            pause = poll_s
            judged = daemon.judge(gpu) if daemon is not None and _occupied(st) else None
            if daemon is not None and _occupied(st) and judged is None and not daemon.busy:
                daemon = None  # it cannot judge for jobs: don't ask again
            if judged is not None:
                st, local = judged, None
            elif own & set(st.compute_pids or ()):
                if local is None:
                    local = _OwnProcessGate(doc.gate(), own)
                st = local.judge(st)
                pause = min(poll_s, local.max_poll_s)
            else:
                local = None
            if on_poll is not None:
                on_poll(st)
            if st.ready:
                return st
            left = deadline - self._clock()
            if left <= 0:
                raise TimeoutError(
                    f"gpu {gpu}: gate not open after {timeout:g}s; last: {st.describe()}"
                )
            self._sleep(min(pause, left))

    def _job_gate(self) -> _DaemonJobGate | None:
        from gpuwatchd.client.own_gate import _DaemonJobGate

        if self._control is False:
            return None
        path = self._control if self._control is not None else default_socket_path()
        assert not isinstance(path, bool)
        return _DaemonJobGate(path, self.timeout)

    # -- winners -----------------------------------------------------------------------

    def winners(
        self,
        *,
        workload: str | None = None,
        regime: Regime | str | None = None,
        gpu_model: str | None = None,
    ) -> list[Winner]:
        """The newest winner per (GPU model, workload, regime) matching the filters; on a
        store shared by a fleet, this host's own where it measured one."""
        from gpuwatchd.api.winners import WINNERS_PATH, parse_regime, parse_winners, winners_json

        filters: dict[str, Any] = {
            "workload": _opt_name(workload, "workload"),
            "regime": parse_regime(regime),
            "gpu_model": _opt_name(gpu_model, "gpu_model"),
        }
        problems: list[str] = []
        if not self._store_given:
            query = {k: str(v) for k, v in filters.items() if v is not None}
            try:
                return parse_winners(self._get_json(WINNERS_PATH, query), self.url)
            except GpuwatchdError as exc:  # down, too old to serve winners, or garbage
                problems.append(str(exc))
        from gpuwatchd.store import StoreError, open_store
        from gpuwatchd.store.rows import host_name

        try:
            location, password_file = self._store_location()
            host = host_name()  # the daemon's name for this host: its own winners first
            store = open_store(location, readonly=True, password_file=password_file)
            try:
                doc = winners_json(store, **filters, prefer_host=host)
            finally:
                store.close()
            return parse_winners(doc, store.where)
        except StoreError as exc:
            problems.append(str(exc))
        raise GpuwatchdUnavailable("no winners source: " + "; ".join(problems))

    def winner(
        self, workload: str, regime: Regime | str, gpu_model: str | None = None
    ) -> Winner | None:
        """The recorded winner of ``workload`` in ``regime``; None when none is recorded.

        ``gpu_model=None`` takes the most recently measured of any GPU model: pass it on
        a host whose GPUs are of several models.
        """
        if not isinstance(workload, str) or not workload:
            raise ValueError(f"workload: expected a workload name, got {workload!r}")
        if regime is None:
            raise ValueError("regime: expected one of unthrottled, sustained, got None")
        rows = self.winners(workload=workload, regime=regime, gpu_model=gpu_model)
        return max(rows, key=lambda w: w.measured_at) if rows else None

    def _store_location(self) -> tuple[str | os.PathLike[str], Path | None]:
        """The store to read and its password file: the store given (a file or a
        PostgreSQL connection string, told apart by :func:`gpuwatchd.store.open_store`),
        else the daemon config's PostgreSQL URL, else the first store file found."""
        if self._store is not None:
            return self._store, None
        shared = default_store_url()
        if shared is not None:
            return shared
        return self._store_path(), None

    def _store_path(self) -> Path:
        from gpuwatchd.api.winners import WINNERS_PATH
        from gpuwatchd.store.location import find_store_file

        return find_store_file(default_store_paths(), self.url + WINNERS_PATH)


def _find_gpu(doc: StateDocument, gpu: int | str, url: str) -> GpuState:
    if isinstance(gpu, bool) or not isinstance(gpu, int | str):
        raise ValueError(f"gpu: expected a GPU index or UUID, got {gpu!r}")
    want = normalize_uuid(gpu) if isinstance(gpu, str) else None
    for st in doc.gpus:
        if (want is None and st.gpu == gpu) or (
            want is not None and st.uuid is not None and normalize_uuid(st.uuid) == want
        ):
            return st
    seen = [f"{st.gpu} ({st.uuid})" if st.uuid else str(st.gpu) for st in doc.gpus]
    watched = ", ".join(seen) or "none"
    raise ValueError(f"gpu {gpu!r}: not watched by the daemon at {url} (GPUs: {watched})")


def _occupied(st: GpuState) -> bool:
    """Shut while processes are on the GPU: perhaps only this job's own."""
    return not st.open and bool(st.compute_pids)


def _check_seconds(value: float, name: str, *, allow_zero: bool) -> None:
    if not is_finite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(field_error(name, f"expected a finite number of seconds {bound}", value))


def _opt_name(value: str | None, name: str) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(field_error(name, "expected a non-empty string", value))
    return value


# -- module-level shortcuts ------------------------------------------------------------------

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _with_default_client(method: Callable[Concatenate[Client, _P], _R]) -> Callable[_P, _R]:
    """``method`` called on a :class:`Client` with the default daemon and store, made at
    each call (so the environment is read then). The shortcut takes exactly the method's
    arguments: it is the method, not a second copy of its signature."""

    @functools.wraps(method)
    def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        return method(Client(), *args, **kwargs)

    sig = inspect.signature(method)  # help() shows the arguments, without ``self``
    call.__signature__ = sig.replace(  # type: ignore[attr-defined]
        parameters=list(sig.parameters.values())[1:]
    )
    return call


state = _with_default_client(Client.state)
wait_until_stable = _with_default_client(Client.wait_until_stable)
winner = _with_default_client(Client.winner)
