"""Prometheus collectors, one per file; each reads state the daemon already holds."""
