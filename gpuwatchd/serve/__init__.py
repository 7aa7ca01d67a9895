"""The daemon's servers: the read-only HTTP endpoint and the control socket.

Both hold their connections on one event loop (:class:`gpuwatchd.serve.loop.ServeLoop`).
What they serve comes from below: the exporter's rendered metrics, the JSON API, the
daemon's op table (handed in); no server module imports a collector.
"""

from __future__ import annotations

from gpuwatchd.serve.http import HttpServer, ListenError
from gpuwatchd.serve.routes import Routes

__all__ = ["HttpServer", "ListenError", "Routes"]
