"""``gpuwatchd store prune``: apply the configured retention to the store now.

The daemon prunes on its own every ``[store] prune_interval_s`` (one host of a fleet per
interval); this runs the same pruning once, with the same ``[store]`` ages, for an
operator who wants the space back now or runs no daemon on the store.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from gpuwatchd.cli.common import (
    CONFIG_HELP,
    CliError,
    Subparsers,
    add_command,
    load_with_overrides,
    open_configured_store,
)


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    p = add_command(
        subparsers,
        "store",
        "store maintenance: prune old sessions and departed hosts' clocks",
        "Maintain the tuning store the config names ([store] url, else the state\n"
        "directory's gpuwatchd.db). `prune` deletes sessions finished more than\n"
        "[store] keep_sessions_s ago (never one a winner points at, nor each GPU's latest\n"
        "completed one) and GPUs' clocks not reported for [store] keep_clocks_s.",
        (
            "gpuwatchd store prune",
            "gpuwatchd store prune --config /etc/gpuwatchd/config.toml",
        ),
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    prune = actions.add_parser("prune", help="apply the configured retention now")
    prune.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    prune.add_argument("--state-dir", metavar="DIR", help="state directory holding the store")
    p.set_defaults(func=run)  # prune is the only action
    return p


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    from gpuwatchd.store import StoreError
    from gpuwatchd.store.retention import prune

    out = out if out is not None else sys.stdout
    cfg, _ = load_with_overrides(args)
    store = open_configured_store(cfg)
    try:
        done = prune(
            store, keep_sessions_s=cfg.store.keep_sessions_s, keep_clocks_s=cfg.store.keep_clocks_s
        )
    except StoreError as exc:
        raise CliError(str(exc)) from None
    finally:
        store.close()
    print(
        f"pruned {done.sessions} session(s) and {done.clocks} host clock(s) from {store.where}",
        file=out,
    )
    return 0
