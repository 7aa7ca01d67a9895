"""``gpuwatchd store prune``: apply the configured retention to the store now.

The daemon prunes on its own every ``[store] prune_interval_s`` (one host of a fleet per
interval); this runs the same pruning once, with the same ``[store]`` ages, for an
operator who wants the space back now or runs no daemon on the store. It takes the
fleet's pruning lease first (:mod:`gpuwatchd.store.retention`), so it never races a
daemon's pruner: while one holds it, it waits up to ``--wait`` seconds, saying who.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TextIO

from gpuwatchd.cli.common import (
    CONFIG_HELP,
    CliError,
    Subparsers,
    add_command,
    load_with_overrides,
    open_configured_store,
)

#: How long ``store prune`` waits for a daemon's pruning by default, and how often it asks.
DEFAULT_WAIT_S = 300.0
_ASK_EVERY_S = 2.0


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
    prune.add_argument(
        "--wait",
        metavar="SECONDS",
        type=float,
        default=DEFAULT_WAIT_S,
        help="how long to wait while a daemon holds the pruning lease"
        f" (default {DEFAULT_WAIT_S:g}; 0: do not wait)",
    )
    p.set_defaults(func=run)  # prune is the only action
    return p


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    from gpuwatchd.store import StoreError
    from gpuwatchd.store.retention import LEASE_S, PRUNE_CLAIM, holder_text, prune
    from gpuwatchd.store.rows import host_name, machine_id

    out = out if out is not None else sys.stdout
    wait_s = args.wait
    if not (isinstance(wait_s, float) and 0 <= wait_s < float("inf")):
        raise CliError(f"--wait: expected a number of seconds >= 0, got {wait_s!r}")
    cfg, _ = load_with_overrides(args)
    store = open_configured_store(cfg)
    # Its own lease holder: a daemon on this machine holds it as (host, machine id).
    host, me = host_name(), f"store-prune:{machine_id()}:{os.getpid()}"
    try:
        deadline, said = time.monotonic() + wait_s, False
        while not store.claim(PRUNE_CLAIM, host, me, LEASE_S):
            holder = holder_text(store.claim_holder(PRUNE_CLAIM))
            if time.monotonic() >= deadline:
                raise CliError(
                    f"store {store.where} is being pruned by {holder}; waited {wait_s:g} s,"
                    " try again later (or pass --wait)"
                )
            if not said:
                print(f"waiting: {holder} is pruning {store.where}", file=sys.stderr)
                said = True
            time.sleep(_ASK_EVERY_S)
        try:
            done = prune(
                store,
                keep_sessions_s=cfg.store.keep_sessions_s,
                keep_clocks_s=cfg.store.keep_clocks_s,
                renew=lambda: store.claim(PRUNE_CLAIM, host, me, LEASE_S),
            )
        finally:
            store.release(PRUNE_CLAIM, host, me)
    except StoreError as exc:
        raise CliError(str(exc)) from None
    finally:
        store.close()
    print(
        f"pruned {done.sessions} session(s) and {done.clocks} host clock(s) from {store.where}",
        file=out,
    )
    return 0
