"""torch.compile with gpuwatchd's winners: record a compiled model's GEMMs, compile them tuned.

Capture: :func:`capture_compiled` is a context manager around the first steps of a
``torch.compile``'d model. Inductor compiles inside it with gpuwatchd's recording
handler: every GEMM it lowers is recorded as a :class:`GemmSite` (its lookup keys and
every choice Inductor generated) and compiled to ATen's kernel, with nothing
benchmarked. The sites become ``inductor.mm`` workloads the daemon tunes.

Use: :func:`inductor_lookup_table` turns the recorded winners of those workloads into
Inductor's lookup table; :func:`use_inductor_winners` installs it (one line, before
``torch.compile``), so ``mode="max-autotune"`` compiles every recorded GEMM straight to
its winner. GEMMs the table does not know are autotuned by Inductor as usual.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuwatchd.client import Client
from gpuwatchd.jobside.requests import Submission
from gpuwatchd.jobside.winner_plan import beats_default, latest_by_workload
from gpuwatchd.jobside.workload_submit import submit_workloads
from gpuwatchd.tuning.intake.workload_requests import workloads_toml
from gpuwatchd.tuning.submitted.inductor_sites import (
    EXCLUSIVE_ID,
    FAMILY,
    GemmSite,
    SiteChoice,
    check_table,
    entry_label,
    is_default_choice,
    lookup_table,
)
from gpuwatchd.tuning.types import Regime, Workload
from gpuwatchd.tuning.winners import JOB_DEFAULT, VS_DEFAULT
from gpuwatchd.tuning.worker.inductor import (
    handler_installed,
    install_globally,
    recording_handler,
    require_lookup_table,
    table_handler,
)

if TYPE_CHECKING:
    from gpuwatchd.api.winners import Winner

log = logging.getLogger(__name__)


class CompiledCapture:
    """The GEMM sites Inductor lowered inside :func:`capture_compiled`."""

    def __init__(self) -> None:
        self._sites: list[GemmSite] | None = None

    @property
    def sites(self) -> list[GemmSite]:
        if self._sites is None:
            raise RuntimeError("the capture is still running: read it after the with block")
        return self._sites

    def workloads(self) -> tuple[Workload, ...]:
        """One ``inductor.mm`` workload per distinct site, most frequent first."""
        ranked = sorted(self.sites, key=lambda s: -s.count)
        return tuple(s.workload() for s in ranked)

    def table(self) -> str:
        lines = [f"{'count':>5}  {'op':<8} {'choices':>7}  workload"]
        for s in sorted(self.sites, key=lambda s: -s.count):
            lines.append(f"{s.count:5d}  {s.op_name:<8} {len(s.choices()):7d}  {s.workload().name}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table() if self._sites is not None else "<capture still running>"

    def write(self, path: str | os.PathLike[str]) -> Path:
        """The workloads as TOML ``[[workload]]`` tables (or JSON for other suffixes)."""
        import json

        p = Path(path)
        if p.suffix.lower() == ".toml":
            text = workloads_toml(self.workloads(), "GEMMs of a torch.compile'd model")
        else:
            text = json.dumps({"workloads": [w.to_json() for w in self.workloads()]}, indent=2)
        p.write_text(text + "\n", encoding="utf-8")
        return p

    def submit(
        self,
        *,
        socket_path: str | os.PathLike[str] | None = None,
        spool_dir: str | os.PathLike[str] | None = None,
    ) -> Submission:
        """Hand the sites' workloads to the daemon, else to its spool."""
        import torch

        workloads = self.workloads()
        if not workloads:
            return Submission("failed", "Inductor lowered no GEMM inside the capture")
        source = {
            "kind": "capture_compiled",
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "torch": torch.__version__,
        }
        return submit_workloads(workloads, source, socket_path=socket_path, spool_dir=spool_dir)


@contextmanager
def capture_compiled(*, reset: bool = True) -> Iterator[CompiledCapture]:
    """Record the GEMMs of everything torch.compile compiles inside the block.

    The graphs compiled inside use ATen for every GEMM (nothing is benchmarked). With
    ``reset`` (the default) dynamo's caches are cleared after, so the model compiles
    again, for real, at its next call.
    """
    import torch

    require_lookup_table()
    handler = recording_handler()
    result = CompiledCapture()
    with handler_installed(handler, None, max_autotune_gemm=True):
        yield result
    result._sites = handler.sites()
    if reset:
        torch._dynamo.reset()


# -- winners -> lookup table -----------------------------------------------------------------


