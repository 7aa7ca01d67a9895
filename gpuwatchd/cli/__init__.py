"""The ``gpuwatchd`` command line: one module per command, shared errors in ``common``."""
