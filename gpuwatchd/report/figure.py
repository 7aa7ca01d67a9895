"""What both pictures share: an optional matplotlib, a pyplot-free figure, saving it.

matplotlib is optional (``pip install 'gpuwatchd[plot]'``): it is imported only when a
picture is asked for, so the daemon and the other commands never pay for it. Figures
are built on the Agg canvas directly, never through pyplot: no display, no global
backend switch, safe to call from any thread.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

INSTALL_HINT = "pip install 'gpuwatchd[plot]'"
DPI = 120


class PlotError(ValueError):
    """Input a picture cannot be made from; the message is one line naming the field."""


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotError(f"matplotlib is not installed ({INSTALL_HINT})") from None


def new_figure(width: float, height: float) -> Figure:
    """A Figure on its own Agg canvas: no pyplot state, no display."""
    _require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig: Figure, path: str | Path, dpi: int = DPI) -> Path:
    """Write ``fig`` to ``path``; the suffix picks the format (.png, .svg, .pdf, ...)."""
    p = Path(path)
    fmt = p.suffix.lstrip(".").lower()
    supported = fig.canvas.get_supported_filetypes()
    if fmt not in supported:
        raise PlotError(
            f"path: cannot tell the image format of {str(p)!r} "
            f"(end it in .png, .svg or .pdf; known: {', '.join(sorted(supported))})"
        )
    if not p.parent.is_dir():  # before rendering, which takes a second
        raise PlotError(f"path: cannot write {p}: no such directory {p.parent}")
    try:
        fig.savefig(p, format=fmt, dpi=dpi)
    except OSError as exc:
        raise PlotError(f"path: cannot write {p}: {exc.strerror or exc}") from None
    return p