def site_choices(winners: Iterable[Winner], torch_version: str | None) -> list[SiteChoice]:
    """The lookup choice for each ``inductor.mm`` site (newest winner per workload): see
    :func:`table_meta`.

    Winners measured under another torch are left out: Inductor's keys and templates are
    that torch's.
    """
    out = []
    for w in sorted(latest_by_workload(winners).values(), key=lambda w: w.workload):
        if w.family != FAMILY:
            continue
        if torch_version and w.versions.torch and w.versions.torch != torch_version:
            continue
        choice = _choice_from_meta(table_meta(w))
        if choice is not None:
            out.append(choice)
    return out


def table_meta(w: Winner) -> Mapping[str, Any]:
    """The measured candidate whose choice the table hands a site: the winner where it is
    the site's default (ATen's own op, what torch.compile runs without max-autotune) or
    was shown faster than that default beyond the noise; otherwise the default.

    Shown faster: the worker's verdict against the default says so, or, where none was
    recorded, the winner won outright over every candidate. A stored winner need not be
    either: a tie's nominal fastest, or a row recorded when ``aten::bias_addmm`` counted as
    a default too (``job_default`` on a choice that is not ATen's own op), so a table
    could hand a site a choice nothing showed to be faster.
    """
    op_name = _op_name(w.meta)
    if op_name is None or _is_default(w.meta, op_name):
        return w.meta
    if VS_DEFAULT in w.meta:
        shown = beats_default(w.meta)
    else:
        shown = not w.tie and not w.meta.get(JOB_DEFAULT)
    if shown:
        return w.meta
    default = next(
        (c for c in w.ranked if c.median_s is not None and _is_default(c.meta, op_name)), None
    )
    return default.meta if default is not None else w.meta


def _op_name(meta: Mapping[str, Any]) -> str | None:
    key = meta.get("lookup_key")
    return key.rsplit("+", 1)[-1] if isinstance(key, str) and "+" in key else None


def _is_default(meta: Mapping[str, Any], op_name: str) -> bool:
    entry = meta.get("lookup_entry")
    return isinstance(entry, Mapping) and is_default_choice(entry, op_name)


def _choice_from_meta(meta: Mapping[str, Any]) -> SiteChoice | None:
    """The winner's lookup choice when its meta has exactly the recorded shape (stored
    values are untrusted: torch writes entry values into generated source)."""
    from gpuwatchd.store.row_values import inductor_choice  # only when a table is built

    try:
        return inductor_choice(meta)
    except ValueError as e:
        log.warning("skipping a recorded Inductor winner: %s", e)
        return None


def inductor_lookup_table(
    regime: Regime | str = Regime.SUSTAINED,
    *,
    client: Client | None = None,
    gpu_model: str | None = "auto",
) -> dict[str, list[dict[str, Any]]]:
    """Inductor's ``lookup_table.table`` from the winners recorded for this GPU model.

    ``gpu_model="auto"``: the current CUDA device's model (None: any model).
    """
    import torch

    client = client if client is not None else Client()
    if gpu_model == "auto":
        gpu_model = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    winners = client.winners(regime=regime, gpu_model=gpu_model)
    return check_table(lookup_table(site_choices(winners, torch.__version__)))


@dataclass(frozen=True, slots=True)
class InductorWinners:
    """The table installed and the handler reading it (``handler.handed``: what each GEMM
    was given, so a caller can check that nothing was left to benchmark)."""

    table: dict[str, list[dict[str, Any]]]
    handler: Any
    remove: Callable[[], None]  # put back the lookup table and handler that were there

    @property
    def sites(self) -> int:
        """GEMM sites the table decides."""
        return sum(
            1
            for entries in self.table.values()
            for e in entries
            if e["template_id"] != EXCLUSIVE_ID
        )

    def describe(self) -> str:
        picks = [
            entry_label(e)
            for entries in self.table.values()
            for e in entries
            if e["template_id"] != EXCLUSIVE_ID
        ]
        return f"{len(picks)} GEMM site(s): " + ", ".join(picks) if picks else "empty table"


def use_inductor_winners(
    regime: Regime | str = Regime.SUSTAINED,
    *,
    table: Mapping[str, list[dict[str, Any]]] | None = None,
    client: Client | None = None,
    gpu_model: str | None = "auto",
) -> InductorWinners:
    """Install the winners' lookup table for every later ``torch.compile`` in this process.

    ``table`` defaults to :func:`inductor_lookup_table`. Call it before the model's first
    compiled call.
    """
    require_lookup_table()
    chosen = (
        check_table(table)
        if table is not None
        else inductor_lookup_table(regime, client=client, gpu_model=gpu_model)
    )
    handler = table_handler()
    return InductorWinners(chosen, handler, install_globally(handler, chosen))
