"""gpuwatchd's hooks into torch.compile's GEMM choices, through Inductor's own lookup table.

Inductor's supported extension point for its GEMM choices is a choices handler: a
subclass of ``torch._inductor.lookup_table.LookupTableChoices`` installed with
``V.set_choices_handler`` (this thread) and ``config.inductor_choices_class`` (threads
that compile later, and the compile caches' key: the handler's ``uuid()``), reading
``config.lookup_table.table``. Two subclasses (in
:mod:`~gpuwatchd.tuning.worker.inductor_choices`), nothing of Inductor patched:

- :func:`recording_handler`: lets Inductor generate every choice of every GEMM it
  lowers, records them (:class:`~gpuwatchd.tuning.submitted.inductor_sites.GemmSite`: keys,
  templates, full kwargs) and hands Inductor back one choice per GEMM, so recording
  compiles without benchmarking anything. The ``inductor.mm`` family and
  ``gpuwatchd.torch.capture_compiled`` use it.
- :func:`table_handler`: the stock lookup plus the ``EXCLUSIVE`` marker (a key the
  table fully describes gives no choice beyond its entries), so a table from
  :func:`~gpuwatchd.tuning.submitted.inductor_sites.lookup_table` compiles every GEMM to exactly
  one kernel. It counts what it handed out, so a caller can prove nothing was left to
  benchmark.

The worker and the recording use them inside :func:`handler_installed` (FX graph cache
off, so every compile is really lowered); a job installs the table for good with
:func:`install_globally`. Imports torch lazily; needs a torch with the lookup table
(2.11 and 2.13 checked).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class InductorUnsupported(RuntimeError):
    """This torch has no Inductor lookup table (or no Inductor): one line saying so."""


def lookup_table_support() -> str | None:
    """None when this torch has Inductor's lookup table; else why not, in one line."""
    try:
        import torch
        from torch._inductor import config
        from torch._inductor.lookup_table import LookupTableChoices  # noqa: F401
    except ImportError as e:
        return f"this torch has no torch._inductor.lookup_table ({' '.join(str(e).split())})"
    holder = getattr(config, "lookup_table", None)
    if holder is None or not hasattr(holder, "table"):
        return f"torch {torch.__version__} has no torch._inductor.config.lookup_table.table"
    return None


def require_lookup_table() -> None:
    why = lookup_table_support()
    if why is not None:
        raise InductorUnsupported(why)


# -- the two handlers ------------------------------------------------------------------------


def recording_handler() -> Any:
    """A fresh recording handler; its ``sites()`` after a compile are the GEMMs seen."""
    require_lookup_table()
    from gpuwatchd.tuning.worker.inductor_choices import RecordingChoices

    return RecordingChoices()


def table_handler() -> Any:
    """A fresh lookup-table handler; ``handed`` lists (op, key, choices) per ask."""
    require_lookup_table()
    from gpuwatchd.tuning.worker.inductor_choices import TableChoices

    return TableChoices()


# -- installing a handler --------------------------------------------------------------------


@contextmanager
def handler_installed(
    handler: Any, table: dict[str, list[dict[str, Any]]] | None = None, **config: Any
) -> Iterator[Any]:
    """``handler`` (and ``table``) in force for compiles inside; restored after.

    ``config`` patches other Inductor options for the same span (``max_autotune_gemm``,
    ...). The FX graph cache is off: a graph served from it is never lowered, so the
    handler would see nothing (and a recording compile must never be served to a real one).
    """
    from torch._inductor import config as inductor_config
    from torch._inductor.virtualized import V

    patch: dict[str, Any] = {"lookup_table.table": table, "fx_graph_cache": False, **config}
    if hasattr(inductor_config, "inductor_choices_class"):
        patch["inductor_choices_class"] = type(handler)
    with inductor_config.patch(patch), V.set_choices_handler(handler):
        yield handler


def install_globally(handler: Any, table: dict[str, list[dict[str, Any]]]) -> Callable[[], None]:
    """Install ``handler`` and ``table`` for the rest of the process (this thread and
    threads that compile later); returns a function that puts back what was there."""
    from torch._inductor import config as inductor_config
    from torch._inductor.virtualized import V

    has_factory = hasattr(inductor_config, "inductor_choices_class")
    before_table = inductor_config.lookup_table.table
    before_factory = inductor_config.inductor_choices_class if has_factory else None
    before_handler = V.choices
    inductor_config.lookup_table.table = table
    if has_factory:
        inductor_config.inductor_choices_class = type(handler)
    V.set_choices_handler(handler)

    def restore() -> None:
        inductor_config.lookup_table.table = before_table
        if has_factory:
            inductor_config.inductor_choices_class = before_factory
        V.set_choices_handler(before_handler)

    return restore


def fresh_function(fn: Callable[..., Any], tag: str) -> Callable[..., Any]:
    """``fn`` with a code object of its own: torch.compile caches per code object, so
    each candidate compiled from it gets its own graph, not a recompile of a shared one."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
