"""``gpuwatchd check-config``: validate the config (its web config, the store's password
file) and exit.

Exit 0 and ``FILE: OK`` when the daemon would start with it and serve what clients
accept, then one line saying whether the tuning worker's Python imports what the
configured tuning needs (torch, Triton; asked as the daemon asks at start); otherwise
one line, exit 2: the error the daemon would give, or a served TLS certificate past its
expiry (the daemon serves one with a WARNING).

What is valid but unwise is a warning on stderr, and the OK line counts them (exit 0:
the daemon serves it too, with the same WARNING): a certificate within 14 days of its
expiry, basic auth without TLS, client certificates verified without a client CA.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from gpuwatchd.cli.common import (
    CONFIG_HELP,
    EXIT_CONFIG,
    CliError,
    Subparsers,
    add_command,
    load_with_overrides,
)

if TYPE_CHECKING:
    from gpuwatchd.config import Config


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    p = add_command(
        subparsers,
        "check-config",
        "validate a config file and exit",
        "Parse the config (and a web config) as the daemon would; print the first problem\n"
        "as one line naming the key and exit 2, or exit 0 with a line saying whether the\n"
        "tuning worker's Python can import torch (and Triton) where its work needs them.",
        (
            "gpuwatchd check-config --config /etc/gpuwatchd/config.toml",
            "gpuwatchd check-config --web-config /etc/gpuwatchd/web-config.yml",
        ),
    )
    p.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    p.add_argument("--web-config", metavar="FILE", help="also validate this web-config.yml")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from gpuwatchd.config import ConfigError, check_store_access
    from gpuwatchd.daemon.process import read_web_config
    from gpuwatchd.serve.web.certinfo import refuse_expired
    from gpuwatchd.serve.web.security import config_warnings, expiry_warnings
    from gpuwatchd.serve.web.tls import load_tls

    cfg, _ = load_with_overrides(args)
    try:
        web = read_web_config(cfg)
        check_store_access(cfg)
    except ConfigError as exc:
        raise CliError(str(exc), EXIT_CONFIG) from None
    warnings = config_warnings(web) if web is not None else []
    if web is not None and web.tls is not None:
        certificates = load_tls(web.tls).certificates
        try:
            refuse_expired(certificates, time.time())
        except ValueError as exc:
            raise CliError(f"web config {cfg.daemon.web_config}: {exc}", EXIT_CONFIG) from None
        warnings += expiry_warnings(certificates, time.time())
    for line in warnings:
        print(f"gpuwatchd: warning: web config {cfg.daemon.web_config}: {line}", file=sys.stderr)
    counted = (
        f", with {len(warnings)} warning{'s' if len(warnings) > 1 else ''}" if warnings else ""
    )
    print(f"{cfg.source or 'built-in defaults'}: OK{counted}")
    print(tuning_line(cfg))
    return 0


def tuning_line(cfg: Config) -> str:
    """One line: is tuning off, ready, or missing a module its work needs (and the fix)."""
    from gpuwatchd.sessions.plan import runnable_workloads
    from gpuwatchd.sessions.readiness import needed_modules, probe, readiness

    if not cfg.tuning.enabled:
        return "tuning: disabled ([tuning] enabled = false): monitor only"
    work = runnable_workloads(cfg.tuning_setup(), cfg.daemon.backend)
    needed = sorted(frozenset().union(*(needed_modules(w) for w in work)))
    if not needed:
        return f"tuning: ready (the {cfg.daemon.backend} backend's workloads need no torch)"
    result = probe(cfg.tuning.worker_executable, needed)
    ready, reason = readiness(result, work)
    if not ready:
        state = f"NOT READY ({reason})"
    elif result.missing:
        state = f"ready without {', '.join(result.missing)} (its candidates are skipped)"
    else:
        state = "ready"
    return f"tuning: {state}: {result.describe()}"
