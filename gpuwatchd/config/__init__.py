"""Configuration: a TOML file, validated strictly, with CLI overrides on top."""

from gpuwatchd.config.loader import (
    DEFAULT_CONFIG_PATH,
    STORE_NAME,
    Config,
    ConfigError,
    DaemonConfig,
    ReplayConfig,
    SimConfig,
    load_config,
    parse_config,
    resolve_state_dir,
    store_path,
)

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "STORE_NAME",
    "Config",
    "ConfigError",
    "DaemonConfig",
    "ReplayConfig",
    "SimConfig",
    "load_config",
    "parse_config",
    "resolve_state_dir",
    "store_path",
]
