"""gpuwatchd: a thermal-aware profiling daemon for GPU hosts."""

__version__ = "0.1.0"
