"""The exporter-toolkit web-config format: TLS and basic auth for the HTTP endpoint."""
