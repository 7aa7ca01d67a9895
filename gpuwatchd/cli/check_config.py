"""``gpuwatchd check-config``: validate the config (its web config, the store's password
file) and exit.

Exit 0 and ``FILE: OK`` when the daemon would start with it; otherwise the one-line
error the daemon would give, exit 2.
"""

from __future__ import annotations

import argparse

from gpuwatchd.cli.common import (
    CONFIG_HELP,
    EXIT_CONFIG,
    CliError,
    Subparsers,
    add_command,
    load_with_overrides,
)


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    p = add_command(
        subparsers,
        "check-config",
        "validate a config file and exit",
        "Parse the config (and a web config) as the daemon would; print the first problem\n"
        "as one line naming the key and exit 2, or exit 0.",
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

    cfg, _ = load_with_overrides(args)
    try:
        read_web_config(cfg)
        check_store_access(cfg)
    except ConfigError as exc:
        raise CliError(str(exc), EXIT_CONFIG) from None
    print(f"{cfg.source or 'built-in defaults'}: OK")
    return 0
