"""The daemon process: wiring of poller, scheduler, exporter and control socket."""
