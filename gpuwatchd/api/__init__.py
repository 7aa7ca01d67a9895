"""The read-only JSON documents the daemon serves: each one's producer and parser live together.

:mod:`~gpuwatchd.api.state` (``/api/v1/state``) and :mod:`~gpuwatchd.api.winners`
(``/api/v1/winners``) each own one document; :mod:`~gpuwatchd.api.fetch` is the one
HTTP GET that the job-side client and ``gpuwatchd status`` read them with. Nothing here
imports the exporter, the config, the daemon or the CLI.
"""
